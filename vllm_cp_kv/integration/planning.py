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

import torch

from vllm.logger import init_logger

from ..core import debug as core_debug
from ..core.decode import query_token_lens
from ..core.ownership import CPShardSpec
from ..core.plan import (ContextChunk, global_rows, plan_context_chunks,
                         plan_materialization, plan_split_requests, to_device)
from .context import plan_owned, plan_owned_pcp
from .step import BatchPlan, DecodeBuffers, DecodeView, PCPStep, PlanInputs

logger = init_logger("vllm." + __name__)  # under vLLM's log config


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
                          buffers=buffers)
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
                      buffers=buffers)


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


def plan_batch(inputs: PlanInputs, common, num_decodes: int, *, whole: bool,
               lse_decode: bool, chunked: bool = False, owned: dict | None = None
               ) -> BatchPlan:
    """The batch's :class:`BatchPlan`, made once per step and shared by every
    builder of the KV cache group (the MLA latent and, for sparse models,
    the indexer cache), since they read the same blocks.

    ``chunked``: the context may be read in scratch-sized chunks (the
    backend merges them by LSE); ``owned``: short prefill rows may read
    their context owned (``context.plan_owned``'s settings).
    ``inputs``: the runtime's part (``ShardRuntime.plan_inputs``)."""
    batch = inputs.batch
    key = whole
    made = batch.plans.get(key)
    if made is not None:
        if made.full_table is not None and made.full_table.shape[0] != common.num_reqs:
            raise RuntimeError("cp_kv: two builds of one step disagree on the "
                               "batch; stale step state.")
        return made
    spec, pool_blocks = inputs.spec, inputs.pool_blocks
    table = common.block_table_tensor[: common.num_reqs]
    # Kernels size their index from each request's full length.
    columns = -(-common.max_seq_len // spec.block_size)
    batch.has_prefill |= num_decodes < common.num_reqs
    chunks = rows = owned_rows = None
    if batch.pcp_step is not None:
        plan, full, lens, chunks, rows, owned_rows = _plan_pcp(
            inputs, batch.pcp_step, common, num_decodes, lse_decode, columns,
            chunked and pool_blocks is not None, owned)
    else:
        lens = read_lens(common, num_decodes, whole, lse_decode)
        if owned is not None and chunked and pool_blocks is not None:
            owned_rows = plan_owned(common, num_decodes, lens, spec, link_of=inputs.link_of,
                                    **owned)
            if owned_rows is not None:  # their context is not gathered
                lens = lens.clone()
                lens[owned_rows.rows] = 0
        if chunked and pool_blocks is not None:
            chunks = plan_context_chunks(spec, table, lens, pool_blocks, min_columns=columns)
        else:
            chunks = [ContextChunk(torch.zeros_like(lens), lens, plan_materialization(
                spec, table, lens, min_columns=columns))]
        plan, full = chunks[0].plan, chunks[0].plan.full_block_table
        rows = torch.arange(common.num_reqs)  # the chunks' requests are the rows
        if inputs.debug:
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
    if owned_rows is not None:
        batch.owned_rows = max(batch.owned_rows, int(owned_rows.rows.numel()))
    decode = None
    if lse_decode and num_decodes:
        decode = decode_view(common, num_decodes, spec, spec.head_ranks > 1,
                             inputs.buffers_of(common.block_table_tensor))
        batch.multi_query |= decode.multi_query
    made = BatchPlan(epoch=inputs.epoch, batch=batch,
                     plan=plan if reads and not several else None,
                     full_table=full.to(table.device), reads=reads,
                     num_decodes=num_decodes, decode=decode, chunks=chunks,
                     chunk_rows=rows, owned=owned_rows)
    batch.plans[key] = made
    batch.has_plans = True
    return made


def _plan_pcp(inputs: PlanInputs, step: PCPStep, common, num_decodes: int,
              lse_decode: bool, columns: int, chunked: bool, owned: dict | None):
    """PCP: the plan of the global batch, whose rows this rank's table holds
    in its own order (``core.plan.plan_split_requests``); ``chunked``: the
    global requests' reads in scratch-sized chunks, identical on every rank
    (each rank's rows read their parts: ``core.plan.rows_of_chunk``), less
    the requests read owned (``owned``: ``context.plan_owned_pcp``'s
    settings). Returns ``(plan, local full table, lens, chunks, local rows'
    requests, owned rows)`` (chunks and rows None unless chunked)."""
    table, num_reqs = common.block_table_tensor[: common.num_reqs], common.num_reqs
    owned_rows = None
    if len(step.row_keys) != num_reqs:
        raise RuntimeError(
            f"cp_kv: the PCP step recorded {len(step.row_keys)} local "
            f"rows but the batch has {num_reqs}; stale step state.")
    reads = step.seq_lens if not lse_decode else step.seq_lens * step.is_prefill
    lens = torch.from_numpy(reads.astype("int64"))
    if not chunked:
        plan, full, global_table = plan_split_requests(
            inputs.spec, table, step.row_keys, step.keys, lens, min_columns=columns)
        chunks = rows = None
    else:
        global_table, rows = global_rows(table, step.row_keys, step.keys)
        if owned is not None and step.segments is not None:
            owned_rows = plan_owned_pcp(common, num_decodes, step, global_table, inputs.spec,
                                        link_of=inputs.link_of, **owned)
            if owned_rows is not None:  # their context is not gathered
                lens = lens.clone()
                lens[owned_rows.rows] = 0
        # the chunks' tables as wide as the global batch's longest request
        # (no rank's row is longer), the same on every rank
        bs = inputs.spec.block_size
        columns = max(columns, -(-int(step.seq_lens.max(initial=0)) // bs))
        chunks = plan_context_chunks(inputs.spec, global_table, lens, inputs.pool_blocks,
                                     min_columns=columns)
        plan = chunks[0].plan
        full = plan.full_block_table[to_device(rows, plan.full_block_table.device)]
    if inputs.debug:
        # vLLM's PCP write path gathers new KV across ranks: the owned-writes
        # check runs on the poisoned-cache tests
        if chunks is None:
            core_debug.check_plan_covers(plan, global_table, lens)
        else:
            core_debug.check_chunks_cover(chunks, global_table, lens)
    return plan, full, lens, chunks, rows, owned_rows
