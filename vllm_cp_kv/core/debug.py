"""Syncing invariant checks, run only with ``VLLM_CP_KV_DEBUG=1``.

Each check raises :class:`CPKVInvariantError` with the numbers and the
likely culprit, whatever the interpreter's flags (``python -O`` drops
``assert`` statements, not these). They copy tensors to the host and (for
the plan check) talk to the other ranks, so they are off for performance
runs.
"""

from __future__ import annotations

import torch

from .ownership import CPShardSpec, owned_slot_mapping
from .plan import MaterializationPlan


class CPKVInvariantError(AssertionError):
    """A debug invariant of the sharded layout does not hold (an
    ``AssertionError`` subclass: callers that caught those still do)."""


def _require(ok: bool, message) -> None:
    if not ok:
        raise CPKVInvariantError(message() if callable(message) else message)


def expected_slot_mapping(spec: CPShardSpec, block_table: torch.Tensor,
                          query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor) -> torch.Tensor:
    """Slots this rank must write for the batch's new tokens (-1 = not owned).

    Args:
        block_table: ``[R, C]`` virtual block table.
        query_start_loc: ``[R + 1]`` offsets of each request's new tokens.
        seq_lens: ``[R]`` tokens per request including the new ones.
    Returns:
        ``[T]`` int64 with ``T = query_start_loc[-1]``.
    """
    qsl = query_start_loc.cpu().long()
    seq = seq_lens.cpu().long()[: qsl.numel() - 1]
    q = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(q.numel()), q)
    positions = torch.arange(int(qsl[-1])) - qsl[:-1][req] + (seq - q)[req]
    return owned_slot_mapping(positions, req, block_table.cpu(), spec.block_size,
                              spec.size, spec.rank, interleave=spec.block_size)


def check_owned_writes(spec: CPShardSpec, slot_mapping: torch.Tensor,
                       block_table: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor) -> None:
    """Every slot this rank writes belongs to a block it owns (and vice versa)."""
    want = expected_slot_mapping(spec, block_table, query_start_loc, seq_lens)
    got = slot_mapping.cpu().long()[: want.numel()]
    bad = (got != want).nonzero().flatten()
    _require(bad.numel() == 0, lambda: (
        f"rank {spec.rank}/{spec.size}: slot mapping writes non-owned or wrong "
        f"slots at token(s) {bad[:8].tolist()}: got {got[bad[:8]].tolist()}, "
        f"want {want[bad[:8]].tolist()}. The slot-mapping kernel's interleave "
        f"size is probably not the block size ({spec.block_size})."))


def check_plan_covers(plan: MaterializationPlan, block_table: torch.Tensor,
                      read_lens: torch.Tensor, first_blocks: torch.Tensor | None = None
                      ) -> None:
    """Every block a kernel reads has a valid (non-negative) id and maps to
    its owner's block in the scratch (``first_blocks``: a context chunk's,
    see ``plan.plan_materialization``)."""
    spec = plan.spec
    per_rank = plan.blocks_per_rank
    full = plan.full_block_table.cpu().long()
    send = plan.send_block_ids.cpu()
    counts = plan.num_send_blocks.cpu()
    table = block_table.cpu().long()
    first = [0] * full.shape[0] if first_blocks is None else first_blocks.tolist()
    for i, n_tok in enumerate(read_lens.cpu().tolist()):
        for j in range(first[i], -(-int(n_tok) // spec.block_size)):
            idx = int(full[i, j - first[i]])
            rank, k = divmod(idx, per_rank)
            owner = spec.owner_of(j)
            want = int(table[i, spec.table_index(j)])
            _require(want >= 0, lambda: (
                f"request {i} logical block {j}: the block table holds the negative "
                f"block id {want} (on a GPU the plan does not read the table back)."))
            _require(rank == owner and k < int(counts[rank]) and
                     int(send[rank, k]) == want, lambda: (
                         f"request {i} logical block {j}: scratch block {idx} holds "
                         f"rank {rank}'s block {int(send[rank, k])}, want rank "
                         f"{owner}'s block {want}. The plan is stale or was "
                         "built from another block table."))


def check_chunks_cover(chunks: list, block_table: torch.Tensor,
                       read_lens: torch.Tensor) -> None:
    """The context chunks (``plan.plan_context_chunks``) read every token
    of ``read_lens`` exactly once, in order, each through its owner's block."""
    bs = chunks[0].plan.spec.block_size
    pos = [0] * len(read_lens)
    for k, c in enumerate(chunks):
        for i, (first, n) in enumerate(zip(c.first_blocks.tolist(), c.num_tokens.tolist())):
            if n:
                _require(first * bs == pos[i], lambda: (
                    f"chunk {k} reads request {i} from token {first * bs}, but "
                    f"the chunks before it read up to {pos[i]}."))
                pos[i] += n
        ends = torch.where(c.num_tokens > 0, c.first_blocks * bs + c.num_tokens, 0)
        check_plan_covers(c.plan, block_table, ends, c.first_blocks)
    want = read_lens.cpu().tolist()
    _require(pos == want, lambda: (f"the chunks read {pos} tokens per request, the "
                                   f"batch must read {want}."))


def plan_fingerprint(plan: MaterializationPlan) -> torch.Tensor:
    """Small int64 digest of everything that must match across ranks."""
    parts = [plan.send_block_ids, plan.full_block_table, plan.num_send_blocks]
    digest = [torch.tensor(p.shape).sum() for p in parts]
    weights = [torch.arange(1, p.numel() + 1, dtype=torch.int64) for p in parts]
    digest += [(p.cpu().flatten().long() * w).sum() for p, w in zip(parts, weights)]
    return torch.stack(digest).long()


def check_plan_identical(plan: MaterializationPlan, cpu_group) -> None:
    """All ranks of the shard group hold the same plan (collective)."""
    import torch.distributed as dist

    mine = plan_fingerprint(plan)
    world = dist.get_world_size(cpu_group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=cpu_group)
    for r, other in enumerate(everyone):
        _require(torch.equal(other, mine), lambda: (
            f"rank {plan.spec.rank}: materialization plan differs from rank "
            f"{r} ({mine.tolist()} vs {other.tolist()}). Ranks were given "
            "different block tables or sequence lengths."))


def check_decode_merge(merged: torch.Tensor, reference: torch.Tensor,
                       spec: CPShardSpec, unsharded: torch.Tensor | None = None
                       ) -> tuple[float, float | None]:
    """The LSE-merged decode output equals attention over the full view.

    Tolerance: the two sum the same terms (thousands per row) in another
    order in float32, then round to the output dtype: a few units of that
    dtype's epsilon plus 1e-5 for the float32 sums, relative to the
    output's magnitude. ``unsharded`` is vLLM's own decode kernel on the
    same full view: the merged output may also be as far from the reference
    as twice that kernel's own error (each rank's partial output is
    rounded once more before the merge). A layout error reads other tokens
    and is off by the output's own magnitude.

    Returns:
        ``(error, unsharded error)``, the largest absolute differences from
        ``reference`` (None without ``unsharded``).
    """
    got, want = merged.float(), reference.float()
    eps = torch.finfo(merged.dtype).eps
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    tol = (8 * eps + 1e-5) * scale
    err = float((got - want).abs().max()) if want.numel() else 0.0
    inner = None
    if unsharded is not None:
        inner = float((unsharded.float() - want).abs().max()) if want.numel() else 0.0
        tol = max(tol, 2 * inner + 2 * eps * scale)
    _require(err <= tol, lambda: (
        f"rank {spec.rank}/{spec.size}: shard-aware decode differs from "
        f"attention over the materialized full view by {err:.3g} (tolerance "
        f"{tol:.3g}; vLLM's kernel on that view: {inner}). A decode row's "
        "owned-token count or block table does not match the layout, or the "
        "LSE merge is wrong."))
    return err, inner
