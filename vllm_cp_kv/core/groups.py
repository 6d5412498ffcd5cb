"""One KV shard group over PCP x TP ranks (issue 40): numbering and the
shard-aware decode's merge.

A long-context deployment across nodes runs TP inside a node and PCP across
them. Sharding the MLA latent over all ``N = PCP x TP`` ranks needs one shard
rank per rank, numbered as vLLM numbers a decode-context-parallel (DCP)
group that spans both axes, because vLLM's block tables and slot mapping
(``total_cp_rank``, the DCP rank) decide where each token's KV is written:

* vLLM orders world ranks TP innermost: ``world = pcp_rank * TP + tp_rank``
  (with one DP and PP rank);
* ``initialize_model_parallel`` builds a DCP group of size PCP x TP from the
  ranks with the PCP and TP axes swapped ("DCP spans PCP first, then TP"),
  so the DCP rank is ``tp_rank * PCP + pcp_rank``
  (``tests/test_pcp_tp_group.py`` reads it from vLLM's own groups).

The decode under PCP x TP: every rank holds the queries of its TP rank's
``H / TP`` heads (gathered to all ``H`` over TP, or replicated), attends to
the blocks it owns with all ``H``, and the partial outputs of all ``N`` ranks
merge by LSE; each rank keeps its TP rank's heads. :func:`merge_partials`
does it with three collectives: the LSEs all-gathered over the shard group,
the weighted outputs summed over the PCP group (ranks of one TP rank), then
reduce-scattered by heads over the TP group.

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
        """The rank in the shard group: vLLM's DCP rank (PCP innermost),
        which its slot mapping writes by."""
        self._check(pcp_rank, tp_rank)
        return tp_rank * self.pcp + pcp_rank

    def coords(self, shard_rank: int) -> tuple[int, int]:
        """``(pcp_rank, tp_rank)`` of a shard rank."""
        if not 0 <= shard_rank < self.size:
            raise ValueError(f"cp_kv: shard rank {shard_rank} outside 0..{self.size - 1}")
        return shard_rank % self.pcp, shard_rank // self.pcp

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
    if layout.pcp > 1:  # the ranks of this TP rank: their keys, all heads
        dist.all_reduce(weighted, group=pcp_group)
    if layout.tp == 1:
        return weighted.to(out.dtype)
    # heads first: the TP ranks' slices are contiguous chunks to scatter
    by_head = weighted.transpose(0, 1).contiguous()  # [H, B, D]
    mine = torch.empty(h // layout.tp, b, d, dtype=acc, device=out.device)
    dist.reduce_scatter_tensor(mine, by_head, group=tp_group)
    return mine.transpose(0, 1).to(out.dtype)
