"""``ShardedKVConnector``: vLLM's connector interface, delegating to the
scheduler side (:mod:`.scheduler`) and the worker side (:mod:`.worker`)."""

from __future__ import annotations

from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorRole, KVConnectorTransferResults, SupportsHMA)
from vllm.logger import init_logger

from ..geometry import ShardGeometry, geometry_of, group_size_of
from .config import ConnectorConfig, check_decode_exposure
from .scheduler import SchedulerSide, ShardedKVMetadata
from .stats import ShardedKVPromMetrics, ShardedKVStats
from .worker import WorkerSide

logger = init_logger("vllm." + __name__)  # under vLLM's log config


class ShardedKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(kv.kv_connector_extra_config, kv.is_kv_producer)
        self.is_producer, self.is_consumer = kv.is_kv_producer, kv.is_kv_consumer
        parallel = vllm_config.parallel_config
        self.shard_size = group_size_of(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = kv.engine_id
        # every decode TP rank pulls: every block into its replicated latent
        # cache (an unsharded decode), or the blocks it owns (a sharded
        # decode); the prefill frees once all of them are done
        self.tp_size = parallel.tensor_parallel_size
        if self.is_consumer:
            from vllm.utils.network_utils import get_ip

            check_decode_exposure(self.cfg, get_ip())
        if self.is_consumer and parallel.prefill_context_parallel_size > 1:
            raise ValueError(
                "ShardedKVConnector: the decode (kv_consumer) instance runs without "
                "prefill context parallelism (got --prefill-context-parallel-size "
                f"{parallel.prefill_context_parallel_size}); use TP there.")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.cfg, self.engine_id, self.shard_size,
                                            self.block_size, self.is_producer, self.is_consumer)
            if (self.is_consumer and self.cfg.allowed_prefill_hosts is None
                    and self.cfg.secret is None):
                logger.warning(
                    "cp_kv connector: this decode fetches KV from whatever prefill host "
                    "a request's kv_transfer_params name; set allowed_prefill_hosts or a "
                    "side-channel secret unless every client is trusted "
                    "(docs/disaggregated.md, Security)")

    # ==============================
    # Scheduler-side methods
    # ==============================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> ShardedKVMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids[0])

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def cp_kv_idle_wait_s(self) -> float:
        """How long an engine with only transfers pending waits for a client
        call before stepping again (``idle_step_s``; plugin.py item 25): 0
        while the workers have sends or receives to be told of, or reads in
        flight (the workers' own wait for them paces the loop)."""
        s = self._scheduler
        return 0.0 if s.has_undelivered_meta() or s.has_reads_in_flight() else self.cfg.idle_step_s

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    # ==============================
    # Worker-side methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        geometry = geometry_of(self._vllm_config)
        self._worker = WorkerSide.start(
            self.cfg, list(kv_caches.values()), geometry, side_rank(geometry),
            self.engine_id, self.tp_size, self.is_producer, self.is_consumer,
            kv_cache_dtype=self._vllm_config.cache_config.cache_dtype)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        # transfers run in background threads (see get_transfer_results)
        self._worker.start_step(forward_context, kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    # ==============================
    # Transfer figures (docs/disaggregated.md, "Transfer figures")
    # ==============================
    def get_kv_connector_stats(self) -> ShardedKVStats | None:
        data = self._worker.stats() if self._worker is not None else None
        return ShardedKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ShardedKVStats:
        return ShardedKVStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues) -> ShardedKVPromMetrics:
        return ShardedKVPromMetrics(vllm_config, metric_types, labelnames,
                                    per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


def side_rank(geometry: ShardGeometry, tp_rank: int | None = None) -> int:
    """The rank a worker serves as (prefill) or reads as (decode): its shard
    rank when sharded (it names the blocks the worker owns and its
    side-channel port, ``side_channel_port + rank``), else its TP rank (an
    unsharded decode's TP ranks each read every block). ``tp_rank``: given
    by tests, else vLLM's."""
    if geometry.size > 1:
        return geometry.rank
    if tp_rank is None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    return tp_rank
