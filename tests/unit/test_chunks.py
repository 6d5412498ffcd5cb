"""Chunked context reading (bounded scratch) against an independent
reference: every request's cached context is read chunk by chunk through
each chunk's plan (one process; every rank's pack concatenated as the
all-gather would) and must equal, token for token and in order, what the
reference reads from where vLLM's slot-mapping kernel stored it; no
chunk's gather may exceed the scratch."""

import random

import pytest
import torch

from builders import BS, make_batch, read_rows, spec
from harness.reference import full_view
from vllm_cp_kv.core import debug
from vllm_cp_kv.core.materialize import pack
from vllm_cp_kv.core.plan import chunk_ranges, plan_context_chunks, plan_materialization


def read_by_chunks(n, table, lens, caches, capacity):
    """Each request's tokens, concatenated over the chunks in order
    (``builders.read_rows`` with every row its own request)."""
    chunks = plan_context_chunks(spec(n), table, lens, capacity)
    assert all(c.plan.num_scratch_blocks <= capacity for c in chunks)
    return chunks, read_rows(chunks, torch.arange(len(lens)), lens, caches)


@pytest.mark.parametrize("seed", range(60))
def test_chunks_read_every_token_once_in_order(seed):
    rnd = random.Random(seed)
    n = rnd.choice([1, 2, 3, 4, 8])
    lens = [rnd.choice([0, 1, 15, 16, 17, 100, 333, 700]) for _ in range(rnd.randint(1, 6))]
    capacity = rnd.choice([n, 2 * n, 3 * n + 1, 7 * n, 40, 1000])
    table, lens_t, caches = make_batch(n, lens, seed=seed, num_blocks=400)
    chunks, got = read_by_chunks(n, table, lens_t, caches, capacity)
    ref = full_view(table, lens_t, caches, BS, n)
    for i in range(len(lens)):
        assert torch.equal(got[i], ref[i]), (i, lens[i])
    # a batch that fits is one chunk, the single gather of before
    whole = plan_materialization(spec(n), table, lens_t)
    if sum(-(-x // BS) for x in lens) <= capacity // n:  # fits whatever the owners
        assert len(chunks) == 1
        assert torch.equal(chunks[0].plan.full_block_table, whole.full_block_table)


def test_chunks_fill_the_scratch():
    """Chunks are as large as the scratch allows (not one block at a time):
    4 ranks, one request of 100 blocks, 40 scratch blocks: 10 blocks per
    rank per chunk, so three chunks (40, 40, 20 blocks)."""
    n, capacity = 4, 40
    ranges = chunk_ranges(spec(n), torch.tensor([100 * BS]), capacity)
    assert [int(t) // BS for _, t in ranges] == [40, 40, 20]
    assert [int(f) for f, _ in ranges] == [0, 40, 80]


def test_shared_blocks_are_gathered_once_per_chunk():
    n = 2
    table, lens, caches = make_batch(n, [128, 128], seed=3, shared_rows=(0, 1, 2))
    chunks = plan_context_chunks(spec(n), table, lens, 1000)
    assert len(chunks) == 1 and int(chunks[0].plan.num_send_blocks.sum()) == 16 - 4
    # split: two requests of 8 blocks in 8-block chunks, still correct
    chunks, got = read_by_chunks(n, table, lens, caches, 8)
    assert len(chunks) == 2
    ref = full_view(table, lens, caches, BS, n)
    assert all(torch.equal(g, r) for g, r in zip(got, ref))


def test_negative_control_a_wrong_first_block_reads_other_tokens():
    """The check above can fail: shifting one chunk's first block by one
    reads the wrong tokens."""
    n = 2
    table, lens, caches = make_batch(n, [200], seed=5, num_blocks=64)
    ranges = chunk_ranges(spec(n), lens, 4)
    first, tokens = ranges[1]
    bad = plan_materialization(spec(n), table, (first + 1) * BS + tokens,
                               first_blocks=first + 1)
    scratch = torch.cat([pack(bad, r, c) for r, c in enumerate(caches)])
    t = int(tokens[0])
    got = scratch[bad.full_block_table[0, : -(-t // BS)].long()].reshape(-1, 576)[:t]
    ref = full_view(table, lens, caches, BS, n)[0]
    start = int(first[0]) * BS
    assert not torch.equal(got, ref[start:start + t])


def test_scratch_below_one_block_per_rank_is_refused():
    with pytest.raises(ValueError, match="one block of each of 4 ranks"):
        chunk_ranges(spec(4), torch.tensor([100]), 3)


def test_debug_check_covers_chunks():
    n = 2
    table, lens, caches = make_batch(n, [300, 50], seed=7, num_blocks=64)
    chunks = plan_context_chunks(spec(n), table, lens, 6)
    debug.check_chunks_cover(chunks, table, lens)
    first, tokens, plan = chunks[1].first_blocks, chunks[1].num_tokens, chunks[1].plan
    # negative control: drop a chunk, or claim a chunk reads from block 0
    with pytest.raises(debug.CPKVInvariantError, match="read"):
        debug.check_chunks_cover(chunks[:1] + chunks[2:], table, lens)
    shifted = type(chunks[1])(torch.zeros_like(first), tokens, plan)
    with pytest.raises(debug.CPKVInvariantError):
        debug.check_chunks_cover([chunks[0], shifted] + chunks[2:], table, lens)


def read_rows_by_chunks(n, table, lens, caches, capacity, row_keys, keys, row_context,
                        local=None):
    """PCP: the chunks are planned over the global requests (every rank
    the same); each local row (several may belong to one request, each with
    its own context) reads its part of each chunk (``rows_of_chunk``)."""
    from vllm_cp_kv.core.plan import global_rows

    global_table, rows = global_rows(table, row_keys, keys)
    chunks = plan_context_chunks(spec(n), global_table, lens, capacity)
    return read_rows(chunks, rows if local is None else local, row_context, caches)


def pcp_rows(rnd, lens):
    """A rank's local rows: 1 or 2 rows a request (PCP's head and tail
    pieces), in shuffled order, each with a context up to its request's
    read length; the global keys in another order."""
    keys = list(range(100, 100 + len(lens)))
    row_keys, context = [], []
    for k, n in zip(keys, lens):
        for _ in range(rnd.choice([1, 2])):
            row_keys.append(k)
            context.append(rnd.randint(0, n))
    order = list(range(len(row_keys)))
    rnd.shuffle(order)
    return [row_keys[i] for i in order], [context[i] for i in order], keys


@pytest.mark.parametrize("seed", range(40))
def test_pcp_rows_read_their_context_from_the_global_chunks(seed):
    """Under PCP every row reads, over the global chunks in order, exactly
    its own context (its request's tokens 0 .. its context length), as the
    reference reads it from where vLLM stored it."""
    rnd = random.Random(seed)
    n = rnd.choice([2, 4, 8])
    lens = [rnd.choice([1, 17, 100, 333, 700]) for _ in range(rnd.randint(1, 5))]
    capacity = rnd.choice([n, 2 * n, 3 * n + 1, 40, 1000])
    table, lens_t, caches = make_batch(n, lens, seed=seed, num_blocks=400)
    row_keys, context, keys = pcp_rows(rnd, lens)
    # this rank's table: each local row holds its request's block table
    local_table = table[[keys.index(k) for k in row_keys]]
    ref = full_view(table, lens_t, caches, BS, n)
    got = read_rows_by_chunks(n, local_table, lens_t, caches, capacity, row_keys, keys,
                              torch.tensor(context))
    for i, (k, c) in enumerate(zip(row_keys, context)):
        assert torch.equal(got[i], ref[keys.index(k)][:c]), (i, k, c)


def test_negative_control_pcp_rows_mapped_to_the_wrong_request():
    """The check above can fail: rows mapped to their neighbour's request
    read other tokens."""
    n, lens = 2, [300, 500, 200]
    table, lens_t, caches = make_batch(n, lens, seed=7, num_blocks=400)
    row_keys, context, keys = [101, 100, 102, 101], [250, 120, 150, 40], [100, 101, 102]
    local_table = table[[keys.index(k) for k in row_keys]]
    ref = full_view(table, lens_t, caches, BS, n)
    wrong = torch.tensor([(keys.index(k) + 1) % 3 for k in row_keys])
    got = read_rows_by_chunks(n, local_table, lens_t, caches, 2 * n, row_keys, keys,
                              torch.tensor(context), local=wrong)
    assert any(not torch.equal(g, ref[keys.index(k)][:c])
               for g, k, c in zip(got, row_keys, context))


def test_chunk_plans_fit_the_scratch_sized_on_the_host():
    """Chunk plans size their collective from the host (no read back: on the
    meta device, where any read fails, they are built all the same), and
    stay within the scratch even where requests share blocks (the shared
    blocks' extra slots are padding, which ``chunk_ranges`` counted)."""
    n, capacity = 2, 12
    table, lens, caches = make_batch(n, [128, 128, 40], seed=11, shared_rows=(0, 1, 2))
    chunks, got = read_by_chunks(n, table, lens, caches, capacity)
    ref = full_view(table, lens, caches, BS, n)
    for i in range(len(lens)):
        assert torch.equal(got[i], ref[i][: int(lens[i])])
    meta = plan_context_chunks(spec(n), table.to("meta"), lens, capacity)
    assert [c.plan.send_block_ids.shape for c in meta] == \
        [c.plan.send_block_ids.shape for c in chunks]
