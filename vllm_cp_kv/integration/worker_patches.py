"""The rebindings the sharded worker installs when it starts (plugin.py's
items 9, 10, 14 and 15; why each is needed: plugin.py's docstring), before
vLLM builds its model runner and model: :func:`register_worker`. Each is
installed once per process and is inert where its condition does not hold
(no PCP, a dense model, no speculative decoding, layers not sharded).
"""

from __future__ import annotations

import functools

from . import vllm_api
from .options import enabled, sharding

_WORKER_PATCHES: set[str] = set()


def _first_time(name: str) -> bool:
    """Whether patch ``name`` is not installed in this process yet (and now is)."""
    if name in _WORKER_PATCHES:
        return False
    _WORKER_PATCHES.add(name)
    return True


# -- 9 ----------------------------------------------------------------------
def patch_forward_context() -> None:
    """PCP + MoE: the gathered tokens' padding mask (item 9). Installed by the
    sharded worker when it builds vLLM's V2 runner."""
    if not _first_time("forward_context"):
        return
    from vllm.v1.worker.gpu import cudagraph_utils, model_runner
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar import speculator

    # the V2 runner's forwards, its CUDA graph captures (whose MoE layers keep
    # reading the mask's buffer at every replay) and its MTP drafter's (each
    # module imports the function by name): a DeepSeek MTP layer is MoE too
    for module in (model_runner, cudagraph_utils, speculator):
        module.set_forward_context = _gathered_padding(module.set_forward_context)


def _gathered_padding(orig):
    @functools.wraps(orig)
    def set_forward_context(attn_metadata, vllm_config, *args, is_padding=None,
                            **kwargs):
        pcp = vllm_config.parallel_config.prefill_context_parallel_size
        if is_padding is not None and pcp > 1 and enabled(vllm_config):
            from .pcp import gathered_padding

            # the step's recorded mask; dummy and profile runs, and the
            # drafter's chained steps (item 15), are identical on every rank
            is_padding = gathered_padding(*_recorded_padding(attn_metadata), is_padding,
                                          pcp)
        return orig(attn_metadata, vllm_config, *args, is_padding=is_padding,
                    **kwargs)

    return set_forward_context


def _recorded_padding(attn_metadata) -> tuple[bool, object]:
    """Whether this forward's metadata carries a batch plan, and the padding
    masks the PCP manager recorded in its step (None where the forward is
    replicated on every rank)."""
    groups = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
    for group in groups:
        for md in (group or {}).values():
            made = getattr(md, "cp_kv", None)
            if made is not None:
                return True, made.batch.padding
    return False, None


# -- 10 ---------------------------------------------------------------------
def patch_sparse_indexer() -> None:
    """Sparse models (item 10). Installed by the sharded worker before vLLM
    builds the model (idempotent)."""
    if not _first_time("sparse_indexer"):
        return
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.models.deepseek_v32 import attention

    from .sparse import sharded_indexer_backend, sharded_indexer_op

    attention.sparse_attn_indexer = sharded_indexer_op(attention.sparse_attn_indexer)
    orig_backend = DeepseekV32IndexerCache.get_attn_backend

    @functools.wraps(orig_backend)
    def get_attn_backend(self):
        return sharded_indexer_backend(orig_backend(self))

    DeepseekV32IndexerCache.get_attn_backend = get_attn_backend


def patch_sparse_merge() -> None:
    """Sparse models on the shard-aware path (item 10, vLLM 0.34): the
    exchange of the ranks' local top-k (``sparse_dcp.merge_dcp_topk_global``)
    replaces vLLM's CuteDSL-only merge, which its indexer op looks up by name
    at every call (idempotent)."""
    if not _first_time("sparse_merge"):
        return
    from vllm.model_executor.layers import sparse_attn_indexer

    from .sparse_dcp import merge_dcp_topk_global

    sparse_attn_indexer._merge_dcp_topk_global = merge_dcp_topk_global


# -- 14 ---------------------------------------------------------------------
def patch_drafter() -> None:
    """Speculative decoding with sharded draft layers (item 14)."""
    if not _first_time("drafter"):
        return
    import torch
    from vllm.v1.spec_decode import llm_base_proposer as lbp
    from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

    from ..core.ownership import owned_slot_mapping
    from .runtime import runtime_of_layers

    proposer = lbp.SpecDecodeBaseProposer

    def runtime_of(self):
        names = [n for group in getattr(self, "draft_attn_groups", None) or ()
                 for n in group.layer_names]
        runtime = runtime_of_layers(self.vllm_config, names)
        return runtime if runtime is not None and runtime.spec.size > 1 else None

    orig_build = proposer.build_per_group_and_layer_attn_metadata

    @functools.wraps(orig_build)
    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, *args, **kwargs):
        runtime = runtime_of(self)
        if runtime is not None:
            runtime.new_forward()
        return orig_build(self, common_attn_metadata, *args, **kwargs)

    orig_update = proposer._update_positions_dependent_metadata

    @functools.wraps(orig_update)
    def update_positions(self, positions, common_attn_metadata, batch_size,
                         input_batch_size, block_size):
        out = orig_update(self, positions, common_attn_metadata, batch_size,
                          input_batch_size, block_size)
        runtime = runtime_of(self)
        if runtime is not None:
            spec, slots = runtime.spec, common_attn_metadata.slot_mapping
            pos = (out[0] if self.uses_mrope else out)[:batch_size].long()
            rows = torch.arange(batch_size, device=pos.device)
            owned = owned_slot_mapping(pos, rows, common_attn_metadata.block_table_tensor,
                                       block_size, spec.size, spec.rank, spec.block_size,
                                       PADDING_SLOT_ID)
            # past max_model_len vLLM wrote the padding slot: keep it
            slots.copy_(torch.where(slots == PADDING_SLOT_ID, slots, owned))
        return out

    proposer.build_per_group_and_layer_attn_metadata = build_per_group_and_layer_attn_metadata
    proposer._update_positions_dependent_metadata = update_positions


def patch_v2_speculator() -> None:
    """Speculative decoding on the V2 runner (item 15)."""
    if not _first_time("v2_speculator"):
        return
    from vllm.v1.worker.gpu.spec_decode import speculator as sp

    from .runtime import runtime_of_layers

    cls = sp.DraftModelSpeculator
    orig = cls._build_attn_metadata

    @functools.wraps(orig)
    def _build_attn_metadata(self, *args, **kwargs):
        runtime = runtime_of_layers(self.vllm_config,
                                    sorted(getattr(self, "draft_attn_layer_names", ()) or ()))
        if runtime is not None:
            # a chained draft step: the whole batch on every rank, one
            # token a request, also under PCP (the draft prefill before it
            # ran on the target's split and metadata)
            runtime.new_forward(replicated=True)
        return orig(self, *args, **kwargs)

    cls._build_attn_metadata = _build_attn_metadata


def register_worker(vllm_config, v2_runner: bool) -> None:
    """Items 9, 10, 14 and 15 where they apply: called once by the sharded
    worker before vLLM builds its model runner and model."""
    if v2_runner and not vllm_api.vllm_gathers_moe_padding():
        patch_forward_context()
    if sharding(vllm_config) and getattr(vllm_config.model_config.hf_text_config,
                                          "index_topk", None):
        from .sparse_dcp import shard_aware_sparse

        patch_sparse_merge() if shard_aware_sparse(vllm_config) else patch_sparse_indexer()
    if sharding(vllm_config) and vllm_config.speculative_config is not None:
        patch_v2_speculator() if v2_runner else patch_drafter()


