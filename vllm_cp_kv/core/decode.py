"""Shard-aware decode: attend to the owned blocks, merge by log-sum-exp.

A decode query (one new token of a request) attends to every token of its
request. The keys are split over the shard group by block ownership, and
softmax attention over a union of disjoint key sets factorises exactly::

    lse = log(sum_r exp(lse_r))
    out = sum_r exp(lse_r - lse) * out_r

where ``out_r, lse_r`` are attention over rank ``r``'s keys alone. So each
rank attends to the blocks it owns and only queries, partial outputs and
LSEs cross ranks: the bytes per step do not grow with the context.

The local view needs no plan. In vLLM's DCP layout (interleave = block
size) rank ``r``'s physical block ``block_table[i, c]`` holds logical block
``c * N + r`` of request ``i``, so the rank's tokens of the request are the
first ``owned_token_count`` tokens of the paged sequence that the (shared)
virtual block table describes. Any paged-attention kernel that returns the
LSE runs on it unchanged; :func:`paged_attention_with_lse` is the torch one
for platforms whose MLA kernels do not return it (vLLM's CPU backends).
"""

from __future__ import annotations

import torch


def paged_attention_with_lse(q: torch.Tensor, kv_cache: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor,
                             scale: float, v_dim: int,
                             max_len: int | None = None,
                             out_dtype: torch.dtype | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention (MQA over the latent) with the softmax LSE.

    Args:
        q: ``[B, H, D]`` absorbed queries (``D`` = latent + rope width).
        kv_cache: ``[num_blocks, block_size, D]`` paged latent cache; the
            values are its first ``v_dim`` columns.
        block_table: ``[B, C]`` int, physical block of each paged position.
        seq_lens: ``[B]`` tokens to attend to per row (0 allowed).
        max_len: ``max(seq_lens)`` if the caller knows it on the host.
        out_dtype: of the output (default ``q``'s; float32 keeps a partial
            output unrounded until the merge).
    Returns:
        ``out [B, H, v_dim]`` and ``lse [B, H]`` float32
        (natural log; ``-inf`` and a zero output where a row has no token).
        Scores and the weighted sum accumulate in a type wider than the
        cache's: float32 for 16-bit caches, float64 for float32 ones, so
        that splitting the softmax over ranks adds no error visible in the
        model's dtype.
    """
    b, h, _ = q.shape
    bs = kv_cache.shape[1]
    if max_len is None:
        max_len = int(seq_lens.max()) if b else 0
    nb = max(1, -(-max_len // bs))
    kv = kv_cache[block_table[:, :nb].long()].reshape(b, nb * bs, kv_cache.shape[-1])
    acc = torch.float64 if kv_cache.dtype == torch.float32 else torch.float32
    kv = kv.to(acc)
    scores = torch.bmm(q.to(acc), kv.transpose(1, 2)).mul_(scale)  # [B, H, T]
    valid = torch.arange(nb * bs, device=q.device) < seq_lens.to(q.device)[:, None]
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = scores.sub_(finite[..., None]).exp_()  # exp(-inf) = 0 off the rows
    out = torch.bmm(probs, kv[..., :v_dim])
    return out.to(out_dtype or q.dtype), lse.float()


def merge_by_lse(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Combine partial attention outputs of disjoint key sets.

    Args:
        outs: ``[N, B, H, D]`` each part's normalized output.
        lses: ``[N, B, H]`` each part's natural-log LSE (``-inf``: no keys).
    Returns:
        ``[B, H, D]`` in ``outs``' dtype, accumulated in float32 (float64 for
        float64 parts); zero where no part had a key.
    """
    acc = torch.float64 if outs.dtype == torch.float64 else torch.float32
    lses = lses.to(acc)
    top = lses.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = (lses - top).exp()  # [N, B, H], 0 for empty parts
    total = weights.sum(dim=0)
    weights = weights / total.clamp(min=1e-30)
    out = (outs.to(acc) * weights[..., None]).sum(dim=0)
    return out.to(outs.dtype)
