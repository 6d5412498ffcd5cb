"""The ownership rule against vLLM's own code: a scalar transcription of
vLLM's slot-mapping kernel (harness/reference.py) decides where every token
lives, and vLLM's ``get_dcp_local_seq_lens`` how many tokens each rank holds.
The package's rule (``j % N``, ``table[j // N]``) is never the reference.
Negative control: the same checks reject token-interleaved DCP (vLLM's
default interleave 1), which is a valid layout but not block ownership.
"""

import pytest
import torch

from conftest import needs_vllm
from harness.reference import owned_counts, stored_at, vllm_slot
from vllm_cp_kv.core.ownership import (CPShardSpec, owned_slot_mapping,
                                       owned_token_count)

BS = 16


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_token_lives_where_the_rule_says(n):
    row = list(range(1000, 1100))  # a block table row
    for pos in range(0, 40 * BS * n // 8 + 3 * BS):
        rank, slot = stored_at(pos, row, BS, n)
        spec = CPShardSpec(rank, n, BS)
        j = pos // BS
        assert bool(spec.owns_slot(torch.tensor([pos]))[0])
        assert int(spec.owner_of(j)) == rank
        # the physical block is the table entry the rule names, on that rank
        assert slot // BS == row[int(spec.table_index(j))]
        assert j in spec.logical_blocks_of(rank, j + 1)


@pytest.mark.parametrize("n", [2, 4])
def test_owned_slot_mapping_matches_vllms_kernel(n):
    gen = torch.Generator().manual_seed(n)
    table = torch.randint(1, 500, (3, 8), generator=gen, dtype=torch.int32)
    positions = torch.arange(0, 8 * BS * n, 7)
    req = torch.arange(positions.numel()) % 3
    for rank in range(n):
        for interleave in (BS, 1):
            got = owned_slot_mapping(positions, req, table, BS, n, rank, interleave)
            want = [vllm_slot(int(p), table[int(r)].tolist(), BS, n, rank, interleave)
                    for p, r in zip(positions, req)]
            assert got.tolist() == want


@needs_vllm
@pytest.mark.parametrize("n", [2, 4, 8])
def test_owned_token_count_equals_vllms_dcp_local_lengths(n):
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    lens = torch.tensor([0, 1, 15, 16, 17, 33, 64, 100, 257, 1000, 4097])
    want = owned_counts(lens.tolist(), BS, n)
    got = [int(owned_token_count(lens, CPShardSpec(r, n, BS)).sum()) for r in range(n)]
    assert got == want
    for r in range(n):
        vllm_counts = get_dcp_local_seq_lens(lens, n, r, BS)
        assert owned_token_count(lens, CPShardSpec(r, n, BS)).tolist() == \
            vllm_counts.tolist()
    # negative control: vLLM's default token interleave is another layout
    other = get_dcp_local_seq_lens(lens, n, 0, 1)
    assert other.tolist() != owned_token_count(lens, CPShardSpec(0, n, BS)).tolist()


def test_block_ownership_differs_from_token_interleave():
    """Negative control for the slot checks: with interleave 1 the same
    position lands elsewhere, and the rule-vs-kernel comparison catches it."""
    n, row = 2, list(range(100))
    pos = 1  # block 0 (rank 0 under block ownership), odd token (rank 1 at interleave 1)
    assert stored_at(pos, row, BS, n)[0] == 0
    assert vllm_slot(pos, row, BS, n, 0, 1) == -1


@pytest.mark.parametrize("n", [2, 4, 8])
def test_capacity_splits_evenly(n):
    """N ranks give N times the capacity: per-rank token counts of a long
    request differ by at most one block (from the kernel transcription)."""
    counts = owned_counts([37 * BS + 5], BS, n)
    assert sum(counts) == 37 * BS + 5
    assert max(counts) - min(counts) <= BS


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="rank"):
        CPShardSpec(2, 2, BS)
    with pytest.raises(ValueError, match="block_size"):
        CPShardSpec(0, 2, 0)
    with pytest.raises(ValueError, match="cyclic"):
        CPShardSpec(0, 2, BS, rule="random")
