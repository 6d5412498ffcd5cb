"""Real vLLM on CPU, TP=2 worker processes, a held-out tiny DeepSeek-V2
(tools/tiny_model.build_held_out: not the demo's model) with prompts of
fixed random token ids, decode-heavy: two phases of 8 requests, contexts of
about 200-700 and 2000-2300 tokens (4x apart), 128 greedy tokens each.

Every comparison is against the unsharded run of the same configuration
with PyTorch's rope (the correct run: vLLM 0.32's CPU rotary kernel is
wrong for MLA). The sharded run sets nothing but ``cp_kv.enable``:

* float32 with CPU_MLA (block 16; runs on every CPU): identical greedy
  tokens, logprobs within 1e-4, for the shard-aware (LSE) decode and for
  the materializing decode; the debug switch on (its invariant checks and
  the LSE-merge-against-full-view check run and hold);
* bytes that cross the workers' collectives per pure decode step (counted
  on the collectives, not by the plugin): the same at both context lengths
  with the LSE decode, growing with the context when materializing;
* 1.95x the logical KV capacity; poisoned caches (a one-phase run, where no
  block is reused): each rank writes exactly the tokens it owns (counted
  from vLLM's slot-mapping kernel, transcribed);
* negative controls: one corrupted owned block after prefill changes the
  output; keeping vLLM's CPU rotary kernel (``+rotary_embedding``) changes
  first tokens (the derived setting matters);
* the plugin installed but not enabled is plain vLLM;
* bfloat16 on the platform's default backend (AMX_MLA on CPUs with AMX,
  else CPU_MLA): the prefill's first tokens are identical; decode rounds
  differently (bf16 partial outputs merged, another accumulation order than
  vLLM's CPU decode kernel), so the largest logprob difference of agreeing tokens is reported
  (``bf16_report.json`` in the test's directory) and bounded loosely.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import amx_available, needs_vllm, run_generate
from harness.reference import owned_counts

pytestmark = needs_vllm
SHORT = "200,260,330,400,470,540,610,700"
LONG = "2000,2040,2080,2120,2160,2200,2240,2280"
NEW = 128
MAT_NEW = 16
EXACT = ("--dtype", "float32", "--backend", "CPU_MLA", "--max-model-len", "3200",
         "--max-tokens", str(NEW))
PHASES = ("--token-prompts", f"{SHORT};{LONG}")
# 4 GiB of KV per rank: the scratch full view of one layer (8 requests of
# 3,200 tokens) is then under 2% of the budget of this 2-layer model
KV = {"VLLM_CPU_KVCACHE_SPACE": "4"}
DEBUG = {**KV, "VLLM_CP_KV_DEBUG": "1"}


@pytest.fixture(scope="module")
def runs(held_out, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("e2e"))
    quick = ("--dtype", "float32", "--backend", "CPU_MLA", "--max-model-len", "3200",
             "--token-prompts", SHORT, "--max-tokens", "16")
    return {
        "ref": run_generate(held_out, d, "ref", *EXACT, *PHASES, "--torch-rope",
                            env=KV, timeout=900),
        "on": run_generate(held_out, d, "on", *EXACT, *PHASES, "--shard",
                           "--stats", env=DEBUG, timeout=900),
        # what crosses the collectives, without the debug checks (whose
        # reference gathers a full view every step)
        "on_bytes": run_generate(held_out, d, "on_bytes", *EXACT, *PHASES, "--shard",
                                 "--stats", "--count-collectives", "--max-tokens",
                                 str(MAT_NEW), env=KV, timeout=900),
        # the materializing decode: the same phases, fewer tokens (its identity
        # is on those tokens; its bytes per step are the same every step)
        "mat": run_generate(held_out, d, "mat", *EXACT, *PHASES, "--cp-kv",
                            '{"decode": "materialize"}', "--stats", "--count-collectives",
                            "--max-tokens", str(MAT_NEW), env=DEBUG, timeout=900),
        "plain": run_generate(held_out, d, "plain", *quick, "--torch-rope", "--no-plugin",
                              "--poison", env=KV),
        "corrupt": run_generate(held_out, d, "corrupt", *quick, "--shard", "--poison",
                                "--corrupt-after-prefill"),
        "kernel_rope": run_generate(held_out, d, "kernel_rope", *quick, "--shard",
                                    "--kernel-rope", "--max-tokens", "1"),
        "dir": d,
    }


def max_logprob_diff(ref, got):
    return max(abs(p - q) for la, lb, ta, tb in zip(ref["logprobs"], got["logprobs"],
                                                    ref["tokens"], got["tokens"])
               for p, q, x, y in zip(la, lb, ta, tb) if x == y)


def assert_identical(ref, got, tol=1e-4):
    """``got`` (possibly fewer new tokens) equals ``ref`` over its tokens."""
    assert ref["prompt_lens"] == got["prompt_lens"]
    n = len(got["tokens"][0])
    for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])):
        assert len(b) == n and a[:n] == b, f"prompt {i}: first difference at " \
            f"{next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)}"
    diff = max_logprob_diff(ref, got)
    assert diff <= tol, diff


def test_sharding_is_active_and_the_baseline_is_not(runs):
    on, ref = runs["on"], runs["ref"]
    assert on["dcp"] == 2 and ref["dcp"] == 1
    assert all(b == ["ShardedKVImpl_CPU_MLA"] for b in on["backends"])
    assert all(b == ["CPUMLAImpl"] for b in ref["backends"])
    assert on["block_size"] == 16
    # derived on CPU without being asked: PyTorch's rope
    assert "-rotary_embedding" in on["custom_ops"]


def test_lse_decode_matches_unsharded(runs):
    assert_identical(runs["ref"], runs["on"])


def test_materializing_decode_matches_unsharded(runs):
    assert_identical(runs["ref"], runs["mat"])


def decode_bytes(run, phase):
    """Bytes rank 0 took in through its collectives per pure decode step of
    all 8 requests in one phase, counted on the collectives themselves
    (harness/run_vllm.py ``--count-collectives``: vLLM's all-reduces and
    the plugin's exchanges alike), and the plugin's own count of the same
    steps."""
    steps = [b for b, reqs, decode in run["phases"][phase]["collectives"][0]
             if decode and reqs == 8][: MAT_NEW // 2]
    own = run["phases"][phase]["stats"][0]["decode_step_bytes"][: MAT_NEW // 2] \
        if run["phases"][phase].get("stats") else None
    return steps, own


def test_decode_bytes_do_not_grow_with_the_context(runs):
    (lse_short, own_short), (lse_long, own_long) = (decode_bytes(runs["on_bytes"], p)
                                                     for p in (0, 1))
    # (the debug checks' own gathers grow with the context too: the
    # materializing decode grows with or without them)
    (mat_short, _), (mat_long, _) = (decode_bytes(runs["mat"], p) for p in (0, 1))
    assert len(lse_short) == len(lse_long) == MAT_NEW // 2
    # LSE: queries, partial outputs, LSEs and vLLM's own all-reduces: the same
    # at 4x the context
    assert len(set(lse_short + lse_long)) == 1, (lse_short[:4], lse_long[:4])
    # materializing: the context itself, about 4x more at 4x the context
    assert min(mat_long) > 3 * max(mat_short)
    assert max(lse_long) * 10 < min(mat_long)
    # the plugin's counter of its own exchange, constant too and part of it
    assert len(set(own_short + own_long)) == 1 and own_short[0] < lse_short[0]
    with open(os.path.join(runs["dir"], "decode_bytes.json"), "w") as f:
        json.dump({"lse": [lse_short[0], lse_long[0]], "lse_plugin_counter": own_short[0],
                   "materialize": [mat_short[0], mat_long[0]]}, f)


def test_logical_capacity_doubles(runs):
    ratio = runs["on"]["kv_cache_tokens"] / runs["ref"]["kv_cache_tokens"]
    assert ratio >= 1.95, ratio


def test_capacity_command_matches_the_engine(runs, held_out):
    """``vllm-cp-kv capacity`` (no engine) against the engine's own KV
    sizes of these runs: within 1%."""
    script = os.path.join(os.path.dirname(sys.executable), "vllm-cp-kv")
    proc = subprocess.run(
        [script, "capacity", "--model", held_out, "--tp", "2", "--kv-memory-gib",
         KV["VLLM_CPU_KVCACHE_SPACE"], "--block-size", str(runs["on"]["block_size"]),
         "--dtype", "float32", "--max-model-len", "3200", "--max-num-seqs", "8",
         "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for key, run in (("unsharded", runs["ref"]), ("sharded", runs["on"])):
        assert abs(got[key] / run["kv_cache_tokens"] - 1) <= 0.01, (key, got, run)


def test_each_rank_writes_exactly_what_it_owns(runs):
    """Poisoned caches, one phase (no block is reused): every token whose KV
    is computed (the last sampled one never is) lands on its owner only."""
    bad, plain = runs["corrupt"], runs["plain"]  # sharded; unsharded
    lens = [p + 16 - 1 for p in bad["prompt_lens"]]
    want = owned_counts(lens, bad["block_size"], 2)
    for rank, layers in enumerate(bad["written_rows"]):
        assert layers == [want[rank]] * len(layers), (rank, layers, want)
    total = sum(want)  # unsharded: every rank stores every token
    assert plain["written_rows"] == [[total] * len(plain["written_rows"][0])] * 2


def test_debug_invariants_ran(runs):
    log = runs["on"]["log"]
    assert "cp_kv: KV shard group of 2 ranks" in log
    assert "cp_kv: debug invariants hold (owned writes, plan coverage)" in log
    assert "LSE-merged decode equals attention over the materialized full view" in log
    # the materializing decode gathers every step: its plans are compared
    assert "debug invariants hold (identical plans across ranks)" in runs["mat"]["log"]
    assert "debug invariants" not in runs["corrupt"]["log"]  # off by default


def test_corrupting_one_owned_block_changes_the_output(runs):
    on, bad = runs["on"], runs["corrupt"]
    assert bad["corrupted_block"][0] is None and bad["corrupted_block"][1] >= 0
    clean = [t[:16] for t in on["phases"][0]["tokens"]]
    changed = [a != b for a, b in zip(clean, bad["tokens"])]
    assert any(changed), "a corrupted owned block went unnoticed"


def test_cpu_rotary_kernel_would_change_the_answers(runs):
    """Negative control for the derived rope: with vLLM's CPU kernel kept,
    sharded first tokens differ from the correct unsharded run."""
    kernel, ref = runs["kernel_rope"], runs["ref"]
    assert "+rotary_embedding" in kernel["custom_ops"]
    first_ref = [t[0] for t in ref["phases"][0]["tokens"]]
    first_kernel = [t[0] for t in kernel["tokens"]]
    assert first_kernel != first_ref


def test_installed_but_not_enabled_is_plain_vllm(runs):
    plain, ref = runs["plain"], runs["ref"]
    assert plain["plugin_loaded"] is False and ref["plugin_loaded"] is True
    assert plain["kv_cache_tokens"] == ref["kv_cache_tokens"]
    assert plain["backends"] == ref["backends"]
    assert plain["tokens"] == [t[:16] for t in ref["phases"][0]["tokens"]]


def test_bfloat16_on_the_platform_backend(held_out, tmp_path):
    d = str(tmp_path)
    args = ("--token-prompts", SHORT, "--max-tokens", "16")
    ref = run_generate(held_out, d, "bf16_ref", *args, "--torch-rope")
    on = run_generate(held_out, d, "bf16_on", *args, "--shard")
    backend = "AMX_MLA" if amx_available() else "CPU_MLA"
    assert on["backends"][0] == [f"ShardedKVImpl_{backend}"]
    # the prefill path is the same kernel on the same values: exact
    assert [t[0] for t in on["tokens"]] == [t[0] for t in ref["tokens"]]
    same = sum(a == b for a, b in zip(ref["tokens"], on["tokens"]))
    report = {"backend": backend, "prompts": len(ref["tokens"]),
              "identical_prompts": same,
              "max_logprob_diff_agreeing_tokens": max_logprob_diff(ref, on)}
    with open(os.path.join(d, "bf16_report.json"), "w") as f:
        json.dump(report, f)
    print("bf16 report:", report)
    assert report["max_logprob_diff_agreeing_tokens"] < 1.0, report


def test_chunked_prefill_reads_context_through_the_full_view(held_out, tmp_path):
    """Prefill chunks of 128 tokens: later chunks read earlier chunks' KV
    from the materialized view (vLLM keeps chunked prefill on for MLA only
    with AMX_MLA)."""
    if not amx_available():
        pytest.skip("chunked prefill: vLLM turns it off for MLA on CPUs without "
                    "AMX (CPU_MLA backend)")
    d = str(tmp_path)
    args = ("--max-num-batched-tokens", "128", "--token-prompts", SHORT,
            "--max-tokens", "16")
    off = run_generate(held_out, d, "chunk_off", *args, "--torch-rope")
    on = run_generate(held_out, d, "chunk_on", "--shard", *args)
    assert on["chunked_prefill"]
    assert [t[0] for t in on["tokens"]] == [t[0] for t in off["tokens"]]
