"""The materializing MLA backend: wraps the platform's MLA backend.

``sharded_backend(inner)`` returns a subclass of ``inner`` (CPU_MLA,
AMX_MLA here; FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA on GPU) whose

* metadata builder plans the full-view gather once per batch (all layers)
  and translates the block tables to the scratch full view;
* impl writes new KV to this rank's persistent cache through vLLM's own DCP
  slot mapping (owner-only), then, per layer, gathers the planned blocks
  into the scratch and runs the inner kernel unchanged on it.

The impl reports ``dcp_world_size == 1`` to the ``MLAAttention`` layer: the
kernel sees a complete, unsharded view, so the layer must not all-gather
queries or merge partial outputs by LSE.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import cache

import torch

from ..core import debug as core_debug
from ..core.plan import plan_materialization, plan_split_requests
from .runtime import current_pcp_step, get_runtime


class _SingleRankGroup:
    world_size = 1
    rank_in_group = 0


# Modules whose builders or impls read the DCP group while initializing.
_DCP_READERS = (
    "vllm.model_executor.layers.attention.mla_attention",
    "vllm.model_executor.layers.attention.sparse_mla_attention",
    "vllm.v1.attention.backends.mla.indexer",
)


@contextlib.contextmanager
def unsharded_view(vllm_config):
    """Make vLLM's MLA code initialize (or select a backend) as if DCP were off.

    Why: with DCP > 1 the MLA builders expect the layer's LSE-merging
    ``MLADCPManager``, kernels without DCP varlen support (FLASH_ATTN_MLA
    with interleave > 1) send short prefills down the prefill path instead
    of the decode kernel, FLASH_ATTN_MLA_SPARSE declines to be selected and
    FLASHMLA_SPARSE switches to vLLM's own PCP+DCP gather. Our kernels read
    a complete materialized view, so all of them must behave exactly as
    unsharded (same kernel per request, hence the same tokens as an
    unsharded run).
    """
    import importlib

    parallel = vllm_config.parallel_config
    modules = [importlib.import_module(name) for name in _DCP_READERS]
    saved = [m.get_dcp_group for m in modules]
    orig_dcp = parallel.decode_context_parallel_size
    for m in modules:
        m.get_dcp_group = lambda: _SingleRankGroup()
    parallel.decode_context_parallel_size = 1
    try:
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.get_dcp_group = fn
        parallel.decode_context_parallel_size = orig_dcp


def read_lens(common, decode_threshold: int, whole: bool = False) -> torch.Tensor:
    """Tokens each request reads from the KV cache in this step.

    Decode rows read their whole sequence (the new token included, written
    before attention); prefill rows read only their cached context (their
    new tokens come straight from the projections), unless ``whole``: sparse
    attention and the indexer read every token from the cache.
    """
    qsl = common.query_start_loc_cpu.long()
    q = qsl[1:] - qsl[:-1]
    # The host copy avoids a device sync; it is exact without speculative
    # decoding, which the startup checks refuse.
    host = getattr(common, "seq_lens_cpu_upper_bound", None)
    seq = (host if host is not None else common.seq_lens.cpu()).long()[: q.numel()]
    return seq if whole else torch.where(q <= decode_threshold, seq, seq - q)


def plan_batch(common, block_size: int, decode_threshold: int, whole: bool):
    """``(plan, full_table, reads)`` for one batch: planned once and shared by
    every builder of the KV cache group (the MLA latent and, for sparse
    models, the indexer cache), since they read the same blocks.

    ``full_table`` is the block table translated to the scratch full view
    (this rank's rows); ``reads`` is a host flag, identical on every rank.
    """
    runtime = get_runtime(block_size)
    memo = runtime.batch_plan
    if memo is not None and memo[0] is common and memo[1] == whole:
        return memo[2]
    table = common.block_table_tensor[: common.num_reqs]
    # Kernels size their index from each request's full length.
    columns = -(-common.max_seq_len // block_size)
    step = current_pcp_step()
    if step is not None:
        # PCP: ranks run different chunks; plan from the global batch
        if len(step.row_keys) != common.num_reqs:
            raise RuntimeError(
                f"cp_kv: the PCP step recorded {len(step.row_keys)} local "
                f"rows but the batch has {common.num_reqs}; stale step state.")
        lens = torch.from_numpy(step.seq_lens)
        plan, full, global_table = plan_split_requests(
            runtime.spec, table, step.row_keys, step.keys, lens,
            min_columns=columns)
        reads = bool((step.seq_lens > 0).any())
        if runtime.debug:
            # vLLM's PCP write path gathers new KV across ranks: the
            # owned-writes check runs on the poisoned-cache tests
            core_debug.check_plan_covers(plan, global_table, lens)
    else:
        lens = read_lens(common, decode_threshold, whole)
        plan = plan_materialization(runtime.spec, table, lens, min_columns=columns)
        full, reads = plan.full_block_table, bool((lens > 0).any())
        if runtime.debug:
            core_debug.check_owned_writes(
                runtime.spec, common.slot_mapping, table,
                common.query_start_loc_cpu, common.seq_lens[: common.num_reqs])
            core_debug.check_plan_covers(plan, table, lens)
    result = (plan, full.to(table.device), reads)
    runtime.batch_plan = (common, whole, result)
    return result


def translated(common, full_table):
    """``common`` as the unsharded kernels must see it: the full-view block
    table, and no DCP-local lengths (nothing is DCP-local in the view)."""
    return dataclasses.replace(common, block_table_tensor=full_table,
                               dcp_local_seq_lens=None,
                               dcp_local_seq_lens_cpu_upper_bound=None)


@cache
def sharded_backend(inner: type) -> type:
    """Return the materializing subclass of MLA backend ``inner``."""
    inner_impl = inner.get_impl_cls()
    inner_builder = inner.get_builder_cls()
    # sparse MLA reads every token of the batch through the cache
    sparse = bool(getattr(inner, "is_sparse", lambda: False)())

    class Builder(inner_builder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device,
                     *args, **kwargs):
            with unsharded_view(vllm_config):
                super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                                 *args, **kwargs)

        def build(self, common_prefix_len, common_attn_metadata,
                  fast_build: bool = False):
            common = common_attn_metadata
            plan, full, reads = plan_batch(
                common, self.kv_cache_spec.block_size,
                self.reorder_batch_threshold or 1, whole=sparse)
            metadata = super().build(common_prefix_len, translated(common, full),
                                     fast_build)
            metadata.cp_kv_plan = plan
            # host flag, identical on every rank: gather for prefills or not
            metadata.cp_kv_reads = reads
            return metadata

    class Impl(inner_impl):
        materializes_full_view = True

        def __init__(self, *args, **kwargs):
            from vllm.config import get_current_vllm_config

            with unsharded_view(get_current_vllm_config()):
                super().__init__(*args, **kwargs)
            # The layer sees an unsharded kernel: no query all-gather and
            # no LSE merge (see module docstring).
            self.dcp_world_size, self.dcp_rank = 1, 0
            self.total_cp_world_size, self.total_cp_rank = 1, 0
            self.need_to_return_lse_for_decode = False

        def _full_view(self, kv_cache, attn_metadata):
            runtime = get_runtime(kv_cache.shape[1])
            return runtime.materialize(attn_metadata.cp_kv_plan, kv_cache)

        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            full = self._full_view(kv_c_and_k_pe_cache, attn_metadata)
            return super().forward_mqa(q, full, attn_metadata, layer)

        def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache,
                        attn_metadata, k_scale, output, output_scale=None):
            if attn_metadata.cp_kv_reads:
                kv_c_and_k_pe_cache = self._full_view(kv_c_and_k_pe_cache,
                                                      attn_metadata)
            return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache,
                                       attn_metadata, k_scale, output,
                                       output_scale)

    class Backend(inner):
        @staticmethod
        def get_impl_cls():
            return Impl

        @staticmethod
        def get_builder_cls():
            return Builder

    for cls, role in ((Backend, "Backend"), (Impl, "Impl"), (Builder, "Builder")):
        cls.__name__ = cls.__qualname__ = f"ShardedKV{role}_{inner.get_name()}"
    return Backend
