"""The ``cp_kv`` opt-in: parsed from ``additional_config``.

``LLM(..., additional_config={"cp_kv": {"enable": True}})`` or
``vllm serve ... --additional-config '{"cp_kv": {"enable": true}}'``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

DEBUG_ENV = "VLLM_CP_KV_DEBUG"


def debug_enabled() -> bool:
    """``VLLM_CP_KV_DEBUG=1`` turns on syncing invariant checks."""
    return os.environ.get(DEBUG_ENV, "0").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class CPKVOptions:
    enable: bool = False
    # Upper bound of scratch blocks per layer; 0 = derive the exact worst case
    # from max_num_seqs, max_model_len and the KV budget.
    max_scratch_blocks: int = 0
    # Collect only sampled rows at the end of a PCP prefill (V2 GPU runner).
    last_token_gather: bool = True
    # Shard the KV cache. False keeps vLLM's layout and only installs the
    # last-token gather (for PCP > 1 until PCP sharding lands).
    kv_sharding: bool = True

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
        for key in ("enable", "last_token_gather", "kv_sharding"):
            if not isinstance(raw.get(key, False), bool):
                raise ValueError(
                    f"cp_kv.{key} must be true or false, got {raw[key]!r}.")
        return cls(**raw)


def options_of(vllm_config) -> CPKVOptions:
    return CPKVOptions.from_additional_config(
        getattr(vllm_config, "additional_config", None))
