"""Capacity arithmetic: the scratch bound, and tokens per KV budget
sharded and not (``vllm-cp-kv capacity``)."""

from __future__ import annotations


# Default workspace of the chunked context: 1% of the KV budget, raised to
# DCP_CHUNK_TOKENS or max_model_len, whichever is less, while that costs at
# most 2% of the budget, so one request's context takes no more chunks (one
# all-gather each per layer) than vLLM's DCP reads it in; at least 4 blocks
# per rank (a chunk of a few blocks per rank moves little).
WORKSPACE_BUDGET_DIVISOR = 100
WORKSPACE_BUDGET_CEILING = 50  # at most 1/50 = 2% of the budget to reach DCP's chunk
# the most vLLM's MLA chunked-prefill workspace, its context chunk, holds:
# min(64K, max(8 * max_model_len, 4 * max_num_seqs * block_size)) tokens
# (determine_chunked_prefill_workspace_size in vLLM 0.32 and 0.34; activation
# memory there, out of the KV budget here)
DCP_CHUNK_TOKENS = 64 * 1024
MIN_WORKSPACE_BLOCKS_PER_RANK = 4


def whole_view_blocks(*, available_bytes: int, page_bytes: int, num_layers: int,
                      shard_size: int, block_size: int, max_num_seqs: int,
                      max_model_len: int) -> int:
    """Scratch blocks (one layer's full view) that no batch can exceed.

    A batch reads at most ``max_num_seqs`` requests of ``max_model_len``
    tokens, and never more blocks than the persistent cache holds; the
    scratch holds ``shard_size`` ranks' worth of the padded per-rank list::

        per_req  = ceil(ceil(max_model_len / block_size) / shard_size)
        by_seqs  = shard_size * max_num_seqs * per_req
        # scratch <= shard_size * (available - scratch) / (layers * page)
        by_bytes = available * shard_size // ((layers + shard_size) * page)
    """
    per_req = -(-(-(-max_model_len // block_size)) // shard_size)
    by_seqs = shard_size * max_num_seqs * per_req
    by_bytes = available_bytes * shard_size // ((num_layers + shard_size) * page_bytes)
    return min(by_seqs, by_bytes)


def workspace_blocks(*, available_bytes: int, page_bytes: int, shard_size: int,
                     block_size: int, workspace_tokens: int = 0,
                     max_model_len: int = 0) -> int:
    """Scratch blocks of the chunked context (prefill rows read their cached
    context in chunks of this many blocks of one layer, ``core.plan.
    chunk_ranges``): ``workspace_tokens`` if given, else 1% of the budget,
    raised to vLLM's own context chunk (``DCP_CHUNK_TOKENS``, or
    ``max_model_len`` where shorter) where that fits in 2% of the budget;
    never fewer than one block per rank (each chunk must make progress).
    New tokens never pass through it (they come from the projections)."""
    if workspace_tokens:
        return max(-(-workspace_tokens // block_size), shard_size)
    dcp_tokens = min(DCP_CHUNK_TOKENS, max_model_len or DCP_CHUNK_TOKENS)
    blocks = max(available_bytes // (WORKSPACE_BUDGET_DIVISOR * page_bytes),
                 min(-(-dcp_tokens // block_size),
                     available_bytes // (WORKSPACE_BUDGET_CEILING * page_bytes)),
                 MIN_WORKSPACE_BLOCKS_PER_RANK * shard_size)
    return max(blocks, shard_size)


def one_request_view_blocks(*, shard_size: int, block_size: int, max_model_len: int) -> int:
    """Scratch blocks the whole view of one request of ``max_model_len``
    tokens needs (``shard_size`` ranks' worth of its padded per-rank
    list): the least a whole-view scratch can hold and still serve every
    request."""
    return shard_size * -(-(-(-max_model_len // block_size)) // shard_size)


def scratch_blocks_bound(*, available_bytes: int, page_bytes: int,
                         num_layers: int, shard_size: int, block_size: int,
                         max_num_seqs: int, max_model_len: int,
                         cap_blocks: int = 0, chunked: bool = False,
                         workspace_tokens: int = 0) -> int:
    """Scratch blocks the worker reserves per cache layout and buffer.

    ``chunked`` (dense MLA with the shard-aware decode on backends whose
    prefill merges context chunks by LSE): the workspace
    (:func:`workspace_blocks`), which does not grow with the cache; else
    (sparse models, ``decode: materialize``, AMX_MLA) the whole view
    (:func:`whole_view_blocks`). Never more than the whole view, nor than
    ``cap_blocks`` (0 = no cap).

    Args:
        available_bytes: KV budget of this rank before the scratch is taken.
        page_bytes: bytes of one block of one layer.
    Returns:
        Blocks, a multiple of ``shard_size`` (at least ``shard_size`` when
        chunked).
    """
    blocks = whole_view_blocks(
        available_bytes=available_bytes, page_bytes=page_bytes, num_layers=num_layers,
        shard_size=shard_size, block_size=block_size, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len)
    if chunked:
        blocks = min(blocks, workspace_blocks(
            available_bytes=available_bytes, page_bytes=page_bytes,
            shard_size=shard_size, block_size=block_size,
            workspace_tokens=workspace_tokens, max_model_len=max_model_len))
    if cap_blocks:
        blocks = min(blocks, cap_blocks)
    blocks -= blocks % shard_size
    return max(blocks, shard_size) if chunked else blocks


def logical_capacity_tokens(*, budget_bytes: int, page_bytes: int, num_layers: int,
                            block_size: int, shard_size: int, max_num_seqs: int,
                            max_model_len: int, cap_blocks: int = 0,
                            chunked: bool = True, workspace_tokens: int = 0,
                            scratch: bool = True) -> dict:
    """Tokens a KV budget per rank holds, unsharded and sharded, with the
    arithmetic vLLM's engine uses (whole blocks of every layer) and the
    plugin's scratch taken out of the sharded budget first.

    Args:
        budget_bytes: KV memory per rank.
        page_bytes: one block of one layer, every cache of the layer summed
            (latent; sparse models: plus the indexer's keys and scales).
        chunked: the scratch is the chunked context's workspace (dense
            models); False: the whole view (the materializing sparse path
            and the other cases of :func:`scratch_blocks_bound`).
        scratch: False where the plugin reserves none (sparse models on the
            shard-aware path: every rank reads its own blocks; vLLM's own
            prefill gather buffers are activation memory, outside the KV
            budget, as for vLLM's DCP).
    Returns:
        ``{"unsharded": tokens, "sharded": tokens, "scratch_blocks": n,
        "ratio": sharded / unsharded}``.
    """
    per_block = page_bytes * num_layers
    unsharded = budget_bytes // per_block * block_size
    blocks = scratch_blocks_bound(
        available_bytes=budget_bytes, page_bytes=page_bytes, num_layers=num_layers,
        shard_size=shard_size, block_size=block_size, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, cap_blocks=cap_blocks, chunked=chunked,
        workspace_tokens=workspace_tokens) if scratch else 0
    sharded = (budget_bytes - blocks * page_bytes) // per_block * block_size * shard_size
    return {"unsharded": unsharded, "sharded": sharded, "scratch_blocks": blocks,
            "ratio": sharded / unsharded if unsharded else float("inf")}


def is_dense_fp8(kv_cache_dtype: str, sparse: bool) -> bool:
    """An FP8 cache of a dense MLA model (``fp8``, ``fp8_e4m3``,
    ``fp8_e5m2``; sparse models keep their own ``fp8_ds_mla``)."""
    return kv_cache_dtype.startswith("fp8") and kv_cache_dtype != "fp8_ds_mla" and not sparse
