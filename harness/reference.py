"""Independent references for the tests (and the GPU checks): token by
token, from a scalar transcription of vLLM's own slot-mapping kernel, never
from the package's ownership formula.

vLLM's ``_compute_slot_mappings_kernel`` (``v1/worker/gpu/block_table.py``;
the same arithmetic in the V1 runner) decides where each token of a request
is stored under DCP: one virtual block of ``block_size * N`` tokens per
block-table entry, token offsets dealt to ranks in runs of ``interleave``.
Everything here follows from that alone.
"""

from __future__ import annotations

import torch


def vllm_slot(pos: int, table_row, bs: int, n: int, rank: int, interleave: int) -> int:
    """Scalar transcription of vLLM's slot-mapping kernel: the slot where
    ``rank`` stores token ``pos``, or -1 if another rank stores it."""
    virtual = bs * n
    vblock, voff = divmod(pos, virtual)
    if (voff // interleave) % n != rank:
        return -1
    local = (voff // (n * interleave)) * interleave + voff % interleave
    return int(table_row[vblock]) * bs + local


def stored_at(pos: int, table_row, bs: int, n: int) -> tuple[int, int]:
    """``(rank, slot)`` of the one rank that stores token ``pos``
    (interleave = block size, the plugin's layout)."""
    hits = [(r, s) for r in range(n)
            if (s := vllm_slot(pos, table_row, bs, n, r, bs)) >= 0]
    assert len(hits) == 1, (pos, hits)
    return hits[0]


def owned_counts(seq_lens, bs: int, n: int) -> list[int]:
    """Tokens each rank stores for requests of ``seq_lens`` tokens."""
    counts = [0] * n
    row = list(range(10**6))  # any table: ownership does not depend on it
    for length in seq_lens:
        for pos in range(int(length)):
            counts[stored_at(pos, row, bs, n)[0]] += 1
    return counts


def full_view(block_table: torch.Tensor, seq_lens, caches: list[torch.Tensor],
              bs: int, n: int) -> list[torch.Tensor]:
    """Each request's tokens ``[len, ...]`` read from where vLLM stored them
    (``caches[rank]`` is rank ``rank``'s ``[num_blocks, bs, ...]`` cache)."""
    out = []
    for i, length in enumerate(torch.as_tensor(seq_lens).tolist()):
        row = block_table[i].tolist()
        rows = []
        for pos in range(int(length)):
            rank, slot = stored_at(pos, row, bs, n)
            rows.append(caches[rank][slot // bs, slot % bs])
        out.append(torch.stack(rows) if rows else caches[0][0, :0])
    return out


def tokens_of(view_blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``[nb, bs, ...]`` blocks -> the first ``length`` token rows."""
    return view_blocks.reshape(-1, *view_blocks.shape[2:])[:length]


def attention(q: torch.Tensor, keys: torch.Tensor, scale: float, v_dim: int):
    """Softmax attention of ``q [H, D]`` over ``keys [T, D]`` (values: the
    first ``v_dim`` columns), float64: ``(out [H, v_dim], lse [H])``."""
    q, k = q.double(), keys.double()
    scores = q @ k.T * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ k[:, :v_dim], lse
