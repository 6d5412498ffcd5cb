"""Batch planning: what each step reads through the full view, made once
per step and shared by every builder and layer of the batch.

* :func:`plan_batch` (called by the sharded metadata builders, the latent's
  and for sparse models the indexer's) makes the step's :class:`BatchPlan`
  from vLLM's common attention metadata: the materialization plan of the
  prefill rows' cached context (``core/plan.py``), the block table
  translated to the full view, and for the shard-aware decode the decode
  rows' view of this rank's own blocks (``decode.decode_view``).
* Where the backend merges context chunks by LSE (``chunked``), the cached
  context is planned as chunks that each fit the scratch
  (``core.plan.plan_context_chunks``); a batch that fits is one chunk, the
  single gather. Each layer then gathers and attends chunk by chunk
  (``backend.ShardedImpl._compute_prefill_context``).
* Under PCP the ranks run different chunks of each prefill but the gather
  is a collective, so the plan is made from the global batch the PCP
  manager recorded (:class:`PCPStep`, ``core.plan.plan_split_requests``);
  its chunks are the global requests', and each rank's rows read their
  parts of them (``core.plan.rows_of_chunk``).
* The step's :class:`BatchContext` (opened by ``ShardRuntime.step``) holds
  the plans; a :class:`BatchPlan` rides on the attention metadata
  (``metadata.cp_kv``) to the layers.
* Decode rows of the shard-aware decode get their :class:`DecodeView` here
  (:func:`decode_view`): this rank's paged view of its own tokens, one row
  per query token, written into :class:`DecodeBuffers` that outlive every
  step. vLLM's full CUDA graphs replay the decode kernels on the addresses
  they saw at capture, so every tensor those kernels and the merge read is a
  slice of a persistent buffer (vLLM's own, or these), rewritten in place
  each step, with the captured shape (vLLM's padded batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.logger import init_logger

from ..core import debug as core_debug
from ..core.decode import query_token_lens
from ..core.materialize import LayerPrefetcher
from ..core.ownership import CPShardSpec
from ..core.plan import (ContextChunk, MaterializationPlan, global_rows, plan_context_chunks,
                         plan_materialization, plan_split_requests)
from .context import plan_owned

if TYPE_CHECKING:  # annotations only: these modules import this one
    from .decode import AMXLocal
    from .runtime import ShardRuntime

logger = init_logger("vllm." + __name__)  # under vLLM's log config


@dataclass(frozen=True)
class PCPStep:
    """What the metadata builder needs from the PCP manager for one step:
    the global batch, so that every rank derives the same plan."""

    keys: np.ndarray  # [G] request-state index of each global request
    seq_lens: np.ndarray  # [G] tokens each request has after this step
    is_prefill: np.ndarray  # [G] bool: the request prefills in this step
    row_keys: np.ndarray  # [R_local] request-state index of each local row


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
    # ``local_lens`` with every 0 raised to 1 (persistent too): FlashMLA's
    # dense FP8 kernel faults on rows of no tokens (rank 1 of a prompt of at
    # most one block); such a row reads one token, given no weight in the
    # merge (``decode.run_gpu``)
    kernel_lens: torch.Tensor | None = None


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
        self.kernel_lens = torch.ones_like(self.lens)
        self._table = None
        self._one_query = None

    def check(self, rows: int) -> None:
        if rows > self.rows:
            raise RuntimeError(
                f"cp_kv: a decode of {rows} query tokens exceeds the {self.rows} "
                "rows the shard-aware decode's buffers hold "
                "(max_num_batched_tokens); stale configuration.")

    def at_least_one(self, rows: int) -> torch.Tensor:
        """The first ``rows`` lengths with 0 raised to 1, in place."""
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


def local_len_bound(max_seq_len: int, spec: CPShardSpec) -> int:
    """The most tokens one rank owns of a request of ``max_seq_len`` tokens:
    vLLM's own DCP bound (``ceil(L / (N * I)) * I``, host, no device read).
    vLLM captures graphs with ``max_seq_len = max_model_len``, so a graph's
    bound holds at every replay."""
    part = spec.size * spec.block_size
    return -(-max(max_seq_len, 1) // part) * spec.block_size


def decode_view(common, num_decodes: int, spec: CPShardSpec, gather_heads: bool,
                buffers: DecodeBuffers) -> DecodeView:
    """This rank's paged view of the decode rows' owned tokens, one row per
    query token (``core.decode.query_token_lens``), with the shape vLLM
    captures: as many rows as the batch's (padded) decode tokens.

    The lengths are computed on the device and in int32 from vLLM's
    sequence lengths (no host read) and written into ``buffers``; rows with
    one query token keep vLLM's own (persistent) block table and query
    offsets. Rows vLLM added to pad a graph batch (no query token) see
    nothing, whatever their stale sequence length."""
    table = common.block_table_tensor[:num_decodes]
    qsl_cpu = common.query_start_loc_cpu[: num_decodes + 1]
    query_lens = (qsl_cpu[1:] - qsl_cpu[:-1]).tolist()
    real = sum(1 for n in query_lens if n > 0)
    if any(n == 0 for n in query_lens[:real]):
        raise RuntimeError("cp_kv: decode rows without a query token before rows with "
                           "one; vLLM pads batches at the end.")
    # a batch of only decode rows has vLLM's padded token count (a graph shape)
    tokens = common.num_actual_tokens if num_decodes == common.num_reqs \
        else int(qsl_cpu[-1])
    bound = local_len_bound(common.max_seq_len, spec)
    lens = buffers.lens
    if max(query_lens, default=0) <= 1 and tokens <= num_decodes:
        buffers.check(num_decodes)
        _, local = query_token_lens(common.seq_lens[:real], query_lens[:real], spec)
        lens[:real].copy_(local)
        lens[real:].zero_()
        return DecodeView(block_table=table, local_lens=lens[:num_decodes],
                          max_local_len=bound, gather_heads=gather_heads,
                          query_start_loc=common.query_start_loc[: num_decodes + 1],
                          query_start_loc_cpu=qsl_cpu,
                          kernel_lens=buffers.at_least_one(num_decodes))
    rows, local = query_token_lens(common.seq_lens[:real], query_lens[:real], spec)
    if rows is None:  # one token a row, fewer rows than the graph's tokens
        rows = torch.arange(real, device=table.device)
    n = local.numel()
    total = max(tokens, n)
    buffers.check(total)
    rows_table, one_query, one_query_cpu = buffers.multi_query()
    if n:
        torch.index_select(table, 0, rows, out=rows_table[:n])
    lens[:n].copy_(local)
    lens[n:].zero_()
    return DecodeView(block_table=rows_table[:total], local_lens=lens[:total],
                      max_local_len=bound, gather_heads=gather_heads,
                      query_start_loc=one_query[: total + 1],
                      query_start_loc_cpu=one_query_cpu[: total + 1], multi_query=True,
                      kernel_lens=buffers.at_least_one(total))


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
    debug_decode_checked: bool = False
    # a dummy run of vLLM's (V2 runner): its slot mapping is padding (vLLM
    # 0.34 fills it with -1), so the owned-writes check does not apply
    dummy: bool = False


@dataclass
class BatchPlan:
    """One batch's reading plan, attached to its attention metadata."""

    runtime: ShardRuntime  # materializes it
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
    views: dict = field(default_factory=dict)  # (layer name, chunk) -> full view
    decode_builder: Any = None  # debug: the (vLLM) builder whose kernel reads a view
    prefetcher: LayerPrefetcher | None = None  # this batch's (GPU, cp_kv.prefetch)

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


def split_rows(builder, common) -> int:
    """Decode rows at the front of the batch, exactly as vLLM's MLA builder
    counts them (the same function and arguments)."""
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    try:
        from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport

        uniform = getattr(builder, "query_len_support", None) != QueryLenSupport.VARLEN
    except ImportError:  # pragma: no cover - vLLM moved it
        uniform = True
    num_decodes, *_ = split_decodes_and_prefills(
        common, decode_threshold=builder.reorder_batch_threshold or 1,
        require_uniform=uniform,
        treat_short_extends_as_decodes=not getattr(builder, "use_pcp", False))
    return num_decodes


def host_seq_lens(common) -> torch.Tensor:
    """Sequence lengths on the host. The upper bound avoids a device sync; it
    is exact for prefill rows, and for decode rows without speculative
    decoding (with it, rejected drafts make it larger: decode rows read at
    most that much, and their kernels use the exact device lengths)."""
    host = getattr(common, "seq_lens_cpu_upper_bound", None)
    return (host if host is not None else common.seq_lens.cpu()).long()


def read_lens(common, num_decodes: int, whole: bool, lse_decode: bool) -> torch.Tensor:
    """Tokens each request reads through the full view in this step (host).

    Prefill rows read their cached context (their new tokens come straight
    from the projections), or every token when ``whole`` (sparse attention
    and the indexer read this step's tokens from the cache too).
    Decode rows read their whole sequence, or nothing when they attend to
    the owned blocks (``lse_decode``).
    """
    qsl = common.query_start_loc_cpu.long()
    q = qsl[1:] - qsl[:-1]
    seq = host_seq_lens(common)[: q.numel()]
    lens = (seq if whole else seq - q).clone()
    lens[:num_decodes] = 0 if lse_decode else seq[:num_decodes]
    return lens


def translated(common, full_table):
    """``common`` as the unsharded kernels must see it: the full-view block
    table, and no DCP-local lengths (nothing is DCP-local in the view)."""
    return dataclasses.replace(common, block_table_tensor=full_table,
                               dcp_local_seq_lens=None,
                               dcp_local_seq_lens_cpu_upper_bound=None)


def plan_batch(runtime, common, num_decodes: int, *, whole: bool, lse_decode: bool,
               chunked: bool = False, owned: dict | None = None) -> BatchPlan:
    """The batch's :class:`BatchPlan`, made once per step and shared by every
    builder of the KV cache group (the MLA latent and, for sparse models,
    the indexer cache), since they read the same blocks.

    ``chunked``: the context may be read in scratch-sized chunks (the
    backend merges them by LSE); ``owned``: short prefill rows may read
    their context owned (``context.plan_owned``'s settings; TP only)."""
    batch = runtime.batch()
    key = whole
    made = batch.plans.get(key)
    if made is not None:
        if made.full_table is not None and made.full_table.shape[0] != common.num_reqs:
            raise RuntimeError("cp_kv: two builds of one step disagree on the "
                               "batch; stale step state.")
        return made
    spec = runtime.spec
    table = common.block_table_tensor[: common.num_reqs]
    # Kernels size their index from each request's full length.
    columns = -(-common.max_seq_len // spec.block_size)
    batch.has_prefill |= num_decodes < common.num_reqs
    chunks = rows = owned_rows = None
    if batch.pcp_step is not None:
        plan, full, lens, chunks, rows = _plan_pcp(
            runtime, batch.pcp_step, table, common.num_reqs, lse_decode, columns,
            chunked and runtime.pool is not None)
    else:
        lens = read_lens(common, num_decodes, whole, lse_decode)
        if owned is not None and chunked and runtime.pool is not None:
            owned_rows = plan_owned(common, num_decodes, lens, spec, link_of=runtime.link,
                                    **owned)
            if owned_rows is not None:  # their context is not gathered
                lens = lens.clone()
                lens[owned_rows.rows] = 0
        if chunked and runtime.pool is not None:
            chunks = plan_context_chunks(spec, table, lens, runtime.pool.capacity_blocks,
                                         min_columns=columns)
        else:
            chunks = [ContextChunk(torch.zeros_like(lens), lens, plan_materialization(
                spec, table, lens, min_columns=columns))]
        plan, full = chunks[0].plan, chunks[0].plan.full_block_table
        rows = torch.arange(common.num_reqs)  # the chunks' requests are the rows
        if runtime.debug:
            if not batch.dummy:
                core_debug.check_owned_writes(
                    spec, common.slot_mapping, table,
                    common.query_start_loc_cpu, common.seq_lens[: common.num_reqs])
            core_debug.check_chunks_cover(chunks, table, lens)
            logger.info_once("cp_kv: debug invariants hold (owned writes, plan "
                             "coverage).")
    reads = bool((lens > 0).any())
    if chunks is not None and reads:
        batch.context_chunks = max(batch.context_chunks, len(chunks))
    several = chunks is not None and len(chunks) > 1
    made = BatchPlan(runtime=runtime, batch=batch,
                     plan=plan if reads and not several else None,
                     full_table=full.to(table.device), reads=reads,
                     num_decodes=num_decodes, chunks=chunks, chunk_rows=rows,
                     owned=owned_rows)
    if owned_rows is not None:
        batch.owned_rows = max(batch.owned_rows, int(owned_rows.rows.numel()))
    if lse_decode and num_decodes:
        made.decode = decode_view(common, num_decodes, spec, spec.head_ranks > 1,
                                  runtime.decode_buffers(common.block_table_tensor))
        batch.multi_query |= made.decode.multi_query
    batch.plans[key] = made
    batch.has_plans = True
    return made


def _plan_pcp(runtime, step: PCPStep, table, num_reqs: int, lse_decode: bool,
              columns: int, chunked: bool):
    """PCP: the plan of the global batch, whose rows this rank's table holds
    in its own order (``core.plan.plan_split_requests``); ``chunked``: the
    global requests' reads in scratch-sized chunks, identical on every rank
    (each rank's rows read their parts: ``core.plan.rows_of_chunk``).
    Returns ``(plan, local full table, lens, chunks, local rows' requests)``
    (the last two None unless chunked)."""
    if len(step.row_keys) != num_reqs:
        raise RuntimeError(
            f"cp_kv: the PCP step recorded {len(step.row_keys)} local "
            f"rows but the batch has {num_reqs}; stale step state.")
    reads = step.seq_lens if not lse_decode else step.seq_lens * step.is_prefill
    lens = torch.from_numpy(reads.astype("int64"))
    if not chunked:
        plan, full, global_table = plan_split_requests(
            runtime.spec, table, step.row_keys, step.keys, lens, min_columns=columns)
        chunks = rows = None
    else:
        global_table, rows = global_rows(table, step.row_keys, step.keys)
        # the chunks' tables as wide as the global batch's longest request
        # (no rank's row is longer), the same on every rank
        bs = runtime.spec.block_size
        columns = max(columns, -(-int(step.seq_lens.max(initial=0)) // bs))
        chunks = plan_context_chunks(runtime.spec, global_table, lens,
                                     runtime.pool.capacity_blocks, min_columns=columns)
        plan = chunks[0].plan
        full = plan.full_block_table[rows.to(plan.full_block_table.device)]
    if runtime.debug:
        # vLLM's PCP write path gathers new KV across ranks: the owned-writes
        # check runs on the poisoned-cache tests
        if chunks is None:
            core_debug.check_plan_covers(plan, global_table, lens)
        else:
            core_debug.check_chunks_cover(chunks, global_table, lens)
    return plan, full, lens, chunks, rows
