"""What a sharded worker keeps: one :class:`ShardRuntime`, made by the worker
once the KV cache is known and bound to the model's attention layers.

It holds the shard geometry, the shard group (vLLM's DCP group, which the
plugin makes span the TP group, the PCP group, or both), the head group
(the ranks the query heads split over: the shard group under TP, vLLM's TP
group under PCP x TP), the scratch
pool, the running statistics, and the one open
:class:`~vllm_cp_kv.integration.step.BatchContext` of the engine step
(:meth:`ShardRuntime.step`). Builders reach it through their layers
(:func:`runtime_of_layers`), impls through their binding, the sparse
indexer op through its layer in vLLM's forward context; the batch plan
holds none: no module global.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from vllm.logger import init_logger

from ..core import debug as core_debug
from ..core.materialize import (AllGatherFn, LayerPrefetcher, ScratchPool,
                                all_gather_into_fn, gather)
from ..core.plan import MaterializationPlan
from .geometry import ShardGeometry, shard_rank
from .options import debug_enabled
from .step import BatchContext, BatchPlan, DecodeBuffers, PlanInputs

logger = init_logger("vllm." + __name__)  # under vLLM's log config


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
    chunked_context_steps: int = 0  # steps whose prefill context took several chunks
    max_context_chunks: int = 0  # the most chunks one step's context took
    owned_context_steps: int = 0  # steps with a prefill row reading its context owned
    owned_context_rows: int = 0  # such rows, all steps
    mixed_context_steps: int = 0  # steps with rows read owned and rows gathered
    owned_step_bytes: list = field(default_factory=list)  # those steps' bytes (the last 256)
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


# plans whose per-layer state is kept outside a step (the builders of one
# dummy forward: the latent's and, for sparse models, the indexer's)
OUTSIDE_STEP_PLANS = 4


class ShardRuntime:
    """What the sharded builders and impls of one worker share."""

    def __init__(self, spec: ShardGeometry, group, scratch_blocks: int | None,
                 max_decode_rows: int = 8192, head_group=None):
        self.spec = spec
        self.group = group
        self.head_group = group if head_group is None else head_group
        # the most query tokens one step's decode rows hold (the scheduler's
        # token budget): the size of the decode buffers
        self.max_decode_rows = max_decode_rows
        self._decode_buffers: dict[tuple, DecodeBuffers] = {}
        self.all_gather_into = make_all_gather_into(group)
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
        self.layer_of: dict[str, int] = {}
        self.layer_caches: list[torch.Tensor] = []
        self._batch: BatchContext | None = None
        self._link = None  # the group's collective cost (context.measure_link)
        # the per-layer state of the live plans (BatchPlan is frozen), keyed
        # by the plan's epoch: full views by (epoch, layer, chunk), the
        # prefetcher by epoch, debug-once flags by (kind, epoch); plans older
        # than ``_live_from`` belong to an ended step or forward
        self._epoch = 0
        self._live_from = 1
        self._views: dict[tuple, torch.Tensor] = {}
        self._prefetchers: dict[int, LayerPrefetcher] = {}
        self._checked: set[tuple] = set()

    @property
    def measured_link(self):
        """The :meth:`link` measured so far (None: not yet)."""
        return self._link

    # ---- the step's context ---------------------------------------------
    def begin_step(self) -> BatchContext:
        """Open the engine step's :class:`BatchContext` (the worker's
        ``execute_model``; it stays open through ``sample_tokens``, where the
        speculative drafter runs). A step left open is closed first."""
        if self._batch is not None:
            self.end_step()
        self._retire_plans()  # the plans of vLLM's runs outside a step too
        self._batch = BatchContext()
        return self._batch

    def end_step(self, count: bool = True) -> None:
        """Close the open step; ``count``: into the statistics."""
        batch, self._batch = self._batch, None
        self._retire_plans()
        if batch is not None and count and (batch.has_plans or batch.bytes):
            self._count_step(batch)

    @contextlib.contextmanager
    def step(self, dummy: bool = False):
        """A step as a block (the V2 runner's dummy runs, ``dummy=True``: not
        counted, and their padded inputs not checked); inside an open step it
        is that step."""
        if self._batch is not None:
            yield self._batch
            return
        batch = self.begin_step()
        batch.dummy = dummy
        try:
            yield batch
        finally:
            self.end_step(count=not dummy)

    def new_forward(self, replicated: bool = False) -> None:
        """A forward of the open step with a batch of its own (each forward
        of the speculative drafter): its builds plan anew. ``replicated``:
        that batch is the whole batch on every rank (the V2 speculator's
        chained draft steps under PCP), so the step's PCP split and its
        padding masks no longer describe it."""
        if self._batch is not None:
            self._batch.plans = {}  # (the step's earlier plans stay live: the
            # drafter's first forward reads the target's metadata)
            if replicated:
                self._batch.pcp_step = None
                self._batch.padding = None

    def plan_inputs(self, table: torch.Tensor) -> PlanInputs:
        """What ``planning.plan_batch`` reads of this runtime, for a batch
        whose block table is ``table`` (the decode buffers are per width)."""
        return PlanInputs(spec=self.spec, batch=self.batch(), epoch=self.next_epoch(),
                          pool_blocks=None if self.pool is None else self.pool.capacity_blocks,
                          buffers_of=self.decode_buffers, link_of=self.link,
                          debug=self.debug)

    def next_epoch(self) -> int:
        """The epoch of a new plan (``planning.plan_batch``). Outside a step
        (vLLM's profile and dummy runs) each build plans on its own and no
        step ends to retire them: the state of all but the last few plans
        goes (those runs are single forwards)."""
        self._epoch += 1
        if self._batch is None:
            old = self._epoch - OUTSIDE_STEP_PLANS
            self._views = {k: v for k, v in self._views.items() if k[0] > old}
            self._prefetchers = {k: v for k, v in self._prefetchers.items() if k > old}
        return self._epoch

    def _retire_plans(self) -> None:
        """Plans made so far are of an ended step (or of runs outside one):
        their views, prefetcher and flags go, and :meth:`live` refuses them."""
        self._live_from = self._epoch + 1
        self._views.clear()
        self._prefetchers.clear()
        self._checked.clear()

    def live(self, made: BatchPlan) -> None:
        """Refuse a plan whose step has ended (its views would be of another
        batch's blocks)."""
        if made.epoch < self._live_from:
            raise RuntimeError(
                f"cp_kv: a batch plan of an ended step (epoch {made.epoch}, "
                f"live from {self._live_from}) was read; stale attention metadata.")

    def first_check(self, kind: str, made: BatchPlan) -> bool:
        """Debug: whether the check ``kind`` has not run on this plan yet
        (now it has)."""
        key = (kind, made.epoch)
        if key in self._checked:
            return False
        self._checked.add(key)
        return True

    def step_open(self) -> bool:
        return self._batch is not None

    def batch(self) -> BatchContext:
        """The open step's context, or a throwaway one: builds outside a
        step (vLLM's profile and dummy runs) share nothing."""
        return self._batch if self._batch is not None else BatchContext()

    def reset_stats(self) -> None:
        self.stats = ShardStats()

    def _count_step(self, batch: BatchContext) -> None:
        s, n, has_prefill = self.stats, batch.bytes, batch.has_prefill
        s.multi_query_decode_steps += batch.multi_query
        s.chunked_context_steps += batch.context_chunks > 1
        s.max_context_chunks = max(s.max_context_chunks, batch.context_chunks)
        if batch.owned_rows:
            s.owned_context_steps += 1
            s.owned_context_rows += batch.owned_rows
            s.mixed_context_steps += batch.context_chunks > 0
            s.owned_step_bytes = (s.owned_step_bytes + [n])[-256:]
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

    def received(self, gathered: torch.Tensor) -> None:
        """Count what an all-gather brought from the other ranks."""
        total = gathered.numel() * gathered.element_size()
        self.batch_bytes(total - total // self.spec.size)

    def batch_bytes(self, n: int) -> None:
        if self._batch is not None:
            self._batch.bytes += n

    # ---- materialization ------------------------------------------------
    def materialize(self, made: BatchPlan, kv_cache: torch.Tensor, layer: str,
                    chunk: int = 0) -> torch.Tensor:
        """Full view of layer ``layer``'s ``kv_cache`` for the batch (of one
        chunk of its context when ``made.chunked``); gathered once per layer,
        chunk and batch. Chunks of a layer share one scratch buffer: read
        them in order, each before the next is gathered."""
        self.live(made)
        full = self._views.get((made.epoch, layer, chunk))
        if full is not None:
            return full
        plan = made.plan_of(chunk)
        if self.debug:
            core_debug.check_plan_identical(plan, self.group.cpu_group)
            logger.info_once("cp_kv: debug invariants hold (identical plans "
                             "across ranks).")
        if self.prefetch and layer in self.layer_of:
            full = self._prefetched(made, kv_cache, self.layer_of[layer], chunk)
        else:
            scratch = None if self.pool is None else self.pool.get(plan, kv_cache)
            full = gather(plan, self.spec.rank, kv_cache, self.all_gather_into,
                          scratch=scratch)
        self.received(full)
        self._views[(made.epoch, layer, chunk)] = full
        return full

    def materialize_for_check(self, plan: MaterializationPlan, kv_cache: torch.Tensor
                              ) -> torch.Tensor:
        """A debug check's own full view: a fresh buffer, not counted."""
        return gather(plan, self.spec.rank, kv_cache, self.all_gather_into)

    def register_layers(self, layers: list[tuple[str, torch.Tensor]]) -> None:
        """The latent caches in layer order, by layer name (the prefetch)."""
        self.layer_of = {name: i for i, (name, _) in enumerate(layers)}
        self.layer_caches = [cache for _, cache in layers]

    def _prefetched(self, made: BatchPlan, kv_cache: torch.Tensor, layer: int,
                    chunk: int) -> torch.Tensor:
        """Item ``layer * chunks + chunk``'s view, gathered ahead on a side
        stream while the item before it was attended to; start the next
        item's gather now (two scratch buffers).

        Every rank reads the items in the same order, so the side stream's
        collectives (on the shard group's communicator) match across ranks.
        """
        count = len(made.chunks) if made.chunked else 1
        item = layer * count + chunk
        pf = self._prefetchers.get(made.epoch)
        if pf is None:
            for k in range(count):  # every chunk fits the pool (raises if not)
                self.pool.get(made.plan_of(k), kv_cache)
            buffers = [self.pool.buffer(kv_cache, slot=k) for k in (0, 1)]
            pf = self._prefetchers[made.epoch] = LayerPrefetcher(
                self.spec.rank, self.all_gather_into, buffers)
        if item not in pf.views:
            pf.start(item, made.plan_of(chunk), kv_cache)
        if item > 0:
            pf.release(item - 1)  # the item before's attention is queued before this
        if item + 1 < len(self.layer_caches) * count:
            nxt = item + 1
            pf.start(nxt, made.plan_of(nxt % count), self.layer_caches[nxt // count])
        return pf.wait(item)

    # ---- the shard-aware decode (planning.decode_view, decode.py) -------
    def decode_buffers(self, table: torch.Tensor) -> DecodeBuffers:
        """The decode rows' persistent buffers for block tables like
        ``table`` (its width, dtype and device), made on first use and kept
        for the worker's life: CUDA graphs captured on them stay valid."""
        key = (table.shape[1], table.dtype, table.device)
        buffers = self._decode_buffers.get(key)
        if buffers is None:
            buffers = self._decode_buffers[key] = DecodeBuffers(self.max_decode_rows, table)
        return buffers

    def link(self):
        """The shard group's measured latency and bandwidth (measured at the
        first batch that asks, on every rank alike: its rows are the same)."""
        if self._link is None:
            from .context import measure_link

            self._link = measure_link(self.group)
            logger.info("cp_kv: shard group all-gather latency %.3f ms, bandwidth "
                        "%.2f GB/s (the context path's cost model)",
                        self._link.latency_s * 1e3, self._link.bytes_per_s / 1e9)
        return self._link

    def gather_heads(self, q: torch.Tensor, count: bool = True) -> torch.Tensor:
        """``[B, H / head_ranks, D]`` -> ``[B, H, D]`` over the head group
        (the TP ranks)."""
        q = self.head_group.all_gather(q.contiguous(), dim=1)
        if count:
            self.received(q)
        return q


def make_runtime(spec: ShardGeometry, scratch_blocks: int | None,
                 max_decode_rows: int) -> ShardRuntime:
    """The worker's runtime over vLLM's DCP group (the shard group).

    Where the shard group is the TP group (the same ranks in the same order)
    its collectives go through vLLM's TP group instead: the same exchange,
    and on CPU vLLM gives only TP (and PP) groups its shared-memory
    communicator (other groups use gloo, about 0.5-1 ms per call on the
    shard-aware decode's small tensors, measured)."""
    from vllm.distributed.parallel_state import get_dcp_group, get_tp_group

    group = get_dcp_group()
    if shard_rank(spec.size, group) != spec.rank:
        raise RuntimeError(f"cp_kv: the worker's geometry {spec} is not vLLM's DCP group")
    tp = get_tp_group()
    if list(tp.ranks) == list(group.ranks):
        group = tp
    # PCP x TP: the queries split over the TP group only
    head_group = tp if spec.axis == "pcp-tp" else None
    if head_group is not None and (tp.world_size != spec.head_ranks
                                   or tp.rank_in_group != spec.head_rank):
        raise RuntimeError(f"cp_kv: the worker's geometry {spec} does not number vLLM's "
                           f"TP group (rank {tp.rank_in_group} of {tp.world_size}) as "
                           "vLLM 0.34 does")
    return ShardRuntime(spec, group, scratch_blocks, max_decode_rows, head_group)


def runtime_of_layers(vllm_config, layer_names) -> ShardRuntime | None:
    """The runtime the worker bound to these attention layers (None before
    the worker binds it: vLLM's builds outside a sharded worker)."""
    layers = vllm_config.compilation_config.static_forward_context
    return getattr(layers.get(layer_names[0]), "cp_kv_runtime", None) if layer_names \
        else None


def required_runtime(vllm_config, layer_names) -> ShardRuntime:
    """:func:`runtime_of_layers` for a sharded builder, which cannot run
    without one."""
    runtime = runtime_of_layers(vllm_config, layer_names)
    if runtime is None:
        raise RuntimeError(f"cp_kv: layers {list(layer_names)[:2]} have no shard "
                           "runtime (ShardedKVWorker.bind_layers did not see them).")
    return runtime
