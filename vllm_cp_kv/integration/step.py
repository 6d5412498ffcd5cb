"""The per-step types, a leaf module: what one engine step plans and every
layer reads. The worker's runtime opens a :class:`BatchContext` per step
(the PCP manager records its :class:`PCPStep` into it); the sharded
builders make a :class:`BatchPlan` per batch (``planning.plan_batch``),
which rides on the attention metadata (``metadata.cp_kv``) to the layers;
decode rows get a :class:`DecodeView` in :class:`DecodeBuffers` that
outlive every step (CUDA graphs replay on their addresses). Nothing here
imports the rest of the integration layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..core.plan import MaterializationPlan


@dataclass(frozen=True)
class PCPStep:
    """What the metadata builder needs from the PCP manager for one step:
    the global batch, so that every rank derives the same plan."""

    keys: np.ndarray  # [G] request-state index of each global request
    seq_lens: np.ndarray  # [G] tokens each request has after this step
    is_prefill: np.ndarray  # [G] bool: the request prefills in this step
    row_keys: np.ndarray  # [R_local] request-state index of each local row
    # the owned context path (integration/context.py:plan_owned_pcp)
    query_lens: np.ndarray | None = None  # [G] new tokens of each request
    replicated: np.ndarray | None = None  # [G] bool: every PCP rank runs it whole
    # per PCP rank, its local rows in order: (global request, query offset, length)
    segments: list | None = None
    pcp: int = 1
    pcp_rank: int = 0


@dataclass(frozen=True)
class DecodeView:
    """Decode rows' view of the persistent cache, one row per query token.

    ``block_table`` is vLLM's shared virtual table (on this rank, column
    ``c`` holds logical block ``c * N + rank``), its row repeated for each
    query token of a request, and ``local_lens`` the tokens this rank owns
    that each query token sees: together a paged sequence of exactly this
    rank's visible tokens per query token. Rows past the batch's real query
    tokens (vLLM's graph padding) see no token. Every tensor is a slice of a
    persistent buffer (vLLM's or :class:`DecodeBuffers`).
    """

    block_table: torch.Tensor  # [T, C]
    local_lens: torch.Tensor  # [T] int32
    max_local_len: int  # host, an upper bound (vLLM's DCP bound)
    gather_heads: bool  # TP shard group: this rank returns H / N heads (all_heads)
    query_start_loc: torch.Tensor  # [T + 1] int32 on the device: one query per row
    query_start_loc_cpu: torch.Tensor  # [T + 1] int32
    multi_query: bool = False  # some request row had several query tokens
    # the persistent storage the lengths are a slice of (``DecodeBuffers.
    # at_least_one``: the lengths FlashMLA's dense FP8 kernel is given)
    buffers: DecodeBuffers | None = None


class DecodeBuffers:
    """The shard-aware decode's per-step inputs, in storage that outlives
    every step and every CUDA graph (one set per worker and block-table
    width, made by ``ShardRuntime.decode_buffers``): each step writes the
    same addresses in place, as vLLM's builders do with theirs
    (``build_for_cudagraph_capture``), so a captured decode reads this
    step's lengths and rows. Sized for ``rows`` query tokens, the most a
    step schedules (speculative rows included)."""

    def __init__(self, rows: int, table: torch.Tensor):
        self.rows, self._like = rows, table
        self.lens = torch.zeros(rows, dtype=torch.int32, device=table.device)
        self.kernel_lens = None  # at_least_one's, made at its first call
        self._table = None
        self._one_query = None

    def check(self, rows: int) -> None:
        if rows > self.rows:
            raise RuntimeError(
                f"cp_kv: a decode of {rows} query tokens exceeds the {self.rows} "
                "rows the shard-aware decode's buffers hold "
                "(max_num_batched_tokens); stale configuration.")

    def at_least_one(self, rows: int) -> torch.Tensor:
        """The first ``rows`` lengths with 0 raised to 1, in storage of its
        own that outlives every step (as ``lens``). FlashMLA's dense FP8
        kernel faults on rows of no tokens (rank 1 of a prompt of at most
        one block); such a row reads one token and gets no weight in the
        merge, which sees the true lengths (``decode.run_gpu``)."""
        if self.kernel_lens is None:
            self.kernel_lens = torch.ones_like(self.lens)
        return torch.clamp(self.lens[:rows], min=1, out=self.kernel_lens[:rows])

    def multi_query(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block-table rows and query offsets of rows of one query token
        (made at the first batch with several query tokens a row, which
        vLLM's capture of speculative decode shapes makes at startup)."""
        if self._table is None:
            t, rows = self._like, self.rows
            self._table = torch.zeros(rows, t.shape[1], dtype=t.dtype, device=t.device)
            self._one_query = (torch.arange(rows + 1, dtype=torch.int32, device=t.device),
                               torch.arange(rows + 1, dtype=torch.int32))
        return self._table, *self._one_query


@dataclass(frozen=True)
class AMXLocal:
    """AMX_MLA: the decode metadata of vLLM's CPU decode kernel
    (``decode_attention_cpu``) for this rank's own blocks, made as
    ``AMXMLAMetadataBuilder.build`` makes it (once per batch)."""

    req_to_token: torch.Tensor  # [T, C * block_size] int64: physical row of each position
    req_pool_indices: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [T] int64: owned tokens each query token sees
    num_kv_splits: int


@dataclass
class BatchContext:
    """Shared state of one engine step, owned by ``ShardRuntime``: the worker
    opens it in ``execute_model`` and closes it after ``sample_tokens`` (the
    V2 runner also around its dummy runs); the PCP manager records into it;
    builders add the current forward's plans (the target model's forward,
    then each forward of the speculative drafter: ``new_forward``)."""

    pcp_step: PCPStep | None = None
    # PCP + MoE: (rank-local padding mask, PCP-gathered mask) of this step
    padding: tuple[torch.Tensor, torch.Tensor] | None = None
    plans: dict = field(default_factory=dict)  # whole -> BatchPlan
    has_plans: bool = False  # some forward of the step planned
    has_prefill: bool = False  # for the statistics: a prefill or a decode step
    multi_query: bool = False  # some decode row had several query tokens
    context_chunks: int = 0  # most chunks a plan of the step read its context in
    owned_rows: int = 0  # prefill rows of the step reading their context owned
    bytes: int = 0  # received from the other ranks in this step
    # a dummy run of vLLM's (V2 runner): its slot mapping is padding (vLLM
    # 0.34 fills it with -1), so the owned-writes check does not apply
    dummy: bool = False


@dataclass(frozen=True)
class BatchPlan:
    """One batch's reading plan, attached to its attention metadata; frozen:
    a builder makes it (``planning.plan_batch``, then ``dataclasses.replace``
    with its own metadata's parts), the impl, the indexer and the checks
    only read it. It holds no runtime (they reach theirs through the layer
    the worker bound, ``layer.cp_kv_runtime``) and no per-layer state: the
    runtime keeps the views, the prefetcher and the debug-once flags keyed
    by ``epoch``, and refuses a plan of a step that has ended."""

    epoch: int  # the runtime's plan counter when it was made
    batch: BatchContext
    plan: MaterializationPlan | None  # None: nothing to gather, or several chunks
    full_table: torch.Tensor | None  # rows' full-view block table (first chunk's)
    reads: bool  # host flag, identical on every rank: gather for prefills
    num_decodes: int = 0
    decode: DecodeView | None = None  # decode rows use the LSE path
    amx: AMXLocal | None = None  # AMX_MLA's kernel metadata for the owned blocks
    # the cached context as chunks read one after another (core.plan.ContextChunk;
    # one chunk: the single gather, ``plan``; under PCP the global requests');
    # None where the context is not chunked
    chunks: list | None = None
    # several chunks: each chunk's prefill metadata for vLLM's context loop (its block
    # table and chunked-context metadata; None: no prefill row reads the chunk)
    vllm_chunks: list | None = None
    # with chunks: the chunks' request of each row (host; the identity but
    # under PCP, whose chunks are the global batch's: core.plan.rows_of_chunk)
    chunk_rows: torch.Tensor | None = None
    # prefill rows whose context is read owned (integration/context.py)
    owned: Any = None
    decode_builder: Any = None  # debug: the (vLLM) builder whose kernel reads a view

    @property
    def chunked(self) -> bool:
        """The context is read in several chunks (each gathered per layer)."""
        return self.chunks is not None and len(self.chunks) > 1

    @property
    def loop(self) -> bool:
        """The impl reads the context itself: several chunks, or rows read
        owned beside the gathered ones (``ShardedImpl._compute_prefill_context``)."""
        return self.chunked or self.owned is not None

    def plan_of(self, chunk: int) -> MaterializationPlan:
        return self.chunks[chunk].plan if self.chunked else self.plan


@dataclass(frozen=True)
class PlanInputs:
    """Everything ``planning.plan_batch`` reads besides vLLM's metadata,
    handed over by the worker's runtime (``ShardRuntime.plan_inputs``):
    the planner never sees the runtime."""

    spec: Any  # the shard geometry (``geometry.ShardGeometry``)
    batch: BatchContext  # the open step's (or a throwaway one outside a step)
    epoch: int  # the new plan's (``ShardRuntime.next_epoch``)
    pool_blocks: int | None  # the scratch's capacity in blocks (None: no scratch)
    buffers_of: Callable[[torch.Tensor], DecodeBuffers]  # the decode's persistent
    # inputs for a block table's width (``ShardRuntime.decode_buffers``)
    link_of: Callable[[], Any]  # the group's measured link (context path's cost model)
    debug: bool  # VLLM_CP_KV_DEBUG: the planner's invariant checks

