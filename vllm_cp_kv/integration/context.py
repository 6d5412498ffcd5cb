"""Short prefill rows read their cached context where it lives (issue 51;
the math and the cost model: ``core/context.py``).

* :func:`plan_owned`: once per batch (the builder), the prefill rows whose
  context is read owned (``core.context.choose_owned`` on the group's
  :func:`measure_link`), with their paged view of the owned context tokens:
  the rows' block-table rows and owned context lengths. Their context is
  left out of the gathered plan.
* :func:`owned_context`: per layer (the impl's context attention), the
  rows' queries absorbed into the latent space (vLLM's ``W_UK_T``, this
  rank's heads), all heads gathered (TP), attended to the owned context
  tokens with no causal mask (a row's ``S`` new tokens as ``S * H`` query
  heads: the context is read once per row), the ranks' partial outputs
  merged by LSE (reduce-scattered over heads), then up-projected
  (``W_UV``). vLLM merges the result with the rows' new-token attention, as
  it merges a context chunk's.

Under PCP (and PCP x TP) the rows are vLLM's PCP pieces (:func:`plan_owned_pcp`):
each rank holds some of a row's new tokens, so the queries are all-gathered
over the shard group and each token's merged output is reduce-scattered
back to its rank (``core.context.Exchange``).

Kernels: CPU_MLA the torch attention of ``core/decode.py``; FLASHMLA its
own kernel (``causal=False``). Other backends, AMX_MLA and FP8 caches read
every context gathered (``owned_context_supported``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from ..core.context import (Exchange, Link, PaddedRows, choose_owned, exchange_queries,
                            output_layout, padded_rows, pcp_pieces, row_bytes)
from ..core.decode import paged_attention_with_lse
from ..core.ownership import owned_token_count
from ..core.plan import to_device
from .checks import OWNED_CONTEXT_BACKENDS
from .merge import combine, merge_bytes


def owned_context_supported(backend: str, kv_cache_dtype: str) -> bool:
    """Where a prefill row may read its context owned: a backend of
    ``checks.OWNED_CONTEXT_BACKENDS`` with a 16/32-bit cache (sharding over
    TP, PCP or PCP x TP)."""
    return backend in OWNED_CONTEXT_BACKENDS and kv_cache_dtype in (
        "auto", "bfloat16", "float16", "float32")


def measure_link(group, repeats: int = 5) -> Link:
    """The shard group's all-gather latency (1 KiB) and bandwidth (4 MiB a
    rank), the slowest rank's (every rank then decides alike)."""
    dev = group.device if hasattr(group, "device") else torch.device("cpu")

    def timed(numel: int) -> float:
        x = torch.zeros(numel, dtype=torch.float32, device=dev)
        group.all_gather(x, dim=0)  # warm-up
        times = []
        for _ in range(repeats):
            if x.is_cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            group.all_gather(x, dim=0)
            if x.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    small, big = timed(256), timed(1 << 20)
    moved = (group.world_size - 1) * (4 << 20)
    mine = torch.tensor([small, moved / max(big - small, 1e-6)], dtype=torch.float32)
    every = group.all_gather(mine.to(dev).view(1, 2), dim=0).cpu()
    return Link(latency_s=float(every[:, 0].max()), bytes_per_s=float(every[:, 1].min()))


@dataclass(frozen=True)
class OwnedRows:
    """One batch's rows that read their context owned (from the prefill
    rows on: ``padded.index`` counts tokens from the first prefill token)."""

    rows: torch.Tensor  # [R] host: the rows' index in the batch
    padded: PaddedRows  # index on the device, valid on the host (on it: valid_slots)
    table: torch.Tensor  # [R, C] device: the rows' block-table rows
    local_lens: torch.Tensor  # [R] int32 device: owned context tokens of each row
    slot_lens: torch.Tensor  # [R * S] int32 device: each query slot's (0: padding)
    tokens: torch.Tensor  # [T_o] device: the prefill token of each real slot
    valid_slots: torch.Tensor  # [T_o] device: the real slots (TP's merge keeps them)
    # PCP: the rows' pieces are split over the PCP ranks; R rows are the
    # pieces, whose queries are exchanged (core.context.Exchange, dst on the
    # device); tokens: this rank's own, in the order it sends them
    exchange: Exchange | None = None


def plan_owned(common, num_decodes: int, context_lens: torch.Tensor, spec, *, mode: str,
               max_query: int, link_of, heads: int, width: int, v_dim: int,
               elt: int) -> OwnedRows | None:
    """The batch's owned rows (None: none). ``context_lens``: host ``[R]``
    cached tokens of each row (0 for decode rows); ``link_of()``: the
    group's :class:`Link` (measured on first use)."""
    qsl = common.query_start_loc_cpu[: common.num_reqs + 1].long()
    q = qsl[1:] - qsl[:-1]
    prefill = torch.arange(q.numel()) >= num_decodes
    ctx = torch.where(prefill, context_lens, 0)
    if not bool((ctx > 0).any()):
        return None
    cost = row_bytes(q, ctx, size=spec.size, heads=heads, width=width, v_dim=v_dim, elt=elt)
    link = link_of() if mode == "auto" else None
    chosen = choose_owned(q, ctx, cost, link, mode=mode, max_query=max_query)
    rows = chosen.nonzero().flatten()
    if rows.numel() == 0:
        return None
    start = qsl[rows] - qsl[num_decodes]
    return _owned_rows(rows, padded_rows(start, q[rows]), common.block_table_tensor, rows,
                       owned_token_count(ctx[rows], spec))


def _owned_rows(rows, padded: PaddedRows, table: torch.Tensor, table_rows: torch.Tensor,
                local: torch.Tensor, tokens: torch.Tensor | None = None,
                exchange: Exchange | None = None) -> OwnedRows:
    """:class:`OwnedRows` on ``table``'s device from the host plan:
    ``table[table_rows]`` the rows' block-table rows, ``local`` their owned
    context tokens; ``tokens`` (host) this rank's tokens (None: every real
    slot's, TP); ``exchange``'s ``dst`` moved too. Every host tensor goes
    up in one upload from pinned memory (``core.plan.to_device``): the
    host never waits for the GPU here, nor later for a boolean mask."""
    device = table.device
    slot = torch.where(padded.valid, local.repeat_interleave(padded.width), 0)
    valid_slots = padded.valid.nonzero().flatten()
    if tokens is None:
        tokens = padded.index[valid_slots]
    parts = [padded.index, local, slot, table_rows, tokens, valid_slots,
             *(() if exchange is None else (exchange.dst,))]
    up = to_device(torch.cat([x.reshape(-1).to(torch.int64) for x in parts]), device)
    index, local_d, slot_d, rows_d, tokens_d, valid_d, *dst = \
        up.split([x.numel() for x in parts])
    if exchange is not None:
        exchange = dataclasses.replace(exchange, dst=dst[0])
    return OwnedRows(rows=rows, padded=PaddedRows(index, padded.valid, padded.width),
                     table=table.index_select(0, rows_d), local_lens=local_d.to(torch.int32),
                     slot_lens=slot_d.to(torch.int32), tokens=tokens_d,
                     valid_slots=valid_d, exchange=exchange)


def plan_owned_pcp(common, num_decodes: int, step, global_table: torch.Tensor, spec, *,
                   mode: str, max_query: int, link_of, heads: int, width: int,
                   v_dim: int, elt: int) -> OwnedRows | None:
    """PCP: the global requests whose context is read owned (None: none),
    as the pieces vLLM's PCP split gave each rank (``step``: the
    :class:`~vllm_cp_kv.integration.step.PCPStep`, the same on every rank;
    ``global_table``: its requests' block-table rows on this rank). A
    piece's context is every token before it, the cached ones and the new
    ones of earlier pieces (vLLM's PCP path writes the step's new KV before
    attention); a replicated request is one piece, run by every rank."""
    q = torch.from_numpy(step.query_lens.astype("int64"))
    seq = torch.from_numpy(step.seq_lens.astype("int64"))
    prefill = torch.from_numpy(step.is_prefill.astype(bool))
    replicated = torch.from_numpy(step.replicated.astype(bool))
    ctx = torch.where(prefill, seq - q, 0)
    if not bool((ctx > 0).any()):
        return None
    # each rank sends a replicated request's every token; gathered, the
    # request reads its whole sequence (PCP's pieces see each other's KV)
    cost = row_bytes(torch.where(replicated, q * step.pcp, q), seq, size=spec.size,
                     heads=heads, width=width, v_dim=v_dim, elt=elt)
    link = link_of() if mode == "auto" else None
    chosen = choose_owned(q, ctx, cost, link, mode=mode, max_query=max_query)
    if not bool(chosen.any()):
        return None
    if spec.rank // (spec.size // step.pcp) != step.pcp_rank:
        raise RuntimeError(
            f"cp_kv: shard rank {spec.rank} of {spec.size} is not PCP rank {step.pcp_rank}'s "
            "(the owned context's exchange needs pcp_rank * TP + tp_rank, vLLM 0.34's).")
    pieces = pcp_pieces(step.segments, chosen, replicated, step.pcp_rank)
    qsl = common.query_start_loc_cpu[: common.num_reqs + 1].long()
    mine = step.segments[step.pcp_rank]
    if len(mine) != common.num_reqs:
        raise RuntimeError(f"cp_kv: the PCP step recorded {len(mine)} local rows but the "
                           f"batch has {common.num_reqs}; stale step state.")
    tokens = []
    for j in pieces.rows:
        n = int(qsl[j + 1] - qsl[j])
        if j < num_decodes or n != int(mine[j][2]):
            raise RuntimeError(f"cp_kv: local row {j} ({n} tokens) is not the prefill "
                               f"piece the PCP step recorded ({mine[j]}).")
        start = int(qsl[j] - qsl[num_decodes])
        tokens.append(torch.arange(start, start + n))
    return _owned_rows(chosen.nonzero().flatten(), pieces.padded, global_table, pieces.req,
                       owned_token_count(ctx[pieces.req] + pieces.offset, spec),
                       torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long),
                       pieces.exchange)


def owned_context(runtime, owned: OwnedRows, q: torch.Tensor, kv_cache: torch.Tensor,
                  layer, *, scale: float, v_dim: int, gpu_kernel: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The owned rows' context attention: ``out [T_o, H_l, V]`` (this
    rank's heads, up-projected) and ``lse [H_l, T_o]`` (vLLM's layout),
    for the prefill tokens ``owned.tokens``. ``q [T_p, H_l, nope + rope]``:
    the prefill tokens' queries; ``layer``: vLLM's MLA layer (``W_UK_T``,
    ``W_UV``). Under PCP (``owned.exchange``) the pieces' queries are
    all-gathered over the shard group first and each rank's own tokens'
    results come back in the merge."""
    r, s = owned.table.shape[0], owned.padded.width
    ex = owned.exchange
    w_uk_t = layer.W_UK_T  # [H_l, nope, L]
    nope = w_uk_t.shape[1]
    sel = q[owned.padded.index if ex is None else owned.tokens]  # [T, H_l, nope + rope]
    absorbed = torch.bmm(sel[..., :nope].transpose(0, 1), w_uk_t).transpose(0, 1)
    mq = torch.cat([absorbed, sel[..., nope:]], dim=-1)  # [T, H_l, L + rope]
    split = runtime.spec.head_ranks > 1
    if ex is not None:
        def all_gather(x, dim):  # counted as received (``[N * M, H / T, D]``)
            out = runtime.group.all_gather(x, dim=dim)
            runtime.received(out)
            return out

        mq = exchange_queries(all_gather, mq, ex, owned.padded.index)
    elif split:
        mq = runtime.gather_heads(mq)  # [R * S, H, L + rope]
    heads = mq.shape[1]
    if gpu_kernel:
        out, lse = _flashmla(mq.view(r, s, heads, -1), kv_cache, owned, scale, v_dim)
    else:
        out, lse = paged_attention_with_lse(mq.view(r, s * heads, -1), kv_cache, owned.table,
                                            owned.local_lens, scale, v_dim)
    out, lse = out.reshape(r * s, heads, v_dim), lse.reshape(r * s, heads)
    if ex is not None:
        # the empty slots' LSE (a rank owning none of a piece's context) is
        # masked here: the merge layout mixes pieces in one row
        lse = lse.float().masked_fill(owned.slot_lens[:, None] == 0, float("-inf"))
        out, lse = output_layout(out, lse, ex)
        out, lse = _merge(runtime, out, lse, None, True)
        out, lse = out[: ex.count].to(q.dtype), lse[: ex.count]
    else:
        out, lse = _merge(runtime, out, lse, owned.slot_lens, split)
        keep = owned.valid_slots  # indices: a boolean mask would wait for the GPU
        out, lse = out.index_select(0, keep).to(q.dtype), lse.index_select(0, keep)
    up = torch.bmm(out.transpose(0, 1), layer.W_UV).transpose(0, 1)  # [T_o, H_l, V_head]
    return up, lse.transpose(0, 1).contiguous()


def _flashmla(mq, kv_cache, owned: OwnedRows, scale: float, v_dim: int):
    """FlashMLA's kernel, every query of a row seeing the row's owned
    context (no causal mask): ``out [R, S, H, V]``, ``lse [R, S, H]``."""
    from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

    meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(
        q=mq.contiguous(), k_cache=kv_cache.unsqueeze(-2), block_table=owned.table,
        cache_seqlens=owned.local_lens, head_dim_v=v_dim, tile_scheduler_metadata=meta,
        softmax_scale=scale, causal=False)
    return out, lse.transpose(1, 2)  # FlashMLA's LSE is [R, H, S]


def _merge(runtime, out, lse, seq_lens, split: bool):
    """The ranks' partial outputs and LSEs merged: this rank's heads under
    TP (reduce-scatter), all otherwise. ``seq_lens``: each row's owned
    tokens, whose empty rows' LSEs vLLM's GPU merge masks (None: masked)."""
    if out.is_cuda:
        from vllm.v1.attention.ops.dcp import cp_lse_ag_out_ar, cp_lse_ag_out_rs

        rows = out.shape[0]
        qsl = None if seq_lens is None else torch.arange(
            rows + 1, dtype=torch.int32, device=out.device)
        merge_gpu = cp_lse_ag_out_rs if split else cp_lse_ag_out_ar
        runtime.batch_bytes(merge_bytes(lse.numel(), v_dim=out.shape[-1],
                                        out_bytes=out.element_size(),
                                        size=runtime.spec.size, scatter=split))
        return merge_gpu(out.contiguous(), lse.float(), runtime.group, return_lse=True,
                         seq_lens=seq_lens, query_start_loc=qsl)
    return combine(runtime, out, lse, split, return_lse=True)
