"""What a sharded worker keeps: one :class:`ShardRuntime` per process and,
inside it, one :class:`BatchContext` per engine step.

* :class:`ShardRuntime` (per worker, made on first use after vLLM has set up
  its distributed groups): the shard spec, the shard group (vLLM's DCP
  group, which the plugin makes span the TP group, or the PCP group when
  PCP > 1), the scratch pool, the running statistics.
* :class:`BatchContext` (per batch, opened by the worker around
  ``execute_model`` and, under PCP, by the PCP manager's ``partition_batch``,
  closed at the end of the step or by ``restore_for_sampling``): what the
  batch's PCP manager, metadata builders and attention layers share: the
  global PCP batch, the padding mask of the PCP-gathered tokens, and the
  batch's :class:`BatchPlan` (shared by the latent's and the sparse
  indexer's builders). Builds outside a batch share nothing.
* :class:`BatchPlan` rides on the attention metadata (``metadata.cp_kv``):
  the materialization plan, the full-view table, the decode view, and the
  full views already gathered for this batch (one gather per layer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.logger import init_logger

from ..core import debug as core_debug
from ..core.decode import merge_by_lse, paged_attention_with_lse
from ..core.materialize import (AllGatherFn, LayerPrefetcher, ScratchPool,
                                all_gather_into_fn, gather)
from ..core.ownership import CPShardSpec
from ..core.plan import MaterializationPlan
from .options import debug_enabled

logger = init_logger("vllm." + __name__)  # under vLLM's log config


@dataclass(frozen=True)
class PCPStep:
    """What the metadata builder needs from the PCP manager for one step.

    Under PCP each rank runs its own chunks of the global batch; the gather
    plan must be the same on every rank, so it is made from the global batch
    (see :func:`vllm_cp_kv.core.plan.plan_split_requests`).
    """

    keys: np.ndarray  # [G] request-state index of each global request
    seq_lens: np.ndarray  # [G] tokens each request has after this step
    is_prefill: np.ndarray  # [G] bool: the request prefills in this step
    row_keys: np.ndarray  # [R_local] request-state index of each local row


@dataclass(frozen=True)
class DecodeView:
    """Decode rows' view of the persistent cache (shard-aware decode), one
    row per query token (``core.decode.query_token_lens``).

    ``block_table`` is vLLM's shared virtual table (on this rank, column
    ``c`` holds logical block ``c * N + rank``), its row repeated for each
    query token of a request, and ``local_lens`` the tokens this rank owns
    that each query token sees: together a paged sequence of exactly this
    rank's visible tokens per query token.
    """

    block_table: torch.Tensor  # [T, C]
    local_lens: torch.Tensor  # [T] int32
    max_local_len: int  # host, an upper bound
    gather_heads: bool  # TP shard group: this rank's queries hold H / N heads
    query_start_loc: torch.Tensor  # [T + 1] int32 on the device: one query per row
    query_start_loc_cpu: torch.Tensor  # [T + 1] int32
    multi_query: bool = False  # some request row had several query tokens


@dataclass
class BatchPlan:
    """One batch's reading plan, attached to its attention metadata."""

    plan: MaterializationPlan | None  # None: nothing to gather
    full_table: torch.Tensor | None  # rows' full-view block table
    reads: bool  # host flag, identical on every rank: gather for prefills
    num_decodes: int = 0
    decode: DecodeView | None = None  # set when decode rows use the LSE path
    # set when the plugin runs the prefill rows itself over the full view
    # (CPU_MLA with a cached context): (row, query start, query len, seq len)
    prefill_rows: list | None = None
    views: dict = field(default_factory=dict)  # cache data_ptr -> full view
    build_decode: object = None  # debug: the builder's _build_decode (vLLM's kernel on a view)
    prefetcher: object = None  # LayerPrefetcher of this batch (GPU, cp_kv.prefetch)


@dataclass
class BatchContext:
    """Shared state of one engine step (see the module docstring)."""

    pcp_step: PCPStep | None = None
    padding: tuple | None = None  # (local padding mask, PCP-gathered mask)
    plans: dict = field(default_factory=dict)  # whole-sequence flag -> BatchPlan
    has_prefill: bool = False  # for the statistics: a prefill or a decode step
    debug_decode_checked: bool = False


@dataclass
class ShardStats:
    """Running totals of one worker (bytes this rank received from the
    other ranks of the shard group)."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_bytes: int = 0  # materialization in steps with a prefill row
    decode_bytes: int = 0  # materialization or LSE exchange in decode-only steps
    last_step_bytes: int = 0
    decode_step_bytes: list = field(default_factory=list)  # the last 256 decode steps
    multi_query_decode_steps: int = 0  # steps whose decode rows had several query tokens
    # VLLM_CP_KV_DEBUG: the merged decode's largest error against float32
    # attention over the full view, and vLLM's own kernel's on that view
    debug_decode_checks: int = 0
    debug_decode_err_max: float = 0.0
    debug_unsharded_err_max: float | None = None

    def note_decode_check(self, err: float, unsharded: float | None) -> None:
        self.debug_decode_checks += 1
        self.debug_decode_err_max = max(self.debug_decode_err_max, err)
        if unsharded is not None:
            self.debug_unsharded_err_max = max(self.debug_unsharded_err_max or 0.0, unsharded)

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, list) else v)
                for k, v in self.__dict__.items()}


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
        self.scratch_blocks = scratch_blocks
        self.pool = ScratchPool(scratch_blocks) if scratch_blocks else None
        self.debug = debug_enabled()
        if self.debug:
            logger.warning("cp_kv: VLLM_CP_KV_DEBUG=1: syncing invariant checks "
                           "are on (not for performance runs).")
        self.stats = ShardStats()
        self.metrics = None  # ShardMetrics, attached by the worker
        # layer-ahead prefetch (cp_kv.prefetch, GPU): the latent caches in
        # layer order, registered by the worker
        self.prefetch = False
        self.layer_of: dict[int, int] = {}
        self.layer_caches: list[torch.Tensor] = []
        self._batch: BatchContext | None = None
        self._step_bytes = 0

    # ---- per-batch context ---------------------------------------------
    @contextlib.contextmanager
    def step(self):
        """One ``execute_model`` (the worker): a fresh :class:`BatchContext`,
        closed afterwards, and the step's bytes in the statistics."""
        batch = self.new_batch()
        self._step_bytes = 0
        try:
            yield batch
        finally:
            if self._batch is not None and (self._batch.plans or self._step_bytes):
                self._count_step(self._batch)
            self.end_batch()

    def new_batch(self) -> BatchContext:
        """Start a batch: the worker's step, or under PCP the manager's
        ``partition_batch`` (which also runs for vLLM's dummy batches)."""
        self._batch = BatchContext()
        return self._batch

    def end_batch(self) -> None:
        self._batch = None

    def batch(self) -> BatchContext:
        """The open batch's context, or a throwaway one: builds outside a
        batch (profile and dummy runs without PCP) share nothing."""
        return self._batch if self._batch is not None else BatchContext()

    def reset_stats(self) -> None:
        self.stats = ShardStats()

    def _count_step(self, batch: BatchContext) -> None:
        s, n, has_prefill = self.stats, self._step_bytes, batch.has_prefill
        s.multi_query_decode_steps += any(p.decode is not None and p.decode.multi_query
                                          for p in batch.plans.values())
        s.last_step_bytes = n
        if has_prefill:
            s.prefill_steps += 1
            s.prefill_bytes += n
        else:
            s.decode_steps += 1
            s.decode_bytes += n
            s.decode_step_bytes = (s.decode_step_bytes + [n])[-256:]
        if self.metrics is not None:
            self.metrics.observe_step("prefill" if has_prefill else "decode", n)

    def _received(self, gathered: torch.Tensor) -> None:
        """Count what an all-gather brought from the other ranks."""
        total = gathered.numel() * gathered.element_size()
        self._step_bytes += total - total // self.spec.size

    # ---- materialization ------------------------------------------------
    def materialize(self, batch_plan: BatchPlan, kv_cache: torch.Tensor,
                    for_check: bool = False) -> torch.Tensor:
        """Full view of ``kv_cache`` for the batch; gathered once per layer.
        ``for_check``: a debug check's own view (a fresh buffer, not counted
        in the statistics)."""
        key = kv_cache.data_ptr()
        full = batch_plan.views.get(key)
        if full is not None:
            return full
        plan = batch_plan.plan
        if self.debug and not for_check:
            core_debug.check_plan_identical(plan, self.group.cpu_group)
            logger.info_once("cp_kv: debug invariants hold (identical plans "
                             "across ranks).")
        if self.prefetch and not for_check and key in self.layer_of:
            return self._prefetched(batch_plan, kv_cache)
        scratch = None if for_check or self.pool is None else self.pool.get(plan, kv_cache)
        full = gather(plan, self.spec.rank, kv_cache, self.all_gather_into,
                      scratch=scratch)
        if not for_check:
            self._received(full)
        batch_plan.views[key] = full
        return full

    def register_layers(self, caches: list[torch.Tensor]) -> None:
        """The latent caches in layer order (for the layer-ahead prefetch)."""
        self.layer_caches = list(caches)
        self.layer_of = {c.data_ptr(): i for i, c in enumerate(self.layer_caches)}

    def _prefetched(self, batch_plan: BatchPlan, kv_cache: torch.Tensor) -> torch.Tensor:
        """Layer l's view, gathered ahead on a side stream while layer l - 1
        computed; start layer l + 1's gather now (two scratch buffers).

        Every rank reaches layer l in the same order, so the side stream's
        collectives (on the shard group's communicator) match across ranks.
        """
        layer = self.layer_of[kv_cache.data_ptr()]
        pf = batch_plan.prefetcher
        if pf is None:
            buffers = [self.pool.get(batch_plan.plan, kv_cache, slot=k) for k in (0, 1)]
            pf = batch_plan.prefetcher = LayerPrefetcher(
                batch_plan.plan, self.spec.rank, self.all_gather_into, buffers)
        if layer not in pf.views:
            pf.start(layer, kv_cache)
        if layer > 0:
            pf.release(layer - 1)  # layer l - 1's attention is queued before this
        if layer + 1 < len(self.layer_caches):
            pf.start(layer + 1, self.layer_caches[layer + 1])
        full = pf.wait(layer)
        self._received(full)
        batch_plan.views[kv_cache.data_ptr()] = full
        return full

    # ---- shard-aware decode (CPU: torch attention with LSE) --------------
    def gather_heads(self, q: torch.Tensor, count: bool = True) -> torch.Tensor:
        """``[B, H/N, D]`` -> ``[B, H, D]`` over the shard group (TP)."""
        q = self.group.all_gather(q.contiguous(), dim=1)
        if count:
            self._received(q)
        return q

    def combine(self, out: torch.Tensor, lse: torch.Tensor,
                split_heads: bool) -> torch.Tensor:
        """Merge every rank's partial output by LSE (torch; CPU): one
        all-gather of output and LSE packed as bytes, then the merge of the
        heads this rank returns (``split_heads``: its ``H / N``, TP; else
        all)."""
        _, h, d = out.shape
        width = d * out.element_size()
        packed = torch.cat([out.contiguous().view(torch.uint8),
                            lse.float().unsqueeze(-1).contiguous().view(torch.uint8)], dim=-1)
        parts = self.group.all_gather(packed.unsqueeze(0), dim=0)  # [N, B, H, bytes]
        self._received(parts)
        if split_heads:
            h //= self.spec.size
            parts = parts[:, :, self.spec.rank * h:(self.spec.rank + 1) * h]
        outs = parts[..., :width].contiguous().view(out.dtype)
        lses = parts[..., width:].contiguous().view(torch.float32).squeeze(-1)
        return merge_by_lse(outs, lses)

    def count_merge(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Bytes of vLLM's merge (GPU): the LSE all-gather and the outputs'
        reduce-scatter (what this rank receives of each)."""
        n = self.spec.size
        self._step_bytes += lse.numel() * lse.element_size() * (n - 1)
        self._step_bytes += out.numel() * out.element_size() * (n - 1) // n

    def lse_decode_torch(self, q: torch.Tensor, kv_cache: torch.Tensor,
                         view: DecodeView, scale: float, v_dim: int) -> torch.Tensor:
        """Decode rows: partial attention over the owned blocks, merged.
        Partial outputs cross ranks in the kernel's compute type (float64
        for float32 models, else the model's 16-bit type) and the merge
        accumulates in float32 or wider."""
        if view.gather_heads:
            q = self.gather_heads(q)
        out, lse = paged_attention_with_lse(q, kv_cache, view.block_table,
                                            view.local_lens, scale, v_dim)
        return self.combine(out, lse, view.gather_heads).to(q.dtype)


_STATE: ShardRuntime | None = None
_SCRATCH_BLOCKS: int | None = None  # set by the worker from the KV budget


def set_scratch_capacity(num_blocks: int) -> None:
    """Scratch blocks the worker reserved (before or after the runtime exists:
    vLLM's profile run may build it first)."""
    global _SCRATCH_BLOCKS
    _SCRATCH_BLOCKS = num_blocks
    if _STATE is not None and _STATE.pool is None:
        _STATE.pool = ScratchPool(num_blocks)
        _STATE.scratch_blocks = num_blocks


def get_runtime(block_size: int) -> ShardRuntime:
    """This worker's runtime (built on first use; rebuilt if the block size
    changed, which vLLM finalizes per attention backend in the worker)."""
    global _STATE
    if _STATE is None or _STATE.spec.block_size != block_size:
        from vllm.distributed.parallel_state import get_dcp_group

        group = get_dcp_group()
        spec = CPShardSpec(rank=group.rank_in_group, size=group.world_size,
                           block_size=block_size)
        _STATE = ShardRuntime(spec, group, _SCRATCH_BLOCKS)
    return _STATE


def current_runtime() -> ShardRuntime | None:
    """The runtime if one was built in this process (no side effects)."""
    return _STATE
