"""The dense-MLA architectures beyond DeepSeek-V2/V3 that run sharded
(docs/models.md, families glm4-moe-lite and axk1): real vLLM on CPU, TP=2,
a tiny random-weight model of each in transformers' own classes
(tools/tiny_model.build_dense_arch: one dense and one MoE layer, latent 512
+ rope 64), float32 with CPU_MLA, prompts of 100-700 random token ids, 16
greedy tokens. Each sharded run (the debug switch on: plans, owned writes
and the merged decode against the full view checked every step) against the
unsharded run with PyTorch's rope: identical tokens, logprobs within 1e-4,
1.9x the capacity; the negative control: one corrupted owned block after
prefill changes the output."""

import os

import pytest

from conftest import MODELS_DIR, needs_vllm, run_generate

pytestmark = needs_vllm
ARCHS = ("Glm4MoeLiteForCausalLM", "AXK1ForCausalLM")
ARGS = ("--dtype", "float32", "--backend", "CPU_MLA", "--max-model-len", "1024",
        "--token-prompts", "100,300,500,700", "--max-tokens", "16")


@pytest.fixture(scope="module", params=ARCHS)
def runs(request, tmp_path_factory):
    from vllm_cp_kv.tools.tiny_model import build_dense_arch

    arch = request.param
    model = build_dense_arch(arch, os.path.join(MODELS_DIR, f"tiny-{arch}"))
    d = str(tmp_path_factory.mktemp(arch))
    out = {"arch": arch,
           "ref": run_generate(model, d, "ref", *ARGS, "--torch-rope", "--no-plugin"),
           "on": run_generate(model, d, "on", *ARGS, "--shard", "--stats", "--poison",
                              env={"VLLM_CP_KV_DEBUG": "1"})}
    if arch == ARCHS[0]:
        out["corrupt"] = run_generate(model, d, "corrupt", *ARGS, "--shard", "--poison",
                                      "--corrupt-after-prefill")
    return out


def test_sharded_equals_unsharded(runs):
    ref, on = runs["ref"], runs["on"]
    assert on["dcp"] == 2 and ref["dcp"] == 1
    assert all(b == ["ShardedKVImpl_CPU_MLA"] for b in on["backends"])
    assert on["prompt_lens"] == ref["prompt_lens"] and on["tokens"] == ref["tokens"]
    diff = max(abs(p - q) for a, b in zip(ref["logprobs"], on["logprobs"])
               for p, q in zip(a, b))
    assert diff <= 1e-4, diff
    assert on["kv_cache_tokens"] / ref["kv_cache_tokens"] >= 1.9
    assert "cp_kv: debug invariants hold" in on["log"]


@pytest.mark.parametrize("runs", ARCHS[:1], indirect=True)
def test_corrupting_one_owned_block_changes_the_output(runs):
    on, bad = runs["on"], runs["corrupt"]
    assert bad["corrupted_block"][1] >= 0
    assert bad["tokens"] != on["tokens"], "a corrupted owned block went unnoticed"
