"""Shard-aware decode (core/decode.py): per-rank partial attention over the
owned blocks, merged by LSE, against attention over the whole sequence in
float64 (tests/reference.py). The per-rank caches are filled the way vLLM
writes them under DCP (its slot-mapping kernel, transcribed), so the test
also pins that the owned-token counts and the shared virtual block table
describe each rank's tokens. Negative controls: a corrupted owned block, and
token-interleaved counts (another layout), both change the result."""

import pytest
import torch

from reference import attention, stored_at
from vllm_cp_kv.core.decode import merge_by_lse, paged_attention_with_lse
from vllm_cp_kv.core.ownership import CPShardSpec, owned_token_count

BS, D, V, H = 16, 576, 512, 4
SCALE = 0.07


def sharded_batch(n, lens, seed=0, num_blocks=512):
    """Whole sequences, a shared virtual block table, per-rank caches."""
    gen = torch.Generator().manual_seed(seed)
    cols = max(1, max(-(-(-(-x // BS)) // n) for x in lens))
    ids = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * cols] + 1
    table = ids.view(len(lens), cols).to(torch.int32)
    seqs = [torch.randn(x, D, generator=gen) for x in lens]
    caches = [torch.zeros(num_blocks, BS, D) for _ in range(n)]
    for i, seq in enumerate(seqs):
        for pos in range(seq.shape[0]):
            rank, slot = stored_at(pos, table[i].tolist(), BS, n)
            caches[rank][slot // BS, slot % BS] = seq[pos]
    q = torch.randn(len(lens), H, D, generator=gen)
    return q, table, torch.tensor(lens), seqs, caches


def sharded_decode(q, table, lens, caches, n, counts=None):
    outs, lses = [], []
    for r in range(n):
        local = counts(r) if counts else owned_token_count(lens, CPShardSpec(r, n, BS))
        o, l = paged_attention_with_lse(q, caches[r], table, local, SCALE, V)
        outs.append(o)
        lses.append(l)
    return merge_by_lse(torch.stack(outs), torch.stack(lses))


def test_paged_attention_matches_float64():
    lens = [1, 5, 16, 17, 100, 333, 0]
    q, table, lens_t, seqs, caches = sharded_batch(1, lens, seed=1)
    out, lse = paged_attention_with_lse(q, caches[0], table, lens_t, SCALE, V)
    for i, seq in enumerate(seqs):
        if seq.shape[0] == 0:
            assert torch.isinf(lse[i]).all() and (out[i] == 0).all()
            continue
        want, want_lse = attention(q[i], seq, SCALE, V)
        assert torch.allclose(out[i].double(), want, atol=1e-5)
        assert torch.allclose(lse[i].double(), want_lse, atol=1e-5)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_merged_shards_equal_attention_over_the_whole_sequence(n):
    lens = [1, 15, 16, 33, 100, 257, 511]  # ranks with nothing, partial blocks
    q, table, lens_t, seqs, caches = sharded_batch(n, lens, seed=n)
    merged = sharded_decode(q, table, lens_t, caches, n)
    for i, seq in enumerate(seqs):
        want, _ = attention(q[i], seq, SCALE, V)
        assert torch.allclose(merged[i].double(), want, atol=1e-5), i


def test_a_corrupted_owned_block_changes_only_its_request():
    n = 2
    q, table, lens_t, seqs, caches = sharded_batch(n, [70, 40], seed=3)
    clean = sharded_decode(q, table, lens_t, caches, n)
    caches[1][int(table[0, 0])] += 1  # logical block 1 of request 0, on rank 1
    dirty = sharded_decode(q, table, lens_t, caches, n)
    assert not torch.allclose(dirty[0], clean[0], atol=1e-3)
    assert torch.equal(dirty[1], clean[1])


def test_another_layouts_counts_give_another_result():
    """Negative control: token-interleaved counts (vLLM's default DCP
    interleave 1) read the wrong tokens of this layout."""
    n = 2
    lens = [37, 70]
    q, table, lens_t, seqs, caches = sharded_batch(n, lens, seed=4)

    def interleaved(r):  # tokens rank r holds when tokens alternate
        return (lens_t - r + n - 1) // n

    bad = sharded_decode(q, table, lens_t, caches, n, counts=interleaved)
    want, _ = attention(q[0], seqs[0], SCALE, V)
    assert not torch.allclose(bad[0].double(), want, atol=1e-3)


def test_merge_ignores_empty_parts_and_keeps_dtype():
    gen = torch.Generator().manual_seed(5)
    outs = torch.randn(3, 2, H, V, generator=gen).to(torch.bfloat16)
    lses = torch.randn(3, 2, H, generator=gen)
    lses[1] = float("-inf")  # a rank with no token of these rows
    merged = merge_by_lse(outs, lses)
    assert merged.dtype == torch.bfloat16
    keep = torch.tensor([0, 2])
    w = torch.softmax(lses[keep], dim=0)
    want = (outs[keep].float() * w[..., None]).sum(0)
    # one rounding to bfloat16 (8 bits of mantissa) of values below 8
    assert torch.allclose(merged.float(), want, rtol=2**-8, atol=2**-8)
    all_empty = merge_by_lse(outs, torch.full((3, 2, H), float("-inf")))
    assert (all_empty == 0).all()
