"""The worker cp_kv installs: the platform's worker, with the scratch
full view taken out of the KV-cache memory budget, the shard runtime made
once the KV cache is known and bound to the model's attention layers, and
one step context per engine step (``execute_model`` and the
``sample_tokens`` that follows it, where the speculative drafter runs)."""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms import current_platform

from ..core.capacity import one_request_view_blocks, scratch_blocks_bound
from .checks import check_kv_cache_specs, check_scratch_cap
from . import vllm_api, worker_patches
from .geometry import geometry_of, group_size_of
from .metrics import ShardMetrics
from .options import options_of
from .runtime import ShardRuntime, make_runtime

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker

logger = init_logger("vllm." + __name__)  # under vLLM's log config


class ShardedKVWorker(_PlatformWorker):
    """Reserves the bounded scratch before vLLM sizes the KV cache, and owns
    the :class:`~vllm_cp_kv.integration.runtime.ShardRuntime`."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        self.cp_kv_runtime: ShardRuntime | None = None
        self._cp_kv_scratch_blocks: int | None = None
        # before vLLM builds the model runner's PCP manager and the model
        worker_patches.register_worker(vllm_config, self._v2_runner())

    def _sharding(self) -> bool:
        return options_of(self.vllm_config).kv_sharding

    def _v2_runner(self) -> bool:
        return vllm_api.uses_v2_runner(self)

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        specs = self.model_runner.get_kv_cache_spec()
        if not specs or not self._sharding():
            return available
        check_kv_cache_specs(specs, self._shared_caches())
        from .sparse_dcp import shard_aware_sparse

        if shard_aware_sparse(self.vllm_config):
            logger.info("cp_kv: sparse model on the shard-aware path: no scratch view "
                        "(each rank reads its own blocks); KV budget %.1f MiB.",
                        available / 2**20)
            return available
        # one scratch per cache layout (MLA latent; sparse models: indexer)
        page_bytes = sum({s.page_size_bytes for s in specs.values()})
        block_size = min(s.block_size for s in specs.values())
        cfg = self.vllm_config
        size = group_size_of(cfg)
        buffers = 2 if self._prefetch() else 1  # layer-ahead prefetch: two views
        chunked = self._chunked_context()
        blocks = scratch_blocks_bound(
            available_bytes=available // buffers, page_bytes=page_bytes,
            num_layers=len(specs), shard_size=size, block_size=block_size,
            max_num_seqs=cfg.scheduler_config.max_num_seqs,
            max_model_len=cfg.model_config.max_model_len,
            cap_blocks=options_of(cfg).max_scratch_blocks, chunked=chunked,
            workspace_tokens=options_of(cfg).workspace_tokens)
        if not chunked:
            check_scratch_cap(blocks, options_of(cfg).max_scratch_blocks,
                              one_request_view_blocks(
                                  shard_size=size, block_size=block_size,
                                  max_model_len=cfg.model_config.max_model_len))
        self._cp_kv_scratch_blocks = blocks
        logger.info(
            "cp_kv: KV shard group of %d ranks; scratch full view of %d x %d blocks "
            "(%.1f MiB, %s) reserved from a KV budget of %.1f MiB.", size, buffers, blocks,
            buffers * blocks * page_bytes / 2**20,
            "the chunked context's workspace" if chunked else "the whole view",
            available / 2**20)
        return available - buffers * blocks * page_bytes

    def _shared_caches(self) -> dict:
        """Attention layers that read another layer's KV cache (vLLM's
        cross-layer KV sharing): layer -> the layer whose cache it reads."""
        layers = self.vllm_config.compilation_config.static_forward_context
        return {name: target for name, layer in layers.items()
                if (target := getattr(layer, "kv_sharing_target_layer_name", None))}

    def _sharded_impls(self) -> list:
        """The impls of the model's sharded attention layers."""
        layers = self.vllm_config.compilation_config.static_forward_context.values()
        return [layer.impl for layer in layers
                if getattr(getattr(layer, "impl", None), "cp_kv_sharded", False)]

    def _chunked_context(self) -> bool:
        """Every sharded layer reads its cached context in chunks
        (``backend.chunked_context_enabled``): the scratch is the workspace."""
        from .backend import chunked_context_enabled

        impls = self._sharded_impls()
        return bool(impls) and all(
            chunked_context_enabled(self.vllm_config, impl.cp_kv_backend, impl.cp_kv_sparse)
            for impl in impls)

    def _owned_context(self) -> bool:
        """Some sharded layer's prefill rows may read their context owned
        (``backend.owned_context_enabled``): the cost model needs the link."""
        from .backend import owned_context_enabled

        return any(owned_context_enabled(self.vllm_config, impl.cp_kv_backend,
                                         impl.cp_kv_sparse) for impl in self._sharded_impls())

    def _prefetch(self) -> bool:
        """Layer-ahead prefetch: GPU, dense models (one latent cache a layer)."""
        cfg = self.vllm_config
        return (options_of(cfg).prefetch and not current_platform.is_cpu()
                and not getattr(cfg.model_config.hf_text_config, "index_topk", None))

    def initialize_from_config(self, kv_cache_config) -> None:
        if not (self._sharding() and kv_cache_config.kv_cache_groups):
            return super().initialize_from_config(kv_cache_config)
        # made and bound before vLLM builds the metadata builders (which find
        # it through their layers) and the PCP manager
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        geometry = geometry_of(self.vllm_config, block_size=spec.block_size)
        runtime = self.cp_kv_runtime = make_runtime(
            geometry, self._cp_kv_scratch_blocks,
            max_decode_rows=self.vllm_config.scheduler_config.max_num_batched_tokens)
        runtime.metrics = ShardMetrics(self.vllm_config, geometry.size, geometry.rank,
                                       first_on_node=self.local_rank == 0)
        runtime.metrics.set_capacity(kv_cache_config.num_blocks * spec.block_size
                                     * geometry.size)
        latents = self.bind_layers(runtime)
        if hasattr(self.model_runner, "cp_kv_runtime"):  # the V2 runner (pcp.py)
            self.model_runner.cp_kv_runtime = runtime
        super().initialize_from_config(kv_cache_config)
        if options_of(self.vllm_config).context_path == "auto" and self._owned_context():
            runtime.link()  # measured once at start, on every rank (docs/context.md)
        if self._prefetch():
            runtime.prefetch = True
            layers = self.vllm_config.compilation_config.static_forward_context
            runtime.register_layers([(name, layers[name].kv_cache) for name in latents])

    def bind_layers(self, runtime: ShardRuntime) -> list[str]:
        """Give every attention layer the runtime (its builders find it
        there) and every sharded impl its layer name; returns the target
        model's sharded MLA layers in layer order (the prefetch order: an
        MTP draft layer runs in the drafter's forwards, not after the
        target's last layer)."""
        from vllm.model_executor.models.utils import extract_layer_index

        layers = self.vllm_config.compilation_config.static_forward_context
        sharded = []
        for name, layer in layers.items():
            layer.cp_kv_runtime = runtime
            bind = getattr(getattr(layer, "impl", None), "cp_kv_bind", None)
            if bind is not None:
                bind(name, layer)
                sharded.append(name)
        target = self.vllm_config.model_config.hf_text_config.num_hidden_layers
        return sorted((n for n in sharded if extract_layer_index(n) < target),
                      key=extract_layer_index)

    def execute_model(self, *args, **kwargs):
        runtime = self.cp_kv_runtime
        if runtime is None:
            return super().execute_model(*args, **kwargs)
        runtime.begin_step()
        try:
            out = super().execute_model(*args, **kwargs)
        except BaseException:
            runtime.end_step()
            raise
        if out is not None:  # sampled already: no sample_tokens follows
            runtime.end_step()
        return out

    def sample_tokens(self, *args, **kwargs):
        """The step's second half (vLLM calls it when ``execute_model``
        returned None): sampling and the drafter's forwards, each with a
        batch of its own (``ShardRuntime.new_forward``)."""
        runtime = self.cp_kv_runtime
        if runtime is None or not runtime.step_open():
            return super().sample_tokens(*args, **kwargs)
        runtime.new_forward()
        try:
            return super().sample_tokens(*args, **kwargs)
        finally:
            runtime.end_step()

    def cp_kv_stats(self, reset: bool = False) -> dict | None:
        """Running totals (for ``collective_rpc`` and the metrics);
        ``reset``: start new totals after reading."""
        runtime = self.cp_kv_runtime
        if runtime is None:
            return None
        stats = runtime.stats.as_dict()
        link = runtime.measured_link  # the context path's cost model (docs/context.md)
        if link is not None:
            stats["link"] = {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s}
        if reset:
            runtime.reset_stats()
        return stats

    def _make_model_runner(self):
        """GPU V2 runner: select cp_kv's PCP manager (see pcp.py)."""
        if self._v2_runner():
            from .pcp import make_runner_cls

            return make_runner_cls()(self.vllm_config, self.device)
        return super()._make_model_runner()
