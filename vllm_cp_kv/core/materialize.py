"""Run a :class:`~vllm_cp_kv.core.plan.MaterializationPlan` once per layer.

Steps, all with the plan frozen for the batch:

1. ``pack``: copy the owned blocks this rank sends into its own slice of
   the scratch (``index_select`` of whole blocks: the cache is opaque bytes
   per block, so one copy serves every layout: the bf16 latent, the fp8
   latent with scales, the sparse indexer's keys and scales; on H200 it
   reaches 88% of the device-to-device copy bandwidth).
2. ``gather``: one all-gather of the same size on every rank into the
   scratch full view, rank-major (``scratch[r * P + i]``).

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
        out = kv_cache.new_empty((ids.numel(), *kv_cache.shape[1:]))
    return torch.index_select(kv_cache, 0, ids, out=out)


def gather(plan: MaterializationPlan, rank: int, kv_cache: torch.Tensor,
           all_gather_into: AllGatherFn,
           scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Materialize the batch's full view of one layer's cache.

    Returns:
        ``[N * P, *kv_cache.shape[1:]]`` scratch; block ``plan.full_block_table
        [req, j]`` is logical block ``j`` of request ``req``.
    """
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
    # pack straight into this rank's own slice: NCCL gathers in place
    per_rank = plan.blocks_per_rank
    local = scratch[rank * per_rank:(rank + 1) * per_rank]
    pack(plan, rank, kv_cache, out=local)
    all_gather_into(scratch, local)
    return scratch


def all_gather_into_fn(group=None) -> AllGatherFn:
    """torch.distributed all-gather into a rank-major tensor (NCCL or gloo)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":  # no all_gather_into_tensor there
        size = dist.get_world_size(group)

        def run_gloo(out: torch.Tensor, inp: torch.Tensor) -> None:
            parts = list(out.chunk(size))
            inp = inp.clone() if any(p.data_ptr() == inp.data_ptr() for p in parts) else inp
            dist.all_gather(parts, inp, group=group)
        return run_gloo

    def run(out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.all_gather_into_tensor(out, inp, group=group)
    return run


class ScratchPool:
    """A bounded scratch buffer reused by every layer of a step.

    ``capacity_blocks`` is fixed at startup (at least one block per rank, and
    for a whole-view scratch one request of ``max_model_len``: checked when
    the worker sizes it) and its bytes are taken out of the KV-cache budget,
    so materialization never allocates beyond it; a batch that would need
    more raises (a chunked context plans chunks that fit instead).
    """

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, plan: MaterializationPlan, like: torch.Tensor,
            slot: int = 0) -> torch.Tensor:
        """``slot``: 0, or 1 for the second buffer of a layer-ahead prefetch
        (both counted in the budget by whoever sized the pool)."""
        n = plan.num_scratch_blocks
        if n > self.capacity_blocks:
            raise RuntimeError(
                f"batch needs {n} scratch blocks but the pool holds "
                f"{self.capacity_blocks}; the scheduler limits "
                "(max_num_seqs x max_model_len) were exceeded.")
        return self.buffer(like, slot)[:n]

    def buffer(self, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """The whole buffer of ``slot`` for caches shaped like ``like``."""
        key = (tuple(like.shape[1:]), like.dtype, like.device, slot)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty((self.capacity_blocks, *like.shape[1:]),
                              dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf


class LayerPrefetcher:
    """Gather the next full view on a side stream while the current one is
    attended to (GPU). Two scratch buffers alternate.

    Items are numbered in the order the main stream reads them (one per
    layer; with a chunked context ``layer * chunks + chunk``); item ``i``
    fills buffer ``i % 2``. Lifecycle per batch, on every rank (collectives
    must match)::

        pf = LayerPrefetcher(rank, all_gather_into, buffers)
        pf.start(0, plan_0, cache_0)
        for i in range(items):
            if i + 1 < items:
                pf.start(i + 1, plan_i1, cache_i1)   # overlaps item i
            view = pf.wait(i)                        # main stream waits here only
            ... attention on ``view`` ...
            pf.release(i)                            # buffer may be refilled

    ``buffers`` are two tensors of at least each plan's
    ``num_scratch_blocks`` blocks. A prefetched view holds what the cache
    held when :meth:`start` ran: plan it for the cached context only
    (prefill rows read their new tokens from the projections).
    """

    def __init__(self, rank: int, all_gather_into: AllGatherFn,
                 buffers: list[torch.Tensor], stream: "torch.cuda.Stream | None" = None):
        if len(buffers) != 2:
            raise ValueError(f"double buffering needs two buffers, got {len(buffers)}")
        self.rank, self.all_gather_into = rank, all_gather_into
        self.buffers = buffers
        self.stream = stream or torch.cuda.Stream(device=buffers[0].device)
        self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        self.free = [None, None]  # events: attention done with the buffer
        self.views: dict[int, torch.Tensor] = {}

    def start(self, item: int, plan: MaterializationPlan, kv_cache: torch.Tensor) -> None:
        k = item % 2
        main = torch.cuda.current_stream(kv_cache.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(main)  # the cache and ids are ready
            if self.free[k] is not None:
                self.stream.wait_event(self.free[k])
            self.views[item] = gather(plan, self.rank, kv_cache, self.all_gather_into,
                                      scratch=self.buffers[k])
            self.ready[k].record(self.stream)

    def wait(self, item: int) -> torch.Tensor:
        torch.cuda.current_stream().wait_event(self.ready[item % 2])
        return self.views.pop(item)

    def release(self, item: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        self.free[item % 2] = event
