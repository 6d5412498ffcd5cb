"""Last-token gather at the end of a context-parallel prefill.

Under prefill context parallelism each rank holds the hidden states of its
own chunks. vLLM restores the global batch with one all-gather of every
token (``full = all_gather(local)[restore_idx]``), although sampling reads
only ``full[logits_indices]``. This module collects just those rows:

    src_rank[b] = restore_idx[logits_indices[b]] // local_rows
    src_row[b]  = restore_idx[logits_indices[b]] %  local_rows
    rank r sends buf[b] = local[src_row[b]] for every b   # [B, H]
    gathered = all_gather(buf)                       # [N, B, H], one collective
    out[b]   = gathered[src_rank[b], b]              # == full[logits_indices[b]]

It only needs the split's index map (``restore_idx``: global token ->
position in the rank-major gathered tensor), so any split works: vLLM's
DualChunkSwap zigzag or a plain round-robin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .materialize import AllGatherFn


@dataclass(frozen=True)
class SampledRowsPlan:
    """Where each sampled row lives. Shapes: ``B`` sampled rows.

    Attributes:
        src_rank: ``[B]`` int64, the rank holding each row.
        src_row: ``[B]`` int64, its row in that rank's local hidden states.
        local_rows: rows of every rank's local hidden-state tensor.
        pick: ``[B]`` int64, where row ``b`` lands in the flat gathered tensor.
    """

    src_rank: torch.Tensor
    src_row: torch.Tensor
    local_rows: int
    pick: torch.Tensor  # [B] ``src_rank * B + b``: row in the flat [N * B] gather

    @property
    def num_rows(self) -> int:
        return self.src_rank.numel()


def plan_sampled_rows(restore_idx: torch.Tensor, logits_indices: torch.Tensor,
                      local_rows: int) -> SampledRowsPlan:
    """Args:
        restore_idx: ``[T]`` int, global token -> index into the rank-major
            gathered tensor of ``N * local_rows`` rows.
        logits_indices: ``[B]`` int, global tokens that are sampled.
        local_rows: rows per rank in the gather (padding included).
    """
    pos = restore_idx.long()[logits_indices.long()]
    src_rank = pos // local_rows
    pick = src_rank * pos.numel() + torch.arange(pos.numel(), device=pos.device)
    return SampledRowsPlan(src_rank=src_rank, src_row=pos % local_rows,
                           local_rows=local_rows, pick=pick)


def gather_sampled_rows(plan: SampledRowsPlan, rank: int, world_size: int,
                        local_hidden: torch.Tensor,
                        all_gather_into: AllGatherFn) -> torch.Tensor:
    """Rows ``full[logits_indices]`` with one ``[N, B, H]`` all-gather.

    Args:
        local_hidden: ``[local_rows, H]`` this rank's hidden states.
    Returns:
        ``[B, H]``, bitwise equal to the full gather's rows.
    """
    if local_hidden.shape[0] != plan.local_rows:
        raise ValueError(
            f"local hidden states have {local_hidden.shape[0]} rows, the plan "
            f"expects {plan.local_rows}; re-plan for this batch.")
    num_rows, hidden = plan.num_rows, local_hidden.shape[1]
    # Every rank sends its row for every b (rows it does not own are just
    # whatever it holds there); ``pick`` keeps the owner's copy. No masking,
    # no boolean indexing (which would synchronize with the host): two small
    # kernels and one collective.
    buf = local_hidden.index_select(0, plan.src_row)
    gathered = local_hidden.new_empty((world_size * num_rows, hidden))
    all_gather_into(gathered, buf)
    return gathered.index_select(0, plan.pick)


def narrow_bytes(world_size: int, num_rows: int, hidden: int, elem: int) -> int:
    """Bytes each rank receives on the narrow path."""
    return world_size * num_rows * hidden * elem


def full_bytes(world_size: int, local_rows: int, hidden: int, elem: int) -> int:
    """Bytes each rank receives on vLLM's full path."""
    return world_size * local_rows * hidden * elem
