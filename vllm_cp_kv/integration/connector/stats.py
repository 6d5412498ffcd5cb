"""Transfer figures through vLLM 0.32's KV-connector stats channel.

Route (the same as vLLM's own NixlConnector): every worker's connector
returns the counts of the last step (:class:`~.counters.TransferCounters`)
from ``get_kv_connector_stats`` as a :class:`ShardedKVStats`; the engine sums
them over the workers (``aggregate``) and sends ``data`` to the frontend,
where the connector class rebuilds them (``build_kv_connector_stats``):

* vLLM's logging stat logger prints ``KV Transfer metrics: ...``
  (:meth:`ShardedKVStats.reduce`) every log interval;
* vLLM's Prometheus stat logger records them through
  :class:`ShardedKVPromMetrics` (``build_prom_metrics``), so they appear
  under ``vllm serve``'s ``/metrics`` (labels: vLLM's ``model_name`` and
  ``engine``, plus ``role``, the shard or TP ``rank`` that counted, and
  ``result`` where it applies):

  ================================================  =========  ================
  metric                                            type       role
  ================================================  =========  ================
  ``vllm:cp_kv_transfers_total{result=ok|failed}``  counter    decode: pulls
                                                               (per request and
                                                               decode rank);
                                                               prefill: ok =
                                                               requests served
                                                               to every reader,
                                                               failed = readers
                                                               that gave up
  ``vllm:cp_kv_transfer_bytes_total``               counter    decode: bytes
                                                               read
  ``vllm:cp_kv_transfer_blocks_total``              counter    decode: logical
                                                               blocks read
  ``vllm:cp_kv_transfer_seconds``                   histogram  decode: seconds
                                                               per successful
                                                               pull
  ``vllm:cp_kv_expired_requests_total``             counter    prefill
  ``vllm:cp_kv_expired_blocks_total``               counter    prefill
  ================================================  =========  ================

The counts exist only while vLLM collects stats (``vllm serve``'s default;
offline ``LLM(disable_log_stats=False)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics, KVConnectorStats)

from ..geometry import group_size_of
from .counters import DECODE_KEYS, PREFILL_KEYS, merge, totals

SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


@dataclass
class ShardedKVStats(KVConnectorStats):
    """The connector's counts (``data``: see :mod:`.counters`), summed over
    workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and other.data:
            merge(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        for role in ("decode", "prefill"):
            for counts in (self.data.get(role) or {}).values():
                if any(v for v in counts.values()):
                    return False
        return True

    def reduce(self) -> dict[str, int | float]:
        """The interval's figures for vLLM's ``KV Transfer metrics:`` line."""
        out: dict[str, int | float] = {}
        d = totals(self.data, "decode")
        if d:
            seconds = np.asarray(d.get("seconds") or [0.0])
            mb = d.get("bytes", 0) / 2**20
            busy = float(seconds.sum())
            out.update({
                "Pulls ok": d.get("ok", 0), "Pulls failed": d.get("failed", 0),
                "MB received": round(mb, 3), "Blocks received": d.get("blocks", 0),
                "Avg pull time (ms)": round(float(seconds.mean()) * 1e3, 3),
                "P90 pull time (ms)": round(float(np.percentile(seconds, 90)) * 1e3, 3),
                "Throughput (MB/s)": round(mb / busy, 3) if busy > 0 else 0})
        p = totals(self.data, "prefill")
        if p:
            out.update({"Requests served": p.get("served", 0),
                        "Readers released": p.get("released", 0),
                        "Expired reqs": p.get("expired", 0),
                        "Expired blocks": p.get("expired_blocks", 0)})
        return out


class ShardedKVPromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics of the connector, made in the frontend by vLLM's
    Prometheus stat logger (``metric_types``: its Counter / Histogram)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, "role", "rank"]
        self.transfers = self._counter_cls(
            name="vllm:cp_kv_transfers",
            documentation="cp_kv connector transfers. Decode: pulls of a request's KV "
                          "(one per request and decode rank). Prefill: result=ok, requests "
                          "served to every reader; result=failed, readers that gave up.",
            labelnames=[*names, "result"])
        self.bytes = self._counter_cls(
            name="vllm:cp_kv_transfer_bytes",
            documentation="Bytes the decode read from the prefill ranks (blocks x page "
                          "bytes over every registered cache).", labelnames=names)
        self.blocks = self._counter_cls(
            name="vllm:cp_kv_transfer_blocks",
            documentation="Logical KV blocks the decode read from the prefill ranks.",
            labelnames=names)
        self.seconds = self._histogram_cls(
            name="vllm:cp_kv_transfer_seconds",
            documentation="Seconds per successful pull (first fetch to the last done).",
            buckets=SECONDS_BUCKETS, labelnames=names)
        self.expired = self._counter_cls(
            name="vllm:cp_kv_expired_requests",
            documentation="Requests a prefill rank freed on expiry, never read.",
            labelnames=names)
        self.expired_blocks = self._counter_cls(
            name="vllm:cp_kv_expired_blocks",
            documentation="KV blocks a prefill rank freed on expiry.", labelnames=names)
        # zero-valued series for the ranks this instance has (rate() needs them)
        kv = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        roles = []
        if kv is not None and kv.is_kv_consumer:
            roles.append(("decode", parallel.tensor_parallel_size))
        if kv is not None and kv.is_kv_producer:
            # a series per rank: the shard group's, or (unsharded) the TP ranks
            # (rank 0 serves; the others hold replicas, reported sent at once)
            shard = group_size_of(vllm_config)
            roles.append(("prefill", shard if shard > 1 else parallel.tensor_parallel_size))
        for idx in per_engine_labelvalues:
            for role, ranks in roles:
                for rank in range(ranks):
                    self._children(idx, role, str(rank))

    def _children(self, engine_idx: int, role: str, rank: str) -> dict:
        base = [*self.per_engine_labelvalues[engine_idx], role, rank]
        out = {"ok": self.transfers.labels(*base, "ok"),
               "failed": self.transfers.labels(*base, "failed")}
        if role == "decode":
            out.update(bytes=self.bytes.labels(*base), blocks=self.blocks.labels(*base),
                       seconds=self.seconds.labels(*base))
        else:
            out.update(expired=self.expired.labels(*base),
                       expired_blocks=self.expired_blocks.labels(*base))
        return out

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for rank, c in (transfer_stats_data.get("decode") or {}).items():
            m = self._children(engine_idx, "decode", rank)
            for key in DECODE_KEYS:
                if c.get(key):
                    m[key].inc(c[key])
            for s in c.get("seconds") or ():
                m["seconds"].observe(s)
        for rank, c in (transfer_stats_data.get("prefill") or {}).items():
            m = self._children(engine_idx, "prefill", rank)
            for key, metric in zip(PREFILL_KEYS, ("ok", "failed", "expired",
                                                  "expired_blocks")):
                if c.get(key):
                    m[metric].inc(c[key])
