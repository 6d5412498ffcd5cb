"""Per-process state of a sharded worker: shard spec, group, scratch pool.

Built lazily on first use inside a worker, after vLLM has initialized its
distributed groups. The shard group is vLLM's DCP group, which the plugin
makes span the TP group, or the PCP group when PCP > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core import debug as core_debug
from ..core.materialize import AllGatherFn, ScratchPool, all_gather_into_fn, gather
from ..core.ownership import CPShardSpec
from ..core.plan import MaterializationPlan
from .options import debug_enabled

from vllm.logger import init_logger

logger = init_logger("vllm." + __name__)  # under vLLM's log config

_STATE: "ShardRuntime | None" = None
_SCRATCH_BLOCKS: int | None = None  # set by the worker from the KV budget
_PCP_STEP: "PCPStep | None" = None  # set by the PCP manager for one step


@dataclass(frozen=True)
class PCPStep:
    """What the metadata builder needs from the PCP manager for one step.

    Under PCP each rank runs its own chunks of the global batch; the gather
    plan must be the same on every rank, so it is made from the global batch
    (see :func:`vllm_cp_kv.core.plan.plan_split_requests`).
    """

    keys: np.ndarray  # [G] request-state index of each global request
    seq_lens: np.ndarray  # [G] tokens each request has after this step
    row_keys: np.ndarray  # [R_local] request-state index of each local row


def record_pcp_step(step: "PCPStep | None") -> None:
    global _PCP_STEP
    _PCP_STEP = step


def current_pcp_step() -> "PCPStep | None":
    return _PCP_STEP


def set_scratch_capacity(num_blocks: int) -> None:
    global _SCRATCH_BLOCKS
    _SCRATCH_BLOCKS = num_blocks


def make_all_gather_into(group) -> AllGatherFn:
    """All-gather into a preallocated rank-major tensor over a vLLM group."""
    comm = group.device_communicator
    if comm is not None and hasattr(comm, "dist_module"):
        # CPU: vLLM's shared-memory all-gather (or torch.distributed).
        dist_module = comm.dist_module
        device_group = group.device_group

        def run(out: torch.Tensor, inp: torch.Tensor) -> None:
            # the shared-memory all-gather does not allow an in-place input
            dist_module.all_gather_into_tensor(out, inp.clone(), group=device_group)
        return run
    return all_gather_into_fn(group.device_group)


class ShardRuntime:
    """What the sharded attention impls of one worker share."""

    def __init__(self, spec: CPShardSpec, group, scratch_blocks: int | None):
        self.spec = spec
        self.group = group
        self.all_gather_into = make_all_gather_into(group)
        self.pool = ScratchPool(scratch_blocks) if scratch_blocks else None
        self.debug = debug_enabled()
        if self.debug:
            logger.warning("cp_kv: VLLM_CP_KV_DEBUG=1: syncing invariant checks "
                           "are on (not for performance runs).")
        self._memo: tuple | None = None
        # (common metadata, whole, (plan, full table, reads)) of the batch
        # being built: every builder of a KV cache group shares the plan
        self.batch_plan: tuple | None = None
        self.bytes_gathered = 0  # running total, for logs and benchmarks

    def materialize(self, plan: MaterializationPlan,
                    kv_cache: torch.Tensor) -> torch.Tensor:
        """Full view of ``kv_cache`` for ``plan``; once per (plan, layer)."""
        key = (plan.epoch, kv_cache.data_ptr())
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        if self.debug:
            core_debug.check_plan_identical(plan, self.group.cpu_group)
            logger.info_once("cp_kv: debug invariants hold (plan coverage, "
                             "identical plans across ranks%s)." % (
                                 "" if current_pcp_step() else ", owned writes"))
        if self.pool is None and _SCRATCH_BLOCKS:
            # made before the worker sized the scratch (a profile run)
            self.pool = ScratchPool(_SCRATCH_BLOCKS)
        scratch = self.pool.get(plan, kv_cache) if self.pool is not None else None
        full = gather(plan, self.spec.rank, kv_cache, self.all_gather_into,
                      scratch=scratch)
        self.bytes_gathered += full.numel() * full.element_size()
        self._memo = (key, full)
        return full


def get_runtime(block_size: int) -> ShardRuntime:
    global _STATE
    if _STATE is None or _STATE.spec.block_size != block_size:
        from vllm.distributed.parallel_state import get_dcp_group

        group = get_dcp_group()
        spec = CPShardSpec(rank=group.rank_in_group, size=group.world_size,
                           block_size=block_size)
        _STATE = ShardRuntime(spec, group, _SCRATCH_BLOCKS)
    return _STATE
