"""The worker cp_kv installs: the platform's worker, with the scratch
full view taken out of the KV-cache memory budget."""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms import current_platform

from ..core.capacity import scratch_blocks_bound
from .options import options_of
from .runtime import set_scratch_capacity

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker

logger = init_logger("vllm." + __name__)  # under vLLM's log config


class ShardedKVWorker(_PlatformWorker):
    """Reserves the bounded scratch before vLLM sizes the KV cache."""

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        specs = self.model_runner.get_kv_cache_spec()
        if not specs or not options_of(self.vllm_config).kv_sharding:
            return available
        # one scratch per cache layout (MLA latent; sparse models: indexer)
        page_bytes = sum({s.page_size_bytes for s in specs.values()})
        block_size = min(s.block_size for s in specs.values())
        cfg = self.vllm_config
        size = cfg.parallel_config.decode_context_parallel_size
        blocks = scratch_blocks_bound(
            available_bytes=available, page_bytes=page_bytes,
            num_layers=len(specs), shard_size=size, block_size=block_size,
            max_num_seqs=cfg.scheduler_config.max_num_seqs,
            max_model_len=cfg.model_config.max_model_len,
            cap_blocks=options_of(cfg).max_scratch_blocks)
        set_scratch_capacity(blocks)
        logger.info(
            "cp_kv: KV shard group of %d ranks; scratch full view of %d blocks "
            "(%.1f MiB) reserved from a KV budget of %.1f MiB.", size, blocks,
            blocks * page_bytes / 2**20, available / 2**20)
        return available - blocks * page_bytes

    def load_model(self, *args, **kwargs):
        """Sparse (DeepSeek-V3.2) models: patch the indexer before vLLM
        builds the model (see sparse.py)."""
        cfg = self.vllm_config
        if options_of(cfg).kv_sharding and getattr(
                cfg.model_config.hf_text_config, "index_topk", None):
            from .sparse import install

            install()
        return super().load_model(*args, **kwargs)

    def _make_model_runner(self):
        """GPU V2 runner: select cp_kv's PCP manager (see pcp.py)."""
        if getattr(self, "use_v2_model_runner", False) and \
                not self.vllm_config.is_mm_encoder_only:
            from .pcp import make_runner_cls

            return make_runner_cls()(self.vllm_config, self.device)
        return super()._make_model_runner()
