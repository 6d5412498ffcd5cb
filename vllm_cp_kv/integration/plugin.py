"""Plugin entry: the one place where vLLM internals are patched.

``register()`` runs in every vLLM process (``vllm.general_plugins`` entry
point). Each patch below is inert unless the running config has
``additional_config={"cp_kv": {"enable": true}}``; installed but not
enabled, the plugin changes nothing.

Patches, and why each is needed:

1. ``EngineArgs.create_engine_config``: run the startup checks on the user's
   arguments and derive ``decode_context_parallel_size`` (vLLM's sharded
   block layout) before vLLM validates its config, so vLLM's own DCP checks
   still apply.
2. ``current_platform.check_and_update_config`` and
   ``update_block_size_for_backend``: once the platform has fixed the block
   size (the second runs in each worker, after the attention backend is
   known), pin ``cp_kv_cache_interleave_size`` to it (block ownership), and
   install :class:`~vllm_cp_kv.integration.worker.ShardedKVWorker`.
3. ``selector._cached_get_attn_backend``: wrap the platform's MLA backend
   (dense or sparse) in the materializing backend (the CPU platform ignores
   ``--attention-backend`` for custom backends, so registration alone would
   not reach it); the platform chooses it as for an unsharded run.
4. ``check_attention_cp_compatibility`` in both model runners: vLLM demands
   an LSE-returning decode kernel under DCP because its DCP attention merges
   partial results; a materialized full view needs no merge.
5. GPU V2 runner, ``set_forward_context`` as the runner imported it: under
   PCP, vLLM's MoE layers route the PCP-gathered tokens but slice the
   rank-local padding mask, which fails (``topk_softmax ... is_padding size
   mismatch``, vLLM 0.32); hand them the gathered mask (``pcp.py``;
   installed when a worker builds the V2 runner).
6. CPU only, ``cpu_triton_utils._compute_slot_mapping_kernel_impl``: vLLM's
   C++ stand-in for the slot-mapping kernel asserts CP size 1; sharded
   launches get the same arithmetic in torch (unsharded ones are untouched).

One more, scoped to a ``with`` block in ``backend.py`` (``unsharded_view``):
while a materializing builder or impl initializes, or a backend is chosen,
vLLM's MLA code sees a DCP group of size 1, since it reads a full view
rather than merging shards. Sparse (DeepSeek-V3.2) models get two more
bindings, installed by the sharded worker before the model is built: see
``sparse.py``.
"""

from __future__ import annotations

import functools

from vllm.logger import init_logger

from .options import options_of, CPKVOptions

logger = init_logger("vllm." + __name__)  # under vLLM's log config
_INSTALLED = False
WORKER_CLS = "vllm_cp_kv.integration.worker.ShardedKVWorker"


def _enabled(vllm_config) -> bool:
    return vllm_config is not None and options_of(vllm_config).enable


def _sharding(vllm_config) -> bool:
    return _enabled(vllm_config) and options_of(vllm_config).kv_sharding


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        options = CPKVOptions.from_additional_config(self.additional_config)
        if options.enable:
            from .checks import check_engine_args

            check_engine_args(self, options)
        return orig(self, *args, **kwargs)

    EngineArgs.create_engine_config = create_engine_config


def _patch_platform() -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    orig = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        orig(cls, vllm_config)
        if _enabled(vllm_config):
            from .checks import check_vllm_config

            check_vllm_config(vllm_config, options_of(vllm_config))
            vllm_config.parallel_config.worker_cls = WORKER_CLS

    platform_cls.check_and_update_config = classmethod(check_and_update_config)

    # Workers finalize the block size for the chosen attention backend later
    # (FLASHMLA needs 64): pin the interleave to that final size again.
    orig_update = platform_cls.update_block_size_for_backend.__func__

    def update_block_size_for_backend(cls, vllm_config) -> None:
        orig_update(cls, vllm_config)
        if _enabled(vllm_config):
            from .checks import check_vllm_config

            check_vllm_config(vllm_config, options_of(vllm_config))

    platform_cls.update_block_size_for_backend = classmethod(update_block_size_for_backend)


def _patch_backend_selector() -> None:
    from vllm.v1.attention import selector

    orig = selector._cached_get_attn_backend

    @functools.wraps(orig)
    def cached_get_attn_backend(backend, attn_selector_config, *args, **kwargs):
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if not (attn_selector_config.use_mla and _sharding(vllm_config)):
            return orig(backend, attn_selector_config, *args, **kwargs)
        from .backend import sharded_backend, unsharded_view
        from .checks import check_sparse_backend

        # choose as an unsharded run would (FLASH_ATTN_MLA_SPARSE declines DCP)
        unsharded = attn_selector_config._replace(use_dcp=False)
        with unsharded_view(vllm_config):
            cls = orig(backend, unsharded, *args, **kwargs)
        if attn_selector_config.use_sparse:
            check_sparse_backend(cls.get_name())
        return sharded_backend(cls)

    selector._cached_get_attn_backend = cached_get_attn_backend


def _patch_cp_compat_check() -> None:
    import importlib

    from vllm.v1.worker import cp_utils

    orig = cp_utils.check_attention_cp_compatibility

    @functools.wraps(orig)
    def check(vllm_config, target_layer_names=None):
        if _sharding(vllm_config):
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention_layer_base import (
                AttentionLayerBase)

            layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
            keep = {name for name, layer in layers.items() if not getattr(
                getattr(layer, "impl", None), "materializes_full_view", False)}
            if target_layer_names is not None:
                keep &= set(target_layer_names)
            target_layer_names = keep
        return orig(vllm_config, target_layer_names)

    cp_utils.check_attention_cp_compatibility = check
    for name in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
        try:
            module = importlib.import_module(name)
        except Exception:  # the V2 runner may not import without a GPU
            continue
        if hasattr(module, "check_attention_cp_compatibility"):
            module.check_attention_cp_compatibility = check


def register() -> None:
    """``vllm.general_plugins`` entry point (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _patch_engine_args()
    _patch_platform()
    _patch_backend_selector()
    _patch_cp_compat_check()
    _patch_cpu_slot_mapping()


def patch_forward_context() -> None:
    """PCP + MoE: the gathered tokens' padding mask (see item 5 above).

    Installed by ``pcp.make_runner_cls`` when a worker builds vLLM's V2
    runner (idempotent), so processes that never build it import nothing.
    """
    from vllm.v1.worker.gpu import model_runner

    orig = model_runner.set_forward_context
    if getattr(orig, "_cp_kv", False):
        return

    @functools.wraps(orig)
    def set_forward_context(attn_metadata, vllm_config, *args, is_padding=None,
                            **kwargs):
        pcp = vllm_config.parallel_config.prefill_context_parallel_size
        if is_padding is not None and pcp > 1 and _enabled(vllm_config):
            from .pcp import gathered_padding

            is_padding = gathered_padding(is_padding, pcp)
        return orig(attn_metadata, vllm_config, *args, is_padding=is_padding,
                    **kwargs)

    set_forward_context._cp_kv = True
    model_runner.set_forward_context = set_forward_context


def _patch_cpu_slot_mapping() -> None:
    """CPU only: vLLM's C++ stand-in for the slot-mapping Triton kernel
    asserts ``TOTAL_CP_WORLD_SIZE == 1``; give it the sharded arithmetic.

    Unsharded launches still go to vLLM's own implementation.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch
    from vllm.utils import cpu_triton_utils as cpu_tl

    from ..core.ownership import owned_slot_mapping

    orig = cpu_tl._compute_slot_mapping_kernel_impl

    @functools.wraps(orig)
    def compute_slot_mapping(num_tokens, max_num_tokens, query_start_loc,
                             positions, block_table, block_table_stride,
                             slot_mapping, KV_CACHE_BLOCK_SIZE,
                             TOTAL_CP_WORLD_SIZE=1, TOTAL_CP_RANK=0,
                             CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=-1,
                             BLOCK_SIZE=1024):
        if TOTAL_CP_WORLD_SIZE == 1:
            return orig(num_tokens, max_num_tokens, query_start_loc, positions,
                        block_table, block_table_stride, slot_mapping,
                        KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK,
                        CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID, BLOCK_SIZE)
        qsl = query_start_loc.long()
        num_reqs = qsl.numel() - 1
        counts = qsl[1:] - qsl[:-1]
        req = torch.repeat_interleave(torch.arange(num_reqs), counts)
        n = int(qsl[-1])
        table = block_table.view(-1, block_table_stride)
        slot_mapping[:n] = owned_slot_mapping(
            positions[:n], req, table, KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE,
            TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID)
        slot_mapping[n:max_num_tokens] = PAD_ID

    cpu_tl._compute_slot_mapping_kernel_impl = compute_slot_mapping
