"""Capacity arithmetic: scratch bound and tokens per rank, sharded vs not."""

from __future__ import annotations


def scratch_blocks_bound(*, available_bytes: int, page_bytes: int,
                         num_layers: int, shard_size: int, block_size: int,
                         max_num_seqs: int, max_model_len: int,
                         cap_blocks: int = 0) -> int:
    """Scratch blocks (one layer's full view) that no batch can exceed.

    A batch reads at most ``max_num_seqs`` requests of ``max_model_len``
    tokens, and never more blocks than the persistent cache holds; the
    scratch holds ``shard_size`` ranks' worth of the padded per-rank list::

        per_req  = ceil(ceil(max_model_len / block_size) / shard_size)
        by_seqs  = shard_size * max_num_seqs * per_req
        # scratch <= shard_size * (available - scratch) / (layers * page)
        by_bytes = available * shard_size // ((layers + shard_size) * page)

    Args:
        available_bytes: KV budget of this rank before the scratch is taken.
        page_bytes: bytes of one block of one layer.
        cap_blocks: optional user cap (0 = none).
    Returns:
        Blocks, a multiple of ``shard_size``.
    """
    per_req = -(-(-(-max_model_len // block_size)) // shard_size)
    by_seqs = shard_size * max_num_seqs * per_req
    by_bytes = available_bytes * shard_size // ((num_layers + shard_size) * page_bytes)
    blocks = min(by_seqs, by_bytes)
    if cap_blocks:
        blocks = min(blocks, cap_blocks)
    return blocks - blocks % shard_size


# --- capacity calculator ---------------------------------------------------
from dataclasses import dataclass  # noqa: E402


@dataclass(frozen=True)
class KVLayout:
    """Bytes one token occupies in one layer's persistent caches."""

    name: str
    num_layers: int
    latent_bytes: int  # MLA latent per token per layer
    indexer_bytes: int = 0  # sparse-attention indexer keys + scales

    @property
    def bytes_per_token_layer(self) -> int:
        return self.latent_bytes + self.indexer_bytes


DSV3_LAYERS = 61
DEEPSEEK_V3_LAYOUTS = [
    KVLayout("bf16 latent", DSV3_LAYERS, 576 * 2),
    KVLayout("fp8 latent", DSV3_LAYERS, 656),
    KVLayout("bf16 latent + indexer", DSV3_LAYERS, 576 * 2, 132),
    KVLayout("fp8 latent + indexer", DSV3_LAYERS, 656, 132),
]


def tokens_per_rank(layout: KVLayout, kv_budget_bytes: int, shard_size: int,
                    scratch_tokens: int, scratch_buffers: int = 2) -> dict:
    """Logical KV tokens a shard group of ``shard_size`` ranks can hold,
    per rank of memory, against every rank holding a full copy.

    The scratch full view (``scratch_buffers`` buffers of ``scratch_tokens``
    tokens of one layer: double-buffered for layer-ahead prefetch) comes out
    of the same budget. ``shard_size == 1`` is the replicated baseline.
    """
    per_layer = layout.bytes_per_token_layer
    replicated = kv_budget_bytes // (layout.num_layers * per_layer)
    scratch = scratch_buffers * scratch_tokens * per_layer if shard_size > 1 else 0
    sharded = shard_size * ((kv_budget_bytes - scratch) // (layout.num_layers * per_layer))
    return {"layout": layout.name, "shard_size": shard_size,
            "replicated_tokens": replicated, "sharded_tokens": sharded,
            "scratch_bytes": scratch, "ratio": sharded / replicated,
            "efficiency": sharded / replicated / shard_size}


def capacity_table(kv_budget_bytes: int = 64 << 30, scratch_tokens: int = 256 * 1024,
                   shard_sizes=(2, 4, 8)) -> list[dict]:
    """DeepSeek-V3 (61 layers) tokens per shard group, sharded vs replicated."""
    return [tokens_per_rank(layout, kv_budget_bytes, n, scratch_tokens)
            for layout in DEEPSEEK_V3_LAYOUTS for n in shard_sizes]


def format_table(rows: list[dict]) -> str:
    lines = ["layout                   N   replicated   sharded (logical)   ratio  per-rank eff."]
    for r in rows:
        lines.append(f"{r['layout']:24s} {r['shard_size']:2d} {r['replicated_tokens']:12,d} "
                     f"{r['sharded_tokens']:19,d} {r['ratio']:7.2f}  {r['efficiency']:.3f}")
    return "\n".join(lines)
