"""The materializer with real collectives: 2 and 4 processes over gloo.

Each rank holds only its own cache; the full view it gathers must equal
every token read from where vLLM's slot-mapping kernel stored it
(harness/reference.py; the test can read every rank's cache because every
rank's random cache is seeded). Covers ragged batches,
shared blocks, a rank that owns nothing in the batch and a one-token
request, plus two negative controls: a corrupted owned block changes the
view at exactly that block, and a rank with another block table is caught
by the debug plan check.
"""

import pytest
import torch
import torch.distributed as dist

from builders import BS, make_batch, spawn_ranks, spec, view_of
from harness.reference import full_view, tokens_of
from vllm_cp_kv.core import debug
from vllm_cp_kv.core.materialize import all_gather_into_fn, gather
from vllm_cp_kv.core.plan import plan_materialization

SCENARIOS = [
    dict(lens=[1, 17, 95, 33, 160], shared=None),  # ragged
    dict(lens=[128, 128, 40], shared=(0, 1, 2)),  # shared blocks
    dict(lens=[16, 3], shared=None),  # ranks >= 1 own nothing
    dict(lens=[1], shared=None),  # one token
]


def _worker(rank, n, port, errors):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=n)
        fn = all_gather_into_fn()
        for k, sc in enumerate(SCENARIOS):
            table, lens, caches = make_batch(n, sc["lens"], seed=10 + k,
                                             shared_rows=sc["shared"])
            plan = plan_materialization(spec(n, rank), table, lens)
            debug.check_plan_identical(plan, None)
            full = gather(plan, rank, caches[rank], fn)
            ref = full_view(table, lens, caches, BS, n)
            for i in range(len(lens)):
                got = tokens_of(view_of(plan, full, i), int(lens[i]))
                assert torch.equal(got, ref[i]), (k, i)
            # negative control: rank 1 corrupts logical block 1 of request 0
            if rank == 1:
                caches[1][int(table[0, 0])] += 1
            dirty = gather(plan, rank, caches[rank], fn)
            changed = (view_of(plan, dirty, 0) != view_of(plan, full, 0)
                       ).flatten(1).any(1).nonzero().flatten().tolist()
            want = [1] if int(plan.num_logical_blocks[0]) > 1 else []
            assert changed == want, (k, changed)
        # negative control: the last rank plans from another block table
        table, lens, _ = make_batch(n, [64, 64], seed=99)
        if rank == n - 1:
            table = table.flip(0).contiguous()
        plan = plan_materialization(spec(n, rank), table, lens)
        try:
            debug.check_plan_identical(plan, None)
            raise RuntimeError("differing plans went unnoticed")
        except AssertionError as e:
            assert "differs" in str(e)
        dist.destroy_process_group()
    except BaseException as e:  # report to the parent
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


@pytest.mark.parametrize("n", [2, 4])
def test_gather_matches_the_reference(n):
    spawn_ranks(_worker, n)



def _hybrid_caches(rank, num_blocks, bs, seed):
    """One rank's cache buffer in vLLM's layout for a DeepSeek-V3.2 layer:
    per block, the bf16 latent page (bs x 576) then the indexer page
    (bs x 128 fp8 keys, then bs fp32 scales: bs x 132 bytes), so each cache
    is a strided per-layer view of one buffer."""
    latent_bytes, indexer_bytes = bs * 576 * 2, bs * 132
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    raw = torch.randint(0, 256, (num_blocks, latent_bytes + indexer_bytes),
                        dtype=torch.uint8, generator=gen)
    latent = raw[:, :latent_bytes].view(torch.bfloat16).view(num_blocks, bs, 576)
    indexer = raw[:, latent_bytes:].view(num_blocks, bs, 132)
    return latent, indexer


def _sparse_worker(rank, n, port, errors):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=n)
        fn = all_gather_into_fn()
        table, lens, _ = make_batch(n, [1, 300, 70, 500], seed=7, num_blocks=128)
        bs = spec(n).block_size
        caches = [_hybrid_caches(r, 128, bs, seed=7) for r in range(n)]
        assert not caches[rank][1].is_contiguous()  # the layout under test
        plan = plan_materialization(spec(n, rank), table, lens)  # one plan
        for which in (0, 1):  # latent, then indexer, like a layer does
            full = gather(plan, rank, caches[rank][which], fn)
            ref = full_view(table, lens, [c[which] for c in caches], bs, n)
            for i in range(len(lens)):  # bitwise: random bytes hold NaNs
                got, want = tokens_of(view_of(plan, full, i), int(lens[i])), ref[i]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (which, i)
        # negative control: a scale byte of an owned indexer block changes
        if rank == 1:
            caches[1][1][int(table[1, 0]), -1, -1] ^= 0xFF
        dirty = gather(plan, rank, caches[rank][1], fn)
        changed = (view_of(plan, dirty, 1) != view_of(plan, full, 1)
                   ).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [1], changed
        dist.destroy_process_group()
    except BaseException as e:  # report to the parent
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def test_latent_and_indexer_caches_share_one_plan():
    """Sparse models: one plan gathers both strided per-layer caches (latent
    and indexer pages interleaved per block), each equal to brute force."""
    spawn_ranks(_sparse_worker, 2)
