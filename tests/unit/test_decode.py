"""Shard-aware decode (core/decode.py): per-rank partial attention over the
owned blocks, merged by LSE, against attention over the whole sequence in
float64 (harness/reference.py). The per-rank caches are filled the way vLLM
writes them under DCP (its slot-mapping kernel, transcribed), so the test
also pins that the owned-token counts and the shared virtual block table
describe each rank's tokens. Negative controls: a corrupted owned block, and
token-interleaved counts (another layout), both change the result."""

import pytest
import torch

from harness.reference import attention, stored_at
from vllm_cp_kv.core.decode import merge_by_lse, paged_attention_with_lse, query_token_lens
from vllm_cp_kv.core import debug as core_debug
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


def multi_query_decode(q, table, lens_t, qlens, caches, n, lens_fn=None):
    """Rows with several query tokens, flattened as the backend does: every
    query token its own row (the request's table row, its own length)."""
    outs, lses = [], []
    for r in range(n):
        spec = CPShardSpec(r, n, BS)
        rows, local = (lens_fn or query_token_lens)(lens_t, qlens, spec)
        rows = torch.arange(len(qlens)) if rows is None else rows
        o, l = paged_attention_with_lse(q, caches[r], table[rows], local, SCALE, V)
        outs.append(o)
        lses.append(l)
    return merge_by_lse(torch.stack(outs), torch.stack(lses))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rows_with_several_query_tokens_are_causal_per_query(n):
    """Query t of a row of q new tokens (s in all) sees exactly tokens
    0 .. s - q + t: float64 attention over that prefix is the reference,
    for rows whose new tokens cross block and owner boundaries, a row with
    no context (a short prefill) and one-token rows in the same batch."""
    lens = [40, 17, 100, 3, 64, 33]
    qlens = [5, 1, 20, 3, 1, 17]
    q1, table, lens_t, seqs, caches = sharded_batch(n, lens, seed=10 + n)
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(sum(qlens), H, D, generator=gen)
    merged = multi_query_decode(q, table, lens_t, qlens, caches, n)
    k = 0
    for i, (seq, ql) in enumerate(zip(seqs, qlens)):
        for t in range(ql):
            visible = seq.shape[0] - ql + t + 1
            want, _ = attention(q[k], seq[:visible], SCALE, V)
            assert torch.allclose(merged[k].double(), want, atol=1e-5), (i, t)
            k += 1
    assert k == q.shape[0]


def test_one_token_rows_keep_the_request_rows():
    spec = CPShardSpec(1, 2, BS)
    rows, lens = query_token_lens(torch.tensor([40, 0, 17]), [1, 0, 1], spec)
    assert rows is None and lens.dtype == torch.int32
    assert lens.tolist() == owned_token_count(torch.tensor([40, 0, 17]), spec).tolist()


def test_kernel_style_causal_on_local_tokens_is_wrong():
    """Negative control: masking the query block at the end of each rank's
    local sequence (a kernel's causal flag on the local view) gives another
    result once the new tokens are not all on one rank."""
    n, lens, qlens = 2, [40], [20]  # new tokens 20..39 span blocks 1 and 2
    q1, table, lens_t, seqs, caches = sharded_batch(n, lens, seed=21)
    q = torch.randn(20, H, D, generator=torch.Generator().manual_seed(3))

    def end_aligned(seq_lens, query_lens, spec):
        local = owned_token_count(seq_lens, spec)
        rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        t = torch.arange(rows.numel())
        return rows, (local[rows] - (query_lens[0] - 1 - t)).clamp(min=0).to(torch.int32)

    bad = multi_query_decode(q, table, lens_t, qlens, caches, n, lens_fn=end_aligned)
    good = multi_query_decode(q, table, lens_t, qlens, caches, n)
    assert not torch.allclose(bad, good, atol=1e-3)


def test_debug_check_allows_the_kernel_error_twice_and_no_layout_error():
    """The debug check's tolerance grows with vLLM's own kernel's error on
    the same view (twice it), never to a layout error's size."""
    spec = CPShardSpec(0, 2, BS)
    gen = torch.Generator().manual_seed(7)
    ref = torch.randn(4, H, V, generator=gen) * 3
    kernel = ref + 0.1  # vLLM's kernel off by 0.1
    err, inner = core_debug.check_decode_merge(ref + 0.15, ref, spec, kernel)
    assert abs(err - 0.15) < 1e-5 and abs(inner - 0.1) < 1e-5
    with pytest.raises(core_debug.CPKVInvariantError, match="shard-aware decode differs"):
        core_debug.check_decode_merge(ref + 0.15, ref, spec)  # no kernel: 0.15 > 8 eps
    with pytest.raises(core_debug.CPKVInvariantError, match="vLLM's kernel on that view"):
        core_debug.check_decode_merge(ref.roll(1, 0), ref, spec, kernel)  # other rows


def _amx_kernel_available() -> bool:
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    except Exception:
        return False
    return bool(torch.cpu._is_amx_tile_supported()) and hasattr(
        torch.ops._C, "decode_attention_cpu")


@pytest.mark.skipif(not _amx_kernel_available(),
                    reason="vLLM's AMX_MLA decode kernel needs a CPU with AMX tiles")
@pytest.mark.parametrize("n", [2, 4])
def test_vllms_amx_kernel_gives_the_lse_and_merges(n):
    """AMX_MLA: vLLM's own decode kernel over each rank's owned blocks, its
    LSE read from the split-KV workspace (integration/decode.py), merged by
    LSE, against float64 attention over each whole sequence (bf16 inputs, so
    bf16 tolerance); rows a rank owns nothing of included. Negative control:
    the same partial outputs merged without their LSEs (equal weights) are
    wrong by far more."""
    from vllm_cp_kv.integration.decode import amx_attention_with_lse, build_local_amx
    from vllm_cp_kv.integration.step import DecodeView

    lens = [1, 15, 33, 257, 700, 1500]
    q, table, lens_t, seqs, caches = sharded_batch(n, lens, seed=11 + n)
    q, caches = q.bfloat16(), [c.bfloat16() for c in caches]
    outs, lses = [], []
    for r in range(n):
        local = owned_token_count(lens_t, CPShardSpec(r, n, BS)).to(torch.int32)
        view = DecodeView(block_table=table, local_lens=local,
                          max_local_len=int(local.max()), gather_heads=False,
                          query_start_loc=torch.arange(len(lens) + 1),
                          query_start_loc_cpu=torch.arange(len(lens) + 1))
        o, l = amx_attention_with_lse(q, caches[r], build_local_amx(view, BS), SCALE, V)
        assert not torch.isnan(o).any()
        outs.append(o)
        lses.append(l)
    good = merge_by_lse(torch.stack(outs), torch.stack(lses))
    naive = torch.stack(outs).float().mean(dim=0)
    for i, seq in enumerate(seqs):
        want, _ = attention(q[i].float(), seq.bfloat16().float(), SCALE, V)
        err = float((good[i].double() - want).abs().max())
        assert err < 0.02, (i, err)
        if lens[i] >= n * BS:  # every rank holds part of it
            assert float((naive[i].double() - want).abs().max()) > max(5 * err, 0.02), i
