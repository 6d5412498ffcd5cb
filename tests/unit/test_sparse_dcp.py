"""The shard-aware sparse path's vLLM glue (integration/sparse_dcp.py): the
drop-in for vLLM's ``_merge_dcp_topk_global``, called as vLLM's indexer op
calls it (a slice of its top-k buffer, rank by rank), against brute force
over the whole row; and the selection of the path.

The DCP group here is a stand-in whose all-gather returns what every rank
contributed (the ranks run one after another in this process: no GPU, and
the op itself needs one); the exchange's arithmetic is tested in
tests/unit/test_sparse_topk.py, the real collective on the H200
(benchmarks/results/h200x1-2026-12-04-sparse-shard-aware)."""

import inspect

import pytest
import torch

from conftest import needs_vllm

pytestmark = needs_vllm
BS, N, K = 4, 2, 6


class Group:
    """All-gather over keys the ranks already contributed, rank-major."""

    def __init__(self, parts):
        self.parts = parts

    def all_gather(self, t, dim=0):
        assert dim == 0
        return torch.cat(self.parts, dim=0)


def rank_rows(scores, n):
    """Each rank's local scores (its owned tokens in order) and local top-k."""
    from harness.reference import stored_at

    table = list(range(1, 1000))
    owned = [[] for _ in range(n)]
    for pos in range(scores.shape[1]):
        rank, slot = stored_at(pos, table, BS, n)
        owned[rank].append((slot, pos))
    out = []
    for r in range(n):
        cols = [p for _, p in sorted(owned[r])]
        local = scores[:, cols]
        out.append((local, local.topk(min(K, local.shape[1]), dim=1).indices.int()))
    return out


def test_drop_in_writes_the_global_topk_into_vllms_buffer(monkeypatch):
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers import sparse_attn_indexer

    from vllm_cp_kv.core.sparse import candidate_keys, local_candidates, topk_reference
    from vllm_cp_kv.integration.sparse_dcp import merge_dcp_topk_global

    # vLLM's own signature, parameter for parameter (the 0.34 one adds
    # tuning keywords the drop-in accepts too: registry item 28)
    ours = list(inspect.signature(merge_dcp_topk_global).parameters)
    theirs = list(inspect.signature(sparse_attn_indexer._merge_dcp_topk_global).parameters)
    assert ours[:len(theirs)] == theirs
    scores = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    ranks = rank_rows(scores, N)
    keys = [candidate_keys(*local_candidates(l, t, r, N, BS)) for r, (l, t) in enumerate(ranks)]
    monkeypatch.setattr(parallel_state, "get_dcp_group", lambda: Group(keys))
    want = topk_reference(scores, torch.full((3,), 40), K)
    for r, (logits, local) in enumerate(ranks):
        buffer = torch.full((5, K + 3), 77, dtype=torch.int32)  # vLLM's wider buffer
        buffer[:3, :K] = local
        merge_dcp_topk_global(logits, buffer[:3, :K], K, r, N, BS)
        assert torch.equal(buffer[:3, :K], want)  # in place, every rank the same
        assert (buffer[:, K:] == 77).all() and (buffer[3:] == 77).all()
    # negative control: rank 1's candidates missing from the exchange
    monkeypatch.setattr(parallel_state, "get_dcp_group",
                        lambda: Group([keys[0], torch.full_like(keys[1], -1)]))
    logits, local = ranks[0]
    buffer = local.clone()
    merge_dcp_topk_global(logits, buffer, K, 0, N, BS)
    assert not torch.equal(buffer, want)


def test_one_rank_is_left_alone():
    from vllm_cp_kv.integration.sparse_dcp import merge_dcp_topk_global

    local = torch.tensor([[3, 1, -1]], dtype=torch.int32)
    merge_dcp_topk_global(torch.randn(1, 8), local, 3, 0, 1, BS)
    assert local.tolist() == [[3, 1, -1]]


@pytest.mark.parametrize("release,pcp,decode,want", [
    ((0, 34), 1, "lse", True), ((0, 32), 1, "lse", False), ((0, 34), 2, "lse", False),
    ((0, 34), 1, "materialize", False)])
def test_the_path_is_chosen_by_release_pcp_and_decode(release, pcp, decode, want):
    from vllm_cp_kv.integration.checks import sparse_shard_aware
    from vllm_cp_kv.integration.options import CPKVOptions

    assert sparse_shard_aware(CPKVOptions(enable=True, decode=decode), pcp,
                              release=release) is want
