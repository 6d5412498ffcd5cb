"""Shared builders for materialization tests (plain torch, no vLLM)."""

import torch

from vllm_cp_kv.core.ownership import CPShardSpec

BS = 16  # tokens per block
D = 576  # MLA latent width (kv_lora_rank 512 + rope 64)


def make_batch(n, seq_lens, seed=0, num_blocks=64, shared_rows=None):
    """A virtual block table shared by all ranks and random per-rank caches.

    Args:
        n: shard group size.
        seq_lens: tokens each request reads.
        shared_rows: optional (src, dst, columns): request dst reuses the
            first ``columns`` table entries of request src (shared blocks).
    Returns:
        (block_table [R, C] int32, seq_lens [R] int64, caches: list of
        [num_blocks, BS, D] bf16 tensors, one per rank)
    """
    gen = torch.Generator().manual_seed(seed)
    cols = max(1, max(-(-(-(-s // BS)) // n) for s in seq_lens))
    r = len(seq_lens)
    # distinct physical blocks per (request, column); block 0 stays the null block
    ids = torch.randperm(num_blocks - 1, generator=gen)[: r * cols] + 1
    table = ids.view(r, cols).to(torch.int32)
    if shared_rows is not None:
        src, dst, c = shared_rows
        table[dst, :c] = table[src, :c]
    caches = [torch.randn(num_blocks, BS, D, generator=gen).to(torch.bfloat16)
              for _ in range(n)]
    return table, torch.tensor(seq_lens, dtype=torch.int64), caches


def view_of(plan, scratch, i):
    """Request i's logical blocks read through the plan's translated table."""
    nb = int(plan.num_logical_blocks[i])
    return scratch[plan.full_block_table[i, :nb].long()]


def read_rows(chunks, rows, row_context, caches):
    """Each row's tokens read over context chunks in order (its part of
    each: ``core.plan.rows_of_chunk``; ``rows``: each row's request in the
    chunks), every rank's pack concatenated as the all-gather would; a
    row's parts must follow on from each other."""
    from vllm_cp_kv.core.materialize import pack
    from vllm_cp_kv.core.plan import rows_of_chunk

    got = [[] for _ in range(len(row_context))]
    for c in chunks:
        scratch = torch.cat([pack(c.plan, r, cache) for r, cache in enumerate(caches)])
        tokens, table = rows_of_chunk(c, rows, row_context)
        for i, t in enumerate(tokens.tolist()):
            if t:
                assert int(c.first_blocks[rows[i]]) * BS == sum(v.shape[0] for v in got[i])
                blocks = scratch[table[i, : -(-t // BS)].long()]
                got[i].append(blocks.reshape(-1, blocks.shape[-1])[:t])
    return [torch.cat(g) if g else caches[0][0, :0] for g in got]


def spec(n, rank=0):
    return CPShardSpec(rank=rank, size=n, block_size=BS)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(consecutive: int = 1) -> int:
    """A free loopback port (with ``consecutive - 1`` free ports after it)."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if all(_port_free(port + k) for k in range(1, consecutive)):
            return port


def spawn_ranks(worker, n: int, timeout: float = 300) -> None:
    """Run ``worker(rank, n, port, errors)`` in ``n`` spawned processes (a
    gloo group on ``port``) and fail with every rank's reported error."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, n, port, errors)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, "\n".join(msgs)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
