"""The shard-aware decode in vLLM (``cp_kv.decode = "lse"``, the default
for dense MLA): decode rows attend to this rank's owned blocks only, and the
ranks' partial outputs are merged by LSE (the math, the torch kernel and the
merge: ``core/decode.py``). Queries, outputs and LSEs cross ranks, never the
context.

* The decode rows' paged view of the owned tokens
  (:class:`~vllm_cp_kv.integration.step.DecodeView`) is planned once per
  batch with the rest of the batch (``planning.decode_view``). **Rows with
  several query tokens** (speculative verification, short prefills a
  backend routes to its decode path) become rows of one query token each
  there, each with its own causal limit (``core.decode.query_token_lens``),
  so the kernels, the merge and the debug check below see rows of one query
  token each.
* :func:`decode_threshold`: the longest row the shard-aware decode takes.
* :func:`run_gpu`: vLLM's DCP decode as vLLM runs it (its kernel with the
  LSE on the owned blocks, its merge); :func:`run_cpu`: with AMX_MLA vLLM's
  own CPU decode kernel, whose split-KV workspace holds the LSE, else torch
  attention with the LSE (CPU_MLA's kernel returns none), and a packed
  all-gather (vLLM's merge is Triton-only).

What a step moves and the debug check against a full view are
``decode_audit.py``'s.
"""

from __future__ import annotations

import copy

import torch

from vllm.logger import init_logger

from ..core.decode import paged_attention_with_lse
from . import vllm_api
from .merge import combine
from .step import AMXLocal, DecodeView

logger = init_logger("vllm." + __name__)  # under vLLM's log config


def decode_threshold(vllm_config, inner_threshold: int | None) -> int | None:
    """Longest row the shard-aware decode takes: a verification row of
    speculative decoding (vLLM's ``max_decode_query_len``, 1 + the draft
    tokens), whatever the inner backend's own threshold: its kernel sees
    rows of one query token only (:func:`decode_view`). FLASH_ATTN_MLA and
    FLASHMLA route prefills of up to 512 and 128 tokens to their decode
    path; over a long cached context such a row would read the owned blocks
    once per query token, so here it is a prefill that reads one full view
    (as vLLM's DCP lowers the threshold where its kernels cannot mask the
    layout); CPU_MLA's threshold of 1 would send verification rows to the
    prefill path, which reads the whole context through the full view."""
    from vllm.v1.attention.backend import max_decode_query_len

    if inner_threshold is None:
        return None
    return max_decode_query_len(vllm_config)


def build_local(builder, view: DecodeView, heads_of_ranks: int,
                floor_empty_rows: bool = False):
    """GPU: the decode rows' metadata for this rank's own blocks, as vLLM's
    DCP builds it (the builder's ``_build_decode`` with the local lengths),
    one query token per row, sized for the heads of ``heads_of_ranks`` ranks
    (all H under TP, where the queries are gathered). What the captured
    kernels read is the view's persistent storage and the builder's own
    persistent buffers (its scheduler metadata)."""
    lens = view.local_lens
    if floor_empty_rows:  # FlashMLA's FP8 kernel (fp8_rows_need_a_token)
        lens = view.buffers.at_least_one(lens.shape[0])
    with vllm_api.heads_of(builder, heads_of_ranks):
        return one_query_rows(builder, view, view.block_table, lens, view.max_local_len)


def fp8_rows_need_a_token(builder) -> bool:
    """FlashMLA's dense FP8 decode kernel (``flash_mla_with_kvcache_fp8``)
    reads out of bounds on a row of no tokens (the H100 lease of
    2026-12-05: an illegal memory access at vLLM's warm-up, on rank 1, which
    owns no token of a prompt of one block), where vLLM's DCP, interleaving
    single tokens, rarely has one: FlashMLA's builder with an FP8 cache."""
    names = {c.__name__ for c in type(builder).__mro__}
    return "FlashMLAMetadataBuilder" in names and bool(getattr(builder, "is_fp8_kvcache", False))


def one_query_rows(builder, view: DecodeView, table, lens, max_len: int):
    """vLLM's decode metadata for the rows of ``view`` (one query token
    each) over ``table`` with ``lens`` tokens per row."""
    return vllm_api.build_decode(
        builder, block_table=table, seq_lens=lens, max_seq_len=max_len,
        query_start_loc_cpu=view.query_start_loc_cpu, query_start_loc=view.query_start_loc,
        num_tokens=lens.shape[0])


def all_heads(runtime, view: DecodeView, q: torch.Tensor, local_heads: int,
              count: bool = True) -> torch.Tensor:
    """The queries of every head the shard-aware decode attends with. Under
    TP a rank's layer computes its ``H / N`` heads and they are all-gathered
    over the shard group; with vLLM's query replication (``--dcp-q-replicate``:
    the query projection replicated within the DCP group, here the shard
    group) the layer already computed all ``H``, and the collective is
    skipped."""
    if view.gather_heads and q.shape[1] == local_heads:
        return runtime.gather_heads(q, count)
    return q


def own_heads(runtime, q, local_heads: int):
    """This rank's ``H / N`` heads of queries that vLLM's query replication
    computed for all ``H`` (the decodes that read the full view: every rank
    attends with its own heads only)."""
    if isinstance(q, tuple) or q.shape[1] == local_heads:
        return q
    return head_slice(runtime, q, local_heads)


def head_slice(runtime, x: torch.Tensor, local_heads: int) -> torch.Tensor:
    """This rank's ``local_heads`` heads of ``[B, H, ...]``."""
    rank = runtime.spec.head_rank
    return x[:, rank * local_heads:(rank + 1) * local_heads]


def run_gpu(impl, forward_mqa, runtime, q, kv_cache, attn_metadata, layer, lse_context):
    """GPU: queries of all heads (:func:`all_heads`, TP), vLLM's kernel
    (``forward_mqa``, the inner impl's) on this rank's owned blocks
    returning its LSE, vLLM's merge (``cp_lse_ag_out_rs``: all-gather of
    the LSEs, reduce-scatter of the outputs over heads; under PCP every rank
    has all heads: ``cp_lse_ag_out_ar``; under PCP x TP the same over all N
    ranks, each keeping its TP rank's heads: ``core.groups.merge_partials``
    would move fewer bytes, reduce-scattering over TP and summing ``H / TP``
    heads over PCP, but is not a vLLM kernel). ``lse_context``: where the
    kernel returns a float32 LSE (``vllm_api.float32_decode_lse``)."""
    from vllm.v1.attention.ops.dcp import cp_lse_ag_out_ar, cp_lse_ag_out_rs

    view = attn_metadata.cp_kv.decode
    q = all_heads(runtime, view, q, impl.num_heads, count=False)  # counted at build
    # the kernel sees a plain paged sequence (no DCP masking: a decode query
    # sees every key), and returns its LSE; rows of no owned token (FP8: given
    # one, ``build_local``) get LSE -inf in the merge, from ``local_lens``
    # (vLLM's ``mask_dcp_empty_shards_``)
    if view.multi_query:  # FLASHMLA shapes its queries by the row count
        attn_metadata = copy.copy(attn_metadata)
        attn_metadata.num_decodes = view.local_lens.shape[0]
    with vllm_api.impl_returns_decode_lse(impl), lse_context() as float32:
        out, lse = forward_mqa(q, kv_cache, attn_metadata, layer)
    lse = float32.get("lse", lse)
    scatter, keep_own = merge_kind(runtime.spec, view.gather_heads)
    combine = cp_lse_ag_out_rs if scatter else cp_lse_ag_out_ar
    out = combine(out, lse, runtime.group, is_lse_base_on_e=impl.lse_base_on_e,
                  seq_lens=view.local_lens, query_start_loc=view.query_start_loc)
    return head_slice(runtime, out, impl.num_heads) if keep_own else out


def merge_kind(spec, gather_heads: bool) -> tuple[bool, bool]:
    """How :func:`run_gpu` merges the ranks' partial outputs of all H heads:
    ``(scatter, keep_own)``. The heads split over the whole group (TP):
    reduce-scatter them (each rank gets its ``H / N``); else all-reduce, and
    where the heads split over the TP ranks of a larger group (PCP x TP)
    keep this rank's ``H / TP``; under PCP with TP 1 every rank keeps all."""
    split = spec.head_ranks == spec.size
    return gather_heads and split, gather_heads and not split


def build_local_amx(view: DecodeView, block_size: int) -> AMXLocal:
    from vllm.platforms import current_platform

    rows = view.block_table.shape[0]
    return AMXLocal(
        req_to_token=vllm_api.amx_expand_block_table(view.block_table, block_size).to(
            torch.int64),
        req_pool_indices=torch.arange(rows, dtype=torch.int64),
        seq_lens=view.local_lens.to(torch.int64),
        num_kv_splits=vllm_api.amx_num_kv_splits(max(view.max_local_len, 1),
                                                 current_platform.num_compute_units()))


def amx_attention_with_lse(q: torch.Tensor, kv_cache: torch.Tensor, local: AMXLocal,
                           scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's AMX_MLA decode kernel over this rank's blocks, with its LSE:
    the kernel leaves each KV split's normalized output and natural-log LSE
    in its ``attn_logits`` workspace (the last column), so the LSE of the
    whole is their logsumexp (checked against float64 attention in
    tests/unit/test_decode.py). Rows that see no owned token get a zero output
    and ``-inf`` (the kernel leaves NaN there)."""
    rows, heads, width = q.shape
    flat = kv_cache.view(-1, 1, width)
    out = q.new_zeros(rows, heads, v_dim)
    logits = torch.zeros(rows, heads, local.num_kv_splits, v_dim + 1, dtype=torch.float32)
    vllm_api.cpu_mla_decode(
        query=q.contiguous(), k_buffer=flat, v_buffer=flat[..., :v_dim], output=out,
        key=None, value=None, loc=None, attn_logits=logits, req_to_token=local.req_to_token,
        req_pool_indices=local.req_pool_indices, seq_lens=local.seq_lens, sm_scale=scale,
        logit_cap=0.0, is_cross_attn=False, sliding_window_size=0, encoder_lens=None,
        sinks=None)
    lse = torch.logsumexp(logits[..., v_dim], dim=-1)
    empty = local.seq_lens == 0
    if bool(empty.any()):
        out[empty] = 0
    return out, lse


def run_cpu(runtime, q, kv_cache, view: DecodeView, scale: float, v_dim: int,
            local_heads: int, amx: AMXLocal | None = None):
    """CPU: queries of all heads (:func:`all_heads`), partial attention over
    the owned blocks with the LSE (AMX_MLA: vLLM's own decode kernel,
    :func:`amx_attention_with_lse`; else torch), merged. Partial outputs
    cross ranks in the kernel's compute type (float64 for float32 models,
    else the model's 16-bit type) and the merge accumulates in float32 or
    wider."""
    q = all_heads(runtime, view, q, local_heads)
    if amx is not None:
        out, lse = amx_attention_with_lse(q, kv_cache, amx, scale, v_dim)
    else:
        out, lse = paged_attention_with_lse(q, kv_cache, view.block_table, view.local_lens,
                                            scale, v_dim)
    return combine(runtime, out, lse, view.gather_heads).to(q.dtype)
