"""One KV shard group over PCP x TP (core/groups.py, issue 40), on CPU where
vLLM's PCP itself cannot run (its V2 runner is GPU-only).

* The numbering against vLLM's own: 4 processes build vLLM's groups
  (``initialize_model_parallel`` with TP=2, PCP=2 and a DCP group over both,
  gloo) and read each rank's TP, PCP and DCP rank; on vLLM 0.32 the DCP rank
  (what its slot mapping writes by) must be the layout's PCP-first shard
  rank, and the order of a collective's output over that group the world
  order (torch's), which is why vLLM 0.34 sorted the group.
* The decode's merge over those very groups: each rank's cache holds the
  tokens vLLM's slot-mapping kernel (transcribed, harness/reference.py)
  stores at its DCP rank; each attends with all heads to the tokens it owns
  and :func:`merge_partials` merges; every rank's heads must equal attention
  over the whole sequence (float64). Negative controls: the merge without
  the PCP sum, and the shard rank numbered as the world rank (TP first),
  both answer wrong.
* The arithmetic for every small layout.
"""

import pytest
import torch
import torch.distributed as dist

from builders import spawn_ranks
from conftest import needs_vllm
from harness.reference import attention, stored_at
from vllm_cp_kv.core.decode import paged_attention_with_lse
from vllm_cp_kv.core.groups import PCPxTP, merge_partials
from vllm_cp_kv.core.ownership import CPShardSpec, owned_token_count

BS, D, V, H = 16, 576, 512, 4
SCALE = 0.07
LENS = [1, 15, 16, 33, 100, 257, 511]  # ranks with nothing, partial blocks


@pytest.mark.parametrize("pcp_first", [True, False])
@pytest.mark.parametrize("pcp,tp", [(1, 1), (2, 1), (1, 4), (2, 2), (2, 4), (4, 2), (3, 2)])
def test_numberings_are_permutations_and_round_trip(pcp, tp, pcp_first):
    g = PCPxTP(pcp, tp, pcp_first)
    pairs = [(p, t) for p in range(pcp) for t in range(tp)]
    assert sorted(g.shard_rank(p, t) for p, t in pairs) == list(range(g.size))
    assert sorted(g.world_rank(p, t) for p, t in pairs) == list(range(g.size))
    assert all(g.coords(g.shard_rank(p, t)) == (p, t) for p, t in pairs)
    # TP ranks of one PCP rank split the heads; PCP ranks of one TP rank share them
    heads = [list(range(8))[g.heads(t, 8)] for t in range(tp)]
    assert sum(heads, []) == list(range(8))
    with pytest.raises(ValueError):
        g.shard_rank(pcp, 0)
    with pytest.raises(ValueError):
        g.coords(g.size)


def test_the_numberings_differ_where_both_axes_are_split():
    """TP first (the world, vLLM 0.34's DCP group) and PCP first (0.32 and
    0.33's) agree only when one axis has one rank."""
    g = PCPxTP(2, 2, pcp_first=True)
    assert [g.shard_rank(*divmod(w, 2)) for w in range(4)] == [0, 2, 1, 3]
    assert [PCPxTP(2, 2).shard_rank(*divmod(w, 2)) for w in range(4)] == [0, 1, 2, 3]
    for first in (True, False):
        assert all(PCPxTP(1, 4, first).shard_rank(0, t) == t for t in range(4))
        assert all(PCPxTP(4, 1, first).shard_rank(p, 0) == p for p in range(4))


def _batch(n):
    """Whole sequences, a shared virtual block table, the queries (seeded:
    every process builds the same)."""
    gen = torch.Generator().manual_seed(40)
    cols = max(-(-(-(-x // BS)) // n) for x in LENS)
    ids = torch.randperm(511, generator=gen)[: len(LENS) * cols] + 1
    table = ids.view(len(LENS), cols).to(torch.int32)
    seqs = [torch.randn(x, D, generator=gen) for x in LENS]
    q = torch.randn(len(LENS), H, D, generator=gen)
    return q, table, seqs


def _own_cache(dcp_rank, n, table, seqs):
    """This rank's cache as vLLM writes it: the tokens its slot mapping
    stores at ``dcp_rank``."""
    cache = torch.zeros(512, BS, D)
    for i, seq in enumerate(seqs):
        for pos in range(seq.shape[0]):
            rank, slot = stored_at(pos, table[i].tolist(), BS, n)
            if rank == dcp_rank:
                cache[slot // BS, slot % BS] = seq[pos]
    return cache


def _worker(rank, n, port, errors):
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state as ps

        ps.init_distributed_environment(world_size=n, rank=rank, local_rank=rank,
                                        distributed_init_method=f"tcp://127.0.0.1:{port}",
                                        backend="gloo")
        with set_current_vllm_config(VllmConfig()):
            ps.initialize_model_parallel(tensor_model_parallel_size=2,
                                         prefill_context_model_parallel_size=2,
                                         decode_context_model_parallel_size=4,
                                         backend="gloo")
        tp, pcp, dcp = ps.get_tp_group(), ps.get_pcp_group(), ps.get_dcp_group()
        g = PCPxTP(pcp.world_size, tp.world_size, pcp_first=True)  # vLLM 0.32's numbering
        p, t = pcp.rank_in_group, tp.rank_in_group
        assert dcp.world_size == g.size == n
        assert g.shard_rank(p, t) == dcp.rank_in_group, (rank, p, t, dcp.rank_in_group)
        assert g.world_rank(p, t) == rank
        groups = (dcp.cpu_group, pcp.cpu_group, tp.cpu_group)
        # torch orders the group's collectives by world rank, not by vLLM's
        # rank_in_group: slot i of a gather holds world rank i
        slots = torch.zeros(n, dtype=torch.int64)
        dist.all_gather_into_tensor(slots, torch.tensor([rank]), group=groups[0])
        assert slots.tolist() == [PCPxTP(2, 2).shard_rank(*divmod(w, 2)) for w in range(n)]

        q, table, seqs = _batch(n)
        cache = _own_cache(dcp.rank_in_group, n, table, seqs)
        lens = torch.tensor(LENS)

        def decode(shard_rank, merge=merge_partials):
            local = owned_token_count(lens, CPShardSpec(shard_rank, n, BS))
            out, lse = paged_attention_with_lse(q, cache, table, local, SCALE, V)
            return merge(out, lse, g, *groups)

        mine = g.heads(t, H)
        want = torch.stack([attention(q[i], seq, SCALE, V)[0] for i, seq in enumerate(seqs)])
        got = decode(g.shard_rank(p, t))
        assert got.shape == (len(LENS), H // g.tp, V)
        assert torch.allclose(got.double(), want[:, mine], atol=1e-5)
        # negative controls: each must answer wrong on this rank
        assert not torch.allclose(decode(g.shard_rank(p, t), _merge_without_pcp).double(),
                                  want[:, mine], atol=1e-3)
        wrong = decode(g.world_rank(p, t))  # the other numbering: ranks 1 and 2 swap counts
        if g.world_rank(p, t) != g.shard_rank(p, t):
            assert not torch.allclose(wrong.double(), want[:, mine], atol=1e-3)
        dist.barrier()
    except Exception:
        import traceback

        errors.put(f"rank {rank}: {traceback.format_exc()}")


def _merge_without_pcp(out, lse, g, shard_group, pcp_group, tp_group):
    """The merge as if the shard group were the TP group alone (LSEs of all
    ranks, but no sum over the PCP ranks): what a TP-only merge would do."""
    b, h, d = out.shape
    lses = torch.empty(g.size * b, h, dtype=torch.float64)
    dist.all_gather_into_tensor(lses, lse.double().contiguous(), group=shard_group)
    lses = lses.view(g.size, b, h)
    top = lses.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weighted = out.double() * ((lse.double() - top).exp()
                               / (lses - top).exp().sum(0).clamp(min=1e-30))[..., None]
    mine = torch.empty(h // g.tp, b, d, dtype=torch.float64)
    dist.reduce_scatter_tensor(mine, weighted.transpose(0, 1).contiguous(), group=tp_group)
    return mine.transpose(0, 1)


@needs_vllm
def test_vllms_groups_number_the_shard_group_and_the_merge_is_exact():
    spawn_ranks(_worker, 4, timeout=300)


# ---- the runtime's pieces for PCP x TP (integration; vLLM 0.34's numbering) ---------
def _config(pcp, tp, decode="lse"):
    from types import SimpleNamespace

    return SimpleNamespace(
        additional_config={"cp_kv": {"enable": True, "decode": decode}},
        parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                        prefill_context_parallel_size=pcp))


@pytest.mark.parametrize("pcp,tp", [(1, 4), (2, 1), (2, 2), (2, 4), (4, 2)])
def test_the_geometry_splits_heads_over_the_tp_ranks(pcp, tp):
    """Each rank's layer holds its TP rank's H / TP heads: the geometry's
    head rank is the TP rank of vLLM 0.34's numbering (the world rank), for
    every layout; the decode kernel runs on the TP ranks' heads."""
    from vllm_cp_kv.integration.backend import decode_kernel_ranks
    from vllm_cp_kv.integration.geometry import geometry_of

    g = PCPxTP(pcp, tp)
    for p in range(pcp):
        for t in range(tp):
            geo = geometry_of(_config(pcp, tp), block_size=BS, rank=g.shard_rank(p, t))
            assert geo.size == pcp * tp and geo.head_ranks == tp and geo.head_rank == t
            assert geo.axis == {(True, True): "pcp-tp", (True, False): "pcp"}.get(
                (pcp > 1, tp > 1), "tp")
    assert decode_kernel_ranks(_config(pcp, tp), sparse=False) == tp
    assert decode_kernel_ranks(_config(pcp, tp, "materialize"), sparse=False) == 1
    assert decode_kernel_ranks(_config(pcp, tp), sparse=True) == 1


def test_the_pcp_tp_decode_merge_keeps_each_ranks_tp_heads():
    """What ``decode.run_gpu`` does under PCP x TP, with the collectives
    done in one process: every rank attends with all H heads (queries
    gathered over TP) to the tokens it owns, the LSE merge over all N ranks
    (vLLM's ``cp_lse_ag_out_ar``), then this rank's TP heads
    (``head_slice``): equal to attention over the whole sequence. Negative
    control: slicing by the shard rank (as the TP-only layout may) gives
    another rank's heads."""
    from types import SimpleNamespace

    from vllm_cp_kv.core.decode import merge_by_lse
    from vllm_cp_kv.integration.decode import head_slice
    from vllm_cp_kv.integration.geometry import ShardGeometry

    g = PCPxTP(2, 2)
    q, table, seqs = _batch(g.size)
    lens = torch.tensor(LENS)
    want = torch.stack([attention(q[i], seq, SCALE, V)[0] for i, seq in enumerate(seqs)])
    parts = []
    for r in range(g.size):
        local = owned_token_count(lens, CPShardSpec(r, g.size, BS))
        parts.append(paged_attention_with_lse(q, _own_cache(r, g.size, table, seqs), table,
                                              local, SCALE, V))
    merged = merge_by_lse(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))
    wrong = 0
    for r in range(g.size):
        p, t = g.coords(r)
        geo = ShardGeometry(rank=r, size=g.size, block_size=BS, axis="pcp-tp", tp=g.tp)
        mine = head_slice(SimpleNamespace(spec=geo), merged, H // g.tp)
        assert torch.allclose(mine.double(), want[:, g.heads(t, H)], atol=1e-6)
        by_shard_rank = merged[:, r * (H // g.tp):(r + 1) * (H // g.tp)]
        wrong += by_shard_rank.shape[1] != H // g.tp or not torch.allclose(
            by_shard_rank.double(), want[:, g.heads(t, H)], atol=1e-3)
    assert wrong >= 2  # ranks 2 and 3: their shard rank is no TP rank


def test_decode_bytes_per_step_follow_the_layout_not_the_context():
    """The statistics' decode bytes (``gpu_step_bytes``): TP reduce-scatters
    the outputs over all N, PCP and PCP x TP all-reduce them; the query
    gather spans the TP ranks only; nothing depends on the context."""
    from types import SimpleNamespace

    from vllm_cp_kv.integration.decode_audit import gpu_step_bytes

    rows, h, qw, v = 8, 16, 576, 512

    def step(n, head_ranks, gathers, context):
        view = SimpleNamespace(local_lens=torch.full((rows,), context))
        return gpu_step_bytes(view, heads=h, q_width=qw, v_dim=v, q_bytes=2, out_bytes=2,
                              size=n, gathers_queries=gathers, head_ranks=head_ranks)

    lse = lambda n: rows * h * 4 * (n - 1)  # noqa: E731
    assert step(4, 4, True, 100) == rows * h * qw * 2 * 3 // 4 + lse(4) + rows * h * v * 2 * 3 // 4
    assert step(2, 1, False, 100) == lse(2) + rows * h * v * 2 * 2 // 2
    assert step(4, 2, True, 100) == rows * h * qw * 2 // 2 + lse(4) + rows * h * v * 2 * 6 // 4
    # (the context never enters: the figures are the batch's shapes alone)


@pytest.mark.parametrize("axis,size,tp,gather,want", [
    ("tp", 4, 4, True, (True, False)),        # reduce-scatter: each rank its H / N
    ("tp", 4, 4, False, (False, False)),      # no gather (not reached: TP gathers)
    ("pcp", 2, 1, False, (False, False)),     # all-reduce, all H on every rank
    ("pcp-tp", 4, 2, True, (False, True)),    # all-reduce over N, keep the TP heads
    ("pcp-tp", 8, 4, True, (False, True))])
def test_the_gpu_decode_merges_by_the_layout(axis, size, tp, gather, want):
    """``decode.run_gpu``'s choice of vLLM's merge: reduce-scatter only where
    the heads split over the whole group; PCP x TP all-reduces and keeps its
    TP rank's heads (a reduce-scatter there would hand each rank H / N heads
    of the wrong ranks)."""
    from vllm_cp_kv.integration.decode import merge_kind
    from vllm_cp_kv.integration.geometry import ShardGeometry

    spec = ShardGeometry(rank=size - 1, size=size, block_size=BS, axis=axis, tp=tp)
    assert merge_kind(spec, gather) == want
