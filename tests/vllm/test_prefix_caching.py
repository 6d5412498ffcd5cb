"""Prefix caching with sharded KV, real vLLM on CPU, TP=2, float32 with
CPU_MLA (runs on every CPU).

Two waves of 8 requests on the held-out tiny model: wave 1 runs prompts of
300-1000 random token ids; wave 2, after wave 1 finished, runs each prompt
with a new 24-token suffix, so its prefix is in vLLM's cache. The sharded
run keeps prefix caching on: vLLM's own counters must show the hits, at the
granularity of a scheduler block (block size x shard size tokens), and the
tokens of both waves must equal the unsharded run's. vLLM turns prefix
caching off for MLA on CPU_MLA, so there the unsharded reference
recomputes every prompt; where vLLM keeps it on (AMX_MLA) the reference has
it too. Either way the reference is correct, and the sharded wave 2 reads
its cached context through the full view (with CPU_MLA, by vLLM's own
chunked-context prefill, which the plugin keeps prefix caching on for).

Mixed context paths (``cp_kv.context_path = "owned"``, docs/context.md):
wave 2's rows of at most 30 new tokens attend to each rank's owned context
and merge by LSE, as decode rows do; the others read it gathered, in the
same batch. Both kinds' tokens equal the unsharded run's.

Negative control: a third wave repeats wave 2 after one cached block owned
by shard rank 1 was overwritten: the hit is read, so the output changes.

Bounded scratch (``core.plan.chunk_ranges``): the sharded run reads its
cached context through a 64-token workspace, so wave 2's contexts of
500-1000 tokens take 8-16 chunks per layer, each gathered, read by vLLM's
own context-chunk attention and merged by LSE; the corrupted block is
tokens 336-351 of the first prompt, chunk 6 of its context. The third run
keeps the default workspace (1% of the KV budget, here 8 blocks) at the
same 24 MiB per rank as the reference: its engine must hold at least 1.9x
the reference's tokens (before the bound, 1.20x at this budget).

Decode rows with several query tokens (``core/decode.py``): a third run,
sharded, has the harness's verification shim (scripts/gpu/onegpu/patches.py,
no. 8) that sends every row of up to 64 new tokens down the decode path, as
FLASH_ATTN_MLA does on GPU with 512: every row of wave 2 (each short
extension of a cached context, and the 25-token prompt with nothing cached)
reaches the shard-aware decode as a multi-token row (vLLM's CPU runner does
not reorder wave 1's batch, whose first row is long, so wave 1 is all
prefill). Its tokens must equal the unsharded run's too; on the code before
the per-query causal limit this run gave 8 of 8 identical prompts in wave 1
and 0 of 8 in wave 2.
"""

import json

import pytest

from conftest import harness_env, needs_vllm, run_generate

pytestmark = needs_vllm
PROMPTS = "530,610,700,810,900,1000,1,40"  # the corrupted block (the lowest id) is a hit
ARGS = ("--dtype", "float32", "--backend", "CPU_MLA", "--max-model-len", "2048",
        "--token-prompts", PROMPTS, "--max-tokens", "24", "--suffix-len", "24",
        "--kv-bytes", str(24 * 2**20), "--max-num-seqs", "12")
KV = {"VLLM_CPU_KVCACHE_SPACE": None}  # unset: --kv-bytes, not the environment's GiB
WORKSPACE = 64  # tokens: 4 blocks of 16, 2 per rank
CORRUPT = 10  # rank 1's 11th block: logical block 21 of the first prompt
# wave 2's rows of at most OWNED_QUERY new tokens read their context owned
# (docs/context.md): 610 and 900 (26 and 28 new tokens past hits of 608 and
# 896); the others (32-52 new tokens) gathered in chunks, in the same batch
OWNED_QUERY = 30
ON_OPTIONS = {"workspace_tokens": WORKSPACE, "context_path": "owned",
              "owned_context_max_query": OWNED_QUERY}


@pytest.fixture(scope="module")
def runs(held_out, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("prefix"))
    return {
        "ref": run_generate(held_out, d, "ref", *ARGS, "--torch-rope", "--waves", "2",
                            env=KV),
        "on": run_generate(held_out, d, "on", *ARGS, "--shard", "--waves", "3",
                           "--poison", "--corrupt-between-waves", "--corrupt-index",
                           str(CORRUPT), "--stats",
                           "--cp-kv", json.dumps(ON_OPTIONS),
                           env={"VLLM_CP_KV_DEBUG": "1", **KV}),
        "multi": run_generate(held_out, d, "multi", *ARGS, "--shard", "--waves", "2",
                              "--stats", env=SHIM),
    }


SHIM = {"VLLM_CP_KV_DEBUG": "1", **KV, **harness_env(CPKV_SHIM_DECODE_THRESHOLD="64")}


def test_sharded_run_keeps_prefix_caching_on(runs):
    assert runs["on"]["prefix_caching"] is True
    assert runs["on"]["dcp"] == 2


def test_second_wave_hits_the_cache(runs):
    on = runs["on"]
    wave1, wave2 = on["waves"][0], on["waves"][1]
    assert wave1["prefix_cache_hits"] == 0
    # every prompt's full scheduler blocks are hits (granularity: 16 x 2 tokens)
    granule = on["block_size"] * on["dcp"]
    want = sum((n // granule) * granule for n in wave1["prompt_lens"])
    assert wave2["prefix_cache_hits"] == want, (wave2["prefix_cache_hits"], want)
    print("prefix cache hits (tokens): wave 2", wave2["prefix_cache_hits"], "of",
          wave2["prefix_cache_queries"], "queried; reference",
          runs["ref"]["waves"][1].get("prefix_cache_hits"))


@pytest.mark.parametrize("run", ["on", "multi"])
@pytest.mark.parametrize("wave", [0, 1])
def test_tokens_equal_the_unsharded_run(runs, wave, run):
    ref, on = runs["ref"]["waves"][wave], runs[run]["waves"][wave]
    assert ref["prompt_lens"] == on["prompt_lens"]
    assert ref["tokens"] == on["tokens"]
    diff = max(abs(p - q) for a, b in zip(ref["logprobs"], on["logprobs"])
               for p, q in zip(a, b))
    assert diff <= 1e-4, diff


def test_debug_checks_held_with_cache_hits(runs):
    assert "cp_kv: debug invariants hold" in runs["on"]["log"]


def test_context_was_read_in_chunks(runs):
    """Wave 2's hits of 512-992 tokens through 64-token chunks; both ranks
    planned the same chunks."""
    stats = [s for s in runs["on"]["waves"][1]["stats"] if s]
    assert len(stats) == 2 and stats[0]["max_context_chunks"] == stats[1]["max_context_chunks"]
    assert all(s["chunked_context_steps"] >= 1 for s in stats), stats
    assert stats[0]["max_context_chunks"] >= 1000 // WORKSPACE, stats
    assert "the chunked context's workspace" in runs["on"]["log"]


def test_short_rows_read_their_context_owned_beside_gathered_ones(runs):
    """Wave 2 mixes the paths in one batch: the rows of at most
    ``OWNED_QUERY`` new tokens attend to each rank's owned context (merged
    by LSE), the others read it gathered; the tokens above equal the
    unsharded run's. Which rows: recomputed from the wave's hits."""
    on = runs["on"]
    wave1 = on["waves"][0]
    granule = on["block_size"] * on["dcp"]
    short = [n for n in wave1["prompt_lens"]
             if n >= granule and n - n // granule * granule + 24 <= OWNED_QUERY]
    assert len(short) >= 1 and len(short) < len(wave1["prompt_lens"]) - 1, short
    stats = [s for s in on["waves"][1]["stats"] if s]
    assert len(stats) == 2, stats
    for s in stats:
        assert s["owned_context_rows"] == len(short), (s, short)
        assert s["mixed_context_steps"] >= 1, s
    assert all(not s.get("owned_context_rows") for s in on["waves"][0]["stats"] if s)


def test_capacity_at_a_small_budget(runs):
    """The default workspace at 24 MiB per rank: >= 1.9x the reference."""
    ratio = runs["multi"]["kv_cache_tokens"] / runs["ref"]["kv_cache_tokens"]
    assert ratio >= 1.9, ratio


def test_a_corrupted_cached_block_changes_the_next_hit(runs):
    """The corrupted block lies in a later chunk of the first prompt's
    context (tokens ``(2 * CORRUPT + 1) * 16`` on, chunk
    ``(2 * CORRUPT + 1) * 16 // WORKSPACE``): the first prompt's answer changes."""
    on = runs["on"]
    assert on["corrupted_block"][1] is not None
    assert (2 * CORRUPT + 1) * 16 // WORKSPACE >= 5
    assert on["waves"][2]["tokens"][0] != on["waves"][1]["tokens"][0]
    wave2, wave3 = on["waves"][1], on["waves"][2]
    assert wave3["prefix_cache_hits"] > 0
    assert wave3["tokens"] != wave2["tokens"]


def test_multi_token_rows_reached_the_shard_aware_decode(runs):
    multi = runs["multi"]
    assert "patches armed" in multi["log"]  # the shim ran in the workers
    stats = [s for s in multi["waves"][1]["stats"] if s]  # wave 2, per rank
    assert len(stats) == 2
    assert all(s["multi_query_decode_steps"] >= 1 for s in stats), stats
    # the debug check compared the merged decode with the full view
    assert all(s["debug_decode_checks"] > 0 for s in stats)
    assert "debug invariants hold" in multi["log"]
