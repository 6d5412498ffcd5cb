"""The owned context under PCP and PCP x TP (core/context.py ``pcp_pieces``,
``exchange_queries``, ``output_layout``; integration/context.py
``plan_owned_pcp``): vLLM's own PCP split (``PCPManager._get_rank_segments``
and ``replicated_requests`` of the installed vLLM, through ``vllm_api``)
gives each of ``P`` PCP ranks its pieces of every prefill; ``P x T`` ranks
run as threads (a barrier-synchronised all-gather), each with its owned
cache and its TP heads. Each token's context attention is compared with
float64 multi-head attention over every token before its piece (cached
context and earlier pieces' new tokens). Negative controls: a rank's partial
dropped, a corrupted owned block, the pieces' send order broken."""

import dataclasses
import threading

import numpy as np
import pytest
import torch

from harness.reference import stored_at
from test_context import (BS, H, L, NOPE, ROPE, SCALE, V, Threads, drop_partial, reference,
                          stored)
from vllm_cp_kv.core import context as core_context
from vllm_cp_kv.core.ownership import CPShardSpec
from vllm_cp_kv.integration import context, vllm_api
from vllm_cp_kv.integration.step import PCPStep

# (cached tokens, new tokens, prefilling): a decode row, a short prefill,
# two split ones, one with no cached context (read gathered)
REQS = [(50, 1, False), (40, 9, True), (100, 40, True), (7, 12, True), (0, 30, True)]


def split(p: int, n: int, reqs):
    """vLLM's PCP split of the global batch (its PCP manager's own methods
    on a manager with just the sizes set)."""
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    manager = object.__new__(PCPManager)
    manager.pcp_world_size, manager.dcp_world_size = p, n
    manager.shard_decode_requests = False
    sched = np.array([q for _, q, _ in reqs], dtype=np.int64)
    prefilling = np.array([f for *_, f in reqs], dtype=bool)
    qsl = np.concatenate([[0], np.cumsum(sched)])
    return ([vllm_api.rank_segments(manager, r, sched, prefilling, qsl) for r in range(p)],
            np.asarray(vllm_api.replicated_requests(manager, sched, prefilling), dtype=bool))


def pcp_batch(p: int, t: int, reqs=REQS, seed=0, num_blocks=256):
    n = p * t
    gen = torch.Generator().manual_seed(seed)
    # every token the step's attention sees in the cache: the context and
    # the new tokens (vLLM's PCP path writes the gathered new KV first)
    table, lat, caches = stored([c + q for c, q, _ in reqs], n, gen, num_blocks)
    queries = [torch.randn(q, H, NOPE + ROPE, generator=gen, dtype=torch.float64)
               for _, q, _ in reqs]
    w_uk = torch.randn(H, NOPE, L, generator=gen, dtype=torch.float64) / 4
    w_uv = torch.randn(H, L, V, generator=gen, dtype=torch.float64) / 4
    segments, replicated = split(p, n, reqs)
    return table, lat, caches, queries, w_uk, w_uv, segments, replicated


def local_batch(segments, reqs, table, queries, p: int):
    """PCP rank ``p``'s batch as vLLM's builder sees it: its rows (decodes
    first), their block-table rows and its prefill tokens' queries."""
    rows = segments[p]
    lens = [n for _, _, n in rows]
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    num_decodes = sum(1 for g, _, _ in rows if not reqs[g][2])
    common = dataclasses.make_dataclass("Common", ["query_start_loc_cpu", "num_reqs",
                                                   "block_table_tensor"])(
        qsl, len(rows), table[[g for g, _, _ in rows]].to(torch.int32))
    q = torch.cat([queries[g][o:o + n] for g, o, n in rows[num_decodes:]])
    return common, num_decodes, q


def run_pcp(p, t, table, caches, queries, w_uk, w_uv, segments, replicated, reqs=REQS,
            mode="owned", seq_shift=0):
    n = p * t
    threads, results, counted = Threads(n), [None] * n, [0] * n

    def rank(k):
        pr, tr = divmod(k, t)  # vLLM 0.34's shard rank: pcp_rank * T + tp_rank

        def received(x):
            total = x.numel() * x.element_size()
            counted[k] += total - total // n
        common, num_decodes, q = local_batch(segments, reqs, table, queries, pr)
        step = PCPStep(keys=np.arange(len(reqs)),
                       seq_lens=np.array([c + qq + seq_shift for c, qq, _ in reqs]),
                       is_prefill=np.array([f for *_, f in reqs]),
                       row_keys=np.array([g for g, _, _ in segments[pr]]),
                       query_lens=np.array([qq for _, qq, _ in reqs]), replicated=replicated,
                       segments=segments, pcp=p, pcp_rank=pr)
        owned = context.plan_owned_pcp(common, num_decodes, step, table.to(torch.int32),
                                       CPShardSpec(k, n, BS), mode=mode, max_query=512,
                                       link_of=None, heads=H, width=L + ROPE, v_dim=L, elt=8)
        mine = slice(tr * H // t, (tr + 1) * H // t)
        runtime = threads.rank(k, received)
        runtime.spec.head_ranks = t
        layer = dataclasses.make_dataclass("Layer", ["W_UK_T", "W_UV"])(w_uk[mine], w_uv[mine])
        out, lse = context.owned_context(runtime, owned, q[:, mine], caches[k], layer,
                                         scale=SCALE, v_dim=L, gpu_kernel=False)
        results[k] = (out, lse, owned, common, num_decodes)

    ts = [threading.Thread(target=rank, args=(k,)) for k in range(n)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert all(r is not None for r in results), "a rank failed"
    return results, counted


def expected(k, t, results, segments, lat, queries, w_uk, w_uv):
    """Each owned token's reference: attention over every token before its
    piece, this rank's heads."""
    pr, tr = divmod(k, t)
    out, lse, owned, common, num_decodes = results[k]
    mine = slice(tr * H // t, (tr + 1) * H // t)
    qsl = common.query_start_loc_cpu.long()
    first = int(qsl[num_decodes])
    want_o, want_l, sent = [], [], 0
    for j, (g, o, n) in enumerate(segments[pr]):
        if not bool((owned.rows == g).any()):
            continue
        # the rank sends its pieces' tokens in row order
        assert owned.tokens[sent:sent + n].tolist() == list(
            range(int(qsl[j]) - first, int(qsl[j]) - first + n))
        sent += n
        ctx = int(lat[g].shape[0]) - int(queries[g].shape[0]) + o
        wo, wl = reference(queries[g][o:o + n], lat[g][:ctx], w_uk, w_uv)
        want_o.append(wo[:, mine])
        want_l.append(wl[mine])
    return torch.cat(want_o), torch.cat(want_l, dim=1), out, lse


@pytest.mark.parametrize("p,t", [(2, 1), (2, 2), (4, 1)])
def test_pcp_owned_context_equals_attention_over_every_earlier_token(p, t):
    table, lat, caches, queries, w_uk, w_uv, segments, replicated = pcp_batch(p, t)
    results, _ = run_pcp(p, t, table, caches, queries, w_uk, w_uv, segments, replicated)
    owned = results[0][2]
    assert owned.rows.tolist() == [1, 2, 3]  # prefills with a cached context
    # the split really splits: some chosen request has pieces on every rank
    assert any(len({o for g, o, _ in segments[r] if g == 2}) == 2 for r in range(p))
    for k in range(p * t):
        want_o, want_l, out, lse = expected(k, t, results, segments, lat, queries, w_uk, w_uv)
        assert out.shape[0] == results[k][2].exchange.count == want_o.shape[0] > 0
        assert torch.allclose(out, want_o, atol=1e-6), k
        assert torch.allclose(lse, want_l.float(), atol=1e-5), k


def test_pcp_pieces_send_every_token_once_and_attend_replicated_ones_once():
    segments, replicated = split(2, 2, REQS)
    chosen = torch.tensor([False, True, True, True, False])
    pieces = [core_context.pcp_pieces(segments, chosen, torch.from_numpy(replicated), r)
              for r in range(2)]
    a = pieces[0]
    assert replicated[1] and not replicated[2]
    # request 1 (replicated) is one piece; 2 and 3 are four pieces each
    assert a.req.tolist().count(1) == 1 and a.req.tolist().count(2) == 4
    # every padded slot's source is a distinct sent token
    src = a.padded.index[a.padded.valid]
    once = sum(n for r, seg in enumerate(segments) for g, _, n in seg
               if chosen[g] and (r == 0 or not replicated[g]))  # replicated: rank 0's
    assert len(set(src.tolist())) == src.numel() == once
    # every sent token's destination slot holds that token
    m = a.exchange.width
    for r, pr in enumerate(pieces):
        assert pr.exchange.count == sum(n for g, _, n in segments[r] if chosen[g])
        for i in range(pr.exchange.count):
            slot = int(a.exchange.dst[r * m + i])
            assert bool(a.padded.valid[slot])
            if not replicated[a.req[slot // a.padded.width]]:
                assert int(a.padded.index[slot]) == r * m + i


def test_pcp_bytes_do_not_grow_with_the_context():
    counts = []
    for scale in (1, 4):
        reqs = [(c * scale, q, f) for c, q, f in REQS]
        table, lat, caches, queries, w_uk, w_uv, segments, replicated = pcp_batch(2, 2, reqs)
        _, counted = run_pcp(2, 2, table, caches, queries, w_uk, w_uv, segments, replicated,
                             reqs=reqs)
        counts.append(counted)
    assert counts[0] == counts[1] and min(counts[0]) > 0, counts


def test_pcp_negative_controls(monkeypatch):
    """A dropped rank's partial, a corrupted owned block and a wrong send
    order each change the answer."""
    table, lat, caches, queries, w_uk, w_uv, segments, replicated = pcp_batch(2, 2)
    args = (table, caches, queries, w_uk, w_uv, segments, replicated)
    good, _ = run_pcp(2, 2, *args)
    drop_partial(monkeypatch, 3)
    bad, _ = run_pcp(2, 2, *args)
    assert not torch.allclose(good[0][0], bad[0][0])
    monkeypatch.undo()
    row = table[2].tolist()  # request 2: a block of its context on rank 3
    block = next(s // BS for pos in range(100)
                 for r, s in [stored_at(pos, row, BS, 4)] if r == 3)
    caches[3][block] += 1.0
    bad, _ = run_pcp(2, 2, *args)
    caches[3][block] -= 1.0
    assert not torch.allclose(good[0][0], bad[0][0])
    real = core_context.exchange_queries

    def reversed_send(all_gather, mq, ex, index):
        return real(all_gather, mq.flip(0), ex, index)

    monkeypatch.setattr(context, "exchange_queries", reversed_send)
    bad, _ = run_pcp(2, 2, *args)
    assert not torch.allclose(good[0][0], bad[0][0])
