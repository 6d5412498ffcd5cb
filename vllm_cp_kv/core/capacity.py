"""Capacity arithmetic: the scratch bound, and tokens per KV budget
sharded and not (``vllm-cp-kv capacity``)."""

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


def logical_capacity_tokens(*, budget_bytes: int, page_bytes: int, num_layers: int,
                            block_size: int, shard_size: int, max_num_seqs: int,
                            max_model_len: int, cap_blocks: int = 0) -> dict:
    """Tokens a KV budget per rank holds, unsharded and sharded, with the
    arithmetic vLLM's engine uses (whole blocks of every layer) and the
    plugin's scratch taken out of the sharded budget first.

    Args:
        budget_bytes: KV memory per rank.
        page_bytes: one block of one layer, every cache of the layer summed
            (latent; sparse models: plus the indexer's keys and scales).
    Returns:
        ``{"unsharded": tokens, "sharded": tokens, "scratch_blocks": n,
        "ratio": sharded / unsharded}``.
    """
    per_block = page_bytes * num_layers
    unsharded = budget_bytes // per_block * block_size
    scratch = scratch_blocks_bound(
        available_bytes=budget_bytes, page_bytes=page_bytes, num_layers=num_layers,
        shard_size=shard_size, block_size=block_size, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, cap_blocks=cap_blocks)
    sharded = (budget_bytes - scratch * page_bytes) // per_block * block_size * shard_size
    return {"unsharded": unsharded, "sharded": sharded, "scratch_blocks": scratch,
            "ratio": sharded / unsharded if unsharded else float("inf")}
