"""Materialization plan: which owned blocks each rank sends, and where each
logical block of the batch lands in the scratch full view.

``plan_materialization`` runs once per batch (for all layers); the returned
:class:`MaterializationPlan` is frozen and is consumed by
:mod:`vllm_cp_kv.core.materialize` once per layer.

All inputs must be identical on every rank of the shard group (vLLM's
scheduler sends every rank the same block table and sequence lengths), so
every rank derives the identical plan without communicating.

Scratch layout (rank-major, one collective of the same size on every rank)::

    scratch[r * P + i] = rank r's physical block send_block_ids[r, i]

where ``P = max_r(#blocks rank r sends)`` (for a context chunk, the host's
count of rank ``r``'s reads: ``host_size``); ranks with fewer blocks pad with
``pad_block_id`` (never referenced by ``full_block_table``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ownership import CPShardSpec

# (owner, physical block) sort key: owner * stride + block; ids are int32
_KEY_STRIDE = 1 << 32


@dataclass(frozen=True)
class MaterializationPlan:
    """A frozen per-batch plan. Shapes use ``R`` requests, ``N`` ranks.

    Attributes:
        spec: the shard layout the plan was made for.
        send_block_ids: ``[N, P]`` int64, local physical block ids each rank
            packs, in scratch order.
        num_send_blocks: ``[N]`` int64, real (unpadded) entries per rank.
        full_block_table: ``[R, max_logical_blocks]`` int32, scratch block
            index of every logical block read by each request (0 past the
            request's last block).
        num_logical_blocks: ``[R]`` int64, logical blocks read per request.
    """

    spec: CPShardSpec
    send_block_ids: torch.Tensor
    num_send_blocks: torch.Tensor
    full_block_table: torch.Tensor
    num_logical_blocks: torch.Tensor

    @property
    def blocks_per_rank(self) -> int:
        """``P``: blocks every rank contributes to the collective."""
        return self.send_block_ids.shape[1]

    @property
    def num_scratch_blocks(self) -> int:
        """Blocks in the scratch full view (``N * P``)."""
        return self.spec.size * self.blocks_per_rank


class _PinnedRing:
    """Uploads small host index tensors without waiting for the GPU.

    A copy from pageable memory makes the host wait until the stream has
    run everything queued before it; from pinned memory it is queued like
    a kernel. Buffers are reused round-robin once their last upload has
    run (an event, normally long complete); one still in flight is left to
    PyTorch's pinned-memory cache, which frees it once the copy has run, and
    a new one takes its place, so an upload never waits.
    """

    def __init__(self, device: torch.device, slots: int = 8):
        self.device, self.i = device, 0
        self.buffers = [torch.empty(0, dtype=torch.int64) for _ in range(slots)]
        self.events: list = [None] * slots

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        self.i = i = (self.i + 1) % len(self.buffers)
        if self.events[i] is not None and not self.events[i].query():
            self.buffers[i] = torch.empty(0, dtype=torch.int64)  # still in flight
        if self.buffers[i].numel() < host.numel():
            self.buffers[i] = torch.empty(max(host.numel(), 1024), dtype=torch.int64,
                                          pin_memory=True)
        staged = self.buffers[i][: host.numel()].view(host.shape)
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record(torch.cuda.current_stream(self.device))
        return out


_RINGS: dict[torch.device, _PinnedRing] = {}


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (int64) on ``device``; on CUDA without a host wait."""
    if device.type != "cuda":
        return host.to(device)
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = _PinnedRing(device)
    return ring.upload(host.to(torch.int64))


def _distinct_blocks(owner: torch.Tensor, phys: torch.Tensor, n: int):
    """The distinct (owner, physical block) pairs of the reads, sorted:
    ``(order, owner, phys, slot, counts)``, ``order`` the sort of the
    reads, ``slot`` each sorted read's rank within its owner's distinct
    blocks, ``counts`` ``[n]`` the distinct blocks of each owner."""
    keys, order = torch.sort(owner * _KEY_STRIDE + phys)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    unique_id = torch.cumsum(first, 0) - 1
    k_owner, k_phys = owner[order], phys[order]
    counts = torch.zeros(n, dtype=torch.int64, device=owner.device).index_add_(
        0, k_owner, first.to(torch.int64))
    slot = unique_id - (torch.cumsum(counts, 0) - counts)[k_owner]
    return order, k_owner, k_phys, slot, counts


def _send_size(spec: CPShardSpec, j_host: torch.Tensor, counts: torch.Tensor,
               phys: torch.Tensor, host_size: bool) -> int:
    """``P``, the blocks every rank sends, and the negative-id check.
    ``host_size``: the busiest rank's reads, counted on the host (at least
    its distinct blocks; more where requests share blocks, whose extra slots
    send the pad block), so that the host does not wait for the GPU; the
    check then runs only where the table is on the host (on a GPU it is the
    debug switch's, ``debug.check_plan_covers``). Otherwise the distinct
    count read back from the device with the check: one wait."""
    if host_size:
        per_rank = int(torch.bincount(spec.owner_of(j_host), minlength=spec.size).max())
        min_phys = int(phys.min()) if phys.device.type == "cpu" else 0
    else:
        per_rank, min_phys = (int(v) for v in torch.stack([counts.max(), phys.min()]).cpu())
    if min_phys < 0:
        raise ValueError("block table holds a negative block id for a block "
                         "the batch reads.")
    return per_rank


def plan_materialization(spec: CPShardSpec, block_table: torch.Tensor,
                         seq_lens: torch.Tensor,
                         pad_block_id: int = 0,
                         min_columns: int = 1,
                         first_blocks: torch.Tensor | None = None,
                         host_size: bool = False
                         ) -> MaterializationPlan:
    """Plan the full-view gather for one batch.

    Args:
        spec: shard layout (``spec.rank`` is not used: the plan is the same
            on every rank).
        block_table: ``[R, C]`` int, virtual block table shared by all ranks
            (column ``c`` holds logical blocks ``c*N .. c*N+N-1``).
        seq_lens: ``[R]`` int, tokens whose KV each request reads this step
            (context plus the tokens computed in this step). Pass them on
            the host: every shape of the plan follows from them there (see
            below).
        pad_block_id: a valid local block id used to pad short rank lists.
        min_columns: least width of ``full_block_table`` (kernels that size
            their index from a request's full length need it).
        first_blocks: ``[R]`` host int, the first logical block each request
            reads (a chunk of its context, :func:`plan_context_chunks`);
            column ``c`` of its ``full_block_table`` row is then logical
            block ``first_blocks[r] + c``. Default: every request from 0.
        host_size: size the collective from the host's read counts
            (:func:`_send_size`; the context chunks, whose scratch
            :func:`chunk_ranges` sizes by the same count).
    Returns:
        The frozen plan. Each (owner, physical block) pair read by the batch
        appears once, even when several requests share it.

    On a GPU the plan is built with fixed shapes from the host lengths; its
    only device-to-host read is the collective's size with the negative-id
    check (one wait per batch), and with ``host_size`` none: the host then
    plans ahead of the device, as vLLM's own steps do.
    """
    device = block_table.device
    n, bs = spec.size, spec.block_size
    lens = seq_lens.to("cpu", torch.int64)
    end = (lens + bs - 1) // bs
    num_reqs = block_table.shape[0]
    first = torch.zeros_like(end) if first_blocks is None else \
        first_blocks.to("cpu", torch.int64)
    nblk = (end - first).clamp(min=0)  # blocks each request reads
    max_end = int(end.max()) if num_reqs else 0
    if max_end > block_table.shape[1] * n:
        raise ValueError(
            f"a request reads {max_end} logical blocks but the block table has "
            f"only {block_table.shape[1]} columns of {n} blocks each.")
    width = max(int(nblk.max()) if num_reqs else 0, min_columns, 1)
    total = int(nblk.sum())
    full = torch.zeros((num_reqs, width), dtype=torch.int32, device=device)
    if total == 0:
        send = torch.full((n, 1), pad_block_id, dtype=torch.int64, device=device)
        return MaterializationPlan(spec=spec, send_block_ids=send,
                                   num_send_blocks=torch.zeros(n, dtype=torch.int64,
                                                               device=device),
                                   full_block_table=full, num_logical_blocks=nblk)
    # every (request, logical block) the batch reads, request-major (host)
    req = torch.repeat_interleave(torch.arange(num_reqs), nblk)
    col = torch.arange(total) - torch.repeat_interleave(torch.cumsum(nblk, 0) - nblk, nblk)
    j_host = col + first[req]
    req, col, j = to_device(torch.stack([req, col, j_host]), device)
    owner = spec.owner_of(j)
    phys = block_table[req, spec.table_index(j)].to(torch.int64)
    order, k_owner, k_phys, slot, counts = _distinct_blocks(owner, phys, n)
    per_rank = _send_size(spec, j_host, counts, phys, host_size)
    send = torch.full((n, per_rank), pad_block_id, dtype=torch.int64, device=device)
    send[k_owner, slot] = k_phys  # duplicates write the same id
    index = torch.empty_like(slot)
    index[order] = k_owner * per_rank + slot
    full[req, col] = index.to(torch.int32)
    return MaterializationPlan(spec=spec, send_block_ids=send,
                               num_send_blocks=counts, full_block_table=full,
                               num_logical_blocks=nblk)


@dataclass(frozen=True)
class ContextChunk:
    """One scratch-sized piece of a batch's cached context (host tensors).

    Attributes:
        first_blocks: ``[R]`` first logical block each request reads in this
            chunk (its token ``first_blocks * block_size`` on).
        num_tokens: ``[R]`` tokens read from there (0: not in this chunk).
        plan: the chunk's materialization plan (``full_block_table`` column
            ``c`` is logical block ``first_blocks + c``).
    """

    first_blocks: torch.Tensor
    num_tokens: torch.Tensor
    plan: MaterializationPlan


def chunk_ranges(spec: CPShardSpec, read_lens: torch.Tensor, capacity_blocks: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split every request's first ``read_lens`` tokens into chunks whose
    gather fits ``capacity_blocks`` scratch blocks (host arithmetic, the
    same on every rank).

    A chunk's scratch holds ``N * P`` blocks, ``P`` the most blocks one rank
    sends; counting each rank's blocks of every request's range (without
    the dedup of shared blocks, which only lowers it) bounds ``P``, so each
    chunk takes requests in order, and a request's range up to the block
    where one rank would exceed ``capacity_blocks // N``. A batch that fits
    is one chunk: the single gather.

    Returns:
        ``[(first_blocks [R], num_tokens [R])]`` in reading order.
    Raises:
        ValueError: ``capacity_blocks`` is below ``N`` (a chunk could not
            hold one block of every rank).
    """
    n, bs = spec.size, spec.block_size
    per_rank = capacity_blocks // n
    if per_rank < 1:
        raise ValueError(f"a scratch of {capacity_blocks} blocks cannot hold one block "
                         f"of each of {n} ranks; raise cp_kv.workspace_tokens.")
    lens = [int(x) for x in read_lens.to("cpu", torch.int64)]
    chunks, num_reqs = [], len(lens)
    first, tokens = [0] * num_reqs, [0] * num_reqs
    used = [0] * n  # blocks each rank sends in the open chunk
    for r, length in enumerate(lens):
        start, end = 0, -(-length // bs)
        while start < end:
            # whole rounds of N blocks add one to every rank, then one block
            # at a time while its owner has room
            take = min(per_rank - max(used), (end - start) // n) * n
            for k in range(n):
                used[k] += take // n
            while start + take < end and used[spec.owner_of(start + take)] < per_rank:
                used[spec.owner_of(start + take)] += 1
                take += 1
            if take:
                first[r], tokens[r] = start, min(length, (start + take) * bs) - start * bs
                start += take
            if start < end:  # the chunk is full
                chunks.append((torch.tensor(first), torch.tensor(tokens)))
                first, tokens, used = [0] * num_reqs, [0] * num_reqs, [0] * n
    if any(tokens) or not chunks:
        chunks.append((torch.tensor(first), torch.tensor(tokens)))
    return chunks


def plan_context_chunks(spec: CPShardSpec, block_table: torch.Tensor,
                        read_lens: torch.Tensor, capacity_blocks: int,
                        min_columns: int = 1) -> list[ContextChunk]:
    """The plans of :func:`chunk_ranges`: once per batch, each chunk's
    gather then runs once per layer into the same scratch. Their collectives
    are sized on the host (``host_size``): a chunk's reads fit the scratch,
    so planning a chunked context never waits for the GPU."""
    bs = spec.block_size
    return [ContextChunk(first, tokens, plan_materialization(
        spec, block_table, torch.where(tokens > 0, first * bs + tokens, 0),
        min_columns=min_columns, first_blocks=first, host_size=True))
        for first, tokens in chunk_ranges(spec, read_lens, capacity_blocks)]


def plan_split_requests(spec: CPShardSpec, block_table: torch.Tensor,
                        row_keys, keys, seq_lens: torch.Tensor,
                        min_columns: int = 1
                        ) -> tuple[MaterializationPlan, torch.Tensor, torch.Tensor]:
    """Plan when each rank runs different pieces of the same requests (PCP).

    Under prefill context parallelism every rank holds a different local
    batch (its own chunks of each prefill), but the gather is a collective:
    the plan must come from what all ranks share, the global batch.

    Args:
        block_table: ``[R_local, C]`` this rank's rows (several rows may
            belong to one request).
        row_keys: ``[R_local]`` request key (e.g. vLLM's request-state index)
            of each local row.
        keys: ``[G]`` request keys of the global batch, the same on every rank.
        seq_lens: ``[G]`` tokens each request may read this step (on every
            rank the same).
    Returns:
        ``(plan, local_full_table, global_table)``: the plan over the ``G``
        global requests (identical on every rank), the ``[R_local, W]``
        full-view block table of this rank's rows, and the ``[G, C]`` block
        table the plan was made from (for the debug checks).
    Raises:
        ValueError: a global request has no local row (its block table
            would be unknown here).
    """
    table, local = global_rows(block_table, row_keys, keys)
    plan = plan_materialization(spec, table, seq_lens, min_columns=min_columns)
    return plan, plan.full_block_table[to_device(local, plan.full_block_table.device)], table


def global_rows(block_table: torch.Tensor, row_keys, keys
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """PCP's global requests from a rank's local rows (:func:`plan_split_requests`):
    ``(table, local)``, the ``[G, C]`` block table of the global requests
    (each from its first local row) and ``local`` ``[R_local]`` (host), the
    global request of each local row."""
    row_keys = [int(k) for k in row_keys]
    keys = [int(k) for k in keys]
    first = {}
    for i, k in enumerate(row_keys):
        first.setdefault(k, i)
    missing = [k for k in keys if k not in first]
    if missing:
        raise ValueError(
            f"requests {missing} of the global batch have no row on this rank; "
            "the sharded plan needs every request's block table on every rank.")
    position = {k: g for g, k in enumerate(keys)}
    unknown = [k for k in row_keys if k not in position]
    if unknown:
        raise ValueError(f"local rows of requests {unknown} are not in the global batch.")
    rows = to_device(torch.tensor([first[k] for k in keys], dtype=torch.long),
                     block_table.device)
    return block_table[rows], torch.tensor([position[k] for k in row_keys], dtype=torch.long)


def rows_of_chunk(chunk: ContextChunk, local: torch.Tensor, row_context: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's part of a chunk: from its request's range of the chunk
    (``local``: each row's request in the chunk), the tokens below the
    row's own context length (``row_context``, host). Over TP the rows are
    the chunk's requests and read their whole range; under PCP the chunks
    are the global requests' (identical on every rank) and a row runs one
    piece of its request, so contexts differ between a request's rows and
    ranks.

    Returns ``(tokens, table)``: ``[R_local]`` tokens each row reads from
    the chunk's first token of its request on (0: none), and the
    ``[R_local, W]`` chunk table of each row's request (column 0 = that
    first block).
    """
    start = chunk.first_blocks[local] * chunk.plan.spec.block_size
    tokens = torch.minimum((row_context.long() - start).clamp(min=0),
                           chunk.num_tokens[local])
    table = chunk.plan.full_block_table
    return tokens, table[to_device(local, table.device)]
