"""Shard-aware sparse attention on vLLM 0.34 (DeepSeek-V3.2 / GLM-5 DSA):
every rank reads only the blocks it owns, and only candidates, queries,
outputs and LSEs cross ranks (the math: ``core/sparse.py``).

vLLM 0.34 already runs a DSA layer over a DCP-sharded cache, and the plugin's
layout is vLLM's DCP layout (interleave = block size). Its pieces, each
vLLM's own, run unchanged:

* the indexer (``sparse_attn_indexer``) scores the indexer keys this rank
  owns for every decode row, with its DCP metadata (local block table and
  lengths), and keeps the local top-k; a prefill chunk's rows score keys
  all-gathered chunk by chunk (vLLM's ``dcp_gather_kv_rows``, bounded by its
  prefill buffer, 132 bytes a token: docs/sparse.md says why that stays);
* the sparse MLA impl keeps the selected positions this rank owns
  (``triton_filter_and_convert_dcp_index``), attends to them with all heads
  (the layer's DCP query gather) and returns the LSE;
* the layer merges the ranks' partial outputs by LSE (``dcp_manager.combine``).

What vLLM lacks, and this module adds:

1. :func:`merge_dcp_topk_global`, the exchange of the ranks' local top-k
   (vLLM's ``_merge_dcp_topk_global`` requires CuteDSL, which the plugin
   does not): ``core.sparse.merge_rank_topk``, torch only, one all-gather of
   8-byte keys, the deterministic rule of ``core/sparse.py`` (vLLM's:
   higher score, then lower position). Capturable (no host sync).
2. :func:`shard_aware_sparse_backend`: FLASH_ATTN_MLA_SPARSE (FA3) returns
   no LSE and declines DCP; its subclass here asks FA3 for the LSE it
   computes anyway (``return_softmax_lse``, as vLLM's dense FLASH_ATTN_MLA
   does for DCP) and declares DCP support. Both backends' builders take a
   speculative verification row as a decode row at the plugin's interleave
   (:class:`SpecRowsAsDecode`; vLLM does so only at interleave 1).

Nothing else of the plugin's per-batch machinery runs for these layers: no
plan, no scratch view, no indexer wrapper (that is the materializing path,
``sparse.py``, kept for vLLM 0.32, PCP with a cache other than
``fp8_ds_mla``, and ``cp_kv.decode = "materialize"``).
"""

from __future__ import annotations

import contextlib
import functools
from functools import cache

import torch

from vllm.logger import init_logger

from ..core.sparse import merge_rank_topk
from .options import debug_enabled, options_of

logger = init_logger("vllm." + __name__)  # under vLLM's log config

def shard_aware_sparse(vllm_config) -> bool:
    """Whether a sparse model's layers take the shard-aware path: vLLM 0.34
    or later on GPU (its DCP sparse layers), sharding over TP, or over PCP
    with an ``fp8_ds_mla`` cache (vLLM's PCP + DCP sparse layers; PCP with
    another cache keeps the materializing path: docs/sparse.md), and the default
    ``cp_kv.decode`` (``"materialize"`` keeps the whole-view path). The
    startup checks apply the same rule (``checks.sparse_shard_aware``)."""
    from . import vllm_api
    from .checks import sparse_shard_aware

    release, build = vllm_api.installed()
    hf = vllm_config.model_config.hf_text_config if vllm_config.model_config else None
    return (build == "gpu" and release is not None
            and bool(getattr(hf, "index_topk", None))
            and sparse_shard_aware(options_of(vllm_config),
                                   vllm_config.parallel_config.prefill_context_parallel_size,
                                   release, str(vllm_config.cache_config.cache_dtype)))


def merge_dcp_topk_global(logits: torch.Tensor, topk_indices: torch.Tensor,
                          topk_tokens: int, dcp_rank: int, dcp_world_size: int,
                          cp_interleave: int, row_starts: torch.Tensor | None = None,
                          logits_dtype: torch.dtype = torch.float32,
                          num_positions: int | None = None,
                          direct_max_rows: int = 0) -> None:
    """Drop-in for vLLM's ``_merge_dcp_topk_global`` (same arguments):
    overwrite this rank's local top-k ``topk_indices`` (positions into its
    1/N shard, ``-1`` padding) with the global top-k's logical positions,
    identical on every rank. ``logits_dtype``, ``num_positions`` and
    ``direct_max_rows`` tune vLLM's CuteDSL kernel and symmetric-memory
    exchange; the keys here are exact for any float32 score and position
    below 2**31, and the exchange is the DCP group's all-gather."""
    if dcp_world_size <= 1:
        return
    from vllm.distributed.parallel_state import get_dcp_group

    group = get_dcp_group()
    merged = merge_rank_topk(logits, topk_indices, dcp_rank, dcp_world_size,
                             cp_interleave, lambda keys: group.all_gather(keys, dim=0),
                             row_starts)
    if debug_enabled() and not torch.cuda.is_current_stream_capturing():
        _check_identical(group, merged)
    topk_indices.copy_(merged)


def _check_identical(group, merged: torch.Tensor) -> None:
    """Debug (syncing): every rank computed the same global top-k, each
    row's positions distinct."""
    from ..core.debug import CPKVInvariantError as InvariantError

    every = group.all_gather(merged.unsqueeze(0), dim=0)
    if not bool((every == every[:1]).all()):
        raise InvariantError("cp_kv: debug: the ranks' global top-k differ")
    ordered = merged.long().sort(dim=1).values
    dup = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(dup.any()):
        raise InvariantError("cp_kv: debug: a global top-k row repeats a position")
    logger.info_once("cp_kv: debug invariants hold (the shard-aware sparse path: every "
                     "rank's global top-k identical, positions distinct).")


@contextlib.contextmanager
def _fa3_returns_lse(module):
    """While FA3's sparse impl runs: its ``flash_attn_varlen_func`` returns
    ``(out, lse)`` (the kernel's own LSE, ``[H, T]``)."""
    orig = module.flash_attn_varlen_func
    module.flash_attn_varlen_func = functools.partial(orig, return_softmax_lse=True)
    try:
        yield
    finally:
        module.flash_attn_varlen_func = orig


class FA3SparseLSE:
    """Mixin over vLLM's ``FlashAttnMLASparseImpl``: under DCP its kernel
    returns the LSE (natural log, as FA3's is) and a zero output with
    ``-inf`` for queries that own none of their selected tokens (the merge's
    identity), so vLLM's DCP layer merges the ranks' partial outputs."""

    supports_dcp = True
    can_return_lse_for_decode = True
    lse_base_on_e = True
    # each query token carries its own top-k positions: no layout assumption
    supports_mtp_with_cp_non_trivial_interleave_size = True

    def _forward_mqa_kernel(self, q, kv_cache, topk_indices, valid_counts, **kwargs):
        if not isinstance(q, tuple):  # vLLM's DCP layer gathers the query concatenated
            q = (q[..., :self.kv_lora_rank].contiguous(),
                 q[..., self.kv_lora_rank:].contiguous())
        if not self.need_to_return_lse_for_decode:
            return super()._forward_mqa_kernel(q, kv_cache, topk_indices, valid_counts,
                                               **kwargs)
        import vllm.v1.attention.backends.mla.flashattn_mla_sparse as fa3_sparse

        with _fa3_returns_lse(fa3_sparse):
            (out, lse), _ = super()._forward_mqa_kernel(q, kv_cache, topk_indices,
                                                        valid_counts, **kwargs)
        lse = lse.transpose(0, 1)  # [H, T] -> [T, H]
        empty = (valid_counts == 0).view(-1, 1)
        return out.masked_fill(empty[..., None], 0), lse.masked_fill(empty, float("-inf"))


class SpecRowsAsDecode:
    """Mixin over a sparse backend's metadata builder: a speculative
    verification row (``1 + num_speculative_tokens`` query tokens) takes the
    decode branch under DCP at the plugin's interleave (the block size).

    vLLM 0.34 lowers the builders' decode threshold to 1 under DCP unless the
    builder passes ``supports_dcp_with_varlen`` (FLASHMLA_SPARSE does only
    for interleave 1, FLASH_ATTN_MLA_SPARSE never), so at interleave 64 a
    verification row went to the sparse layer's *prefill* branch while the
    indexer (threshold ``next_n``) and the model runner (a uniform decode
    batch, captured whole) took it as decode; the prefill branch's plans are
    built on the host and a full decode graph bakes them in at capture (wrong
    tokens on replay: docs/sparse.md). The decode branch assumes no layout:
    each query token carries its own top-k positions, which
    ``triton_filter_and_convert_dcp_index`` filters to this rank's with the
    interleave. Only the verification width is raised (as vLLM does for
    spec-as-decode builders); longer rows stay prefill rows."""

    def _init_reorder_batch_threshold(self, reorder_batch_threshold=1,
                                      supports_spec_as_decode=False,
                                      supports_dcp_with_varlen=False):
        super()._init_reorder_batch_threshold(reorder_batch_threshold, supports_spec_as_decode,
                                              supports_dcp_with_varlen)
        if self.reorder_batch_threshold is not None and supports_spec_as_decode:
            from vllm.v1.attention.backend import max_decode_query_len

            self.reorder_batch_threshold = max(self.reorder_batch_threshold,
                                               max_decode_query_len(self.vllm_config))


@cache
def shard_aware_sparse_backend(inner: type) -> type:
    """The backend the shard-aware path runs for vLLM's sparse backend
    ``inner``: its builder with :class:`SpecRowsAsDecode`; for
    FLASH_ATTN_MLA_SPARSE also its impl with :class:`FA3SparseLSE`."""
    builder = inner.get_builder_cls()
    members = {"get_builder_cls": staticmethod(lambda: shard_builder)}
    shard_builder = type(f"ShardAware_{builder.__name__}", (SpecRowsAsDecode, builder), {})
    if inner.get_name() == "FLASH_ATTN_MLA_SPARSE":
        impl = type(f"ShardAware_{inner.get_impl_cls().__name__}",
                    (FA3SparseLSE, inner.get_impl_cls()), {})
        members["get_impl_cls"] = staticmethod(lambda: impl)
    return type(f"ShardAwareBackend_{inner.get_name()}", (inner,), members)
