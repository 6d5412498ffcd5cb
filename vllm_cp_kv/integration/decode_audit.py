"""What the shard-aware decode moves and whether it is right, apart from
its runs (``decode.py``): the bytes of a GPU decode step, counted when the
builder plans it (a replayed CUDA graph runs no Python), and the debug
check (``VLLM_CP_KV_DEBUG``) of the merged output against attention over
the materialized full view.
"""

from __future__ import annotations

import copy

import torch

from vllm.logger import init_logger

from ..core import debug as core_debug
from ..core.decode import paged_attention_with_lse
from ..core.plan import plan_materialization
from . import vllm_api
from .decode import all_heads, head_slice, one_query_rows
from .merge import merge_bytes
from .step import DecodeView

logger = init_logger("vllm." + __name__)  # under vLLM's log config


def gpu_step_bytes(view: DecodeView, *, heads: int, q_width: int, v_dim: int,
                   q_bytes: int, out_bytes: int, size: int, gathers_queries: bool,
                   head_ranks: int | None = None) -> int:
    """What one layer's shard-aware decode receives from the other ranks on
    GPU (:func:`run_gpu`), from the batch's shapes alone: a replayed CUDA
    graph runs no Python, so the builder counts a step's bytes when it
    plans the step. ``heads``: all H; ``gathers_queries``: the query
    all-gather over the ``head_ranks`` ranks (default: all ``size``) runs
    (not with vLLM's query replication or under PCP with TP 1). The outputs
    are reduce-scattered where the heads split over the whole group (TP),
    else all-reduced (a ring's ``2 (N - 1) / N``)."""
    rows, n = view.local_lens.shape[0], size
    t = n if head_ranks is None else head_ranks
    q = rows * heads * q_width * q_bytes * (t - 1) // t if gathers_queries else 0
    return q + merge_bytes(rows * heads, v_dim=v_dim, out_bytes=out_bytes, size=n,
                           scatter=t == n)


def _dequantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """An FP8 query or cache (vLLM's FP8 MLA kernels take both quantized,
    each with a per-tensor scale) in float32; other dtypes as they are."""
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.float() * scale
    return x


def check_against_full_view(impl, forward_mqa, q, out, attn_metadata, kv_cache,
                            layer) -> None:
    """Debug: once per step, the merged decode output of one layer against
    float32 attention over the materialized full view, and vLLM's own
    decode kernel on that view against the same reference (rows of one
    query token each; both errors go to the statistics)."""
    made = attn_metadata.cp_kv
    runtime, view = impl.cp_kv_runtime, made.decode
    if not runtime.first_check("decode", made):
        return
    # whole lengths: every rank's owned counts, summed
    mine = view.local_lens.reshape(1, -1).long().contiguous().view(torch.float32)
    lens = runtime.group.all_gather(mine, dim=0).view(torch.int64).sum(dim=0).cpu()
    plan = plan_materialization(runtime.spec, view.block_table, lens)
    full = runtime.materialize_for_check(plan, kv_cache)
    q_all = all_heads(runtime, view, q, impl.num_heads, count=False)
    q_scale, k_scale = vllm_api.fp8_scales(layer)
    ref, _ = paged_attention_with_lse(_dequantized(q_all, q_scale), _dequantized(full, k_scale),
                                      plan.full_block_table, lens, impl.scale,
                                      impl.kv_lora_rank)
    if view.gather_heads:
        ref = head_slice(runtime, ref, out.shape[1])
    unsharded = None
    if made.decode_builder is not None and not view.multi_query:
        md = copy.copy(attn_metadata)
        md.decode = one_query_rows(
            made.decode_builder, view, plan.full_block_table.to(view.block_table.device),
            lens.to(device=view.local_lens.device, dtype=torch.int32), int(lens.max()))
        unsharded = forward_mqa(q, full, md, layer)[0]
        if unsharded.shape[1] != out.shape[1]:  # replicated queries: this rank's heads
            unsharded = head_slice(runtime, unsharded, out.shape[1])
    err, inner_err = core_debug.check_decode_merge(out, ref, runtime.spec, unsharded)
    runtime.stats.note_decode_check(err, inner_err)
    if runtime.stats.debug_decode_checks == 1:
        logger.info("cp_kv: debug: LSE-merged decode equals attention over the "
                    "materialized full view (largest difference %.3g; vLLM's "
                    "kernel on that view: %s).", err, inner_err)
