"""Copy kernels of materialization: Triton on GPU, torch elsewhere.

Both kernels treat a paged cache as opaque bytes per block or per row, so one
kernel serves every layout: the bf16 MLA latent (576 values per token), the
fp8 latent with scales (656 bytes per token) and the sparse indexer cache
(per block: ``block_size x 128`` fp8 keys, then ``block_size`` fp32 scales).

* :func:`pack_blocks`: ``out[i] = cache[ids[i]]`` (whole blocks; the pack
  step of the gather). ``index_select`` by default; the Triton kernel is kept
  for comparison (same bandwidth, more host launch time).
* :func:`scatter_rows`: ``cache_rows[slots[t]] = rows[t]`` where
  ``slots[t] >= 0`` (owner-only write of new KV; ``-1`` marks tokens another
  rank owns). For layouts whose token is not one contiguous row (the indexer
  cache) the caller scatters each part through its own row view.
"""

from __future__ import annotations

import torch

try:  # Triton needs a GPU here; CPUs use the torch paths
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    _HAS_TRITON = False


def _use_triton(t: torch.Tensor) -> bool:
    return _HAS_TRITON and t.is_cuda


if _HAS_TRITON:

    @triton.jit
    def _pack_kernel(src, dst, ids, width, CHUNK: tl.constexpr):
        i = tl.program_id(0)
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        mask = offs < width
        s = tl.load(ids + i).to(tl.int64)
        tl.store(dst + i.to(tl.int64) * width + offs,
                 tl.load(src + s * width + offs, mask=mask), mask=mask)

    @triton.jit
    def _scatter_kernel(src, dst, slots, num_rows, width, block_stride, block_size,
                        ROWS: tl.constexpr, CHUNK: tl.constexpr):
        # ROWS token rows per program: enough bytes in flight for short rows.
        # When the ROWS slots are consecutive inside one block (a chunk of new
        # tokens filling its blocks), they are one contiguous destination:
        # copy them as a single flat range.
        r0 = tl.program_id(0) * ROWS
        r = r0 + tl.arange(0, ROWS)
        rmask = r < num_rows
        slot = tl.load(slots + r, mask=rmask, other=-1).to(tl.int64)
        first = tl.load(slots + r0).to(tl.int64)
        run = (r0 + ROWS <= num_rows) & (first >= 0) & \
            (first % block_size + ROWS <= block_size) & \
            (tl.sum((slot != first + tl.arange(0, ROWS)).to(tl.int32), axis=0) == 0)
        if run:
            base_dst = (first // block_size) * block_stride + (first % block_size) * width
            base_src = r0.to(tl.int64) * width
            total = ROWS * width
            for c in range(0, total, CHUNK * ROWS):
                offs = c + tl.arange(0, CHUNK * ROWS)
                m = offs < total
                tl.store(dst + base_dst + offs, tl.load(src + base_src + offs, mask=m), mask=m)
        else:
            valid = slot >= 0
            dst_row = (slot // block_size) * block_stride + (slot % block_size) * width
            src_row = r.to(tl.int64) * width
            for c in range(0, width, CHUNK):
                offs = c + tl.arange(0, CHUNK)
                cmask = offs < width
                vals = tl.load(src + src_row[:, None] + offs[None, :],
                               mask=rmask[:, None] & cmask[None, :])
                tl.store(dst + dst_row[:, None] + offs[None, :], vals,
                         mask=valid[:, None] & cmask[None, :])

    def _grid(n, width):
        chunk = min(4096, triton.next_power_of_2(width))
        return (n, triton.cdiv(width, chunk)), chunk


def _wide(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret the last (contiguous) dim as the widest int type that fits."""
    b = t.view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if b.shape[-1] % size == 0 and all(st % size == 0 for st in b.stride()[:-1]) \
                and b.data_ptr() % size == 0:
            return b.view(dtype)
    return b


def pack_blocks(cache: torch.Tensor, ids: torch.Tensor,
                out: torch.Tensor | None = None, use_triton: bool | None = None
                ) -> torch.Tensor:
    """``out[i] = cache[ids[i]]`` for a contiguous ``[num_blocks, ...]`` cache.

    Args:
        ids: ``[P]`` int, block ids (on the cache's device).
        out: optional contiguous ``[P, *cache.shape[1:]]`` destination.
    """
    if out is None:
        out = cache.new_empty((ids.numel(), *cache.shape[1:]))
    if ids.numel() == 0:
        return out
    # Default: torch index_select, which reaches the same bandwidth for whole
    # blocks (measured on H200, benchmarks/) and launches with less host time
    # than the Triton launcher, which matters for small gathers.
    if use_triton:
        src = _wide(cache.reshape(cache.shape[0], -1))
        dst = _wide(out.reshape(out.shape[0], -1))
        grid, chunk = _grid(ids.numel(), src.shape[1])
        _pack_kernel[grid](src, dst, ids, src.shape[1], CHUNK=chunk,
                           num_warps=8 if chunk >= 2048 else 4)
        return out
    return torch.index_select(cache, 0, ids, out=out)


def scatter_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                 use_triton: bool | None = None, rows_per_program: int | None = None,
                 chunk: int | None = None) -> None:
    """``cache[s // bs, s % bs] = rows[t]`` for every ``s = slots[t] >= 0``.

    Args:
        cache: ``[num_blocks, block_size, D]``; tokens of a block contiguous
            (blocks may be strided, as in the indexer's page views).
        slots: ``[T]`` int64 slot ids, ``-1`` = not this rank's token.
        rows: ``[T, D]`` new rows, same dtype as the cache.
    """
    if slots.numel() == 0:
        return
    assert cache.stride(2) == 1 and cache.stride(1) == cache.shape[2], (
        f"scatter_rows needs contiguous token rows, got strides {cache.stride()}")
    if use_triton if use_triton is not None else _use_triton(cache):
        dst = _wide(cache)
        src = _wide(rows.contiguous())
        width = src.shape[1]
        # 8 rows x 128 words per program for 1152-byte latent rows: measured
        # best on H200 over block-ordered and random slots (benchmarks/)
        chunk = chunk or min(128, triton.next_power_of_2(width))
        rows_per_program = rows_per_program or max(1, 1024 // chunk)
        grid = (triton.cdiv(slots.numel(), rows_per_program),)
        _scatter_kernel[grid](src, dst, slots, slots.numel(), width, dst.stride(0),
                              cache.shape[1], ROWS=rows_per_program, CHUNK=chunk,
                              num_warps=4)
        return
    keep = slots >= 0
    s = slots[keep]
    bs = cache.shape[1]
    cache[s // bs, s % bs] = rows[keep]


def indexer_views(cache: torch.Tensor, block_size: int, head_dim: int = 128,
                  scale_bytes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-row views of a sparse-indexer cache page layout.

    vLLM's DeepSeek-V3.2 indexer cache holds, per block, ``block_size x
    head_dim`` fp8 keys and then ``block_size`` fp32 scales (132 bytes per
    token). Returns uint8 views ``keys [num_blocks, block_size, head_dim]``
    and ``scales [num_blocks, block_size, scale_bytes]`` over the same memory,
    for :func:`scatter_rows` with ordinary slot ids.
    """
    pages = cache.reshape(cache.shape[0], -1).view(torch.uint8)
    n = pages.shape[0]
    keys = pages[:, : block_size * head_dim].view(n, block_size, head_dim)
    scales = pages[:, block_size * head_dim:].view(n, block_size, scale_bytes)
    return keys, scales
