"""cp_kv under prefill context parallelism (vLLM's V2 GPU model runner).

:class:`CPKVPCPManager` extends the last-token manager with what sharding
over the PCP group needs, and :func:`make_runner_cls` selects it through
``GPUModelRunner.pcp_manager_cls`` (vLLM's hook for its PCP manager).

* **Layout.** The plugin sets DCP = PCP (vLLM 0.32 lets the DCP group span
  the PCP axis; with TP > 1, DCP = PCP x TP on vLLM 0.34), so vLLM's
  scheduler, block tables and slot mapping already use the sharded block
  layout. Each rank all-gathers every rank's new KV
  (vLLM's PCP path) and writes only the rows it owns.
* **Plan.** Ranks run different chunks of each prefill, but the full-view
  gather is a collective: each step the manager records the global batch
  (:class:`~vllm_cp_kv.integration.step.PCPStep`) so that every rank's
  metadata builder derives the same plan.
* **MoE padding** (vLLM 0.32 only: from 0.33 vLLM's manager gathers the
  mask itself, ``vllm_api.vllm_gathers_moe_padding``). Under PCP vLLM 0.32's
  MoE layers route the PCP-gathered tokens
  but read the rank-local padding mask (``topk_softmax ...
  is_padding size mismatch``); the manager writes each step's gathered mask
  (every rank's own padding, from vLLM's split) into a buffer of its own
  that outlives the step, as vLLM keeps its local mask (a captured MoE
  layer reads the same address at every replay), records it in the step's
  context (and on itself, for ``kv_sharding: false``), and the plugin hands
  it to the forward context (``worker_patches.patch_forward_context``,
  :func:`gathered_padding`).

Both records go into the open step's
:class:`~vllm_cp_kv.integration.step.BatchContext`, which the worker opens
for each ``execute_model`` and :class:`make_runner_cls`'s runner for each of
vLLM's dummy runs (``ShardRuntime.step``); the manager never opens or
closes one.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from vllm.v1.worker.gpu.pcp_manager import PCPManager

from . import vllm_api
from .last_token import LastTokenPCPManager, bound_manager_cls
from .options import options_of
from .step import PCPStep


def rank_token_counts(manager: PCPManager, num_scheduled, is_prefilling) -> list[int]:
    """Real (unpadded) tokens each PCP rank runs in this step (vLLM's split)."""
    return [sum(n for _, _, n in vllm_api.rank_chunks(manager, r, num_scheduled, is_prefilling))
            for r in range(manager.pcp_world_size)]


def gathered_padding_mask(counts: list[int], padded: int) -> torch.Tensor:
    """``[len(counts) * padded]`` bool, rank-major: True past each rank's tokens."""
    return (torch.arange(padded)[None, :] >= torch.tensor(counts)[:, None]).flatten()


_MANAGER: list = [lambda: None]  # the worker process's PCP manager (a weak reference)


def gathered_padding(planned: bool, recorded, is_padding: torch.Tensor, pcp: int
                     ) -> torch.Tensor:
    """The PCP-gathered padding mask of a forward whose local mask is
    ``is_padding``: the mask ``recorded`` for it (the step's, from vLLM's
    split), else, for forwards identical on every rank (dummy and capture
    runs, the drafter's chained steps), the local mask repeated; both in the
    PCP manager's persistent buffer. ``planned``: the forward's metadata
    carries a batch plan, whose step record is ``recorded`` (None: a
    replicated forward); without one (``kv_sharding: false``) the manager's
    own record of the step is used where it is this forward's mask."""
    manager = _MANAGER[0]()
    if not planned and manager is not None:
        recorded = manager.cp_kv_padding_of(is_padding)
    if recorded is not None:
        local, gathered = recorded
        if local.shape != is_padding.shape:
            raise RuntimeError(
                f"cp_kv: the PCP step recorded a padding mask of {local.shape} "
                f"tokens, the forward has {is_padding.shape}; stale step state.")
        return gathered
    if manager is None:  # no manager in this process (tests)
        return is_padding.repeat(pcp)
    return manager.cp_kv_write_padding(is_padding.expand(pcp, -1))


class CPKVPCPManager(LastTokenPCPManager):
    """vLLM's PCP manager with the last-token gather and KV sharding."""

    cp_kv_padding = None  # (local mask, gathered mask) of the last real step
    _cp_kv_padding_buffer = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _MANAGER[0] = weakref.ref(self)  # found by gathered_padding from capture on

    def cp_kv_write_padding(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` ([PCP, local tokens], any device) into the persistent
        gathered-mask buffer; returns its rank-major view."""
        n = mask.numel()
        buf = self._cp_kv_padding_buffer
        if buf is None:
            local = self.input_buffers.is_padding.shape[0]
            buf = self._cp_kv_padding_buffer = torch.ones(
                self.pcp_world_size * local, dtype=torch.bool, device=self.device)
        if n > buf.numel():
            raise RuntimeError(f"cp_kv: a PCP padding mask of {n} tokens exceeds the "
                               f"{buf.numel()} of the manager's buffer.")
        out = buf[:n]
        out.view(mask.shape).copy_(mask, non_blocking=True)
        return out

    def cp_kv_padding_of(self, is_padding: torch.Tensor):
        """The recorded masks if ``is_padding`` is the last step's local mask
        (the same storage and length; ``kv_sharding: false``, where no batch
        plan carries the record)."""
        rec = self.cp_kv_padding
        if rec is not None and rec[0].data_ptr() == is_padding.data_ptr() \
                and rec[0].shape == is_padding.shape:
            return rec
        return None

    @staticmethod
    def validate_config(vllm_config, supports_mm_inputs: bool) -> None:
        if not options_of(vllm_config).kv_sharding:
            return PCPManager.validate_config(vllm_config, supports_mm_inputs)
        # vLLM refuses PCP + DCP for dense MLA because its LSE-merging
        # prefill sizes collectives per rank (vllm#53573); sharded ranks
        # read a materialized full view instead, so run vLLM's other checks
        # as if DCP were off (plugin.py, item 8).
        with vllm_api.unsharded_view(vllm_config):
            PCPManager.validate_config(vllm_config, supports_mm_inputs)

    def partition_batch(self, input_batch, batch_desc):
        local = super().partition_batch(input_batch, batch_desc)
        g = self.global_batch
        n = g.num_reqs
        sched = np.asarray(g.num_scheduled_tokens)
        if not vllm_api.vllm_gathers_moe_padding():  # 0.32: the plugin gathers it
            padded = local.is_padding.shape[0]
            mask = gathered_padding_mask(rank_token_counts(self, sched, g.is_prefilling_np),
                                         padded)
            self.cp_kv_padding = (local.is_padding,
                                  self.cp_kv_write_padding(mask.view(-1, padded)))
        runtime = self.cp_kv_runtime()
        if runtime is None:  # vLLM's profile run, before the worker made it
            return local
        batch = runtime.batch()  # the open step (the worker's, or a dummy run's)
        prefilling = np.asarray(g.is_prefilling_np[:n], dtype=bool).copy()
        computed = np.asarray(g.num_computed_tokens_np[:n])
        segments = replicated = None
        if bool((prefilling & (computed > 0)).any()):
            # every rank's pieces, for the owned context path
            # (context.plan_owned_pcp): only a prefill over a cached context
            # may read it owned, so other steps (decodes) skip the split
            qsl = np.asarray(g.query_start_loc_np)
            replicated = np.asarray(vllm_api.replicated_requests(self, sched[:n], prefilling),
                                    dtype=bool)
            segments = [vllm_api.rank_segments(self, r, sched[:n], prefilling, qsl)
                        for r in range(self.pcp_world_size)]
        batch.pcp_step = PCPStep(
            keys=np.asarray(g.idx_mapping_np[:n]).copy(),
            seq_lens=(computed + sched[:n]).astype(np.int64),
            is_prefill=prefilling,
            row_keys=np.asarray(local.idx_mapping_np[: local.num_reqs]).copy(),
            query_lens=sched[:n].astype(np.int64), replicated=replicated,
            segments=segments, pcp=self.pcp_world_size, pcp_rank=self.pcp_rank)
        batch.padding = self.cp_kv_padding
        return local


def make_runner_cls():
    """vLLM's V2 GPU model runner selecting :class:`CPKVPCPManager`, and
    opening the runtime's step around vLLM's dummy runs (as the worker does
    around ``execute_model``), so that their builds share one batch."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    class CPKVModelRunner(GPUModelRunner):
        cp_kv_runtime = None  # the worker's ShardRuntime, once made

        @property
        def pcp_manager_cls(self):
            cls = bound_manager_cls(self, CPKVPCPManager)
            cls.narrow_gather = options_of(self.vllm_config).last_token_gather
            return cls

        def _dummy_run(self, *args, **kwargs):
            if self.cp_kv_runtime is None:
                return super()._dummy_run(*args, **kwargs)
            with self.cp_kv_runtime.step(dummy=True):
                return super()._dummy_run(*args, **kwargs)

    return CPKVModelRunner
