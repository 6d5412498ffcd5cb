"""Planning under prefill context parallelism: every rank runs different
chunks of the same requests (vLLM's own DualChunkSwap split, taken from its
``PCPManager``), yet the gather is a collective, so every rank must derive
the same plan (``plan_split_requests``), and each local row must see its
own context through its translated table (checked against each token read
from where vLLM's slot-mapping kernel stored it, harness/reference.py)."""

import numpy as np
import pytest
import torch

from builders import BS, make_batch, read_rows, spec
from conftest import needs_vllm
from vllm_cp_kv.core import debug
from harness.reference import full_view, tokens_of
from vllm_cp_kv.core.plan import global_rows, plan_context_chunks, plan_split_requests

pytestmark = needs_vllm

# (num_scheduled_tokens, num_computed_tokens, is_prefilling)
SCENARIOS = {
    "fresh_prefills": ([37, 128, 9, 300], [0, 0, 0, 0], [True] * 4),
    "chunked_prefill_with_context": ([64, 200], [96, 17], [True, True]),
    "decodes_mixed_with_prefills": ([1, 1, 77, 1, 260], [40, 300, 0, 5, 33],
                                    [False, False, True, False, True]),
    "short_prefills_replicated": ([3, 2], [0, 0], [True, True]),
}


def local_rows(mgr, rank, sched, computed, prefilling):
    """This rank's rows: (global request index, tokens the row reads)."""
    qsl = np.concatenate([[0], np.cumsum(sched)])
    rows = []
    for seg in mgr._get_rank_segments(rank, sched, prefilling, qsl):
        g = seg.global_batch_req_idx
        start = computed[g] + seg.global_batch_slice.start - qsl[g]
        # prefill chunks read their context; decodes their whole sequence
        reads = start if prefilling[g] else start + seg.num_tokens
        rows.append((g, int(reads)))
    return rows


def manager(n, rank, dcp):
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    return PCPManager(pcp_world_size=n, pcp_rank=rank, device=torch.device("cpu"),
                      shard_decode_requests=dcp == 1, dcp_world_size=dcp)


def scenario(n, name):
    """A scenario's batch: its arrays, every request's length this step, the
    request-state indices, the state-indexed block table, the ranks' caches
    and the reference view of every request."""
    sched, computed, prefilling = (np.array(x) for x in SCENARIOS[name])
    total = computed + sched
    table, _, caches = make_batch(n, total.tolist(), seed=n, num_blocks=256)
    keys = np.array([7, 3, 11, 0, 5])[: len(sched)]  # request-state indices
    state_table = torch.zeros(16, table.shape[1], dtype=table.dtype)
    state_table[torch.as_tensor(keys)] = table
    return (sched, computed, prefilling), total, keys, state_table, caches, \
        full_view(table, total, caches, BS, n)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_rank_derives_the_same_plan(n, name):
    (sched, computed, prefilling), total, keys, state_table, caches, ref = scenario(n, name)
    plans = []
    for rank in range(n):
        rows = local_rows(manager(n, rank, dcp=n), rank, sched, computed, prefilling)
        row_keys = keys[[g for g, _ in rows]]
        plan, full, global_table = plan_split_requests(
            spec(n, rank), state_table[row_keys], row_keys, keys, torch.as_tensor(total))
        debug.check_plan_covers(plan, global_table, torch.as_tensor(total))
        scratch = torch.cat([caches[r][plan.send_block_ids[r]] for r in range(n)])
        for (g, reads), row in zip(rows, full):
            nb = -(-reads // BS)
            got = tokens_of(scratch[row[:nb].long()], reads)
            assert torch.equal(got, ref[g][:reads]), (name, rank, g)
        plans.append(plan)
    for plan in plans[1:]:
        assert torch.equal(plan.send_block_ids, plans[0].send_block_ids)
        assert torch.equal(plan.full_block_table, plans[0].full_block_table)


@pytest.mark.parametrize("capacity_per_rank", [1, 3, 7])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_chunked_context_under_pcp(n, name, capacity_per_rank):
    """The chunked context under PCP: the chunks are the global requests'
    (identical on every rank, each gather a collective); each of vLLM's rows
    on each rank reads, chunk after chunk, exactly its own context."""
    (sched, computed, prefilling), total, keys, state_table, caches, ref = scenario(n, name)
    per_rank = []
    for rank in range(n):
        rows = local_rows(manager(n, rank, dcp=n), rank, sched, computed, prefilling)
        row_keys = keys[[g for g, _ in rows]]
        global_table, local = global_rows(state_table[row_keys], row_keys, keys)
        chunks = plan_context_chunks(spec(n, rank), global_table, torch.as_tensor(total),
                                     capacity_per_rank * n)
        debug.check_chunks_cover(chunks, global_table, torch.as_tensor(total))
        got = read_rows(chunks, local, torch.tensor([reads for _, reads in rows]), caches)
        for (g, reads), row in zip(rows, got):
            assert torch.equal(row, ref[g][:reads]), (name, rank, g, reads)
        per_rank.append(chunks)
    for chunks in per_rank[1:]:
        assert len(chunks) == len(per_rank[0])
        for a, b in zip(chunks, per_rank[0]):
            assert torch.equal(a.plan.send_block_ids, b.plan.send_block_ids)
            assert torch.equal(a.num_tokens, b.num_tokens)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_builders_pcp_chunks_are_the_same_on_every_rank(name):
    """``planning._plan_pcp`` with chunks: each rank passes its own rows and
    its own minimum width (its longest row, a local figure under PCP), yet
    every chunk's plan, full-view table included, is the same on every rank
    (the debug switch's identical-plan check compares all of it)."""
    from types import SimpleNamespace

    from vllm_cp_kv.integration.planning import _plan_pcp
    from vllm_cp_kv.integration.step import PCPStep

    n = 4
    (sched, computed, prefilling), total, keys, state_table, _, _ = scenario(n, name)
    per_rank = []
    for rank in range(n):
        rows = local_rows(manager(n, rank, dcp=n), rank, sched, computed, prefilling)
        row_keys = keys[[g for g, _ in rows]]
        step = PCPStep(keys=keys, seq_lens=total, is_prefill=prefilling, row_keys=row_keys)
        inputs = SimpleNamespace(spec=spec(n, rank), debug=False, pool_blocks=2 * n)
        local_columns = max(-(-(reads + 1) // BS) for _, reads in rows)
        common = SimpleNamespace(block_table_tensor=state_table[row_keys], num_reqs=len(rows))
        _, full, _, chunks, local, owned = _plan_pcp(inputs, step, common, 0, True,
                                                     local_columns, True, None)
        assert owned is None
        assert full.shape[0] == len(rows) and local.shape[0] == len(rows)
        per_rank.append(chunks)
    for chunks in per_rank[1:]:
        assert len(chunks) == len(per_rank[0])
        for a, b in zip(chunks, per_rank[0]):
            assert torch.equal(a.plan.full_block_table, b.plan.full_block_table)
            assert torch.equal(a.plan.send_block_ids, b.plan.send_block_ids)


def test_a_rank_without_a_request_is_refused():
    """vLLM's PCP-only layout (DCP 1) gives each decode to one rank: the
    other rank cannot know that request's blocks, so planning refuses
    (cp_kv sets DCP = PCP, which keeps decodes on every rank)."""
    sched, computed, prefilling = (np.array([1, 1, 50]), np.array([10, 20, 0]),
                                   np.array([False, False, True]))
    keys = np.arange(3)
    table = torch.arange(1, 1 + 3 * 8, dtype=torch.int32).view(3, 8)
    rows = local_rows(manager(2, 1, dcp=1), 1, sched, computed, prefilling)
    row_keys = keys[[g for g, _ in rows]]
    assert len(set(row_keys.tolist())) < 3
    with pytest.raises(ValueError, match="no row on this rank"):
        plan_split_requests(spec(2, 1), table[row_keys], row_keys, keys,
                            torch.as_tensor(computed + sched))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_moe_padding_mask_matches_vllms_layout(n, name, monkeypatch):
    """The PCP-gathered padding mask the plugin hands vLLM's MoE layers:
    per-rank token counts equal those of vLLM's own batch layout, and the
    mask marks exactly the padded rows of each rank's slice."""
    from vllm.v1.worker.gpu import pcp_manager as vpcp
    from vllm_cp_kv.integration.pcp import gathered_padding_mask, rank_token_counts

    monkeypatch.setattr(vpcp, "async_tensor_h2d",
                        lambda data, device=None, **kw: torch.as_tensor(data, device=device))
    sched, computed, prefilling = (np.array(x) for x in SCENARIOS[name])
    qsl = np.concatenate([[0], np.cumsum(sched)])
    mgr = manager(n, 0, dcp=n)
    _, per_rank = mgr._build_batch_layout(sched, computed, prefilling, qsl)
    counts = rank_token_counts(mgr, sched, prefilling)
    assert counts == per_rank
    padded = max(per_rank) + 3  # as with a padded (graph-sized) batch
    mask = gathered_padding_mask(counts, padded).view(n, padded)
    for r in range(n):
        assert mask[r].tolist() == [i >= per_rank[r] for i in range(padded)]
