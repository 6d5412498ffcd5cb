"""Shard-aware sparse attention (DeepSeek-V3.2 / GLM-5 DSA): exact global
top-k from each rank's candidates, and sparse attention over the owned
selected tokens with its LSE.

A DSA layer's lightning indexer scores every cached token of a request for
each query row and keeps the ``k`` best; the sparse MLA kernel then attends
to those ``k`` tokens only. With the cache sharded by block ownership no rank
sees every key, and none needs to:

1. **Local candidates.** Each rank scores the indexer keys it owns (a paged
   sequence of ``owned_token_count`` tokens, as the dense decode reads) and
   keeps its local top-k. :func:`local_candidates` turns the local top-k
   positions into ``(score, logical position)`` pairs
   (:func:`logical_positions`: the block-ownership rule read backwards).
2. **Exact global top-k.** A token in the global top-k is in its owner's
   local top-k: at most ``k - 1`` tokens of the whole row rank above it, so at
   most ``k - 1`` of its own rank do. So the ``N x k`` candidates of a row hold
   the global top-k, and :func:`merge_topk` picks it with one rule that every
   rank applies alike (:func:`candidate_keys`):

   * a higher score first; among equal scores the lower logical position
     first (the rule of vLLM's CuteDSL merge kernel, so the same set);
   * a candidate with position ``-1`` or score ``-inf`` is padding and never
     selected; a row with fewer than ``k`` real candidates (a short request,
     or ``k`` larger than the row) is padded with ``-1`` at its end.

   :func:`topk_reference` is the brute force over a whole row with the same
   rule (tests and the debug check compare against it).
3. **Sparse attention over the owned selected tokens.** Every rank holds
   the same global top-k; each attends to the selected positions it owns
   (:func:`owned_slots` maps them to its physical slots, ``-1`` elsewhere)
   with all query heads, returning the output and its LSE
   (:func:`sparse_attention_with_lse`, the torch reference; on GPU vLLM's
   sparse kernels), and the partial results merge by LSE exactly as the
   dense decode's do (``core.decode.merge_by_lse``): softmax over a union of
   disjoint key sets factorises.

What crosses ranks per row and layer: ``N x k`` (score, position) pairs and
the partial outputs with their LSEs; never the context.

Torch only, no vLLM; every function is shape-static and free of host
synchronization, so the integration can run it inside captured CUDA graphs.
"""

from __future__ import annotations

import torch

from .ownership import CPShardSpec

# positions are below 2**31 (int32 everywhere in vLLM): a key packs 32 score
# bits above 31 position bits into a non-negative int64
_POSITION_BITS = 31
_POSITION_MASK = (1 << _POSITION_BITS) - 1
PADDING = -1


def logical_positions(local: torch.Tensor, rank: int, size: int,
                      interleave: int) -> torch.Tensor:
    """The logical token position of each of ``rank``'s local positions.

    A rank's tokens of a request form one paged sequence (its owned blocks
    in order); local position ``p`` is the ``p``-th token it owns. With
    tokens dealt to ranks in runs of ``interleave`` (block ownership:
    ``interleave == block_size``)::

        logical = (p // I) * (N * I) + rank * I + p % I

    Negative entries (padding) stay ``-1``.
    """
    p = local.long()
    out = (p.clamp(min=0) // interleave) * (size * interleave) + rank * interleave \
        + p.clamp(min=0) % interleave
    return torch.where(p >= 0, out, torch.full_like(out, PADDING))


def local_candidates(logits: torch.Tensor, local_topk: torch.Tensor, rank: int,
                     size: int, interleave: int,
                     row_starts: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's candidates: the scores of its local top-k and their
    logical positions.

    Args:
        logits: ``[R, W]`` float, this rank's scores (column ``row_starts[r]
            + p`` holds local position ``p`` of row ``r``; ``row_starts``
            None: column ``p``).
        local_topk: ``[R, k]`` int, local positions (``-1``: padding).
    Returns:
        ``(scores [R, k] float32, positions [R, k] int64)``; padding has
        score ``-inf`` and position ``-1``.
    """
    idx = local_topk.long()
    valid = idx >= 0
    col = idx.clamp(min=0)
    if row_starts is not None:
        col = col + row_starts.long()[:, None]
    col = col.clamp(max=max(logits.shape[1] - 1, 0))
    if logits.shape[1] == 0:
        scores = torch.full(idx.shape, float("-inf"), dtype=torch.float32,
                            device=idx.device)
    else:
        scores = logits.float().gather(1, col)
    scores = scores.masked_fill(~valid, float("-inf"))
    return scores, logical_positions(idx, rank, size, interleave)


def candidate_keys(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 key per candidate that orders them by the merge rule:
    higher score first, then lower position; padding (position ``< 0`` or
    score ``-inf`` or NaN) gets ``-1``, below every real candidate.

    The float32 score's bits are made order-preserving as unsigned
    integers (flip every bit of a negative, the sign bit of a positive)
    and sit above the complemented position, so distinct candidates never
    tie and ``torch.topk`` over the keys is deterministic.
    """
    s = scores.float().contiguous()
    bits = s.view(torch.int32).long() & 0xFFFFFFFF
    ordered = torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    pos = positions.long()
    key = (ordered << _POSITION_BITS) | (_POSITION_MASK - pos.clamp(0, _POSITION_MASK))
    real = (pos >= 0) & (s > float("-inf"))  # NaN compares False: padding
    return torch.where(real, key, torch.full_like(key, -1))


def _positions_of(keys: torch.Tensor) -> torch.Tensor:
    pos = _POSITION_MASK - (keys & _POSITION_MASK)
    return torch.where(keys >= 0, pos, torch.full_like(pos, PADDING)).to(torch.int32)


def merge_topk(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The global top-k of each row from every rank's candidates.

    Args:
        scores: ``[N, R, c]`` float, rank-major candidates (``c`` per rank
            and row; vLLM's ``c`` is ``k``).
        positions: ``[N, R, c]`` int, their logical positions (``-1``:
            padding).
    Returns:
        ``[R, k]`` int32 logical positions, best first by the rule of
        :func:`candidate_keys`; ``-1`` where a row has fewer than ``k``
        real candidates.
    """
    return merge_keys(candidate_keys(scores, positions), k)


def merge_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`merge_topk` on candidates already keyed (``[N, R, c]`` int64
    from :func:`candidate_keys`: what the ranks exchange, 8 bytes a
    candidate, exact for every position below ``2**31``)."""
    n, rows, c = keys.shape
    keys = keys.permute(1, 0, 2).reshape(rows, n * c)
    if n * c < k:
        keys = torch.cat([keys, keys.new_full((rows, k - n * c), -1)], dim=1)
    return _positions_of(keys.topk(k, dim=1, sorted=True).values)


def merge_rank_topk(logits: torch.Tensor, local_topk: torch.Tensor, rank: int, size: int,
                    interleave: int, all_gather, row_starts: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """One rank's side of the exchange: key its local top-k
    (:func:`local_candidates`, :func:`candidate_keys`), all-gather the keys
    over the shard group, and merge (:func:`merge_keys`).

    Args:
        all_gather: ``[R, k] int64 -> [N * R, k]``, rank-major (the
            group's collective; every rank passes the same ``R``).
    Returns:
        ``[R, k]`` int32 global logical positions, identical on every rank.
    """
    k = local_topk.shape[1]
    scores, positions = local_candidates(logits, local_topk, rank, size, interleave,
                                         row_starts)
    gathered = all_gather(candidate_keys(scores, positions).contiguous())
    return merge_keys(gathered.view(size, -1, k), k)


def topk_reference(scores: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    """Brute force: each row's top-k over its first ``lens[r]`` scores by
    the rule of :func:`candidate_keys` (positions are the columns).

    Args:
        scores: ``[R, L]`` float, the whole row's scores.
        lens: ``[R]`` int, tokens of each row (later columns are ignored).
    Returns:
        ``[R, k]`` int32 positions, ``-1``-padded.
    """
    rows, width = scores.shape
    cols = torch.arange(width, device=scores.device).expand(rows, width)
    pos = torch.where(cols < lens.to(scores.device).long()[:, None], cols,
                      torch.full_like(cols, PADDING))
    return merge_topk(scores[None], pos[None], k)


def owned_slots(positions: torch.Tensor, rows: torch.Tensor, block_table: torch.Tensor,
                spec: CPShardSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's physical slots of the selected positions it owns.

    Args:
        positions: ``[T, k]`` int logical positions (``-1``: none).
        rows: ``[T]`` int, the request row of each query in ``block_table``.
        block_table: ``[R, C]`` int, the virtual block table (column ``c``
            of rank ``r``'s table holds logical block ``c * N + r``).
    Returns:
        ``(slots [T, k] int64, counts [T] int32)``: ``slot = physical block
        * block_size + offset`` where this rank owns the position, packed
        to the front of each row in the selection's order, ``-1`` after;
        ``counts`` the owned ones per row.
    """
    pos = positions.long()
    bs = spec.block_size
    block = pos.clamp(min=0) // bs
    mine = (pos >= 0) & (spec.owner_of(block) == spec.rank)
    col = spec.table_index(block).clamp(max=block_table.shape[1] - 1)
    phys = block_table.long()[rows.long()[:, None], col]
    slots = torch.where(mine, phys * bs + pos.clamp(min=0) % bs,
                        torch.full_like(pos, PADDING))
    # stable compaction: owned entries first, in order
    order = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)
    return slots.gather(1, order), mine.sum(dim=1).to(torch.int32)


def sparse_attention_with_lse(q: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor,
                              scale: float, v_dim: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA sparse attention (MQA over the latent) of each query token over
    its selected cache rows, with the softmax LSE.

    Args:
        q: ``[T, H, D]`` absorbed queries (``D`` = latent + rope width).
        kv_rows: ``[S, D]`` cache rows (a paged cache flattened to slots);
            values are the first ``v_dim`` columns.
        slots: ``[T, k]`` int, the rows each query attends to (``-1``: none).
    Returns:
        ``out [T, H, v_dim]`` and ``lse [T, H]`` (natural log), computed in
        float64 for float32 and float64 inputs, else float32; a zero output
        and ``-inf`` where a query has no row (the merge's identity).
    """
    acc = torch.float64 if kv_rows.dtype in (torch.float32, torch.float64) else torch.float32
    s = slots.long()
    valid = s >= 0
    keys = kv_rows.to(acc)[s.clamp(min=0)]  # [T, k, D]
    scores = torch.einsum("thd,tkd->thk", q.to(acc), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = ~valid.any(dim=1)
    weights = torch.softmax(scores.masked_fill(empty[:, None, None], 0.0), dim=-1)
    out = torch.einsum("thk,tkd->thd", weights, keys[..., :v_dim])
    out = out.masked_fill(empty[:, None, None], 0.0)
    return out, lse.masked_fill(empty[:, None], float("-inf"))
