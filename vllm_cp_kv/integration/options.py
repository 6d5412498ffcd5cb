"""The ``cp_kv`` opt-in: parsed from ``additional_config``.

``LLM(..., additional_config={"cp_kv": {"enable": True}})`` or
``vllm serve ... --additional-config '{"cp_kv": {"enable": true}}'``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

DEBUG_ENV = "VLLM_CP_KV_DEBUG"
DECODE_MODES = ("lse", "materialize")


def debug_enabled() -> bool:
    """``VLLM_CP_KV_DEBUG=1`` turns on syncing invariant checks."""
    return os.environ.get(DEBUG_ENV, "0").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class CPKVOptions:
    enable: bool = False
    # Cap of the scratch (blocks of one layer). 0: the chunked context's
    # workspace (dense models with the default decode) or, where the whole
    # view is read at once, its worst case from max_num_seqs, max_model_len
    # and the KV budget. A whole-view cap below one request of max_model_len
    # is refused when the worker starts (startup row scratch-cap).
    max_scratch_blocks: int = 0
    # Collect only sampled rows at the end of a PCP prefill (V2 GPU runner).
    last_token_gather: bool = True
    # Shard the KV cache. False keeps vLLM's layout and only installs the
    # last-token gather.
    kv_sharding: bool = True
    # Decode rows: "lse" attends to each rank's owned blocks and merges the
    # partial outputs by log-sum-exp (bytes per step independent of the
    # context); "materialize" gathers the full view as prefill does. Sparse
    # (DeepSeek-V3.2) models always materialize.
    decode: str = "lse"
    # Tokens of one layer that prefill rows read their cached context
    # through, chunk by chunk (each chunk gathered, attended to, merged by
    # LSE); 0 = 1% of the KV budget, raised to vLLM's own context chunk
    # (64K tokens, or max_model_len) where 2% of the budget holds it.
    # Sparse models, decode "materialize" and AMX_MLA read the whole view
    # at once (docs/design.md).
    workspace_tokens: int = 0
    # A prefill row's cached context (docs/context.md): "gathered" into the
    # full view; "owned": rows of at most owned_context_max_query new tokens
    # attend to each rank's owned context and merge by LSE (as decode rows
    # do); "auto": per batch, the cheaper for the group's measured latency
    # and bandwidth. Where a backend, cache or PCP cannot, always gathered.
    context_path: str = "auto"
    owned_context_max_query: int = 512
    # GPU: gather layer l + 1's full view on a side stream while layer l
    # computes (prefill materialization); reserves a second scratch buffer.
    prefetch: bool = False
    # Start an MLA architecture that has not run sharded with this release
    # (docs/models.md, status "unverified"); refused families stay refused.
    allow_unverified_model: bool = False

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> "CPKVOptions":
        raw = (additional_config or {}).get("cp_kv") if isinstance(
            additional_config, dict) else None
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(
                "additional_config['cp_kv'] must be a dict such as "
                f"{{'enable': true}}, got {raw!r}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"unknown cp_kv option(s) {unknown}; accepted: {sorted(known)}.")
        for key in ("enable", "last_token_gather", "kv_sharding", "prefetch",
                    "allow_unverified_model"):
            if not isinstance(raw.get(key, False), bool):
                raise ValueError(
                    f"cp_kv.{key} must be true or false, got {raw[key]!r}.")
        if raw.get("decode", "lse") not in DECODE_MODES:
            raise ValueError(
                f"cp_kv.decode must be one of {list(DECODE_MODES)}, got "
                f"{raw['decode']!r}.")
        from ..core.context import CONTEXT_PATHS

        if raw.get("context_path", "auto") not in CONTEXT_PATHS:
            raise ValueError(
                f"cp_kv.context_path must be one of {list(CONTEXT_PATHS)}, got "
                f"{raw['context_path']!r}.")
        for key in ("max_scratch_blocks", "workspace_tokens", "owned_context_max_query"):
            value = raw.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"cp_kv.{key} must be an integer >= 0, got {value!r}.")
        return cls(**raw)


def sparse_reads_owned_blocks(decode: str, pcp: int, kv_cache_dtype: str) -> bool:
    """The layout part of the shard-aware sparse path's rule (the release is
    ``checks.sparse_shard_aware``'s): the default ``cp_kv.decode``, and
    sharding over TP, or over PCP (and PCP x TP) with an ``fp8_ds_mla``
    cache. vLLM 0.34's PCP + DCP sparse layers are FLASHMLA_SPARSE's, whose
    prefill rows read the context through the fp8_ds_mla upconvert and which
    refuse any other cache by name (bf16; ``fp8``, which vLLM serves as
    fp8_ds_mla): PCP with those keeps the materializing path (``sparse.py``)."""
    return decode == "lse" and (pcp == 1 or str(kv_cache_dtype) == "fp8_ds_mla")


def options_of(vllm_config) -> CPKVOptions:
    return CPKVOptions.from_additional_config(
        getattr(vllm_config, "additional_config", None))


def enabled(vllm_config) -> bool:
    """cp_kv is on for this config (``additional_config.cp_kv.enable``)."""
    return vllm_config is not None and options_of(vllm_config).enable


def sharding(vllm_config) -> bool:
    """cp_kv shards the KV cache for this config (enabled, ``kv_sharding``)."""
    return enabled(vllm_config) and options_of(vllm_config).kv_sharding
