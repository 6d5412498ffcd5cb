"""A prefill row's context read where it lives (core/context.py,
integration/context.py): ``owned_context`` on N ranks (threads, each with
its own owned cache and its TP heads; the collectives a barrier-synchronised
all-gather) against float64 multi-head attention over the whole context
with vLLM's up-projections (the MHA form vLLM's prefill computes), and the
cost model's choices. Negative controls: one rank's partial dropped from
the merge, a corrupted owned block, the context's last token not counted."""

import threading
from types import SimpleNamespace

import pytest
import torch

from harness.reference import stored_at
from vllm_cp_kv.core.context import (OWNED_TOKENS_PER_STEP, Link, choose_owned, padded_rows,
                                     row_bytes)
from vllm_cp_kv.core.ownership import CPShardSpec
from vllm_cp_kv.integration import context, merge

BS, L, ROPE, NOPE, V, H = 16, 64, 16, 24, 20, 4
SCALE = 0.11


class Threads:
    """N ranks as threads: ``all_gather`` concatenates every rank's input."""

    def __init__(self, n):
        self.n, self.parts, self.barrier = n, [None] * n, threading.Barrier(n)

    def rank(self, r, received):
        group = SimpleNamespace(world_size=self.n)

        def all_gather(x, dim=0):
            self.parts[r] = x
            self.barrier.wait()
            out = torch.cat(self.parts, dim=dim)
            self.barrier.wait()
            return out

        group.all_gather = all_gather

        def gather_heads(q, count=True):
            out = all_gather(q.contiguous(), dim=1)
            received(out)
            return out

        def got(t):
            received(t)
        spec = SimpleNamespace(rank=r, size=self.n, head_ranks=self.n)
        return SimpleNamespace(spec=spec, group=group, gather_heads=gather_heads,
                               received=got)


def stored(lengths, n, gen, num_blocks):
    """Each row's latent of ``lengths[i]`` tokens stored on its owners:
    ``(block table, latents, the ranks' caches)``."""
    cols = max(1, max(-(-(-(-x // BS)) // n) for x in lengths))
    table = (torch.randperm(num_blocks - 1, generator=gen)[: len(lengths) * cols] + 1
             ).view(len(lengths), cols)
    lat = [torch.randn(c, L + ROPE, generator=gen, dtype=torch.float64) for c in lengths]
    caches = [torch.zeros(num_blocks, BS, L + ROPE, dtype=torch.float64) for _ in range(n)]
    for i, seq in enumerate(lat):
        for pos in range(seq.shape[0]):
            rank, slot = stored_at(pos, table[i].tolist(), BS, n)
            caches[rank][slot // BS, slot % BS] = seq[pos]
    return table, lat, caches


def batch(n, ctx_lens, q_lens, num_decodes=1, seed=0, num_blocks=256):
    """A batch (``num_decodes`` one-token rows first), every row's context
    latent stored on its owners, queries of all heads, weights."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(ctx_lens)
    table, ctx, caches = stored(ctx_lens, n, gen, num_blocks)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    common = SimpleNamespace(query_start_loc_cpu=qsl.to(torch.int32), num_reqs=rows,
                             block_table_tensor=table.to(torch.int32))
    q = torch.randn(int(qsl[-1]) - int(qsl[num_decodes]), H, NOPE + ROPE, generator=gen,
                    dtype=torch.float64)
    w_uk = torch.randn(H, NOPE, L, generator=gen, dtype=torch.float64) / 4
    w_uv = torch.randn(H, L, V, generator=gen, dtype=torch.float64) / 4
    return common, ctx, caches, q, w_uk, w_uv, qsl


def reference(q_row, ctx, w_uk, w_uv):
    """MHA over the context (vLLM's prefill form): ``[S, H, V]``, ``[H, S]``."""
    k = torch.cat([torch.einsum("tl,hnl->thn", ctx[:, :L], w_uk),
                   ctx[:, None, L:].expand(-1, H, -1)], dim=-1)  # [T, H, NOPE + ROPE]
    v = torch.einsum("tl,hlv->thv", ctx[:, :L], w_uv)
    s = torch.einsum("shd,thd->hst", q_row, k) * SCALE
    return torch.einsum("hst,thv->shv", s.softmax(-1), v), torch.logsumexp(s, -1)


def run_owned(n, common, caches, q, w_uk, w_uv, ctx_lens, num_decodes=1, max_query=512):
    """``owned_context`` on every rank: ``(outs, lses, bytes, owned)`` per rank."""
    threads, results = Threads(n), [None] * n
    counted = [0] * n

    def rank(r):
        def received(t):
            total = t.numel() * t.element_size()
            counted[r] += total - total // n
        spec = CPShardSpec(r, n, BS)
        owned = context.plan_owned(common, num_decodes, torch.tensor(ctx_lens), spec,
                                   mode="owned", max_query=max_query, link_of=None,
                                   heads=H, width=L + ROPE, v_dim=L, elt=8)
        mine = slice(r * H // n, (r + 1) * H // n)
        layer = SimpleNamespace(W_UK_T=w_uk[mine], W_UV=w_uv[mine])
        out, lse = context.owned_context(threads.rank(r, received), owned, q[:, mine],
                                         caches[r], layer, scale=SCALE, v_dim=L,
                                         gpu_kernel=False)
        results[r] = (out, lse, owned)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results, counted


CTX, QL = [0, 40, 0, 100, 7], [1, 3, 5, 2, 4]  # a decode row, then prefill rows


@pytest.mark.parametrize("n", [2, 4])
def test_owned_context_equals_attention_over_the_whole_context(n):
    common, ctx, caches, q, w_uk, w_uv, qsl = batch(n, CTX, QL)
    results, _ = run_owned(n, common, caches, q, w_uk, w_uv, CTX)
    owned = results[0][2]
    assert owned.rows.tolist() == [1, 3, 4]  # the prefill rows with a context
    first = int(qsl[1])
    for r, (out, lse, _) in enumerate(results):
        mine = slice(r * H // n, (r + 1) * H // n)
        k = 0
        for row in owned.rows.tolist():
            tokens = range(int(qsl[row]) - first, int(qsl[row + 1]) - first)
            want, want_lse = reference(q[list(tokens)], ctx[row], w_uk, w_uv)
            got = out[k:k + len(tokens)]
            assert (owned.tokens[k:k + len(tokens)] == torch.tensor(list(tokens))).all()
            assert torch.allclose(got, want[:, mine], atol=1e-6), (row, r)  # float32 LSEs
            assert torch.allclose(lse[:, k:k + len(tokens)], want_lse[mine].float(),
                                  atol=1e-5), (row, r)
            k += len(tokens)
        assert k == out.shape[0]


def test_bytes_do_not_grow_with_the_context():
    counts = []
    for scale in (1, 10):
        ctx = [c * scale for c in CTX]
        common, _, caches, q, w_uk, w_uv, _ = batch(2, ctx, QL)
        _, counted = run_owned(2, common, caches, q, w_uk, w_uv, ctx)
        counts.append(counted)
    assert counts[0] == counts[1] and counts[0][0] > 0, counts


def drop_partial(monkeypatch, rank: int) -> None:
    """The torch merge from now on ignores shard rank ``rank``'s partial."""
    inner = merge.merge_by_lse

    def drop(outs, lses):
        lses = lses.clone()
        lses[rank] = float("-inf")
        return inner(outs, lses)

    monkeypatch.setattr(merge, "merge_by_lse", drop)


def test_a_dropped_rank_partial_changes_the_output(monkeypatch):
    common, ctx, caches, q, w_uk, w_uv, _ = batch(2, CTX, QL)
    good, _ = run_owned(2, common, caches, q, w_uk, w_uv, CTX)
    drop_partial(monkeypatch, 1)
    bad, _ = run_owned(2, common, caches, q, w_uk, w_uv, CTX)
    assert not torch.allclose(good[0][0], bad[0][0])


def test_a_corrupted_owned_block_or_a_short_count_changes_the_output():
    common, ctx, caches, q, w_uk, w_uv, _ = batch(2, CTX, QL)
    good, _ = run_owned(2, common, caches, q, w_uk, w_uv, CTX)
    table = common.block_table_tensor
    caches[1][int(table[3, 0])] += 1.0  # rank 1's first block of row 3 (tokens 16-31)
    bad, _ = run_owned(2, common, caches, q, w_uk, w_uv, CTX)
    assert not torch.allclose(good[0][0], bad[0][0])
    caches[1][int(table[3, 0])] -= 1.0
    short = [max(c - 1, 0) if c else 0 for c in CTX]  # the last context token not counted
    bad, _ = run_owned(2, common, caches, q, w_uk, w_uv, short)
    assert not torch.allclose(good[0][0], bad[0][0])


def test_only_short_rows_with_a_context_are_candidates():
    common, *_ = batch(2, CTX, QL)
    owned = context.plan_owned(common, 1, torch.tensor(CTX), CPShardSpec(0, 2, BS),
                               mode="owned", max_query=3, link_of=None, heads=H,
                               width=L + ROPE, v_dim=L, elt=2)
    assert owned.rows.tolist() == [1, 3]  # row 4 has 4 new tokens
    assert context.plan_owned(common, 1, torch.tensor(CTX), CPShardSpec(0, 2, BS),
                              mode="gathered", max_query=3, link_of=None, heads=H,
                              width=L + ROPE, v_dim=L, elt=2) is None


def test_the_owned_plan_reads_nothing_back_from_the_device():
    """Built from a block table on the meta device (no values: a read back
    fails), the owned rows come out all the same, so on a GPU the host
    plans them without waiting; their real slots are indices (a boolean
    mask would wait for the GPU where the merge keeps them)."""
    common, *_ = batch(2, CTX, QL)
    kw = dict(mode="owned", max_query=512, link_of=None, heads=H, width=L + ROPE,
              v_dim=L, elt=2)
    host = context.plan_owned(common, 1, torch.tensor(CTX), CPShardSpec(0, 2, BS), **kw)
    meta_common = SimpleNamespace(**{**vars(common),
                                     "block_table_tensor": common.block_table_tensor.to("meta")})
    meta = context.plan_owned(meta_common, 1, torch.tensor(CTX), CPShardSpec(0, 2, BS), **kw)
    assert meta.table.device.type == "meta" and meta.table.shape == host.table.shape
    assert meta.valid_slots.shape == host.valid_slots.shape
    assert host.valid_slots.tolist() == host.padded.valid.nonzero().flatten().tolist()
    assert torch.equal(host.tokens, host.padded.index[host.padded.valid])
    assert host.local_lens.dtype == host.slot_lens.dtype == torch.int32


def test_one_step_reads_a_bounded_number_of_tokens_owned():
    """Rows past ``OWNED_TOKENS_PER_STEP * max_query`` new tokens (in order)
    read gathered, in every mode."""
    q = torch.tensor([4] * 10)
    c = torch.full((10,), 1000)
    cost = row_bytes(q, c, size=2, heads=H, width=L + ROPE, v_dim=V, elt=2)
    for mode, link in (("owned", None), ("auto", Link(1e-9, 1e12))):
        got = choose_owned(q, c, cost, link, mode=mode, max_query=4)
        assert got.tolist() == [True] * OWNED_TOKENS_PER_STEP + [False] * (
            10 - OWNED_TOKENS_PER_STEP), mode


def test_padded_rows_index_every_token_once():
    p = padded_rows(torch.tensor([0, 3, 4]), torch.tensor([3, 1, 2]))
    assert p.width == 3
    assert p.index[p.valid].tolist() == [0, 1, 2, 3, 4, 5]


DSV3 = dict(size=8, heads=128, width=576, v_dim=512, elt=2)


def brute(q, c, cost, link):
    """The cheapest owned set over every subset of candidates (the model's
    own terms: one latency per kind of collective used, bytes / bandwidth)."""
    best = None
    cand = [i for i in range(len(q)) if c[i] > 0 and q[i] <= 512]
    for mask in range(1 << len(cand)):
        owned = torch.zeros(len(q), dtype=torch.bool)
        for j, i in enumerate(cand):
            owned[i] = bool(mask >> j & 1)
        gathered = (c > 0) & ~owned
        t = (link.seconds(3 if owned.any() else 0, float(cost.owned[owned].sum()))
             + link.seconds(1 if gathered.any() else 0, float(cost.gathered[gathered].sum())))
        if best is None or t < best[0] - 1e-15:
            best = (t, owned)
    return best[0]


@pytest.mark.parametrize("latency", [2e-5, 5e-3])
@pytest.mark.parametrize("bandwidth", [1e9, 150e9])
def test_the_choice_is_never_worse_than_the_best_subset_by_much(latency, bandwidth):
    """The three options the model weighs come within the cheapest subset
    (brute force) on random batches: equal where rows prefer one way, and
    never off by more than one collective's latency."""
    gen = torch.Generator().manual_seed(3)
    link = Link(latency, bandwidth)
    for _ in range(40):
        q = torch.randint(1, 700, (5,), generator=gen)
        c = torch.randint(0, 3, (5,), generator=gen) * torch.randint(0, 100_000, (5,),
                                                                        generator=gen)
        cost = row_bytes(q, c, **DSV3)
        chosen = choose_owned(q, c, cost, link)
        gathered = (c > 0) & ~chosen
        t = (link.seconds(3 if chosen.any() else 0, float(cost.owned[chosen].sum()))
             + link.seconds(1 if gathered.any() else 0, float(cost.gathered[gathered].sum())))
        assert t <= brute(q, c, cost, link) + 3 * latency + 1e-12


def test_the_cost_model_follows_latency_and_bandwidth():
    q, c = torch.tensor([200, 200]), torch.tensor([100_000, 60_000])
    cost = row_bytes(q, c, **DSV3)
    assert (cost.owned < cost.gathered).all()  # 200 tokens x 128 heads < 60K x 576
    nvlink = Link(25e-6, 150e9)
    assert choose_owned(q, c, cost, nvlink).all()
    slow = Link(0.5, 150e9)  # collectives so slow that the one gather wins
    assert not choose_owned(q, c, cost, slow).any()
    long_q = torch.tensor([2000, 2000])  # above max_query: never candidates
    assert not choose_owned(long_q, c, row_bytes(long_q, c, **DSV3), nvlink).any()
    assert choose_owned(q, c, cost, slow, mode="owned").all()
    assert not choose_owned(q, c, cost, nvlink, mode="gathered").any()
    with pytest.raises(ValueError):
        choose_owned(q, c, cost, nvlink, mode="sometimes")
