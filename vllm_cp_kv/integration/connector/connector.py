"""``ShardedKVConnector``: vLLM's connector interface, delegating to the
scheduler side (:mod:`.scheduler`) and the worker side (:mod:`.worker`)."""

from __future__ import annotations

from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorRole, KVConnectorTransferResults, SupportsHMA)
from vllm.logger import init_logger

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
        self.shard_size = parallel.decode_context_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = kv.engine_id
        # every decode TP rank holds the whole (replicated) latent cache and
        # pulls every block; the prefill frees once all of them are done
        self.tp_size = parallel.tensor_parallel_size
        if self.is_consumer and self.shard_size > 1:
            raise ValueError(
                "ShardedKVConnector: the decode (kv_consumer) instance must not be "
                f"sharded (got shard size {self.shard_size}); drop cp_kv there.")
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

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    # ==============================
    # Worker-side methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker = WorkerSide.start(
            self.cfg, list(kv_caches.values()), shard_rank(self.shard_size), self.engine_id,
            self.shard_size, self.block_size, self.tp_size, self.is_producer,
            self.is_consumer)

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


def shard_rank(shard_size: int, dcp_group=None, tp_rank: int | None = None) -> int:
    """The rank a worker serves (prefill) or reads as (decode).

    A sharded instance (``shard_size`` > 1) shards over vLLM's DCP group, so
    its shard rank is the rank in that group, as the plugin's ownership rule
    uses it (``runtime.get_runtime``): the TP rank under TP sharding, the PCP
    rank under PCP (where every rank has TP rank 0). It names the blocks the
    worker owns and its side-channel port (``side_channel_port + rank``). An
    unsharded instance (the decode) uses its TP rank. The groups are vLLM's
    unless given (tests pass stand-ins)."""
    if shard_size > 1:
        if dcp_group is None:
            from vllm.distributed.parallel_state import get_dcp_group

            dcp_group = get_dcp_group()
        if dcp_group.world_size != shard_size:
            raise ValueError(f"ShardedKVConnector: vLLM's DCP group has "
                             f"{dcp_group.world_size} ranks, the shard group {shard_size}")
        return dcp_group.rank_in_group
    if tp_rank is None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    return tp_rank
