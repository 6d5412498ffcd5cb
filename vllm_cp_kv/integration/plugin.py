"""Plugin entry: installs the rebindings of vLLM's modules and classes.

``register()`` runs in every vLLM process (``vllm.general_plugins`` entry
point) and installs items 1-7 and 25; the sharded worker installs items 9, 10, 14
and 15 when it starts (``worker_patches.register_worker``); items 8 and
11-13 are scoped views, ``with`` blocks in ``vllm_api.py`` that the sharded
builders and impls enter. Every rebinding is inert unless the running
config has ``additional_config={"cp_kv": {"enable": true}}`` (item 7:
unless the cp_kv connector is configured); installed but not enabled, the
plugin changes nothing. Every private vLLM name the package touches,
these and the ones it overrides, calls or reads, is listed as data in
``vllm_api.REGISTRY`` (its docstring has the table), which ``vllm-cp-kv
compat`` resolves against the installed vLLM. The vLLM config fields the
plugin derives are set where they are derived: the startup checks
(``checks.py``: DCP size, interleave, rope, query replication, prefix
caching), item 2 here (the worker class), the worker (its KV budget) and
the PCP manager (none: it validates under a scoped view). Nothing in the
package imports this module.

Why each is needed:

1. Run the startup checks on the user's arguments and derive the settings
   sharding needs (``decode_context_parallel_size``, on CPU PyTorch's rope)
   before vLLM validates its config, so vLLM's own DCP checks still apply;
   in a ``vllm serve`` frontend, before the engine starts, give the
   workers' metric files a directory that ``/metrics`` collects
   (:func:`~vllm_cp_kv.integration.metrics.prepare_frontend`).
2. Once the platform has fixed the block size, pin
   ``cp_kv_cache_interleave_size`` to it (block ownership) and install
   :class:`~vllm_cp_kv.integration.worker.ShardedKVWorker`. On CPU with the
   CPU_MLA backend vLLM turns prefix caching off because that backend's
   prefill cannot read a cached context; the sharded backend reads it
   through the full view, so a sharded run keeps what the user asked for.
3. Workers finalize the block size for the chosen backend later (FLASHMLA
   raises it to 64): pin the interleave again.
4. Wrap the platform's MLA backend (dense or sparse) in the sharded backend
   (``backend.py``); the CPU platform ignores ``--attention-backend`` for
   custom backends, so registration alone would not reach it. The platform
   chooses as for an unsharded run.
5. vLLM demands an LSE-returning decode kernel under DCP because its DCP
   attention merges partial results; the sharded backend reads a full view
   or merges by itself, so its layers are exempt.
6. vLLM's C++ stand-in for the slot-mapping kernel asserts CP size 1; sharded
   launches get the same arithmetic in torch (unsharded ones are untouched).
7. Malformed ``kv_transfer_params`` for the cp_kv connector get an HTTP 400
   with the reason before they reach the engine (the connector module
   provides the check; inert for other connectors).
8. While a sharded builder or impl initializes, or a backend is chosen,
   vLLM's MLA code must see DCP off: it reads a full view (or merges by
   itself), and with DCP > 1 vLLM would pick other kernel paths (see
   ``vllm_api.unsharded_view``).
9. Under PCP, vLLM 0.32's MoE layers route the PCP-gathered tokens but slice
   the rank-local padding mask (``topk_softmax ... is_padding size
   mismatch``); hand them the gathered mask the PCP manager recorded, in
   the manager's persistent buffer (``pcp.gathered_padding``). The same for
   the V2 runner's CUDA graph captures (a captured MoE layer reads that
   buffer at every replay) and the MTP drafter's forwards (each module
   imports ``set_forward_context`` by name; a DeepSeek MTP layer is MoE).
10. Sparse (DeepSeek-V3.2) models. On vLLM 0.34 (GPU) the shard-aware path:
    vLLM's own DCP sparse layers run (the indexer scores the owned keys, the
    sparse kernel attends to the owned selected tokens, the layer merges by
    LSE), with the plugin's exchange of the ranks' top-k candidates in place
    of vLLM's CuteDSL-only ``_merge_dcp_topk_global`` and, for
    FLASH_ATTN_MLA_SPARSE, the kernel's LSE (``sparse_dcp.py``). On vLLM
    0.32, under PCP, or with ``cp_kv.decode = "materialize"``: the indexer cache's
    builder plans with the latent and sees the full view, and vLLM's indexer
    op runs on the full view (``sparse.py``).
11. TRITON_MLA's decode allocates its LSE in the model dtype; a bf16 LSE of
    an 8K context is off by up to 0.06, a 6% error in the weight of a
    rank's partial output in the LSE merge (measured on one H200: the debug
    check failed by that much). Around the shard-aware decode call only,
    the kernel writes a float32 LSE (``vllm_api.float32_decode_lse``).
12. A sharded impl reports DCP off to its ``MLAAttention`` layer, so that
    the layer neither all-gathers queries nor merges (the impl reads a full
    view or merges itself: ``vllm_api.impl_reports_unsharded``); around the
    shard-aware decode call its kernel returns the LSE
    (``vllm_api.impl_returns_decode_lse``).
13. vLLM's MLA builders size decode metadata and workspaces for
    ``num_heads * dcp_world_size`` query heads; the sharded builder (made
    with DCP off) sizes them for the gathered heads of the TP shard group
    within ``vllm_api.heads_of``.
14. Speculative decoding (MTP): vLLM's drafter runs its forwards in the
    step's ``sample_tokens``, each with a batch of its own, so each starts a
    new forward of the step (the plans of the last do not apply); and for
    its chained draft steps it computes the new tokens' slots as for an
    unsharded cache (``block_table[pos // block_size]``), which under the
    sharded layout would write the draft layer's KV to the wrong slot on
    every rank: those slots are recomputed owner-only with vLLM's DCP
    arithmetic (``core.ownership.owned_slot_mapping``, the same as for the
    target's tokens). Inert for drafters whose layers are not sharded.
15. Speculative decoding (MTP) on GPU, vLLM's V2 runner: its speculator
    builds the attention metadata of each chained draft step anew
    (``DraftModelSpeculator._build_attn_metadata``); each such build starts
    a new forward of the step, so the sharded builders plan that step's
    batch (one more token per request) instead of reusing the last plan.
    The draft prefill reuses the target's metadata and plan (same batch,
    same layout), and the V2 block tables already compute owner-only slots
    under the DCP layout. The sharded builders also decline vLLM's in-place
    update of draft decode metadata (``supports_draft_decode_metadata_
    update``, set in ``backend.ShardedBuilder``): an update in place would
    leave the step's plan stale. Under PCP the draft prefill runs on the
    target's split; the chained steps run the whole batch on every rank,
    so their new forward also drops the step's PCP split and padding masks.
    Inert for drafters whose layers are not sharded.
25. An engine core whose only work is the cp_kv connector's pending
    transfers steps in a tight loop (vLLM: a 1 ms pause), and after each
    step every worker spins for a second, which on a small machine starves
    the transfers and the processes beside it; it waits instead for its next
    client call, up to the connector's ``idle_step_s``, so that a request or
    an abort that arrives meanwhile is handled at once
    (``connector.scheduler.wait_for_client``).
"""

from __future__ import annotations

import functools
import importlib

from vllm.logger import init_logger

from .options import CPKVOptions, enabled, options_of, sharding

logger = init_logger("vllm." + __name__)  # under vLLM's log config
_INSTALLED = False
WORKER_CLS = "vllm_cp_kv.integration.worker.ShardedKVWorker"


_enabled, _sharding = enabled, sharding


# -- 1 ----------------------------------------------------------------------
def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config

    @functools.wraps(orig)
    def create_engine_config(self, usage_context=None, headless=False):
        options = CPKVOptions.from_additional_config(self.additional_config)
        if options.enable:
            from .checks import check_engine_args
            from .metrics import prepare_frontend

            check_engine_args(self, options)
            prepare_frontend(usage_context, headless)
        return orig(self, usage_context, headless)

    EngineArgs.create_engine_config = create_engine_config


# -- 2, 3 -------------------------------------------------------------------
def _patch_platform() -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    orig = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        cache = getattr(vllm_config, "cache_config", None)
        wanted = getattr(cache, "enable_prefix_caching", False)
        orig(cls, vllm_config)
        if _enabled(vllm_config):
            from .checks import check_vllm_config, keep_prefix_caching

            check_vllm_config(vllm_config, options_of(vllm_config))
            keep_prefix_caching(vllm_config, options_of(vllm_config), wanted)
            vllm_config.parallel_config.worker_cls = WORKER_CLS

    platform_cls.check_and_update_config = classmethod(check_and_update_config)

    orig_update = platform_cls.update_block_size_for_backend.__func__

    def update_block_size_for_backend(cls, vllm_config) -> None:
        orig_update(cls, vllm_config)
        if _enabled(vllm_config):
            from .checks import check_vllm_config

            check_vllm_config(vllm_config, options_of(vllm_config))

    platform_cls.update_block_size_for_backend = classmethod(update_block_size_for_backend)


# -- 4 ----------------------------------------------------------------------
def _patch_backend_selector() -> None:
    from vllm.v1.attention import selector

    orig = selector._cached_get_attn_backend

    @functools.wraps(orig)
    def cached_get_attn_backend(backend, attn_selector_config, *args, **kwargs):
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if not (attn_selector_config.use_mla and _sharding(vllm_config)):
            return orig(backend, attn_selector_config, *args, **kwargs)
        from vllm.platforms import current_platform

        from .backend import lse_decode_enabled, sharded_backend
        from .checks import check_decode_backend, check_fp8_backend, check_sparse_backend
        from .sparse_dcp import shard_aware_sparse, shard_aware_sparse_backend
        from .vllm_api import unsharded_view

        # choose as an unsharded run would (FLASH_ATTN_MLA_SPARSE declines DCP)
        unsharded = attn_selector_config._replace(use_dcp=False)
        with unsharded_view(vllm_config):
            cls = orig(backend, unsharded, *args, **kwargs)
        if attn_selector_config.use_sparse:
            check_sparse_backend(cls.get_name())
        check_fp8_backend(cls.get_name(), str(vllm_config.cache_config.cache_dtype),
                          attn_selector_config.use_sparse,
                          vllm_config.parallel_config.prefill_context_parallel_size)
        if attn_selector_config.use_sparse and shard_aware_sparse(vllm_config):
            # vLLM 0.34's own DCP sparse layers, with the plugin's top-k merge
            # (item 10) and FA3's LSE (sparse_dcp.py)
            return shard_aware_sparse_backend(cls)
        check_decode_backend(cls, current_platform.is_cuda_alike(),
                             lse_decode_enabled(vllm_config, attn_selector_config.use_sparse))
        return sharded_backend(cls)

    selector._cached_get_attn_backend = cached_get_attn_backend


# -- 5 ----------------------------------------------------------------------
def _patch_cp_compat_check() -> None:
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
                getattr(layer, "impl", None), "cp_kv_sharded", False)}
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


# -- 6 ----------------------------------------------------------------------
def _patch_cpu_slot_mapping() -> None:
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


# -- 7 ----------------------------------------------------------------------
def _patch_input_processor() -> None:
    """Why there: it runs in the frontend before the request reaches the
    engine, and vLLM maps its ``VLLMValidationError`` to HTTP 400 with the
    message; a connector has no other way to refuse a request with a reason."""
    from vllm.v1.engine.input_processor import InputProcessor

    from .connector.params import check_request_params

    orig = InputProcessor._validate_params
    if getattr(orig, "_cp_kv", False):
        return

    @functools.wraps(orig)
    def _validate_params(self, params, *args, **kwargs):
        result = orig(self, params, *args, **kwargs)
        check_request_params(self.vllm_config, params)
        return result

    _validate_params._cp_kv = True
    InputProcessor._validate_params = _validate_params


# -- 25 ---------------------------------------------------------------------
def _patch_engine_idle_wait() -> None:
    """Item 25: an engine core whose step ran no model while it still has
    work (only the cp_kv connector's transfers pending) waits for its next
    client call, up to the connector's ``idle_step_s``, instead of vLLM's
    1 ms pause (``connector.scheduler.wait_for_client`` says why). Inert
    without the cp_kv connector: other engines step exactly as vLLM's, and so
    do data-parallel engines (``DPEngineCoreProc``: a rank that waited would
    hold up the other ranks' collectives)."""
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

    orig = EngineCoreProc._process_engine_step

    @functools.wraps(orig)
    def _process_engine_step(self):
        executed = orig(self)
        wait = getattr(getattr(self.scheduler, "connector", None), "cp_kv_idle_wait_s", None)
        if wait is not None and not executed and self.scheduler.has_requests() \
                and not isinstance(self, DPEngineCoreProc):
            from .connector.scheduler import wait_for_client

            timeout = wait()
            if timeout > 0:  # 0: the workers have news to be told of: step now
                wait_for_client(self.input_queue, self._handle_client_request, timeout)
        return executed

    EngineCoreProc._process_engine_step = _process_engine_step


def register() -> None:
    """``vllm.general_plugins`` entry point (idempotent): items 1-7 and 25."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _patch_engine_args()
    _patch_platform()
    _patch_backend_selector()
    _patch_cp_compat_check()
    _patch_cpu_slot_mapping()
    _patch_input_processor()
    _patch_engine_idle_wait()
