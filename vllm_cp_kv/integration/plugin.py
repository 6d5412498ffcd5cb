"""Plugin entry, and the one place where vLLM internals are rebound.

``register()`` runs in every vLLM process (``vllm.general_plugins`` entry
point). Every rebinding below is inert unless the running config has
``additional_config={"cp_kv": {"enable": true}}`` (item 7: unless the cp_kv
connector is configured); installed but not enabled, the plugin changes
nothing. Other modules build wrapped classes or functions and this module
installs them; nothing outside this module assigns to vLLM's modules,
classes or config.

=====  ===============================================  ==========  =========
no.    target (vLLM 0.32)                               installed   scope
=====  ===============================================  ==========  =========
1      ``EngineArgs.create_engine_config``              register    process
2      ``Platform.check_and_update_config``             register    process
3      ``Platform.update_block_size_for_backend``       register    process
4      ``attention.selector._cached_get_attn_backend``  register    process
5      ``cp_utils.check_attention_cp_compatibility``    register    process
       (and the model runners' imported names)
6      ``cpu_triton_utils._compute_slot_mapping_...``   register    CPU only
7      ``InputProcessor._validate_params``              register    process
8      ``get_dcp_group`` in vLLM's MLA modules and      ``with``    scoped
       ``parallel_config.decode_context_parallel_size`` block
9      V2 ``set_forward_context`` (model runner,        worker      PCP only
       graph capture, MTP drafter)
10     ``DeepseekV32IndexerCache.get_attn_backend`` and worker      sparse
       ``deepseek_v32.attention.sparse_attn_indexer``
11     ``triton_mla.decode_attention_fwd``              ``with``    scoped
                                                        block
12     the DCP fields vLLM's ``AttentionImplBase``      impl init,  per impl
       sets (``dcp_world_size``, ``dcp_rank``,          ``with``    or block
       ``total_cp_*``, ``need_to_return_lse_...``)      block
13     ``dcp_world_size`` of vLLM's MLA builders        ``with``    scoped
                                                        block
14     the drafter's ``SpecDecodeBaseProposer``:        worker      sharded
       ``build_per_group_and_layer_attn_metadata``,                 drafts
       ``_update_positions_dependent_metadata``
15     V2 ``DraftModelSpeculator._build_attn_metadata`` worker      sharded
                                                                    drafts
=====  ===============================================  ==========  =========

``REGISTRY`` below lists the same targets as data; ``vllm-cp-kv compat``
(``tools/compat.py``) resolves every one of them against the installed vLLM
and says what moved. "worker": installed by :func:`register_worker`, which
the sharded worker calls once when it starts.

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
   :func:`unsharded_view`).
9. Under PCP, vLLM 0.32's MoE layers route the PCP-gathered tokens but slice
   the rank-local padding mask (``topk_softmax ... is_padding size
   mismatch``); hand them the gathered mask the PCP manager recorded, in
   the manager's persistent buffer (``pcp.gathered_padding``). The same for
   the V2 runner's CUDA graph captures (a captured MoE layer reads that
   buffer at every replay) and the MTP drafter's forwards (each module
   imports ``set_forward_context`` by name; a DeepSeek MTP layer is MoE).
10. Sparse (DeepSeek-V3.2) models: the indexer cache's builder plans with the
    latent and sees the full view, and vLLM's indexer op runs on the full
    view (``sparse.py``).
11. TRITON_MLA's decode allocates its LSE in the model dtype; a bf16 LSE of
    an 8K context is off by up to 0.06, a 6% error in the weight of a
    rank's partial output in the LSE merge (measured on one H200: the debug
    check failed by that much). Around the shard-aware decode call only,
    the kernel writes a float32 LSE (:func:`float32_decode_lse`).
12. A sharded impl reports DCP off to its ``MLAAttention`` layer, so that
    the layer neither all-gathers queries nor merges (the impl reads a full
    view or merges itself: :func:`impl_reports_unsharded`); around the
    shard-aware decode call its kernel returns the LSE
    (:func:`impl_returns_decode_lse`).
13. vLLM's MLA builders size decode metadata and workspaces for
    ``num_heads * dcp_world_size`` query heads; the sharded builder (made
    with DCP off) sizes them for the gathered heads of the TP shard group
    within :func:`builder_heads_of`.
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
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass

from vllm.logger import init_logger

from .options import CPKVOptions, options_of

logger = init_logger("vllm." + __name__)  # under vLLM's log config
_INSTALLED = False
_WORKER_PATCHES: set[str] = set()
WORKER_CLS = "vllm_cp_kv.integration.worker.ShardedKVWorker"


def _enabled(vllm_config) -> bool:
    return vllm_config is not None and options_of(vllm_config).enable


def _sharding(vllm_config) -> bool:
    return _enabled(vllm_config) and options_of(vllm_config).kv_sharding


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
        from .checks import check_decode_backend, check_sparse_backend

        # choose as an unsharded run would (FLASH_ATTN_MLA_SPARSE declines DCP)
        unsharded = attn_selector_config._replace(use_dcp=False)
        with unsharded_view(vllm_config):
            cls = orig(backend, unsharded, *args, **kwargs)
        if attn_selector_config.use_sparse:
            check_sparse_backend(cls.get_name())
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


# -- 8 ----------------------------------------------------------------------
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
    FLASHMLA_SPARSE switches to vLLM's own PCP+DCP gather. The sharded
    kernels read a complete materialized view (prefill) or merge their
    partial decode outputs themselves, so all of them must initialize
    exactly as unsharded; the shard-aware decode then lowers the decode
    threshold itself (``decode.decode_threshold``: a short prefill reads
    the full view, as vLLM's DCP sends it to the prefill path).
    """
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


# -- 9 ----------------------------------------------------------------------
def patch_forward_context() -> None:
    """PCP + MoE: the gathered tokens' padding mask (item 9). Installed by the
    sharded worker when it builds vLLM's V2 runner."""
    if "forward_context" in _WORKER_PATCHES:
        return
    _WORKER_PATCHES.add("forward_context")
    from vllm.v1.worker.gpu import cudagraph_utils, model_runner
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar import speculator

    # the V2 runner's forwards, its CUDA graph captures (whose MoE layers keep
    # reading the mask's buffer at every replay) and its MTP drafter's (each
    # module imports the function by name): a DeepSeek MTP layer is MoE too
    for module in (model_runner, cudagraph_utils, speculator):
        module.set_forward_context = _gathered_padding(module.set_forward_context)


def _gathered_padding(orig):
    @functools.wraps(orig)
    def set_forward_context(attn_metadata, vllm_config, *args, is_padding=None,
                            **kwargs):
        pcp = vllm_config.parallel_config.prefill_context_parallel_size
        if is_padding is not None and pcp > 1 and _enabled(vllm_config):
            from .pcp import gathered_padding

            # the step's recorded mask; dummy and profile runs, and the
            # drafter's chained steps (item 15), are identical on every rank
            is_padding = gathered_padding(*_recorded_padding(attn_metadata), is_padding,
                                          pcp)
        return orig(attn_metadata, vllm_config, *args, is_padding=is_padding,
                    **kwargs)

    return set_forward_context


def _recorded_padding(attn_metadata) -> tuple[bool, object]:
    """Whether this forward's metadata carries a batch plan, and the padding
    masks the PCP manager recorded in its step (None where the forward is
    replicated on every rank)."""
    groups = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
    for group in groups:
        for md in (group or {}).values():
            made = getattr(md, "cp_kv", None)
            if made is not None:
                return True, made.batch.padding
    return False, None


# -- 10 ---------------------------------------------------------------------
def patch_sparse_indexer() -> None:
    """Sparse models (item 10). Installed by the sharded worker before vLLM
    builds the model (idempotent)."""
    if "sparse_indexer" in _WORKER_PATCHES:
        return
    _WORKER_PATCHES.add("sparse_indexer")
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.models.deepseek_v32 import attention

    from .sparse import sharded_indexer_backend, sharded_indexer_op

    attention.sparse_attn_indexer = sharded_indexer_op(attention.sparse_attn_indexer)
    orig_backend = DeepseekV32IndexerCache.get_attn_backend

    @functools.wraps(orig_backend)
    def get_attn_backend(self):
        return sharded_indexer_backend(orig_backend(self))

    DeepseekV32IndexerCache.get_attn_backend = get_attn_backend


# -- 11 ---------------------------------------------------------------------
@contextlib.contextmanager
def float32_decode_lse():
    """Within the block, vLLM's Triton MLA decode kernel writes its LSE into
    a float32 buffer (its reduction stores into any float buffer) instead
    of the model-dtype one ``TritonMLAImpl.forward_mqa`` allocates; the
    yielded dict holds it as "lse" after the call."""
    import torch
    from vllm.v1.attention.backends.mla import triton_mla

    orig = triton_mla.decode_attention_fwd
    box: dict = {}

    def decode_attention_fwd(q, k_buffer, v_buffer, o, lse, *args, **kwargs):
        box["lse"] = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
        return orig(q, k_buffer, v_buffer, o, box["lse"], *args, **kwargs)

    triton_mla.decode_attention_fwd = decode_attention_fwd
    try:
        yield box
    finally:
        triton_mla.decode_attention_fwd = orig


# -- 12, 13 -----------------------------------------------------------------
def impl_reports_unsharded(impl) -> None:
    """Item 12: the DCP fields vLLM's ``AttentionImplBase`` set on a sharded
    impl, as with DCP off (its layer must not gather queries or merge)."""
    impl.dcp_world_size, impl.dcp_rank = 1, 0
    impl.total_cp_world_size, impl.total_cp_rank = 1, 0
    impl.need_to_return_lse_for_decode = False


@contextlib.contextmanager
def impl_returns_decode_lse(impl):
    """Item 12: within the block, the impl's decode kernel returns its LSE."""
    impl.need_to_return_lse_for_decode = True
    try:
        yield
    finally:
        impl.need_to_return_lse_for_decode = False


@contextlib.contextmanager
def builder_heads_of(builder, ranks: int):
    """Item 13: within the block, vLLM's builder sizes decode metadata and
    workspaces for the heads of ``ranks`` ranks (``num_heads *
    dcp_world_size``; the sharded builder initialized with DCP off)."""
    saved, builder.dcp_world_size = builder.dcp_world_size, ranks
    try:
        yield
    finally:
        builder.dcp_world_size = saved


# -- 14 ---------------------------------------------------------------------
def patch_drafter() -> None:
    """Speculative decoding with sharded draft layers (item 14)."""
    if "drafter" in _WORKER_PATCHES:
        return
    _WORKER_PATCHES.add("drafter")
    import torch
    from vllm.v1.spec_decode import llm_base_proposer as lbp
    from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

    from ..core.ownership import owned_slot_mapping
    from .runtime import runtime_of_layers

    proposer = lbp.SpecDecodeBaseProposer

    def runtime_of(self):
        names = [n for group in getattr(self, "draft_attn_groups", None) or ()
                 for n in group.layer_names]
        runtime = runtime_of_layers(self.vllm_config, names)
        return runtime if runtime is not None and runtime.spec.size > 1 else None

    orig_build = proposer.build_per_group_and_layer_attn_metadata

    @functools.wraps(orig_build)
    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, *args, **kwargs):
        runtime = runtime_of(self)
        if runtime is not None:
            runtime.new_forward()
        return orig_build(self, common_attn_metadata, *args, **kwargs)

    orig_update = proposer._update_positions_dependent_metadata

    @functools.wraps(orig_update)
    def update_positions(self, positions, common_attn_metadata, batch_size,
                         input_batch_size, block_size):
        out = orig_update(self, positions, common_attn_metadata, batch_size,
                          input_batch_size, block_size)
        runtime = runtime_of(self)
        if runtime is not None:
            spec, slots = runtime.spec, common_attn_metadata.slot_mapping
            pos = (out[0] if self.uses_mrope else out)[:batch_size].long()
            rows = torch.arange(batch_size, device=pos.device)
            owned = owned_slot_mapping(pos, rows, common_attn_metadata.block_table_tensor,
                                       block_size, spec.size, spec.rank, spec.block_size,
                                       PADDING_SLOT_ID)
            # past max_model_len vLLM wrote the padding slot: keep it
            slots.copy_(torch.where(slots == PADDING_SLOT_ID, slots, owned))
        return out

    proposer.build_per_group_and_layer_attn_metadata = build_per_group_and_layer_attn_metadata
    proposer._update_positions_dependent_metadata = update_positions


def patch_v2_speculator() -> None:
    """Speculative decoding on the V2 runner (item 15)."""
    if "v2_speculator" in _WORKER_PATCHES:
        return
    _WORKER_PATCHES.add("v2_speculator")
    from vllm.v1.worker.gpu.spec_decode import speculator as sp

    from .runtime import runtime_of_layers

    cls = sp.DraftModelSpeculator
    orig = cls._build_attn_metadata

    @functools.wraps(orig)
    def _build_attn_metadata(self, *args, **kwargs):
        runtime = runtime_of_layers(self.vllm_config,
                                    sorted(getattr(self, "draft_attn_layer_names", ()) or ()))
        if runtime is not None:
            # a chained draft step: the whole batch on every rank, one
            # token a request, also under PCP (the draft prefill before it
            # ran on the target's split and metadata)
            runtime.new_forward(replicated=True)
        return orig(self, *args, **kwargs)

    cls._build_attn_metadata = _build_attn_metadata


def register_worker(vllm_config, v2_runner: bool) -> None:
    """Items 9, 10, 14 and 15 where they apply: called once by the sharded
    worker before vLLM builds its model runner and model."""
    if v2_runner:
        patch_forward_context()
    if _sharding(vllm_config) and getattr(vllm_config.model_config.hf_text_config,
                                          "index_topk", None):
        patch_sparse_indexer()
    if _sharding(vllm_config) and vllm_config.speculative_config is not None:
        patch_v2_speculator() if v2_runner else patch_drafter()


@dataclass(frozen=True)
class Rebinding:
    """One registry item: the vLLM names it rebinds or relies on.

    ``targets``: ``"module:qualified.name"`` each; ``params``: parameters
    of the first target the wrapper passes by name; ``assigns``: instance
    fields the first target (a class) must assign as ``self.<name> =`` in
    its source; ``optional``: targets that may be absent (other runners)."""

    no: int
    targets: tuple[str, ...]
    params: tuple[str, ...] = ()
    assigns: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()


_MLA = "vllm.model_executor.layers.attention.mla_attention"
REGISTRY = (
    Rebinding(1, ("vllm.engine.arg_utils:EngineArgs.create_engine_config",),
              params=("usage_context", "headless")),
    Rebinding(2, ("vllm.platforms.interface:Platform.check_and_update_config",
                  "vllm.config.parallel:ParallelConfig.worker_cls",
                  "vllm.config.cache:CacheConfig.enable_prefix_caching"),
              params=("vllm_config",)),
    Rebinding(3, ("vllm.platforms.interface:Platform.update_block_size_for_backend",
                  "vllm.config.parallel:ParallelConfig.cp_kv_cache_interleave_size"),
              params=("vllm_config",)),
    Rebinding(4, ("vllm.v1.attention.selector:_cached_get_attn_backend",
                  "vllm.v1.attention.selector:AttentionSelectorConfig.use_dcp",
                  "vllm.v1.attention.selector:AttentionSelectorConfig.use_mla",
                  "vllm.v1.attention.selector:AttentionSelectorConfig.use_sparse"),
              params=("backend", "attn_selector_config")),
    Rebinding(5, ("vllm.v1.worker.cp_utils:check_attention_cp_compatibility",),
              params=("vllm_config",),
              optional=("vllm.v1.worker.gpu_model_runner:check_attention_cp_compatibility",
                        "vllm.v1.worker.gpu.model_runner:check_attention_cp_compatibility")),
    Rebinding(6, ("vllm.utils.cpu_triton_utils:_compute_slot_mapping_kernel_impl",),
              params=("num_tokens", "max_num_tokens", "query_start_loc", "positions",
                      "block_table", "block_table_stride", "slot_mapping",
                      "KV_CACHE_BLOCK_SIZE", "TOTAL_CP_WORLD_SIZE", "TOTAL_CP_RANK",
                      "CP_KV_CACHE_INTERLEAVE_SIZE", "PAD_ID", "BLOCK_SIZE")),
    Rebinding(7, ("vllm.v1.engine.input_processor:InputProcessor._validate_params",
                  "vllm.exceptions:VLLMValidationError"),
              params=("params",)),
    Rebinding(8, (f"{_MLA}:get_dcp_group",
                  "vllm.model_executor.layers.attention.sparse_mla_attention:get_dcp_group",
                  "vllm.v1.attention.backends.mla.indexer:get_dcp_group",
                  "vllm.config.parallel:ParallelConfig.decode_context_parallel_size")),
    Rebinding(9, ("vllm.v1.worker.gpu.model_runner:set_forward_context",
                  "vllm.v1.worker.gpu.cudagraph_utils:set_forward_context",
                  "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator:"
                  "set_forward_context",
                  "vllm.v1.worker.gpu.model_runner:GPUModelRunner.pcp_manager_cls"),
              params=("attn_metadata", "vllm_config", "is_padding")),
    Rebinding(10, ("vllm.model_executor.models.deepseek_v2:"
                   "DeepseekV32IndexerCache.get_attn_backend",
                   "vllm.models.deepseek_v32.attention:sparse_attn_indexer")),
    Rebinding(11, ("vllm.v1.attention.backends.mla.triton_mla:decode_attention_fwd",),
              params=("q", "k_buffer", "v_buffer", "o", "lse")),
    Rebinding(12, ("vllm.v1.attention.backend:AttentionImplBase.__new__",),
              assigns=("dcp_world_size", "dcp_rank", "total_cp_world_size",
                       "total_cp_rank", "need_to_return_lse_for_decode")),
    Rebinding(13, (f"{_MLA}:MLACommonMetadataBuilder.__init__",
                   f"{_MLA}:MLACommonMetadataBuilder._build_decode"),
              assigns=("dcp_world_size",)),
    Rebinding(14, ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer."
                   "_update_positions_dependent_metadata",
                   "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer."
                   "build_per_group_and_layer_attn_metadata",
                   "vllm.v1.spec_decode.utils:PADDING_SLOT_ID"),
              params=("positions", "common_attn_metadata", "batch_size",
                      "input_batch_size", "block_size")),
    Rebinding(15, ("vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator",
                   "vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator."
                   "_build_attn_metadata",
                   "vllm.v1.attention.backend:AttentionMetadataBuilder."
                   "supports_draft_decode_metadata_update"),
              assigns=("draft_attn_layer_names",)),
)


def register() -> None:
    """``vllm.general_plugins`` entry point (idempotent): items 1-7."""
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
