"""Four ranks on CPU: TP=4 sharded against TP=4 unsharded (PyTorch's rope),
real vLLM, the held-out tiny model (8 heads, so TP=4 divides them), float32
with CPU_MLA, 6 prompts of 40-640 random token ids, 16 greedy tokens.

TP=4 on a 2-core machine: workers unbound, one OpenMP thread each
(docs/design.md, platform notes). Asserted: identical tokens, logprobs
within 1e-4, each rank owns a quarter of the capacity (>= 3.8x the
unsharded layout at the same memory per rank), the plan identical on all
four ranks (debug switch), and every rank wrote exactly the tokens it owns
(from vLLM's slot-mapping kernel, transcribed).

Mixed context paths at TP=4 (docs/context.md): a second wave extends each
prompt by 24 tokens, so its prefix is a cache hit (at 16 x 4 = 64-token
granularity); with ``context_path = "owned"`` and at most 80 new tokens,
the rows of 130, 500 and 640 tokens (26, 76 and 24 new) attend to the
owned context on each of the four ranks and merge by LSE, those of 250 and
380 (82 and 84 new) read it gathered, in the same batch. Both waves' tokens equal the
unsharded run's."""

import json

import pytest

from conftest import needs_vllm, run_generate
from harness.reference import owned_counts

pytestmark = needs_vllm
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
ARGS = ("--tp", "4", "--dtype", "float32", "--backend", "CPU_MLA",
        "--token-prompts", "40,130,250,380,500,640", "--max-tokens", "16", "--poison")
WAVES = ("--waves", "2", "--suffix-len", "24")
OWNED_QUERY = 80


@pytest.fixture(scope="module")
def runs(held_out, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tp4"))
    mixed = {"context_path": "owned", "owned_context_max_query": OWNED_QUERY}
    return {
        "ref": run_generate(held_out, d, "tp4_ref", *ARGS, *WAVES, "--torch-rope", env=ENV),
        "on": run_generate(held_out, d, "tp4_on", *ARGS, "--shard",
                           env={**ENV, "VLLM_CP_KV_DEBUG": "1"}),
        "mixed": run_generate(held_out, d, "tp4_mixed", *ARGS, *WAVES, "--shard", "--stats",
                              "--cp-kv", json.dumps(mixed), env=ENV),
    }


def assert_same(ref, on):
    assert on["prompt_lens"] == ref["prompt_lens"]
    assert on["tokens"] == ref["tokens"]
    diff = max(abs(p - q) for a, b in zip(ref["logprobs"], on["logprobs"])
               for p, q in zip(a, b))
    assert diff <= 1e-4, diff


def test_tp4_sharded_equals_unsharded(runs):
    ref, on = runs["ref"], runs["on"]
    assert on["dcp"] == 4 and ref["dcp"] == 1
    assert_same(ref["waves"][0], on)
    ratio = on["kv_cache_tokens"] / ref["kv_cache_tokens"]
    assert ratio >= 3.8, ratio
    assert "cp_kv: debug invariants hold" in on["log"]
    want = owned_counts([p + 16 - 1 for p in on["prompt_lens"]], on["block_size"], 4)
    for rank, layers in enumerate(on["written_rows"]):
        assert layers == [want[rank]] * len(layers), (rank, layers, want)


def test_tp4_mixed_context_paths(runs):
    ref, mixed = runs["ref"], runs["mixed"]
    for wave in (0, 1):
        assert_same(ref["waves"][wave], mixed["waves"][wave])
    granule = mixed["block_size"] * mixed["dcp"]
    lens = mixed["waves"][0]["prompt_lens"]
    hits = [min(n // granule * granule, n + 24 - 1) for n in lens]
    short = [n for n, h in zip(lens, hits) if h and n + 24 - h <= OWNED_QUERY]
    assert 1 <= len(short) < len(lens) - 1, short
    assert mixed["waves"][1]["prefix_cache_hits"] == sum(hits)
    stats = [s for s in mixed["waves"][1]["stats"] if s]
    assert len(stats) == 4, stats
    for s in stats:
        assert s["owned_context_rows"] == len(short), (s, short)
        assert s["mixed_context_steps"] >= 1, s
