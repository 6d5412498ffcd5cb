"""Last-token gather for vLLM's V2 model runner (prefill context parallel).

:class:`LastTokenPCPManager` subclasses vLLM's ``PCPManager``; the runner
selects it through ``GPUModelRunner.pcp_manager_cls`` (vLLM's own hook for
this). Per batch it decides between

* **narrow**: collect only the sampled rows (``cp_size x rows x hidden``,
  one all-gather; :mod:`vllm_cp_kv.core.last_token`), and
* **full**: vLLM's own all-gather of every token, needed when any request
  asks for prompt logprobs, with speculative decoding (drafters consume the
  target's hidden states), or when hidden states are captured (aux hidden
  states, EAGLE-3).

The decision depends only on the batch and the config, which are identical
on every rank, so all ranks take the same path. The runner that selects
this manager is in :mod:`vllm_cp_kv.integration.pcp`.

On the narrow path the returned tensor keeps the full path's shape
(``[num_tokens, hidden]``) with only the sampled rows written; the sampler
reads exactly those rows. With ``VLLM_CP_KV_DEBUG=1`` the other rows are NaN
so a reader of unsampled rows shows up at once.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.distributed.parallel_state import get_pcp_group
from vllm.logger import init_logger
from vllm.v1.worker.gpu.pcp_manager import PCPManager

from ..core.last_token import (full_bytes, gather_sampled_rows, narrow_bytes,
                               plan_sampled_rows)
from . import vllm_api
from .options import debug_enabled
from .runtime import make_all_gather_into

logger = init_logger("vllm." + __name__)  # under vLLM's log config


class LastTokenPCPManager(PCPManager):
    """``PCPManager`` whose ``restore_for_sampling`` moves only sampled rows."""

    narrow_gather = True  # cp_kv.last_token_gather

    def cp_kv_runtime(self):
        """The worker's ShardRuntime (its metrics), where the runner has one."""
        return None

    def full_gather_reason(self, input_batch, aux_hidden_states) -> str | None:
        """Why this batch needs every row (``None``: narrow is enough).

        The runner-bound subclass adds prompt logprobs and speculative
        decoding; here only what the manager itself sees.
        """
        if aux_hidden_states is not None:
            return "hidden-state capture"
        return None

    def restore_for_sampling(self, hidden_states: torch.Tensor,
                             aux_hidden_states: list[torch.Tensor] | None):
        batch = self.global_batch
        reason = self.full_gather_reason(batch, aux_hidden_states)
        restore_idx = vllm_api.hidden_restore_idx(self)
        group = get_pcp_group()
        size, hidden = group.world_size, hidden_states.shape[1]
        elem = hidden_states.element_size()
        full = full_bytes(size, hidden_states.shape[0], hidden, elem)
        if reason is None and not self.narrow_gather:
            reason = "last_token_gather is off"
        if reason is not None or restore_idx is None:
            self._record(batch, "full", full, full)
            logger.debug("cp_kv last-token gather: full path (%s), %d bytes",
                         reason or "no PCP layout", full)
            return super().restore_for_sampling(hidden_states, aux_hidden_states)
        logits_indices = batch.logits_indices
        plan = plan_sampled_rows(restore_idx, logits_indices, hidden_states.shape[0])
        rows = gather_sampled_rows(plan, group.rank_in_group, size, hidden_states,
                                   make_all_gather_into(group))
        out = hidden_states.new_empty((restore_idx.shape[0], hidden))
        if debug_enabled():
            out.fill_(float("nan"))
        out[logits_indices] = rows
        narrow = narrow_bytes(size, plan.num_rows, hidden, elem)
        self._record(batch, "narrow", narrow, full)
        # prefill steps at info level (the saving the feature is for)
        log = logger.info if getattr(batch, "has_prefill", False) else logger.debug
        log("cp_kv last-token gather: %d bytes instead of %d (saved %d) in this "
            "step", narrow, full, full - narrow)
        return out, aux_hidden_states, batch

    def _record(self, batch, path: str, moved: int, full: int) -> None:
        """Last step's path and bytes; running totals in ``cp_kv_stats``."""
        self.last_path, self.last_bytes = path, moved
        stats = self.__dict__.setdefault("cp_kv_stats", {
            "narrow_steps": 0, "full_steps": 0, "bytes": 0, "full_path_bytes": 0,
            "prefill_steps": 0, "prefill_bytes_saved": 0})
        stats[f"{path}_steps"] += 1
        stats["bytes"] += moved
        stats["full_path_bytes"] += full
        if getattr(batch, "has_prefill", False):
            stats["prefill_steps"] += 1
            stats["prefill_bytes_saved"] += full - moved
        runtime = self.cp_kv_runtime()
        if runtime is not None and runtime.metrics is not None:
            runtime.metrics.observe_last_token(full - moved)


def runner_full_gather_reason(runner, input_batch) -> str | None:
    """Reasons only the model runner can see."""
    worker = getattr(runner, "prompt_logprobs_worker", None)
    if worker is not None and np.any(
            worker.uses_prompt_logprobs[input_batch.idx_mapping_np]):
        return "prompt logprobs"
    if getattr(runner, "speculator", None) is not None:
        return "speculative decoding"
    return None


def bound_manager_cls(runner, base: type | None = None) -> type:
    """A manager class that also asks ``runner`` (prompt logprobs, drafts)."""

    class RunnerBoundPCPManager(base or LastTokenPCPManager):
        def full_gather_reason(self, input_batch, aux_hidden_states):
            return (super().full_gather_reason(input_batch, aux_hidden_states)
                    or runner_full_gather_reason(runner, input_batch))

        def cp_kv_runtime(self):
            return getattr(runner, "cp_kv_runtime", None)

    return RunnerBoundPCPManager
