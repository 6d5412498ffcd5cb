"""Speculative decoding with sharded KV: DeepSeek MTP (and n-gram lookup),
real vLLM on CPU, TP=2, float32, CPU_MLA, PyTorch rope.

The model (tools/tiny_model.build_mtp) has one MTP layer whose drafts the
target accepts some of the time (17-55%, not 0), so the acceptance count
depends on what the draft layer reads. Three phases run one after the
other: one batch of four prompts of 20-2,000 tokens, then two requests of
500 and two of 2,000 tokens (contexts 4x apart), 24 greedy tokens each.

For k = 1, 2, 3 draft tokens: sharded + MTP gives exactly the tokens of
unsharded + MTP and of unsharded without speculation (logprobs within
1e-4), and vLLM's own counters (drafts, draft tokens, accepted tokens) are
equal for sharded and unsharded; the MTP layer's latent is sharded with
the target's (capacity >= 1.9x at equal memory), verification rows reach
the shard-aware decode as rows of 1 + k query tokens, and the bytes a rank
receives per decode step are the same at both context lengths. Negative
control: one owned block of the MTP layer's cache overwritten after the
prefill changes the accepted count against phase 1 of the k = 2 run, which
poisons every cache first (the tokens cannot change: the target verifies
every draft). Prefix caching with MTP: the second wave hits
(vLLM's counters), tokens equal the unsharded run's, with its short rows
reading their cached context owned and the others gathered (the mixed
context paths, docs/context.md). n-gram lookup: tokens
equal to the run without speculation.
"""

import json

import pytest

from conftest import needs_vllm, run_generate
from test_e2e_vllm import assert_identical

pytestmark = needs_vllm
PHASES = "20,300,900,2000;500,500;2000,2000"
ARGS = ("--dtype", "float32", "--backend", "CPU_MLA", "--torch-rope", "--max-model-len",
        "2100", "--token-prompts", PHASES, "--max-tokens", "24")
KV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
WAVES = "530,610,700,1000"  # wave 2: each with a new 24-token suffix
VIRTUAL_BLOCK = 16 * 2  # a scheduler block: block size x shard size tokens
# wave 2 with MTP: rows of at most 70 new tokens read their context owned
# (610 and 1000: 58 and 64 new), the others gathered (docs/context.md)
MIXED = {"context_path": "owned", "owned_context_max_query": 70}


def spec(k: int, method: str = "mtp") -> tuple:
    config = {"method": method, "num_speculative_tokens": k}
    if method == "mtp":  # vLLM picks the draft's backend itself (AMX_MLA: bf16 only)
        config["attention_backend"] = "CPU_MLA"
    else:
        config.update(prompt_lookup_max=3, prompt_lookup_min=1)
    return ("--spec", json.dumps(config))


@pytest.fixture(scope="module")
def runs(tiny_mtp, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("mtp"))
    out = {"ref": run_generate(tiny_mtp, d, "ref", *ARGS, "--no-plugin", env=KV)}
    for k in (1, 2, 3):
        out[f"plain{k}"] = run_generate(tiny_mtp, d, f"plain{k}", *ARGS, "--no-plugin",
                                        *spec(k), env=KV)
        # k = 2: debug checks on, and every cache poisoned first: the clean
        # run of the negative control below
        out[f"shard{k}"] = run_generate(
            tiny_mtp, d, f"shard{k}", *ARGS, "--shard", "--stats", *spec(k),
            *(("--poison",) if k == 2 else ()),
            env={**KV, "VLLM_CP_KV_DEBUG": "1"} if k == 2 else KV)
    out["corrupt"] = run_generate(tiny_mtp, d, "corrupt", *ARGS, "--shard", "--poison",
                                  "--corrupt-after-prefill", "--corrupt-layer", "-1",
                                  *spec(2), env=KV)  # runs phase 1 only
    out["ngram"] = run_generate(tiny_mtp, d, "ngram", *ARGS, "--shard", *spec(3, "ngram"),
                                env=KV)
    waves = ("--dtype", "float32", "--backend", "CPU_MLA", "--torch-rope",
             "--max-model-len", "2100", "--token-prompts", WAVES, "--waves", "2",
             "--max-tokens", "16", "--suffix-len", "24")
    out["waves_plain"] = run_generate(tiny_mtp, d, "waves_plain", *waves, "--no-plugin",
                                      *spec(1), env=KV)
    out["waves_shard"] = run_generate(tiny_mtp, d, "waves_shard", *waves, "--shard",
                                      *spec(1), "--stats", "--cp-kv", json.dumps(MIXED),
                                      env=KV)
    out["waves_nospec"] = run_generate(tiny_mtp, d, "waves_nospec", *waves, "--shard",
                                       env=KV)
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sharded_mtp_gives_the_tokens_and_counters_of_unsharded_mtp(runs, k):
    ref, plain, shard = runs["ref"], runs[f"plain{k}"], runs[f"shard{k}"]
    assert shard["backends"] == [["ShardedKVImpl_CPU_MLA"]] * 2 and plain["dcp"] == 1
    assert_identical(ref, plain)  # vLLM's MTP itself is exact here
    assert_identical(plain, shard)
    assert_identical(ref, shard)
    assert shard["spec_decode"] == plain["spec_decode"], (shard["spec_decode"],
                                                          plain["spec_decode"])
    counters = shard["spec_decode"]
    assert counters["spec_decode_num_draft_tokens"] == k * counters["spec_decode_num_drafts"]
    assert counters["spec_decode_num_accepted_tokens"] > 0  # the drafts matter


@pytest.mark.parametrize("k", [1, 2, 3])
def test_verification_rows_take_the_shard_aware_decode(runs, k):
    for phase in runs[f"shard{k}"]["phases"]:
        for rank in phase["stats"]:
            assert rank["decode_steps"] > 0
            assert rank["multi_query_decode_steps"] > 0  # rows of 1 + k query tokens


def test_the_mtp_layer_is_sharded_too(runs):
    shard, plain = runs["shard2"], runs["plain2"]
    assert len(shard["cache_shapes"]) == 3  # two target layers and the MTP layer
    ratio = shard["capacity_tokens"] / plain["capacity_tokens"]
    assert ratio >= 1.9, ratio


def test_decode_bytes_do_not_grow_with_the_context(runs):
    """Phases 2 and 3: two requests each, contexts of 500 and 2,000 tokens."""
    for k in (1, 2, 3):
        short, long_ = runs[f"shard{k}"]["phases"][1:]
        for a, b in zip(short["stats"], long_["stats"]):
            per_step = set(a["decode_step_bytes"]) | set(b["decode_step_bytes"])
            # every step with both requests running moves the same bytes
            assert max(a["decode_step_bytes"]) == max(b["decode_step_bytes"]), per_step


def test_debug_checks_ran_under_mtp(runs):
    log = runs["shard2"]["log"]
    assert "debug invariants hold (owned writes, plan coverage)" in log
    assert "LSE-merged decode equals attention over the materialized full view" in log
    for rank in runs["shard2"]["stats"]:
        assert rank["debug_decode_checks"] > 0 and rank["debug_decode_err_max"] < 1e-4


def test_corrupting_one_owned_block_of_the_mtp_layer_changes_the_drafts(runs):
    """The corrupted run is phase 1 of shard2 (the same prompts on a fresh
    engine) with one owned block of the MTP layer overwritten after the prefill."""
    clean, corrupt = runs["shard2"]["phases"][0], runs["corrupt"]
    assert corrupt["corrupted_block"][1] is not None  # rank 1 overwrote one
    assert clean["prompt_lens"] == corrupt["prompt_lens"]
    assert clean["tokens"] == corrupt["tokens"]  # the target verifies every draft
    assert clean["spec_decode"] != corrupt["spec_decode"], clean["spec_decode"]


def test_ngram_speculation_with_sharded_kv(runs):
    assert_identical(runs["ref"], runs["ngram"])
    assert runs["ngram"]["spec_decode"]["spec_decode_num_drafts"] > 0


def test_prefix_caching_with_mtp(runs):
    """Wave 2 hits the prefill's cache; vLLM drops the last cached block of
    an MTP (EAGLE) request's prefix, a virtual block of block size x shard
    size tokens under sharding: that many fewer hits per request than
    without speculation."""
    shard, plain, nospec = runs["waves_shard"], runs["waves_plain"], runs["waves_nospec"]
    for a, b in zip(plain["waves"], shard["waves"]):
        assert_identical(a, b)
    hits = shard["waves"][1]["prefix_cache_hits"]
    without = nospec["waves"][1]["prefix_cache_hits"]
    requests = len(WAVES.split(","))
    assert 0 < hits < without, (hits, without)
    assert without - hits == requests * VIRTUAL_BLOCK, (hits, without)
    # the mixed context paths (MIXED) in the wave with hits, on both ranks
    lens = [int(n) for n in WAVES.split(",")]
    cached = [max(n // VIRTUAL_BLOCK * VIRTUAL_BLOCK - VIRTUAL_BLOCK, 0) for n in lens]
    short = [n for n, h in zip(lens, cached)
             if h and n + 24 - h <= MIXED["owned_context_max_query"]]
    assert sum(cached) == hits and 1 <= len(short) < len(lens), (cached, short)
    stats = [s for s in shard["waves"][1]["stats"] if s]
    assert len(stats) == 2, stats
    for s in stats:
        assert s["owned_context_rows"] == len(short), (s, short)
        assert s["mixed_context_steps"] >= 1, s
