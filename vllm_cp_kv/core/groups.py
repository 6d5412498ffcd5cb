"""One KV shard group over PCP x TP ranks (issue 40): numbering and the
shard-aware decode's merge.

A long-context deployment across nodes runs TP inside a node and PCP across
them. Sharding the MLA latent over all ``N = PCP x TP`` ranks needs one shard
rank per rank, numbered as vLLM numbers a decode-context-parallel (DCP)
group that spans both axes, because vLLM's block tables and slot mapping
(``total_cp_rank``, the DCP rank) decide where each token's KV is written.
vLLM orders world ranks TP innermost (``world = pcp_rank * TP + tp_rank``,
one DP and PP rank) and builds that DCP group from the ranks with the PCP
and TP axes swapped ("DCP spans PCP first, then TP"):

* vLLM 0.32 and 0.33 list the group's members in that order, so the DCP
  rank (``rank_in_group``) is ``tp_rank * PCP + pcp_rank`` (``pcp_first``;
  ``tests/distributed/test_pcp_tp_group.py`` reads it from vLLM's own groups); but
  torch orders a group's collectives by world rank, so there a gather's
  output slot ``i`` holds world rank ``i``, not DCP rank ``i``: a gather
  indexed by shard rank must permute (the test shows both orders);
* vLLM 0.34 sorts the members ("or rank_in_group disagrees with the
  collectives' output order"), so the DCP rank is the world rank.
The decode under PCP x TP: every rank holds the queries of its TP rank's
``H / TP`` heads (gathered to all ``H`` over TP, or replicated), attends to
the blocks it owns with all ``H``, and the partial outputs of all ``N`` ranks
merge by LSE; each rank keeps its TP rank's heads. :func:`merge_partials`
does it with three collectives: the LSEs all-gathered over the shard group,
the weighted outputs reduce-scattered by heads over the TP group (inside a
node), then summed over the PCP group (across nodes: ``H / TP`` heads, not
all ``H``).

Torch only: the groups are ``torch.distributed`` process groups (vLLM's
``GroupCoordinator.device_group`` or ``cpu_group`` in the integration).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PCPxTP:
    """The shard group of ``pcp`` x ``tp`` ranks and its numberings."""

    pcp: int
    tp: int
    pcp_first: bool = False  # vLLM 0.32/0.33's DCP numbering; 0.34's is the world's

    def __post_init__(self):
        if self.pcp < 1 or self.tp < 1:
            raise ValueError(f"cp_kv: PCP {self.pcp} x TP {self.tp}: sizes must be >= 1")

    @property
    def size(self) -> int:
        return self.pcp * self.tp

    def world_rank(self, pcp_rank: int, tp_rank: int) -> int:
        """vLLM's world rank (TP innermost; one DP and PP rank)."""
        self._check(pcp_rank, tp_rank)
        return pcp_rank * self.tp + tp_rank

    def shard_rank(self, pcp_rank: int, tp_rank: int) -> int:
        """The rank in the shard group: vLLM's DCP rank, which its slot
        mapping writes by (PCP innermost where ``pcp_first``)."""
        self._check(pcp_rank, tp_rank)
        if self.pcp_first:
            return tp_rank * self.pcp + pcp_rank
        return pcp_rank * self.tp + tp_rank

    def coords(self, shard_rank: int) -> tuple[int, int]:
        """``(pcp_rank, tp_rank)`` of a shard rank."""
        if not 0 <= shard_rank < self.size:
            raise ValueError(f"cp_kv: shard rank {shard_rank} outside 0..{self.size - 1}")
        if self.pcp_first:
            return shard_rank % self.pcp, shard_rank // self.pcp
        return divmod(shard_rank, self.tp)

    def heads(self, tp_rank: int, num_heads: int) -> slice:
        """The query heads a TP rank's layer computes (of ``num_heads``)."""
        if num_heads % self.tp:
            raise ValueError(f"cp_kv: {num_heads} heads do not split over TP {self.tp}")
        per = num_heads // self.tp
        return slice(tp_rank * per, (tp_rank + 1) * per)

    def _check(self, pcp_rank: int, tp_rank: int) -> None:
        if not (0 <= pcp_rank < self.pcp and 0 <= tp_rank < self.tp):
            raise ValueError(f"cp_kv: ranks (pcp {pcp_rank}, tp {tp_rank}) outside "
                             f"PCP {self.pcp} x TP {self.tp}")


def merge_partials(out: torch.Tensor, lse: torch.Tensor, layout: PCPxTP, shard_group,
                   pcp_group, tp_group) -> torch.Tensor:
    """This rank's heads of the attention over every rank's owned keys.

    Args:
        out: ``[B, H, D]`` this rank's partial output over the keys it owns
            (all ``H`` heads), normalized.
        lse: ``[B, H]`` its natural-log LSE (``-inf``: no key).
        shard_group, pcp_group, tp_group: the process groups of all ``N``
            ranks, of the ranks with this rank's TP rank, of those with its
            PCP rank.
    Returns:
        ``[B, H / TP, D]`` in ``out``'s dtype (accumulated in float32, float64
        for float64 parts): the merge of all ``N`` parts for this rank's TP
        heads; zero where no rank had a key.
    """
    b, h, d = out.shape
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    lses = torch.empty(layout.size * b, h, dtype=acc, device=lse.device)
    dist.all_gather_into_tensor(lses, lse.to(acc).contiguous(), group=shard_group)
    lses = lses.view(layout.size, b, h)
    top = lses.max(dim=0).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    total = (lses - top).exp().sum(dim=0).clamp(min=1e-30)
    weighted = out.to(acc) * ((lse.to(acc) - top).exp() / total)[..., None]
    # heads first: the TP ranks' slices are contiguous chunks to scatter
    mine = weighted.transpose(0, 1).contiguous()  # [H, B, D]
    if layout.tp > 1:  # within a node: this PCP rank's keys, this TP rank's heads
        part = torch.empty(h // layout.tp, b, d, dtype=acc, device=out.device)
        dist.reduce_scatter_tensor(part, mine, group=tp_group)
        mine = part
    if layout.pcp > 1:  # across nodes: the other PCP ranks' keys, H / TP heads only
        dist.all_reduce(mine, group=pcp_group)
    return mine.transpose(0, 1).to(out.dtype)
