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

**Rows with several query tokens** (speculative verification, or a short
prefill a backend routes to its decode path) are handled in one place,
:func:`query_token_lens`: query ``t`` of a row of ``q`` new tokens and ``s``
tokens in all sits at position ``s - q + t`` and sees the ``s - q + t + 1``
tokens up to it, of which this rank owns ``owned_token_count(s - q + t + 1)``,
a prefix of its paged sequence. So every query token becomes a row of its
own (the request's block-table row, its own length), as vLLM's TRITON_MLA
flattens a multi-token block, and the kernels see single-token rows only;
the merge by LSE is per query token and does not change. A kernel's own
causal mask cannot be used instead: it aligns the queries with the end of
the local sequence, but on a rank that does not own the newest block the
queries see the same local tokens.
"""

from __future__ import annotations

import torch

from .ownership import CPShardSpec, owned_token_count
from .plan import to_device


def query_token_lens(seq_lens: torch.Tensor, query_lens: list[int], spec: CPShardSpec
                     ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """This rank's key count for every query token of the decode rows.

    Args:
        seq_lens: ``[D]`` tokens of each decode row after this step (any
            device; no host sync).
        query_lens: host, new tokens of each row (0 for padding rows).
    Returns:
        ``(rows, lens)``: ``rows [T]`` the row of each query token, on
        ``seq_lens``' device, or None when no row has more than one token
        (then ``T == D`` and row ``i`` is query ``i``); ``lens [T]`` int32
        (the kernels' type), the owned tokens query token ``t`` attends to.
    """
    seq = seq_lens.long()
    if max(query_lens, default=0) <= 1:
        return None, owned_token_count(seq, spec).to(torch.int32)
    q = torch.tensor(query_lens, dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(q.numel()), q)
    first = torch.cumsum(q, 0) - q
    after = q[rows] - 1 - (torch.arange(rows.numel()) - first[rows])  # later queries of the row
    rows, after = to_device(torch.stack([rows, after]), seq.device)  # no host wait
    visible = seq[rows] - after
    return rows, owned_token_count(visible, spec).to(torch.int32)


def paged_attention_with_lse(q: torch.Tensor, kv_cache: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor,
                             scale: float, v_dim: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention (MQA over the latent) with the softmax LSE.

    Args:
        q: ``[B, H, D]`` absorbed queries (``D`` = latent + rope width).
        kv_cache: ``[num_blocks, block_size, D]`` paged latent cache; the
            values are its first ``v_dim`` columns.
        block_table: ``[B, C]`` int, physical block of each paged position
            (entries past a row's length must be valid ids, as vLLM's are).
        seq_lens: ``[B]`` tokens to attend to per row (0 allowed).
    Returns:
        ``out [B, H, v_dim]`` in the compute type below and ``lse [B, H]`` float32
        (natural log; ``-inf`` and a zero output where a row has no token).

    The rows' pages are gathered into one padded key block (one
    ``index_select``) and attended to in one call of PyTorch's fused CPU
    flash attention, which returns the LSE (the queries' heads are its query
    positions, the latent is both key and value; positions past a row's
    length are masked). 16-bit caches compute in their own type (the kernel
    accumulates in float32, as vLLM's CPU MLA decode does); float32 caches
    in float64, so that splitting the softmax over ranks adds no error
    visible in the model's dtype.
    """
    b, h, d = q.shape
    compute = torch.float64 if kv_cache.dtype == torch.float32 else kv_cache.dtype
    bs = kv_cache.shape[1]
    out = q.new_zeros(b, h, v_dim, dtype=compute)
    lse = q.new_full((b, h), float("-inf"), dtype=torch.float32)
    lens = seq_lens.to(torch.long)
    rows = (lens > 0).nonzero().flatten()
    if rows.numel() == 0:
        return out, lse
    lens = lens[rows]
    pages = -(-int(lens.max()) // bs)
    table = block_table.to(device=kv_cache.device, dtype=torch.long)[rows, :pages]
    keys = kv_cache.index_select(0, table.flatten()).view(rows.numel(), pages * bs, d)
    o, l = _attend(q[rows].to(compute), keys.to(compute), lens, scale)
    out[rows] = o[..., :v_dim].to(out.dtype)
    lse[rows] = l
    return out, lse


def _attend(q: torch.Tensor, k: torch.Tensor, lens: torch.Tensor, scale: float):
    """``q [R, H, D]`` over ``k [R, T, D]`` (keys = values), row ``r`` seeing
    its first ``lens[r] > 0`` keys: output ``[R, H, D]`` and LSE ``[R, H]``."""
    keep = torch.arange(k.shape[1], device=k.device)[None, :] < lens.to(k.device)[:, None]
    if q.device.type == "cpu":
        mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill_(~keep, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, None], k[:, None], k[:, None], attn_mask=mask[:, None, None], scale=scale)
        return o[:, 0], lse[:, 0].float()
    # other devices (the GPU debug check's reference): the plain formula,
    # accumulated in float32 or wider
    acc = torch.promote_types(k.dtype, torch.float32)
    k = k.to(acc)
    scores = (q.to(acc) @ k.transpose(1, 2)).mul_(scale).masked_fill_(
        ~keep[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ k, torch.logsumexp(scores, dim=-1).float()


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


def merge_two_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                     lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention outputs of disjoint key sets (two
    chunks of a prefill's context).

    Args:
        out_a, out_b: ``[..., D]`` normalized outputs.
        lse_a, lse_b: ``out.shape[:-1]`` natural-log LSEs (``-inf``: no keys).
    Returns:
        ``(out, lse)``: ``out`` in ``out_a``'s dtype (accumulated in float32),
        ``lse`` float32; a zero output and ``-inf`` where neither had a key.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    top = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = out_a.float() * (lse_a - top).exp()[..., None] + \
        out_b.float() * (lse_b - top).exp()[..., None]
    return out.to(out_a.dtype), lse
