"""Real vLLM on CPU, tiny DeepSeek-V2 (MLA + MoE), TP=2 worker processes.

Every comparison is against the unsharded run of the same configuration:
identical greedy tokens (8 prompts of 3-560 tokens, up to 18 blocks of 32,
32 new tokens each, so decode reads the sharded context at every step),
logprobs within 0.05, at least 1.95x the logical KV capacity at the same
memory. Poisoned caches show that each rank writes exactly the tokens it
owns; corrupting one owned block after prefill changes the output
(negative control). The plugin installed but not enabled matches plain
vLLM (the plugin not loaded at all).
"""

import pytest

from conftest import needs_vllm, run_generate
from vllm_cp_kv.core.ownership import brute_force_owned_counts

pytestmark = needs_vllm
BLOCK = "32"  # AMX_MLA needs a multiple of 32; CPU_MLA forces 16


def owned_tokens(prompt_lens, new_tokens, block_size, n):
    """Tokens whose KV each rank must store (the last sample is never fed back)."""
    return brute_force_owned_counts([p + new_tokens - 1 for p in prompt_lens],
                                    block_size, n)


@pytest.fixture(scope="module")
def runs(tiny_dsv2, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("e2e"))
    common = ("--block-size", BLOCK)
    return {
        "plain": run_generate(tiny_dsv2, d, "plain", "--no-plugin", *common),
        "off": run_generate(tiny_dsv2, d, "off", "--poison", *common),
        "on": run_generate(tiny_dsv2, d, "on", "--shard", "--poison", *common,
                           env={"VLLM_CP_KV_DEBUG": "1"}),
        "corrupt": run_generate(tiny_dsv2, d, "corrupt", "--shard", "--poison",
                                "--corrupt-after-prefill", *common),
    }


def assert_same_generation(ref, got):
    assert len(ref["tokens"]) >= 8
    assert ref["prompt_lens"] == got["prompt_lens"]
    for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])):
        assert len(a) >= 32 and a == b, f"prompt {i}: {a} != {b}"
    diff = max(abs(p - q) for la, lb in zip(ref["logprobs"], got["logprobs"])
               for p, q in zip(la, lb))
    assert diff <= 0.05, diff


def test_sharding_is_active_and_the_baseline_is_not(runs):
    on, off = runs["on"], runs["off"]
    assert on["dcp"] == 2 and off["dcp"] == 1
    assert all(b[0].startswith("ShardedKVImpl_") for b in on["backends"])
    assert not any(b[0].startswith("ShardedKVImpl_") for b in off["backends"])
    assert max(on["prompt_lens"]) >= 8 * int(BLOCK)  # spans 8+ blocks


def test_sharded_tokens_match_unsharded(runs):
    assert_same_generation(runs["off"], runs["on"])


def test_logical_capacity_doubles(runs):
    ratio = runs["on"]["kv_cache_tokens"] / runs["off"]["kv_cache_tokens"]
    assert ratio >= 1.95, ratio


def test_each_rank_writes_exactly_what_it_owns(runs):
    on, off = runs["on"], runs["off"]
    want = owned_tokens(on["prompt_lens"], 32, on["block_size"], 2)
    for rank, layers in enumerate(on["written_rows"]):
        assert layers == [want[rank]] * len(layers), (rank, layers, want)
    # unsharded: every rank stores every token
    total = sum(want)
    assert off["written_rows"] == [[total] * len(off["written_rows"][0])] * 2


def test_debug_invariants_ran(runs):
    log = runs["on"]["log"]
    assert "cp_kv: KV shard group of 2 ranks" in log
    assert "cp_kv: debug invariants hold" in log
    assert "debug invariants" not in runs["corrupt"]["log"]  # off by default


def test_corrupting_one_owned_block_changes_the_output(runs):
    on, bad = runs["on"], runs["corrupt"]
    assert bad["corrupted_block"][0] is None and bad["corrupted_block"][1] >= 0
    changed = [a != b for a, b in zip(on["tokens"], bad["tokens"])]
    assert any(changed), "a corrupted owned block went unnoticed"


def test_installed_but_not_enabled_is_plain_vllm(runs):
    plain, off = runs["plain"], runs["off"]
    assert plain["plugin_loaded"] is False and off["plugin_loaded"] is True
    assert plain["kv_cache_tokens"] == off["kv_cache_tokens"]
    assert plain["tokens"] == off["tokens"]
    assert plain["backends"] == off["backends"]


def test_chunked_prefill_reads_context_through_the_full_view(tiny_dsv2, tmp_path):
    """Prefill chunks of 128 tokens: later chunks read earlier chunks' KV
    from the materialized view (AMX_MLA keeps chunked prefill on)."""
    d = str(tmp_path)
    args = ("--block-size", BLOCK, "--max-num-batched-tokens", "128")
    off = run_generate(tiny_dsv2, d, "chunk_off", *args)
    on = run_generate(tiny_dsv2, d, "chunk_on", "--shard", *args)
    if not on["chunked_prefill"]:
        pytest.skip("this CPU's MLA backend disables chunked prefill")
    assert_same_generation(off, on)


def test_reference_cpu_mla_backend(tiny_dsv2, tmp_path):
    """The other CPU backend (block size 16, no chunked prefill)."""
    d = str(tmp_path)
    off = run_generate(tiny_dsv2, d, "cpumla_off", "--backend", "CPU_MLA")
    on = run_generate(tiny_dsv2, d, "cpumla_on", "--shard", "--backend", "CPU_MLA")
    assert on["backends"][0] == ["ShardedKVImpl_CPU_MLA"]
    assert on["block_size"] == 16
    assert_same_generation(off, on)
    assert on["kv_cache_tokens"] / off["kv_cache_tokens"] >= 1.95
