"""Shard-aware sparse attention (core/sparse.py): the exact global top-k from
each rank's candidates, and sparse attention over the owned selected tokens
merged by LSE.

References are independent of the package's ownership formula: which rank
stores a token, and where, comes from the scalar transcription of vLLM's
slot-mapping kernel (harness/reference.py), and the top-k is brute force over
the whole row (``torch.sort`` with the documented rule, not the package's
keys). Negative controls: a rank's candidates dropped, an off-by-one logical
position, a rank's partial output dropped, an off-by-one slot."""

import pytest
import torch

from harness.reference import stored_at
from vllm_cp_kv.core.decode import merge_by_lse
from vllm_cp_kv.core.ownership import CPShardSpec
from vllm_cp_kv.core.sparse import (candidate_keys, local_candidates, logical_positions,
                                    merge_keys, merge_rank_topk, merge_topk, owned_slots,
                                    sparse_attention_with_lse, topk_reference)

BS = 4


def brute_topk(scores: torch.Tensor, lens, k: int) -> list[list[int]]:
    """Each row's top-k by the rule, with Python's sort: higher score, then
    lower position; -inf (and positions past the row) never selected;
    padded with -1."""
    out = []
    for r, n in enumerate(lens):
        real = [(float(scores[r, p]), p) for p in range(int(n))
                if float(scores[r, p]) != float("-inf")]
        real.sort(key=lambda sp: (-sp[0], sp[1]))
        picked = [p for _, p in real[:k]]
        out.append(picked + [-1] * (k - len(picked)))
    return out


def owners(n_tokens: int, n: int) -> list[list[int]]:
    """Logical positions each rank stores, in its local (paged) order, from
    vLLM's slot arithmetic: a rank's local position p is the p-th token it
    stores, which is the order of its slots in its paged sequence."""
    table = list(range(1, 10**4))
    per = [[] for _ in range(n)]
    for pos in range(n_tokens):
        rank, slot = stored_at(pos, table, BS, n)
        per[rank].append((slot, pos))
    return [[pos for _, pos in sorted(s)] for s in per]


def rank_candidates(scores, lens, n, k, drop=None):
    """Each rank's local top-k (by the rule, over its own tokens) as
    ``(logits [R, W], local_topk [R, k])``."""
    rows, width = scores.shape
    mine = owners(width, n)
    out = []
    for r in range(n):
        local = torch.full((rows, max(len(mine[r]), 1)), float("-inf"))
        lens_r = []
        for i in range(rows):
            toks = [p for p in mine[r] if p < int(lens[i])]
            local[i, :len(toks)] = scores[i, toks]
            lens_r.append(len(toks))
        picked = torch.tensor(brute_topk(local, lens_r, k), dtype=torch.int32)
        if drop == r:
            picked.fill_(-1)
        out.append((local, picked))
    return out


def merged(scores, lens, n, k, drop=None, off_by_one=False):
    """The global top-k every rank computes from the exchanged candidates."""
    cands = rank_candidates(scores, lens, n, k, drop)
    keys = []
    for r, (logits, picked) in enumerate(cands):
        s, p = local_candidates(logits, picked, r, n, BS)
        if off_by_one:
            p = torch.where(p >= 0, p + 1, p)
        keys.append(candidate_keys(s, p))
    results = []
    for r, (logits, picked) in enumerate(cands):
        if off_by_one:  # the exchange already carries the shifted keys
            results.append(merge_keys(torch.stack(keys), k))
        else:
            results.append(merge_rank_topk(logits, picked, r, n, BS,
                                           lambda _: torch.cat(keys, dim=0)))
    for res in results[1:]:
        assert torch.equal(res, results[0])  # identical on every rank
    return results[0]


CASES = [
    # (name, score maker)
    ("random", lambda g, shape: torch.randn(shape, generator=g)),
    ("ties", lambda g, shape: torch.randint(0, 3, shape, generator=g).float()),
    ("neg-inf", lambda g, shape: torch.randn(shape, generator=g).masked_fill(
        torch.rand(shape, generator=g) < 0.3, float("-inf"))),
]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_global_topk_equals_whole_row(n, name, make):
    g = torch.Generator().manual_seed(n)
    rows, width, k = 7, 97, 12
    scores = make(g, (rows, width))
    # a full row, rows shorter than k, rows shorter than one rank's block
    # share, a row with k larger than any rank's tokens, an empty row
    lens = torch.tensor([97, 5, 11, 3, 40, 0, 66])
    got = merged(scores, lens, n, k)
    assert got.tolist() == brute_topk(scores, lens, k)
    assert torch.equal(got, topk_reference(scores, lens, k))


def test_k_larger_than_candidates():
    """k above N x (a rank's candidates): padded with -1, nothing invented."""
    scores = torch.randn(2, 10)
    lens = torch.tensor([10, 6])
    pos = torch.arange(10).expand(2, 10).clone()
    pos[1, 6:] = -1
    got = merge_topk(scores[None], pos[None], 16)
    assert got.tolist() == brute_topk(scores, lens, 16)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_negative_controls_change_the_selection(n):
    g = torch.Generator().manual_seed(100 + n)
    scores = torch.randn(6, 120, generator=g)
    lens = torch.full((6,), 120)
    want = brute_topk(scores, lens, 16)
    assert merged(scores, lens, n, 16).tolist() == want
    for r in range(n):  # every rank's candidates matter
        assert merged(scores, lens, n, 16, drop=r).tolist() != want
    assert merged(scores, lens, n, 16, off_by_one=True).tolist() != want


def test_logical_positions_match_vllm_slots():
    """Local position p of rank r is the p-th token r stores (vLLM's slot
    arithmetic), for interleave = block size."""
    for n in (2, 4, 8):
        mine = owners(200, n)
        for r in range(n):
            local = torch.arange(len(mine[r]))
            assert logical_positions(local, r, n, BS).tolist() == mine[r]
        assert logical_positions(torch.tensor([-1]), 0, n, BS).tolist() == [-1]


def sharded_cache(n, lens, gen, d=16, num_blocks=256):
    """Whole sequences, a shared virtual block table, per-rank caches filled
    where vLLM's slot arithmetic stores each token."""
    cols = max(1, max(-(-(-(-x // BS)) // n) for x in lens))
    table = (torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * cols] + 1
             ).view(len(lens), cols)
    seqs = [torch.randn(x, d, generator=gen, dtype=torch.float64) for x in lens]
    caches = [torch.zeros(num_blocks * BS, d, dtype=torch.float64) for _ in range(n)]
    for i, seq in enumerate(seqs):
        for pos in range(seq.shape[0]):
            rank, slot = stored_at(pos, table[i].tolist(), BS, n)
            caches[rank][slot] = seq[pos]
    return table, seqs, caches


def reference_attention(q, seqs, rows, selected, scale, v_dim):
    """float64 softmax attention of each query over its selected tokens of
    the whole (unsharded) sequence."""
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float64)
    for t in range(q.shape[0]):
        pos = [p for p in selected[t].tolist() if p >= 0]
        if not pos:
            continue
        keys = seqs[int(rows[t])][pos]
        w = torch.softmax(q[t].double() @ keys.T * scale, dim=-1)
        out[t] = w @ keys[:, :v_dim]
    return out


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sparse_partials_merge_to_attention_over_selection(n):
    g = torch.Generator().manual_seed(7 + n)
    lens = [45, 9, 70, 1]
    table, seqs, caches = sharded_cache(n, lens, g)
    k, h, d, v = 10, 3, 16, 12
    rows = torch.tensor([0, 1, 2, 2, 3])  # two query tokens of request 2
    q = torch.randn(rows.numel(), h, d, generator=g, dtype=torch.float64)
    selected = torch.full((rows.numel(), k), -1)
    for t, i in enumerate(rows.tolist()):
        pick = torch.randperm(lens[i], generator=g)[:k]
        selected[t, :pick.numel()] = pick
    want = reference_attention(q, seqs, rows, selected, 0.3, v)

    def sharded(drop=None, shift=0):
        outs, lses = [], []
        for r in range(n):
            slots, counts = owned_slots(selected, rows, table, CPShardSpec(r, n, BS))
            if shift:
                slots = torch.where(slots >= 0, slots + shift, slots)
            assert torch.equal(counts, (slots >= 0).sum(1).int())
            o, lse = sparse_attention_with_lse(q, caches[r], slots, 0.3, v)
            if r == drop:
                o, lse = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
            outs.append(o)
            lses.append(lse)
        return merge_by_lse(torch.stack(outs), torch.stack(lses))

    assert torch.allclose(sharded(), want, atol=1e-12)
    # every selected token is owned by exactly one rank
    total = sum(owned_slots(selected, rows, table, CPShardSpec(r, n, BS))[1]
                for r in range(n))
    assert total.tolist() == (selected >= 0).sum(1).tolist()
    for r in range(n):
        assert not torch.allclose(sharded(drop=r), want, atol=1e-6)
    assert not torch.allclose(sharded(shift=1), want, atol=1e-6)


def test_empty_selection_is_the_merge_identity():
    q = torch.randn(2, 2, 8, dtype=torch.float64)
    kv = torch.randn(16, 8, dtype=torch.float64)
    slots = torch.tensor([[3, 5, -1], [-1, -1, -1]])
    out, lse = sparse_attention_with_lse(q, kv, slots, 0.5, 6)
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    assert (out[1] == 0).all() and torch.isfinite(lse[0]).all()
