"""Pins the ownership rule: a bijection between (request, logical block)
and (owner rank, physical block), identical to vLLM's DCP layout with
``cp_kv_cache_interleave_size == block_size``.

Constants: N ranks, BS tokens per block.
"""

import pytest
import torch

from vllm_cp_kv.core.capacity import scratch_blocks_bound
from vllm_cp_kv.core.ownership import CPShardSpec, owned_slot_mapping

BS = 16


def vllm_slot_reference(pos, table_row, bs, n, rank, interleave):
    """Scalar transcription of vLLM's ComputeSlotMappingKernel."""
    virtual = bs * n
    vblock, voff = divmod(pos, virtual)
    if (voff // interleave) % n != rank:
        return -1
    local = (voff // (n * interleave)) * interleave + voff % interleave
    return table_row[vblock] * bs + local


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ranks_partition_blocks(n):
    num_blocks = 37
    owned = [set(CPShardSpec(r, n, BS).logical_blocks_of(r, num_blocks)) for r in range(n)]
    assert set().union(*owned) == set(range(num_blocks))
    assert sum(len(o) for o in owned) == num_blocks
    sizes = [len(o) for o in owned]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n", [2, 4])
def test_owned_slot_mapping_matches_vllm_kernel(n):
    gen = torch.Generator().manual_seed(n)
    table = torch.randint(1, 500, (3, 8), generator=gen, dtype=torch.int32)
    positions = torch.arange(0, 8 * BS * n, 7)
    req = torch.arange(positions.numel()) % 3
    for rank in range(n):
        got = owned_slot_mapping(positions, req, table, BS, n, rank, BS)
        want = [vllm_slot_reference(int(p), table[int(r)].tolist(), BS, n, rank, BS)
                for p, r in zip(positions, req)]
        assert got.tolist() == want
        spec = CPShardSpec(rank, n, BS)
        assert ((got >= 0) == spec.owns_slot(positions)).all()


def test_every_position_stored_exactly_once():
    n = 4
    table = torch.arange(100, 110, dtype=torch.int32)[None]
    positions = torch.arange(10 * BS * n)
    req = torch.zeros_like(positions)
    stored = torch.stack([owned_slot_mapping(positions, req, table, BS, n, r, BS)
                          for r in range(n)])
    assert ((stored >= 0).sum(0) == 1).all()
    # within each rank, distinct positions never share a slot
    for r in range(n):
        s = stored[r][stored[r] >= 0]
        assert s.unique().numel() == s.numel()


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="rank"):
        CPShardSpec(2, 2, BS)
    with pytest.raises(ValueError, match="block_size"):
        CPShardSpec(0, 2, 0)
    with pytest.raises(ValueError, match="cyclic"):
        CPShardSpec(0, 2, BS, rule="random")


def test_scratch_bound_is_the_tighter_limit():
    kw = dict(page_bytes=16 * 1152, num_layers=3, shard_size=2, block_size=16)
    # limited by max_num_seqs x max_model_len: 16 seqs x 16 blocks per rank x 2
    assert scratch_blocks_bound(available_bytes=2**30, max_num_seqs=16,
                                max_model_len=512, **kw) == 2 * 16 * 16
    # limited by memory: scratch <= N * (available - scratch) / (L * page)
    b = scratch_blocks_bound(available_bytes=2**20, max_num_seqs=256,
                             max_model_len=8192, **kw)
    persistent_blocks_per_layer = (2**20 - b * kw["page_bytes"]) / (3 * kw["page_bytes"])
    assert b <= 2 * persistent_blocks_per_layer and b % 2 == 0 and b > 0
    assert scratch_blocks_bound(available_bytes=2**30, max_num_seqs=16,
                                max_model_len=512, cap_blocks=10, **kw) == 10
