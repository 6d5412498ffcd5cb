"""Copy kernels (torch paths; the Triton paths are checked against these on
the GPU by benchmarks/gpu_materialize.py) and the capacity calculator."""

import pytest
import torch

from vllm_cp_kv.core.capacity import (DEEPSEEK_V3_LAYOUTS, KVLayout, capacity_table,
                                      tokens_per_rank)
from vllm_cp_kv.core.kernels import indexer_views, pack_blocks, scatter_rows

BS = 64
LAYOUTS = {"bf16_latent": ((BS, 576), torch.bfloat16),
           "fp8_latent": ((BS, 656), torch.uint8),
           "indexer": ((BS * 132,), torch.uint8)}


def rand(shape, dtype, gen):
    if dtype == torch.bfloat16:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 256, shape, generator=gen, dtype=dtype)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pack_blocks_copies_whole_blocks(layout):
    shape, dtype = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(1)
    cache = rand((20, *shape), dtype, gen)
    ids = torch.tensor([7, 0, 19, 7])
    out = pack_blocks(cache, ids)
    for i, b in enumerate(ids.tolist()):
        assert torch.equal(out[i], cache[b])


def test_scatter_rows_skips_unowned_slots():
    gen = torch.Generator().manual_seed(2)
    cache = rand((4, BS, 576), torch.bfloat16, gen)
    before = cache.clone()
    slots = torch.tensor([5, -1, 64 * 3 + 63, 70])
    rows = rand((4, 576), torch.bfloat16, gen)
    scatter_rows(cache, slots, rows)
    flat, flat_before = cache.view(-1, 576), before.view(-1, 576)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], rows[t])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat[untouched], flat_before[untouched])


def test_indexer_views_hit_vllm_byte_offsets():
    """Keys at block*page + t*128, scales at block*page + bs*128 + t*4."""
    pages = torch.zeros((3, BS * 132), dtype=torch.uint8)
    keys, scales = indexer_views(pages, BS)
    slot = 2 * BS + 5  # block 2, token 5
    scatter_rows(keys, torch.tensor([slot]), torch.full((1, 128), 9, dtype=torch.uint8))
    scatter_rows(scales, torch.tensor([slot]), torch.full((1, 4), 7, dtype=torch.uint8))
    page = pages[2]
    assert page[5 * 128:6 * 128].eq(9).all() and page[BS * 128 + 20:BS * 128 + 24].eq(7).all()
    assert int((pages != 0).sum()) == 132  # nothing else written


def test_tokens_per_rank_arithmetic():
    layout = KVLayout("x", num_layers=10, latent_bytes=100)
    r = tokens_per_rank(layout, kv_budget_bytes=1_000_000, shard_size=4, scratch_tokens=50)
    assert r["replicated_tokens"] == 1000
    assert r["scratch_bytes"] == 2 * 50 * 100
    assert r["sharded_tokens"] == 4 * ((1_000_000 - 10_000) // 1000) == 3960
    assert tokens_per_rank(layout, 1_000_000, 1, 50)["ratio"] == 1.0


def test_deepseek_v3_table_meets_the_capacity_goal():
    rows = capacity_table()
    assert len(rows) == 3 * len(DEEPSEEK_V3_LAYOUTS)
    for r in rows:
        assert 0.97 <= r["efficiency"] < 1.0, r  # scratch is counted, so < N
