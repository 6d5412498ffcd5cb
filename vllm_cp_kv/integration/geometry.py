"""The shard geometry: which ranks share one sharded KV cache, and how.

Derived once from vLLM's configuration and passed whole to everything that
needs it (the runtime, the connector, the statistics, the handshake): the
group size in :func:`shard_group_size` and the rank in :func:`shard_rank`,
nowhere else.

The KV shard group is the TP group without PCP, the PCP group with TP 1,
and all PCP x TP ranks with both (vLLM 0.34, ``core.groups.PCPxTP``). Each
way the plugin makes it vLLM's DCP group (``decode_context_parallel_size``,
which vLLM lets span the TP axis, the PCP axis, or both), so vLLM's
scheduler, block tables and slot mapping already use the sharded layout
(``core/ownership.py``). The query heads split over the TP ranks: every
rank of a TP shard group has ``H / N``, of a PCP group all ``H``, of a PCP x
TP group its TP rank's ``H / TP`` (:attr:`ShardGeometry.head_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.groups import PCPxTP
from ..core.ownership import CPShardSpec
from .options import options_of


def shard_group_size(tp: int, pcp: int) -> int:
    """Ranks of the KV shard group: all PCP x TP ranks (the PCP group with TP
    1, the TP group without PCP; both at once, ``core.groups.PCPxTP``, on
    vLLM 0.34: row pcp-and-tp)."""
    return PCPxTP(pcp, tp).size


def group_size_of(vllm_config) -> int:
    """The shard group's size for a running config: 1 unless cp_kv shards."""
    options = options_of(vllm_config)
    if not (options.enable and options.kv_sharding):
        return 1
    parallel = vllm_config.parallel_config
    return shard_group_size(parallel.tensor_parallel_size,
                            parallel.prefill_context_parallel_size)


def shard_rank(size: int, dcp_group=None) -> int:
    """This worker's rank in the shard group (a worker-process call): the
    rank in vLLM's DCP group, which spans the shard group (the TP rank under
    TP sharding, the PCP rank under PCP, where every rank has TP rank 0, and
    under PCP x TP the world rank, ``pcp_rank * TP + tp_rank``, as vLLM 0.34
    numbers that group); 0 when nothing is sharded. The group is vLLM's
    unless given (tests)."""
    if size == 1:
        return 0
    if dcp_group is None:
        from vllm.distributed.parallel_state import get_dcp_group

        dcp_group = get_dcp_group()
    if dcp_group.world_size != size:
        raise ValueError(f"cp_kv: vLLM's DCP group has {dcp_group.world_size} "
                         f"ranks, the shard group {size}")
    return dcp_group.rank_in_group


@dataclass(frozen=True)
class ShardGeometry(CPShardSpec):
    """A :class:`~vllm_cp_kv.core.ownership.CPShardSpec` (rank, size, block
    size, ownership rule) and the parallel axis its group spans."""

    axis: str = "tp"  # "tp", "pcp" or "pcp-tp": the vLLM axes the shard group spans
    tp: int = 1  # TP ranks (under "pcp-tp"; the query heads split over them)

    @property
    def head_ranks(self) -> int:
        """Ranks the query heads split over, each layer holding ``H / this``:
        the shard group's N (TP), 1 (PCP), TP (PCP x TP). The shard-aware
        decode gathers the queries over them."""
        return {"tp": self.size, "pcp": 1}.get(self.axis, self.tp)

    @property
    def head_rank(self) -> int:
        """This rank's place among :attr:`head_ranks` (its TP rank: under PCP
        x TP, ``rank % TP``, vLLM 0.34's numbering, ``core.groups.PCPxTP``)."""
        return self.rank % self.head_ranks


def geometry_of(vllm_config, block_size: int | None = None, rank: int | None = None
                ) -> ShardGeometry:
    """The worker's geometry. ``block_size``: the KV spec's finalized block
    size (default: the cache config's); ``rank``: given by tests, else
    :func:`shard_rank` (needs vLLM's distributed groups)."""
    parallel = vllm_config.parallel_config
    size = group_size_of(vllm_config)
    tp, pcp = parallel.tensor_parallel_size, parallel.prefill_context_parallel_size
    axis = ("pcp-tp" if tp > 1 else "pcp") if pcp > 1 else "tp"
    return ShardGeometry(rank=shard_rank(size) if rank is None else rank, size=size,
                         block_size=block_size or vllm_config.cache_config.block_size,
                         axis=axis, tp=tp)
