"""Transfer manifests: the union of (owned block, position) over all prefill
ranks fills every position exactly once and rebuilds the layout vLLM's
slot-mapping kernel (transcribed in harness/reference.py) writes (property
test over shard sizes and random block assignments), bad entries are
refused, runs merge (read descriptors equal the brute-force maximal
contiguous byte ranges)."""

import random

import pytest

from harness.reference import stored_at
from vllm_cp_kv.core.manifest import (ManifestError, Run, check_complete, merge_runs,
                                      owned_manifest, read_descriptors, validate_manifest)

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
        # rebuilding a cache from them: every position's block is where
        # vLLM wrote that block's tokens
        assert rebuild(manifests) == layout(table, n, size)


def rebuild(manifests):
    """logical block -> (rank, physical block) as a receiver places them."""
    return {j: (r, b) for r, m in manifests.items() for j, b in m}


def layout(table, num_blocks, size):
    """logical block -> (rank, physical block) of its first token, from
    vLLM's slot mapping (harness/reference.py)."""
    out = {}
    for j in range(num_blocks):
        rank, slot = stored_at(j * BS, table, BS, size)
        out[j] = (rank, slot // BS)
    return out


def test_wrong_positions():
    """A block delivered to a position another rank owns is refused. Two of a
    rank's own blocks swapped pass validation (the receiver cannot know the
    sender's table), and the rebuilt layout is wrong: that is caught on the
    bytes (tests/pd/test_transfer_dist.py moves real blocks and compares them
    with the unsharded layout, dropping positions as negative control)."""
    table = [5, 9, 11]
    m = owned_manifest(1, 2, BS, table, 6 * BS)  # logical blocks 1, 3, 5
    shifted = [(j + 1, b) for j, b in m]  # one position off
    with pytest.raises(ManifestError, match="owns"):
        validate_manifest(shifted, 1, 2, 6, 100)
    swapped = [(m[0][0], m[1][1]), (m[1][0], m[0][1]), m[2]]  # right owner, wrong slot
    accepted = validate_manifest(swapped, 1, 2, 6, 100)
    rank0 = validate_manifest(owned_manifest(0, 2, BS, table, 6 * BS), 0, 2, 6, 100)
    check_complete({0: rank0, 1: accepted}, 6)
    want = layout(table, 6, 2)
    assert rebuild({0: rank0, 1: validate_manifest(m, 1, 2, 6, 100)}) == want
    assert rebuild({0: rank0, 1: accepted}) != want


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


@pytest.mark.parametrize("size", [2, 4])
def test_read_descriptors_are_the_maximal_contiguous_ranges(size):
    """Per rank and cache, the reads cover exactly each owned block's bytes
    (remote slot -> local slot), and there are as many as there are maximal
    runs contiguous on both sides, counted block by block."""
    rng = random.Random(size)
    pages, bases = [1152 * BS, 132 * BS], [(1 << 30, 1 << 20), (1 << 31, 1 << 21)]
    for _ in range(50):
        n = rng.randint(1, 40)
        per_rank = -(-n // size)
        remote = [10 + c + (rng.random() < 0.2) * 50 for c in range(per_rank)]
        local = rng.choice([
            list(range(3, 3 + n)),  # a fresh decode: each owned block apart
            [3 + (j % size) * per_rank + j // size for j in range(n)],  # runs merge
            rng.sample(range(200), n)])  # a fragmented free list
        for r in range(min(size, n)):
            entries = owned_manifest(r, size, BS, remote, n * BS)
            runs = merge_runs(entries, local)
            per_cache = []
            for pg, (rb, lb) in zip(pages, bases):
                reads = read_descriptors(runs, [rb], [lb], [pg])
                blocks = [(rb + remote[j // size] * pg, lb + local[j] * pg) for j, _ in entries]
                assert sorted((ra + k, la + k) for ra, la, nb in reads
                              for k in range(0, nb, pg)) == sorted(blocks)
                breaks = sum(1 for a, b in zip(blocks, blocks[1:])
                             if (b[0] - a[0], b[1] - a[1]) != (pg, pg))
                assert len(reads) == breaks + 1
                per_cache += reads
            assert read_descriptors(runs, [b[0] for b in bases], [b[1] for b in bases],
                                    pages) == per_cache


@pytest.mark.parametrize("n_p,n_d", [(1, 2), (2, 2), (2, 4), (4, 2), (3, 2)])
def test_each_decode_rank_reads_exactly_its_owned_blocks(n_p, n_d):
    """A sharded decode of ``n_d`` ranks: over its ranks, every logical
    block is read exactly once, by the decode rank that owns it (j % n_d),
    into its virtual table's column j // n_d, from the prefill rank that
    holds it, against a brute-force placement; the decode's own prefix-cache
    hits (leading columns) are read by no rank. Negative control: a rank
    that takes its neighbour's share reads blocks another rank owns."""
    from vllm_cp_kv.core.manifest import for_decode_rank
    from vllm_cp_kv.core.ownership import CPShardSpec

    rng = random.Random(10 * n_p + n_d)
    for _ in range(40):
        num_tokens = rng.randint(1, 40 * BS)
        n = -(-num_tokens // BS)
        table = rng.sample(range(1000), -(-n // n_p))  # the prefill's virtual table
        manifests = {r: validate_manifest(owned_manifest(r, n_p, BS, table, num_tokens),
                                          r, n_p, n, 1000) for r in range(n_p)}
        check_complete(manifests, n)
        local = rng.sample(range(2000, 3000), -(-n // n_d))  # the decode's virtual table
        cached = rng.choice([0, 0, min(2, len(local) - 1)])
        read = {}
        for d in range(n_d):
            mine = for_decode_rank(manifests, CPShardSpec(d, n_d, BS), first_column=cached)
            for r, entries in mine.items():
                for j, b in entries:
                    assert j not in read
                    read[j] = (d, r, b, local[j // n_d])
                runs = merge_runs(entries, local, decode_size=n_d)
                assert sorted(run.local_start + k for run in runs
                              for k in range(run.num_blocks)) == sorted(
                    local[j // n_d] for j, _ in entries)
        want = {j: (j % n_d, j % n_p, table[j // n_p], local[j // n_d])
                for j in range(n) if j // n_d >= cached}
        assert read == want
        if n - cached * n_d >= 2:  # negative control: each rank its neighbour's share
            wrong = {}
            for d in range(n_d):
                other = CPShardSpec((d + 1) % n_d, n_d, BS)
                for r, entries in for_decode_rank(manifests, other, cached).items():
                    wrong.update({j: (d, r, b, local[j // n_d]) for j, b in entries})
            assert wrong.keys() == want.keys() and wrong != want
