"""A prefill row's cached context, attended where it lives (issue 51).

A prefill row of ``q`` new tokens over ``c`` cached tokens attends to its
context either

* **gathered**: the owned blocks of the context are all-gathered into the
  full view (``core/plan.py``) and vLLM's context attention reads them:
  per layer about ``c * W * e * (N - 1) / N`` bytes into each rank (``W``
  the latent width, 576, ``e`` its bytes), one all-gather per context chunk
  whatever the number of rows; or
* **owned**: like a decode (``core/decode.py``), each rank attends with the
  row's queries of all ``H`` heads, absorbed into the latent space, to the
  context tokens it owns, and the ranks' partial outputs merge by LSE; then
  the row's new-token attention merges in as a context chunk's does. Per
  layer ``q * H * (W e + 4 + V e)`` bytes cross ranks (queries gathered,
  LSEs gathered, outputs of width ``V``, 512, reduce-scattered; each
  ``(N - 1) / N``), three collectives, and no byte grows with ``c``.

Owned pays in collectives and in ``H`` times the query bytes; gathered pays
in context bytes. :func:`choose_owned` picks per batch, from the bytes each
row would move and the shard group's measured latency and bandwidth
(:class:`Link`), the cheaper of: every row the cheaper way for it, all
gathered, all owned. The context of an owned row is a prefix of its paged
sequence on every rank (``ownership.owned_token_count``), so a decode
kernel runs on it unchanged with the row's ``q`` queries as ``q * H``
query heads and no causal mask (:func:`padded_rows`): every new token sees
every context token, the new tokens' own attention is vLLM's.

Under PCP a row's new tokens are split over the PCP ranks in pieces, each
seeing every token before it (:func:`pcp_pieces`); the pieces' queries are
all-gathered over the shard group (:func:`exchange_queries`) and each
token's merged output returns to its rank in the merge's reduce-scatter
(:func:`output_layout`): the same three collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CONTEXT_PATHS = ("auto", "gathered", "owned")


@dataclass(frozen=True)
class Link:
    """A shard group's collective cost: ``latency_s + bytes / bandwidth``
    (measured at start, the same on every rank: each decision must be)."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, collectives: int, nbytes: float) -> float:
        return collectives * self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class RowCost:
    """What one layer moves into a rank for each row, both ways (host)."""

    owned: torch.Tensor  # [R] float64 bytes
    gathered: torch.Tensor  # [R] float64 bytes


OWNED_COLLECTIVES = 3  # query all-gather, LSE all-gather, output reduce-scatter
# the rows read owned in one step hold at most this many times
# ``max_query`` new tokens (in order; the rest read gathered): each rank
# holds their partial outputs of all heads, transient memory that vLLM's
# profile run does not see
OWNED_TOKENS_PER_STEP = 8


def row_bytes(query_lens: torch.Tensor, context_lens: torch.Tensor, *, size: int,
              heads: int, width: int, v_dim: int, elt: int) -> RowCost:
    """Bytes into one rank per layer for each row (``query_lens``,
    ``context_lens``: host ``[R]``) read owned or gathered; ``heads``: all
    ``H`` (under TP a rank computes ``H / N`` and gathers the rest)."""
    share = (size - 1) / size
    q = query_lens.double()
    owned = q * heads * (width * elt * share + 4 * (size - 1) + v_dim * elt * share)
    gathered = context_lens.double() * width * elt * share
    return RowCost(owned=owned, gathered=gathered)


def choose_owned(query_lens: torch.Tensor, context_lens: torch.Tensor, cost: RowCost,
                 link: Link, *, mode: str = "auto", max_query: int = 512) -> torch.Tensor:
    """Rows (host ``[R]`` bool) whose context is read owned.

    Candidates: rows with a context and at most ``max_query`` new tokens,
    together at most ``OWNED_TOKENS_PER_STEP * max_query`` (the first ones).
    ``mode`` "owned" takes every candidate, "gathered" none; "auto" the
    cheapest of three choices by ``link``: each candidate the way that moves
    fewer bytes for it, none, all (ties: fewer owned rows). The gathered
    side costs one collective per layer whenever some row is read that way
    (more with several context chunks, which only makes owned cheaper)."""
    if mode not in CONTEXT_PATHS:
        raise ValueError(f"context path must be one of {CONTEXT_PATHS}, got {mode!r}")
    has_context = context_lens > 0
    cand = has_context & (query_lens <= max_query) & (query_lens > 0)
    budget = OWNED_TOKENS_PER_STEP * max_query
    cand &= torch.cumsum(torch.where(cand, query_lens, 0), 0) <= budget
    if mode != "auto" or not bool(cand.any()):
        return cand if mode == "owned" else torch.zeros_like(cand)

    def seconds(owned: torch.Tensor) -> float:
        gathered = has_context & ~owned
        return (link.seconds(OWNED_COLLECTIVES if bool(owned.any()) else 0,
                             float(cost.owned[owned].sum()))
                + link.seconds(1 if bool(gathered.any()) else 0,
                               float(cost.gathered[gathered].sum())))

    options = [torch.zeros_like(cand), cand & (cost.owned < cost.gathered), cand]
    return min(options, key=lambda o: (seconds(o), int(o.sum())))


@dataclass(frozen=True)
class PaddedRows:
    """The owned rows' queries as ``[R, S, ...]`` (``S`` the longest row's
    new tokens; shorter rows padded, their padding discarded): ``index``
    ``[R * S]`` the prefill token of each slot (0 in padding) and ``valid``
    ``[R * S]`` bool."""

    index: torch.Tensor
    valid: torch.Tensor
    width: int  # S


def padded_rows(query_start: torch.Tensor, query_lens: torch.Tensor) -> PaddedRows:
    """``query_start``, ``query_lens``: host ``[R]`` first token (within the
    prefill tokens) and count of each owned row."""
    s = int(query_lens.max()) if query_lens.numel() else 0
    slot = torch.arange(s)
    valid = slot[None, :] < query_lens[:, None]
    index = torch.where(valid, query_start[:, None] + slot[None, :], 0)
    return PaddedRows(index=index.flatten(), valid=valid.flatten(), width=s)


@dataclass(frozen=True)
class Exchange:
    """PCP: the owned rows' query tokens are split over the PCP ranks
    (vLLM's DualChunkSwap: each rank runs two pieces of a prefill, or the
    whole of a short one). Every rank attends with every piece's queries to
    its own context tokens, so the queries are all-gathered over the shard
    group and each partial output goes back to the rank that holds its
    token (:func:`exchange_queries`, :func:`output_layout`).

    ``dst`` ``[P * M]``: the padded slot (``PaddedRows``) of the ``m``-th
    token each PCP rank sends (rank-major; past a rank's tokens, slot 0,
    whose result is dropped); ``count``: the tokens this rank sends."""

    dst: torch.Tensor
    pcp: int
    width: int  # M: the most tokens one PCP rank sends
    count: int


@dataclass(frozen=True)
class Pieces:
    """The owned rows' pieces under PCP: ``req`` / ``offset`` ``[R]`` (host)
    the global request and first new token of each piece attended once (a
    replicated request's piece: the first rank's that runs it);
    ``padded``: their queries as ``[R, S]`` slots, ``index`` into the
    PCP-gathered queries (``[P * M]``, rank-major); ``exchange``; ``rows``
    (host): this rank's local rows that hold pieces, in send order."""

    req: torch.Tensor
    offset: torch.Tensor
    padded: PaddedRows
    exchange: Exchange
    rows: list


def pcp_pieces(segments: list, chosen: torch.Tensor, replicated, pcp_rank: int) -> Pieces:
    """The pieces of the ``chosen`` global requests (host ``[G]`` bool).
    ``segments[r]``: PCP rank ``r``'s local rows in order, each ``(global
    request, query offset, length)`` (vLLM's split, the same on every rank);
    ``replicated[g]``: every PCP rank runs request ``g`` whole (its piece is
    attended once, from the first rank's copy)."""
    sends = [[(int(g), int(o), int(n), j) for j, (g, o, n) in enumerate(seg)
              if bool(chosen[int(g)])] for seg in segments]
    width = max((sum(s[2] for s in send) for send in sends), default=0)
    pieces, first, where = [], {}, []
    for r, send in enumerate(sends):
        m, mine = 0, []
        for g, o, n, _ in send:
            k = first.get(g) if bool(replicated[g]) else None
            if k is None:
                k = len(pieces)
                pieces.append((g, o, n, r * width + m))
                if bool(replicated[g]):
                    first[g] = k
            mine.append((k, m, n))
            m += n
        where.append(mine)
    s = max((p[2] for p in pieces), default=0)
    index = torch.zeros(len(pieces) * s, dtype=torch.long)
    valid = torch.zeros(len(pieces) * s, dtype=torch.bool)
    for k, (_, _, n, start) in enumerate(pieces):
        index[k * s: k * s + n] = torch.arange(start, start + n)
        valid[k * s: k * s + n] = True
    dst = torch.zeros(len(segments) * width, dtype=torch.long)
    for r, mine in enumerate(where):
        for k, m, n in mine:
            dst[r * width + m: r * width + m + n] = torch.arange(k * s, k * s + n)
    col = (lambda i: torch.tensor([p[i] for p in pieces], dtype=torch.long))
    return Pieces(req=col(0), offset=col(1),
                  padded=PaddedRows(index=index, valid=valid, width=s),
                  exchange=Exchange(dst=dst, pcp=len(segments), width=width,
                                    count=sum(n for _, _, n in where[pcp_rank])),
                  rows=[j for *_, j in sends[pcp_rank]])


def exchange_queries(all_gather, mq: torch.Tensor, ex: Exchange, index: torch.Tensor
                     ) -> torch.Tensor:
    """Every piece's queries of all heads, ``[R * S, H, D]``, from this
    rank's ``mq`` ``[count, H / T, D]`` (its sent tokens, its TP rank's
    heads): one all-gather over the shard group of ``N = P x T`` ranks,
    numbered PCP-major (``pcp_rank * T + tp_rank``, vLLM 0.34's shard
    rank), then ``index`` (``Pieces.padded.index``, on the device)."""
    send = mq.new_zeros((ex.width,) + tuple(mq.shape[1:]))
    send[: ex.count] = mq
    parts = all_gather(send, dim=0)  # [N * M, H / T, D]
    tp = parts.shape[0] // (ex.pcp * ex.width)
    hl, d = mq.shape[1:]
    parts = parts.view(ex.pcp, tp, ex.width, hl, d).transpose(1, 2)
    return parts.reshape(ex.pcp * ex.width, tp * hl, d)[index]


def output_layout(out: torch.Tensor, lse: torch.Tensor, ex: Exchange
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial outputs ``out [R * S, H, V]`` and LSEs ``[R * S, H]`` laid
    out for a merge that reduce-scatters over heads (``cp_lse_ag_out_rs``,
    ``merge.combine``): ``[M, P * H, V]``, ``[M, P * H]``. Head block ``k``
    (of ``H / T`` heads, ``k = pcp_rank * T + tp_rank``) holds PCP rank
    ``pcp_rank``'s sent tokens and TP rank ``tp_rank``'s heads, so shard rank
    ``k`` gets its own tokens' merged outputs of its own heads. ``ex.dst``
    on ``out``'s device."""
    m, p, dst = ex.width, ex.pcp, ex.dst
    h, v = out.shape[1], out.shape[2]
    o = out[dst].view(p, m, h, v).transpose(0, 1).reshape(m, p * h, v)
    return o, lse[dst].view(p, m, h).transpose(0, 1).reshape(m, p * h)
