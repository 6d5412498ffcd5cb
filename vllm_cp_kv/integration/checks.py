"""Startup checks: unsupported combinations fail with what to change.

Two stages, both run only when ``cp_kv.enable`` is set:

* :func:`check_engine_args` runs on the user's ``EngineArgs`` before vLLM
  builds its config, and derives the settings sharding needs
  (``decode_context_parallel_size``, prefix caching off).
* :func:`check_vllm_config` runs once the model config and the block size
  are known, and pins ``cp_kv_cache_interleave_size`` to the block size.

Every message is listed in docs/startup-checks.md; tests match them.
"""

from __future__ import annotations

from .options import CPKVOptions


class CPKVConfigError(ValueError):
    """A configuration the cp_kv plugin cannot run."""


def shard_group_size(tp: int, pcp: int) -> int:
    """The KV shard group: PCP when > 1 (with TP 1), else TP.

    Either way it becomes vLLM's DCP group (``decode_context_parallel_size``),
    which vLLM 0.32 lets span the TP axis, or the PCP axis when PCP > 1.
    """
    return pcp if pcp > 1 else tp


def _on_gpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def check_engine_args(args, options: CPKVOptions) -> None:
    """Validate and derive engine args in place (frontend, before VllmConfig)."""
    tp = args.tensor_parallel_size
    pcp = args.prefill_context_parallel_size
    if args.worker_cls not in ("auto", None):
        raise CPKVConfigError(
            f"cp_kv: a custom --worker-cls ({args.worker_cls}) cannot be combined "
            "with cp_kv, which installs its own worker; remove --worker-cls.")
    if not options.kv_sharding:
        return  # only the last-token gather: vLLM's own layout and checks
    if args.pipeline_parallel_size > 1:
        raise CPKVConfigError(
            "cp_kv: pipeline parallelism is not supported "
            f"(--pipeline-parallel-size={args.pipeline_parallel_size}); set it to 1 "
            "or disable cp_kv.")
    if pcp > 1 and tp > 1:
        raise CPKVConfigError(
            f"cp_kv: sharding with both --tensor-parallel-size={tp} and "
            f"--prefill-context-parallel-size={pcp} is not supported yet; the KV "
            "shard group is the PCP group with TP 1, or the TP group without PCP.")
    if _on_gpu() and not args.enforce_eager:
        # a captured graph would replay the gather of the capture batch's plan
        raise CPKVConfigError(
            "cp_kv: CUDA graphs are not supported with sharded KV yet (the "
            "full-view gather is planned per batch); add --enforce-eager or "
            "disable cp_kv.")
    if pcp > 1 and getattr(args, "kv_transfer_config", None):
        raise CPKVConfigError(
            "cp_kv: a KV connector (--kv-transfer-config) with sharding over the "
            "prefill-context-parallel group is not supported yet; shard the "
            "prefill instance over TP (--tensor-parallel-size N).")
    if pcp > 1 and not _on_gpu():
        raise CPKVConfigError(
            "cp_kv: sharding over the prefill-context-parallel group "
            f"(--prefill-context-parallel-size={pcp}) needs vLLM's GPU V2 model "
            "runner; on this platform shard over TP instead "
            "(--tensor-parallel-size N).")
    size = shard_group_size(tp, pcp)
    if size < 2:
        raise CPKVConfigError(
            "cp_kv: the KV shard group has size 1 (--tensor-parallel-size=1, "
            "--prefill-context-parallel-size=1), so there is nothing to shard; "
            "set --tensor-parallel-size 2 or more (or, on GPU, "
            "--prefill-context-parallel-size 2 or more), or disable cp_kv.")
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
    if args.enable_prefix_caching:
        raise CPKVConfigError(
            "cp_kv: prefix caching is not supported with sharded KV yet; "
            "add --no-enable-prefix-caching or disable cp_kv.")
    if args.speculative_config:
        raise CPKVConfigError(
            "cp_kv: speculative decoding is not supported with sharded KV; "
            "remove --speculative-config or disable cp_kv.")
    # Before vLLM's own DCP validation, which would reject a non-MLA model
    # with a message that does not mention cp_kv.
    check_model(args.create_model_config())
    args.decode_context_parallel_size = size
    args.enable_prefix_caching = False


SPARSE_BACKENDS = ("FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE")
# vLLM 0.32 runs both on vllm.models.deepseek_v32 (the code sparse.py patches)
SPARSE_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


def check_model(model_config) -> None:
    """The model must be MLA: dense (DeepSeek-V2/V3) or, on GPU, with
    DeepSeek-V3.2 sparse attention (its indexer cache is sharded too)."""
    if not model_config.use_mla:
        raise CPKVConfigError(
            f"cp_kv: model {model_config.model!r} does not use MLA; cp_kv shards "
            "the MLA latent KV cache (DeepSeek-V2/V3 style). Disable cp_kv for "
            "this model.")
    hf = model_config.hf_text_config
    if not getattr(hf, "index_topk", None):
        return
    archs = list(getattr(model_config, "architectures", None) or [])
    if not set(archs) & set(SPARSE_ARCHITECTURES):
        raise CPKVConfigError(
            f"cp_kv: sparse-attention architecture {archs} is not supported with "
            "sharded KV; only models on vLLM's DeepSeek-V3.2 attention are ("
            f"{', '.join(SPARSE_ARCHITECTURES)}). Disable cp_kv for this model.")
    if not _on_gpu():
        raise CPKVConfigError(
            "cp_kv: sparse-attention (DeepSeek-V3.2) models need a GPU (vLLM has "
            "no sparse MLA backend on this platform); disable cp_kv here.")


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
    check_model(vllm_config.model_config)
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        raise CPKVConfigError(
            "cp_kv: HiSparse (host-backed sparse KV) is not supported with sharded "
            "KV; remove the HiSparse config or disable cp_kv.")
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
