"""Transfer manifests for disaggregated prefill with sharded KV.

Each prefill rank of a shard group sends only the blocks it owns, each with
its explicit logical position in the request; each decode rank takes the
blocks it owns in its own layout and writes logical block ``j`` into its
block-table slot ``j // N_d`` (an unsharded decode: ``N_d = 1``, every
block, slot ``j``):

    manifest of rank r = [(j, remote_block)] for every logical block j of
                         the request with owner(j) == r,
                         remote_block = virtual_table[j // N_p]   (on rank r)
    decode rank d reads  the entries with j % N_d == d            (:func:`for_decode_rank`)
                         into local_table[j // N_d]

The receiver checks every entry (:func:`validate_manifest`) before any byte
moves, checks that the union over ranks fills each position exactly once
(:func:`check_complete`), merges entries whose remote and local blocks are
both consecutive into one read (:func:`merge_runs`), and turns runs into reads
of every cache (:func:`read_descriptors`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ownership import CPShardSpec, num_logical_blocks


class ManifestError(ValueError):
    """Transfer metadata that must not be acted on."""


@dataclass(frozen=True)
class Run:
    """``num_blocks`` consecutive blocks: remote ``remote_start..`` ->
    local ``local_start..`` (logical blocks ``logical_start..``)."""

    logical_start: int
    remote_start: int
    local_start: int
    num_blocks: int


def owned_manifest(rank: int, size: int, block_size: int,
                   virtual_table: list[int], num_tokens: int) -> list[tuple[int, int]]:
    """What prefill rank ``rank`` sends: ``[(logical_block, remote_block)]``."""
    spec = CPShardSpec(rank, size, block_size)
    n = num_logical_blocks(num_tokens, block_size)
    columns = int(spec.table_index(n - 1)) + 1 if n else 0
    if columns > len(virtual_table):
        raise ManifestError(
            f"{num_tokens} tokens need {columns} virtual blocks, the table "
            f"has {len(virtual_table)}.")
    return [(j, int(virtual_table[spec.table_index(j)]))
            for j in spec.logical_blocks_of(rank, n)]


def validate_manifest(entries, rank: int, size: int, num_blocks_total: int,
                      remote_num_blocks: int) -> list[tuple[int, int]]:
    """Bounds- and ownership-check one rank's manifest.

    Args:
        entries: ``[(logical_block, remote_block)]`` as received.
        num_blocks_total: logical blocks of the request.
        remote_num_blocks: physical blocks in the sender's cache.
    Returns:
        The entries as int pairs, sorted by logical block.
    """
    out = []
    seen = set()
    try:
        spec = CPShardSpec(rank, size, 1)
    except ValueError as e:
        raise ManifestError(f"manifest for rank {rank} of {size}: {e}") from None
    try:
        pairs = [(int(j), int(b)) for j, b in entries]
    except (TypeError, ValueError) as e:
        raise ManifestError(f"malformed manifest from rank {rank}: {e}") from None
    for j, b in pairs:
        if not 0 <= j < num_blocks_total:
            raise ManifestError(
                f"rank {rank} sent logical block {j}, outside 0..{num_blocks_total - 1}.")
        owner = int(spec.owner_of(j))
        if owner != rank:
            raise ManifestError(
                f"rank {rank} sent logical block {j}, which rank {owner} owns "
                f"(rule {spec.rule}, {size} ranks).")
        if not 0 <= b < remote_num_blocks:
            raise ManifestError(
                f"rank {rank} sent block id {b} for logical block {j}, outside its "
                f"cache of {remote_num_blocks} blocks.")
        if j in seen:
            raise ManifestError(f"rank {rank} sent logical block {j} twice.")
        seen.add(j)
        out.append((j, b))
    return sorted(out)


def check_complete(manifests: dict[int, list[tuple[int, int]]],
                   num_blocks_total: int) -> None:
    """Every logical position is delivered by exactly one rank."""
    count = [0] * num_blocks_total
    for entries in manifests.values():
        for j, _ in entries:
            count[j] += 1
    missing = [j for j, c in enumerate(count) if c == 0]
    twice = [j for j, c in enumerate(count) if c > 1]
    if missing or twice:
        raise ManifestError(
            f"manifests do not cover the request exactly once: missing logical "
            f"blocks {missing[:8]}, duplicated {twice[:8]}.")


def for_decode_rank(manifests: dict[int, list[tuple[int, int]]], decode: CPShardSpec,
                    first_column: int = 0) -> dict[int, list[tuple[int, int]]]:
    """The entries decode rank ``decode.rank`` of ``decode.size`` reads: the
    logical blocks it owns (the same cyclic rule, over the decode's own
    ranks), from column ``first_column`` of its virtual table on (the
    columns before hold its own prefix-cache hits, which it keeps). Every
    prefill rank's list, in order; an unsharded decode (size 1) reads all."""
    return {r: [(j, b) for j, b in entries
                if int(decode.owner_of(j)) == decode.rank
                and int(decode.table_index(j)) >= first_column]
            for r, entries in manifests.items()}


def merge_runs(entries: list[tuple[int, int]], local_block_ids: list[int],
               decode_size: int = 1) -> list[Run]:
    """Merge entries (sorted by logical block) into maximal runs where both
    the remote and the local block ids are consecutive. Logical block ``j``
    lands in ``local_block_ids[j // decode_size]`` (the decode rank's
    virtual table: one column holds ``decode_size`` logical blocks, one a
    rank)."""
    runs: list[Run] = []
    for j, remote in entries:
        local = int(local_block_ids[j // decode_size])
        if runs:
            last = runs[-1]
            if (remote == last.remote_start + last.num_blocks
                    and local == last.local_start + last.num_blocks):
                runs[-1] = Run(last.logical_start, last.remote_start,
                               last.local_start, last.num_blocks + 1)
                continue
        runs.append(Run(j, remote, local, 1))
    return runs


def read_descriptors(runs: list[Run], remote_addrs: list[int], local_addrs: list[int],
                     page_bytes: list[int]) -> list[tuple[int, int, int]]:
    """``(remote_addr, local_addr, nbytes)`` reads for ``runs`` in every cache.

    Cache ``i`` (a layer's latent, or its indexer cache) starts at
    ``remote_addrs[i]`` / ``local_addrs[i]`` and holds ``page_bytes[i]`` bytes
    per block; the same block ids index every cache.
    """
    return [(remote_addrs[i] + run.remote_start * page_bytes[i],
             local_addrs[i] + run.local_start * page_bytes[i],
             run.num_blocks * page_bytes[i])
            for i in range(len(page_bytes)) for run in runs]


def without_positions(manifests: dict[int, list[tuple[int, int]]]
                      ) -> dict[int, list[tuple[int, int]]]:
    """Negative control: what a receiver ignoring the logical positions would
    do (blocks laid out in arrival order, rank by rank)."""
    order = iter(range(sum(len(m) for m in manifests.values())))
    return {r: [(next(order), b) for _, b in m] for r, m in sorted(manifests.items())}
