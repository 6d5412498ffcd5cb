"""The worker cp_kv installs: the platform's worker, with the scratch
full view taken out of the KV-cache memory budget, the shard runtime made
once the KV cache is known, and one batch context per engine step."""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms import current_platform

from ..core.capacity import scratch_blocks_bound
from . import plugin
from .metrics import ShardMetrics
from .options import options_of
from .runtime import current_runtime, get_runtime, set_scratch_capacity

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker

logger = init_logger("vllm." + __name__)  # under vLLM's log config


class ShardedKVWorker(_PlatformWorker):
    """Reserves the bounded scratch before vLLM sizes the KV cache."""

    def _sharding(self) -> bool:
        return options_of(self.vllm_config).kv_sharding

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        specs = self.model_runner.get_kv_cache_spec()
        if not specs or not self._sharding():
            return available
        # one scratch per cache layout (MLA latent; sparse models: indexer)
        page_bytes = sum({s.page_size_bytes for s in specs.values()})
        block_size = min(s.block_size for s in specs.values())
        cfg = self.vllm_config
        size = cfg.parallel_config.decode_context_parallel_size
        buffers = 2 if self._prefetch() else 1  # layer-ahead prefetch: two views
        blocks = scratch_blocks_bound(
            available_bytes=available // buffers, page_bytes=page_bytes,
            num_layers=len(specs), shard_size=size, block_size=block_size,
            max_num_seqs=cfg.scheduler_config.max_num_seqs,
            max_model_len=cfg.model_config.max_model_len,
            cap_blocks=options_of(cfg).max_scratch_blocks)
        set_scratch_capacity(blocks)
        logger.info(
            "cp_kv: KV shard group of %d ranks; scratch full view of %d x %d blocks "
            "(%.1f MiB) reserved from a KV budget of %.1f MiB.", size, buffers, blocks,
            buffers * blocks * page_bytes / 2**20, available / 2**20)
        return available - buffers * blocks * page_bytes

    def _prefetch(self) -> bool:
        """Layer-ahead prefetch: GPU, dense models (one latent cache a layer)."""
        cfg = self.vllm_config
        return (options_of(cfg).prefetch and not current_platform.is_cpu()
                and not getattr(cfg.model_config.hf_text_config, "index_topk", None))

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        if self._sharding() and kv_cache_config.kv_cache_groups:
            # the runtime exists before the first step (the PCP manager and
            # the step context below need it)
            spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
            runtime = get_runtime(spec.block_size)
            n = runtime.spec.size
            runtime.metrics = ShardMetrics(self.vllm_config, n, runtime.spec.rank)
            runtime.metrics.set_capacity(kv_cache_config.num_blocks * spec.block_size * n)
            if self._prefetch():
                runtime.prefetch = True
                runtime.register_layers(self.model_runner.kv_caches)

    def execute_model(self, *args, **kwargs):
        runtime = current_runtime()
        if runtime is None:
            return super().execute_model(*args, **kwargs)
        with runtime.step():
            return super().execute_model(*args, **kwargs)

    def cp_kv_stats(self, reset: bool = False) -> dict | None:
        """Running totals (for ``collective_rpc`` and the metrics);
        ``reset``: start new totals after reading."""
        runtime = current_runtime()
        if runtime is None:
            return None
        stats = runtime.stats.as_dict()
        if reset:
            runtime.reset_stats()
        return stats

    def load_model(self, *args, **kwargs):
        """Sparse (DeepSeek-V3.2) models: patch the indexer before vLLM
        builds the model (plugin.py, item 10)."""
        cfg = self.vllm_config
        if self._sharding() and getattr(cfg.model_config.hf_text_config,
                                        "index_topk", None):
            plugin.patch_sparse_indexer()
        return super().load_model(*args, **kwargs)

    def _make_model_runner(self):
        """GPU V2 runner: select cp_kv's PCP manager (see pcp.py)."""
        if getattr(self, "use_v2_model_runner", False) and \
                not self.vllm_config.is_mm_encoder_only:
            from .pcp import make_runner_cls

            plugin.patch_forward_context()  # PCP + MoE padding (plugin.py, item 9)
            return make_runner_cls()(self.vllm_config, self.device)
        return super()._make_model_runner()
