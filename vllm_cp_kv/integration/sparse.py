"""Sparse attention (DeepSeek-V3.2 DSA): the indexer K cache is sharded with
the MLA latent, by the same block ownership, and materialized by the same
per-batch plan.

A DSA layer keeps two paged caches in one KV cache group: the latent (read
by the sparse MLA backend, FLASH_ATTN_MLA_SPARSE or FLASHMLA_SPARSE, which
``backend.sharded_backend`` wraps like any MLA backend) and the indexer's
fp8 keys with their scales (read by vLLM's ``sparse_attn_indexer`` op to
pick each query's top-k tokens). Both are written owner-only through vLLM's
DCP slot mapping, so each rank stores only the blocks it owns. Here:

* the indexer's metadata builder takes the batch plan the latent's builder
  made (:func:`~vllm_cp_kv.integration.planning.plan_batch`, one per batch)
  and sees the full-view block table;
* vLLM's indexer op (``sparse_attn_indexer``) runs unchanged on the
  materialized full view, as if DCP were off: no CuteDSL top-k merge across
  ranks is needed, since every rank sees every key. New keys are written to
  the persistent cache first (by the model's fused norm/RoPE kernel, or
  under PCP by the op's own insert, done here beforehand), owner-only.

``worker_patches.patch_sparse_indexer`` installs both wrappers in sharded workers
of sparse models, before the model is built; without a plan in the batch
metadata (sharding off, profile runs) the op runs exactly as vLLM's.
"""

from __future__ import annotations

import functools
from functools import cache

from . import vllm_api
from .geometry import group_size_of
from .planning import plan_batch, split_rows, translated
from .runtime import required_runtime


class ShardedIndexerBuilder:
    """Mixin over vLLM's DSA indexer builder: plans with the latent (the
    same batch plan) and sees the full-view block table."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        if "block_table_width" in kwargs:
            # a full-view row holds every logical block of a request: N times
            # the columns of a DCP-sharded row
            kwargs["block_table_width"] *= group_size_of(vllm_config)
        with vllm_api.unsharded_view(vllm_config):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                             *args, **kwargs)
        self.cp_kv_layers = (vllm_config, list(layer_names))

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        """NEVER: the indexer reads a full view gathered by a per-batch plan,
        so vLLM keeps it out of full graphs (its op is outside piecewise
        graphs already)."""
        from vllm.v1.attention.backend import AttentionCGSupport

        return AttentionCGSupport.NEVER

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        common = common_attn_metadata
        # the indexer reads every token of the batch, as sparse MLA does
        runtime = required_runtime(*self.cp_kv_layers)
        made = plan_batch(runtime.plan_inputs(common.block_table_tensor), common,
                          split_rows(self, common), whole=True, lse_decode=False)
        metadata = super().build(common_prefix_len, translated(common, made.full_table),
                                 fast_build)
        metadata.cp_kv = made
        return metadata


@cache
def sharded_indexer_backend(inner: type) -> type:
    """``inner`` (vLLM's DSA indexer backend) with :class:`ShardedIndexerBuilder`."""
    name = inner.get_name()
    builder = type(f"ShardedKVBuilder_{name}",
                   (ShardedIndexerBuilder, inner.get_builder_cls()), {})
    return type(f"ShardedKVBackend_{name}", (inner,),
                {"get_builder_cls": staticmethod(lambda: builder)})


def _write_owned(k, metadata, kv_cache, args) -> None:
    """This step's indexer keys into this rank's persistent cache.

    The same steps as the insert inside vLLM's ``sparse_attn_indexer`` (PCP
    runs insert there; otherwise the model's fused norm/RoPE kernel has
    already written them): vLLM's DCP slot mapping is ``-1`` for tokens
    another rank owns, so each rank writes only its own blocks.
    """
    from vllm import _custom_ops as ops
    from vllm.distributed import get_pcp_group
    from vllm.v1.attention.ops.pcp import maybe_gather_indexer_k

    slot_mapping = metadata.slot_mapping
    num_tokens = slot_mapping.shape[0]
    if args["use_pcp"] and num_tokens > k.shape[0]:
        num_tokens //= get_pcp_group().world_size
    k, slots = maybe_gather_indexer_k(
        k[:num_tokens], slot_mapping, metadata.num_decode_tokens, args["use_pcp"],
        pcp_shard_decode_requests=args["pcp_shard_decode_requests"])
    ops.indexer_k_quant_and_cache(k, kv_cache, slots, args["quant_block_size"],
                                  args["scale_fmt"])


def sharded_indexer_op(orig):
    """Wrap vLLM's ``sparse_attn_indexer`` function: on a sharded batch, run
    it on the full view with the insert done beforehand and DCP off."""
    import inspect

    from vllm import forward_context

    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def sparse_attn_indexer(*args, **kwargs):
        context = forward_context.get_forward_context()
        metadata = context.attn_metadata
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        layer = vllm_api.resolve_layer_name(a["k_cache_prefix"])
        if isinstance(metadata, dict):
            metadata = metadata.get(layer)
        made = getattr(metadata, "cp_kv", None)
        if made is None or made.plan is None:  # not sharded, or a profile run
            return orig(*args, **kwargs)
        persistent = a["kv_cache"]
        if not a["skip_k_cache_insert"]:
            _write_owned(a["k"], metadata, persistent, a)
        runtime = context.no_compile_layers[layer].cp_kv_runtime  # bound by the worker
        a["kv_cache"] = runtime.materialize(made, persistent, layer)
        a.update(skip_k_cache_insert=True, dcp_rank=0, dcp_world_size=1)
        return orig(**a)

    sparse_attn_indexer._cp_kv = True
    return sparse_attn_indexer
