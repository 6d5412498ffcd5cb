"""Run a :class:`~vllm_cp_kv.core.plan.MaterializationPlan` once per layer.

Steps, all with the plan frozen for the batch:

1. ``pack``: copy the owned blocks this rank sends into a contiguous buffer
   (``index_select`` here; Triton on GPU where it beats it).
2. ``gather``: one all-gather of the same size on every rank into the
   scratch full view, rank-major (``scratch[r * P + i]``).
3. ``write_new``: the tokens computed this step go into the scratch at
   ``plan.scratch_slot_mapping`` (every rank computed them), so the history
   gather never has to wait for this step's KV.

The persistent cache keeps only owned blocks; the scratch is temporary and
is reused across layers (see :class:`ScratchPool`).
"""

from __future__ import annotations

from typing import Callable

import torch

from .plan import MaterializationPlan

# all_gather_into(out, inp): out has shape [N * inp.shape[0], *inp.shape[1:]]
AllGatherFn = Callable[[torch.Tensor, torch.Tensor], None]


def pack(plan: MaterializationPlan, rank: int, kv_cache: torch.Tensor,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Owned blocks rank ``rank`` sends, ``[P, *kv_cache.shape[1:]]``.

    Args:
        kv_cache: ``[num_blocks, ...]`` this rank's persistent paged cache
            (any per-block layout: bf16 latent, fp8 + scales, indexer bytes).
    """
    ids = plan.send_block_ids[rank]
    if ids.device != kv_cache.device:
        ids = ids.to(kv_cache.device)
    if out is None:
        return kv_cache.index_select(0, ids)
    return torch.index_select(kv_cache, 0, ids, out=out)


def gather(plan: MaterializationPlan, rank: int, kv_cache: torch.Tensor,
           all_gather_into: AllGatherFn,
           scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Materialize the batch's full view of one layer's cache.

    Returns:
        ``[N * P, *kv_cache.shape[1:]]`` scratch; block ``plan.full_block_table
        [req, j]`` is logical block ``j`` of request ``req``.
    """
    local = pack(plan, rank, kv_cache)
    n = plan.spec.size * plan.blocks_per_rank
    if scratch is None:
        scratch = torch.empty((n, *kv_cache.shape[1:]), dtype=kv_cache.dtype,
                              device=kv_cache.device)
    elif scratch.shape[0] < n or scratch.shape[1:] != kv_cache.shape[1:]:
        raise ValueError(
            f"scratch of shape {tuple(scratch.shape)} cannot hold {n} blocks of "
            f"shape {tuple(kv_cache.shape[1:])}; re-plan or enlarge the pool.")
    else:
        scratch = scratch[:n]
    all_gather_into(scratch, local)
    return scratch


def write_new(scratch: torch.Tensor, block_size: int,
              scratch_slots: torch.Tensor, new_kv: torch.Tensor) -> None:
    """Write this step's new KV rows into the scratch.

    Args:
        scratch: ``[B, block_size, D]`` full view.
        scratch_slots: ``[T]`` from ``plan.scratch_slot_mapping``.
        new_kv: ``[T, D]`` rows in the cache's dtype.
    """
    flat = scratch.view(-1, *scratch.shape[2:])
    flat.index_copy_(0, scratch_slots.to(flat.device), new_kv.to(flat.dtype))


def all_gather_into_fn(group=None) -> AllGatherFn:
    """torch.distributed all-gather into a rank-major tensor (NCCL or gloo)."""
    import torch.distributed as dist

    def run(out: torch.Tensor, inp: torch.Tensor) -> None:
        if dist.get_backend(group) == "gloo":
            dist.all_gather(list(out.chunk(dist.get_world_size(group))), inp,
                            group=group)
        else:
            dist.all_gather_into_tensor(out, inp.contiguous(), group=group)

    return run


class ScratchPool:
    """A bounded scratch buffer reused by every layer of a step.

    ``capacity_blocks`` is fixed at startup and its bytes are taken out of the
    KV-cache budget, so materialization never allocates beyond it.
    """

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, plan: MaterializationPlan, like: torch.Tensor) -> torch.Tensor:
        n = plan.num_scratch_blocks
        if n > self.capacity_blocks:
            raise RuntimeError(
                f"batch needs {n} scratch blocks but the pool holds "
                f"{self.capacity_blocks}; the scheduler limits "
                "(max_num_seqs x max_model_len) were exceeded.")
        key = (tuple(like.shape[1:]), like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty((self.capacity_blocks, *like.shape[1:]),
                              dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:n]
