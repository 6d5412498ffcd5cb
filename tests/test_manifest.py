"""Transfer manifests: the union of (owned block, position) over all prefill
ranks fills every position exactly once (property test over shard sizes and
random block assignments), bad entries are refused, runs merge."""

import random

import pytest

from vllm_cp_kv.core.manifest import (ManifestError, Run, check_complete, merge_runs,
                                      owned_manifest, validate_manifest)

BS = 16


@pytest.mark.parametrize("size", [2, 4, 8])
def test_union_over_ranks_fills_every_position_once(size):
    rng = random.Random(size)
    for _ in range(50):
        num_tokens = rng.randint(1, 40 * BS)
        n = -(-num_tokens // BS)
        table = rng.sample(range(1000), -(-n // size))  # random physical blocks
        manifests = {r: validate_manifest(owned_manifest(r, size, BS, table, num_tokens),
                                          r, size, n, 1000) for r in range(size)}
        check_complete(manifests, n)
        # rebuilding a cache from them equals the brute-force layout
        rebuilt = {j: (r, b) for r, m in manifests.items() for j, b in m}
        assert rebuilt == {j: (j % size, table[j // size]) for j in range(n)}


def test_wrong_position_is_detected():
    """Negative control: a block delivered to another position is refused."""
    table = [5, 9, 11]
    m = owned_manifest(1, 2, BS, table, 6 * BS)  # logical blocks 1, 3, 5
    shifted = [(j + 1, b) for j, b in m]  # one position off
    with pytest.raises(ManifestError, match="owns"):
        validate_manifest(shifted, 1, 2, 6, 100)
    swapped = [(m[0][0], m[1][1]), (m[1][0], m[0][1]), m[2]]  # right owner, wrong slot
    ok = validate_manifest(swapped, 1, 2, 6, 100)
    assert ok != validate_manifest(m, 1, 2, 6, 100)


@pytest.mark.parametrize("entries,match", [
    ([(7, 1)], "outside"),            # position past the request
    ([(1, 100)], "outside its cache"),  # block id out of range
    ([(1, 3), (1, 4)], "twice"),
    ([("a", 1)], "malformed"),
    ([(0, 1)], "owns"),
])
def test_bad_entries_are_refused(entries, match):
    with pytest.raises(ManifestError, match=match):
        validate_manifest(entries, 1, 2, 6, 100)


def test_missing_rank_is_detected():
    table = [1, 2]
    m0 = validate_manifest(owned_manifest(0, 2, BS, table, 4 * BS), 0, 2, 4, 10)
    with pytest.raises(ManifestError, match="missing"):
        check_complete({0: m0}, 4)


def test_contiguous_blocks_merge_into_runs():
    entries = [(0, 10), (2, 11), (4, 12), (6, 20)]
    local = [100, 0, 101, 0, 102, 0, 103]
    assert merge_runs(entries, local) == [Run(0, 10, 100, 3), Run(6, 20, 103, 1)]
    assert len(merge_runs(entries, [5, 0, 9, 0, 13, 0, 17])) == 4  # nothing merges
