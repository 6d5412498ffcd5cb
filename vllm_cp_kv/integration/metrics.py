"""What a sharded worker reports to operators: a periodic log line, and
Prometheus metrics that ``vllm serve`` shows under ``/metrics``.

Route: the figures (bytes gathered per step, last-token savings) exist only
in the worker processes. vLLM 0.32's stat-logger plugins
(``vllm.stat_logger_plugins``) run in the frontend and see only scheduler
and iteration stats, and the KV-connector stats channel exists only when a
connector is configured. But ``vllm serve`` runs ``prometheus_client`` in
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, inherited by the engine
core and its workers) and its ``/metrics`` collects every process's
metric files: a metric a worker creates appears there like vLLM's own.
Offline (no such directory) only the log line is written.

Names follow vLLM's (``vllm:`` prefix, units in the name, ``_total`` for
counters); labels: ``model_name`` and the shard ``rank``.
"""

from __future__ import annotations

import os
import time

from vllm.logger import init_logger

logger = init_logger("vllm." + __name__)  # under vLLM's log config
LOG_INTERVAL_S = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
PHASES = ("prefill", "decode")


class ShardMetrics:
    """Per-worker figures; ``observe_*`` is called by the runtime."""

    def __init__(self, vllm_config, shard_size: int, rank: int):
        self.rank, self.shard_size = rank, shard_size
        self.capacity_tokens = 0
        self._window = {"prefill_steps": 0, "decode_steps": 0, "prefill_bytes": 0,
                        "decode_bytes": 0, "saved_bytes": 0}
        self._last_log = time.monotonic()
        self._prom = None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            model = vllm_config.model_config.served_model_name \
                if vllm_config.model_config is not None else ""
            self._prom = _PromMetrics(str(model), rank)
            self._prom.shard_size.set(shard_size)

    def set_capacity(self, tokens: int) -> None:
        self.capacity_tokens = tokens
        if self._prom is not None:
            self._prom.capacity.set(tokens)

    def observe_step(self, phase: str, received_bytes: int) -> None:
        self._window[f"{phase}_steps"] += 1
        self._window[f"{phase}_bytes"] += received_bytes
        if self._prom is not None:
            self._prom.steps.labels(phase=phase).inc()
            self._prom.gathered.labels(phase=phase).inc(received_bytes)
        self._maybe_log()

    def observe_last_token(self, saved_bytes: int) -> None:
        self._window["saved_bytes"] += saved_bytes
        if self._prom is not None:
            self._prom.saved.inc(saved_bytes)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S or self.rank != 0:
            return
        w, span = self._window, now - self._last_log
        per_decode = w["decode_bytes"] / max(w["decode_steps"], 1)
        logger.info(
            "cp_kv: shard group %d, logical KV capacity %d tokens; last %.0f s: "
            "%d prefill steps gathered %.1f MiB, %d decode steps received "
            "%.1f KiB per step%s", self.shard_size, self.capacity_tokens, span,
            w["prefill_steps"], w["prefill_bytes"] / 2**20, w["decode_steps"],
            per_decode / 2**10,
            f", last-token gather saved {w['saved_bytes'] / 2**20:.1f} MiB"
            if w["saved_bytes"] else "")
        self._window = dict.fromkeys(w, 0)
        self._last_log = now


class _PromMetrics:
    """The worker's Prometheus metrics (multiprocess mode)."""

    def __init__(self, model_name: str, rank: int):
        from prometheus_client import Counter, Gauge

        labels = {"model_name": model_name, "rank": str(rank)}
        names = list(labels)
        self.shard_size = Gauge(
            "vllm:cp_kv_shard_size", "Ranks in the KV shard group.", names,
            multiprocess_mode="mostrecent").labels(**labels)
        self.capacity = Gauge(
            "vllm:cp_kv_logical_capacity_tokens",
            "Logical KV capacity of the shard group, in tokens.", names,
            multiprocess_mode="mostrecent").labels(**labels)
        self.gathered = _Labelled(Counter(
            "vllm:cp_kv_received_bytes",
            "Bytes this rank received from the other ranks of the shard group "
            "(prefill: full-view gathers; decode: queries, partial outputs and "
            "LSEs, or full-view gathers when materializing).",
            [*names, "phase"]), labels)
        self.steps = _Labelled(Counter(
            "vllm:cp_kv_steps", "Engine steps with sharded attention.",
            [*names, "phase"]), labels)
        self.saved = Counter(
            "vllm:cp_kv_last_token_saved_bytes",
            "Bytes the last-token gather did not move at the end of PCP prefills.",
            names).labels(**labels)


class _Labelled:
    """A labelled metric with the fixed labels bound (``.labels(phase=..)``)."""

    def __init__(self, metric, labels: dict):
        self.metric, self.fixed = metric, labels

    def labels(self, **more):
        return self.metric.labels(**self.fixed, **more)
