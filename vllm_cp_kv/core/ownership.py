"""Block ownership: which rank of the KV shard group stores a logical block.

The rule is vLLM's own DCP layout with ``cp_kv_cache_interleave_size ==
block_size``. Every rank of the shard group holds the same *virtual* block
table; a virtual block spans ``shard_size`` logical blocks of ``block_size``
tokens. For logical block ``j`` of a request (tokens ``[j*bs, (j+1)*bs)``)::

    owner(j)        = j % shard_size
    table_index(j)  = j // shard_size        # column of the virtual block table
    physical id     = block_table[req, table_index(j)]   # on rank owner(j)

Pure and stateless: the planner, the materializer, the decode's owned
counts, the CPU slot mapping and the connectors call these functions; none
recomputes ownership inline. vLLM's scheduler and its GPU slot-mapping
kernel keep vLLM's own DCP layout, which equals this rule with
``cp_kv_cache_interleave_size == block_size`` (pinned by the plugin). Because owners are exactly
cyclic, per-rank block counts of one request differ by at most one, so N ranks
give N times the logical capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


CYCLIC = "cyclic"  # the one ownership rule: owner(j) = j % size


@dataclass(frozen=True)
class CPShardSpec:
    """Everything both sides of a transfer need to reproduce the layout."""

    rank: int  # this rank's index in the shard group
    size: int  # ranks in the shard group (N)
    block_size: int  # tokens per logical (kernel-visible) block
    rule: str = CYCLIC  # owner(j) = j % size

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"CPShardSpec needs 0 <= rank < size, got rank={self.rank}, "
                f"size={self.size}.")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.rule != CYCLIC:
            raise ValueError(f"only the 'cyclic' rule exists, got {self.rule!r}.")

    def owner_of(self, logical_blocks: torch.Tensor) -> torch.Tensor:
        """Owner rank of each logical block index (any int shape)."""
        return logical_blocks % self.size

    def table_index(self, logical_blocks: torch.Tensor) -> torch.Tensor:
        """Column of the virtual block table that holds each logical block."""
        return logical_blocks // self.size

    def owns_slot(self, token_positions: torch.Tensor) -> torch.Tensor:
        """Mask of token positions whose KV this rank stores."""
        return self.owner_of(token_positions // self.block_size) == self.rank

    def logical_blocks_of(self, rank: int, num_logical_blocks: int) -> list[int]:
        """Logical block indices of one request that ``rank`` owns."""
        return list(range(rank, num_logical_blocks, self.size))


def owned_token_count(seq_lens: torch.Tensor, spec: CPShardSpec) -> torch.Tensor:
    """Tokens of each request (of ``seq_lens`` tokens) that ``spec.rank`` owns.

    Whole blocks ``0 .. full - 1`` are dealt cyclically, so the rank owns
    ``ceil((full - rank) / N)`` of them; the partial last block ``full``
    (``seq % block_size`` tokens) belongs to ``owner_of(full)``.
    """
    seq = seq_lens.long()
    bs, n, r = spec.block_size, spec.size, spec.rank
    full = seq // bs
    whole = torch.div(full - r + n - 1, n, rounding_mode="floor").clamp(min=0)
    tail = torch.where(spec.owner_of(full) == r, seq % bs, torch.zeros_like(seq))
    return whole * bs + tail


def num_logical_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def owned_slot_mapping(positions: torch.Tensor, req_indices: torch.Tensor,
                       block_table: torch.Tensor, block_size: int,
                       cp_size: int, cp_rank: int, interleave: int,
                       pad_id: int = -1) -> torch.Tensor:
    """Slots where this rank stores each new token, ``pad_id`` if not owned.

    The same arithmetic as vLLM's ``ComputeSlotMappingKernel`` (a virtual
    block of ``block_size * cp_size`` tokens; token offsets are dealt to
    ranks in runs of ``interleave``), in plain torch for CPUs. With
    ``interleave == block_size`` this is :meth:`CPShardSpec.owns_slot`.

    Args:
        positions: ``[T]`` int64 token positions.
        req_indices: ``[T]`` request row of each token in ``block_table``.
        block_table: ``[R, C]`` int32 virtual block table.
    Returns:
        ``[T]`` int64 slot ids.
    """
    virtual = block_size * cp_size
    vblock = positions // virtual
    voffset = positions % virtual
    local = (voffset // interleave) % cp_size == cp_rank
    local_offset = (voffset // (cp_size * interleave)) * interleave + voffset % interleave
    blocks = block_table[req_indices.long(), vblock.long()].long()
    slots = blocks * block_size + local_offset
    return torch.where(local, slots, torch.full_like(slots, pad_id))
