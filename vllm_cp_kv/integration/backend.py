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


@contextlib.contextmanager
def _unsharded_view(vllm_config):
    """Make vLLM's MLA metadata builder initialize as if DCP were off.

    Why: with DCP > 1 the builder expects the layer's LSE-merging
    ``MLADCPManager`` and, for kernels without DCP varlen support
    (FLASH_ATTN_MLA with interleave > 1), sends short prefills down the
    prefill path instead of the decode kernel. Our kernels read a complete
    materialized view, so the builder must behave exactly as unsharded
    (same kernel per request, hence the same tokens as an unsharded run).
    """
    from vllm.model_executor.layers.attention import mla_attention

    parallel = vllm_config.parallel_config
    orig_group, orig_dcp = mla_attention.get_dcp_group, parallel.decode_context_parallel_size
    mla_attention.get_dcp_group = lambda: _SingleRankGroup()
    parallel.decode_context_parallel_size = 1
    try:
        yield
    finally:
        mla_attention.get_dcp_group = orig_group
        parallel.decode_context_parallel_size = orig_dcp


def read_lens(common, decode_threshold: int) -> torch.Tensor:
    """Tokens each request reads from the KV cache in this step.

    Decode rows read their whole sequence (the new token included, written
    before attention); prefill rows read only their cached context (their
    new tokens come straight from the projections).
    """
    qsl = common.query_start_loc_cpu.long()
    q = qsl[1:] - qsl[:-1]
    # The host copy avoids a device sync; it is exact without speculative
    # decoding, which the startup checks refuse.
    host = getattr(common, "seq_lens_cpu_upper_bound", None)
    seq = (host if host is not None else common.seq_lens.cpu()).long()[: q.numel()]
    return torch.where(q <= decode_threshold, seq, seq - q)


@cache
def sharded_backend(inner: type) -> type:
    """Return the materializing subclass of MLA backend ``inner``."""
    inner_impl = inner.get_impl_cls()
    inner_builder = inner.get_builder_cls()

    class Builder(inner_builder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device,
                     *args, **kwargs):
            with _unsharded_view(vllm_config):
                super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                                 *args, **kwargs)

        def build(self, common_prefix_len, common_attn_metadata,
                  fast_build: bool = False):
            common = common_attn_metadata
            block_size = self.kv_cache_spec.block_size
            runtime = get_runtime(block_size)
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
                lens = read_lens(common, self.reorder_batch_threshold)
                plan = plan_materialization(runtime.spec, table, lens,
                                            min_columns=columns)
                full, reads = plan.full_block_table, bool((lens > 0).any())
                if runtime.debug:
                    core_debug.check_owned_writes(
                        runtime.spec, common.slot_mapping, table,
                        common.query_start_loc_cpu,
                        common.seq_lens[: common.num_reqs])
                    core_debug.check_plan_covers(plan, table, lens)
            translated = dataclasses.replace(
                common, block_table_tensor=full.to(table.device))
            metadata = super().build(common_prefix_len, translated, fast_build)
            metadata.cp_kv_plan = plan
            # host flag, identical on every rank: gather for prefills or not
            metadata.cp_kv_reads = reads
            return metadata

    class Impl(inner_impl):
        materializes_full_view = True

        def __init__(self, *args, **kwargs):
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
