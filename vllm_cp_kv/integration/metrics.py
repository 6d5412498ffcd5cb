"""What a sharded worker reports to operators: a periodic log line, and
Prometheus metrics that ``vllm serve`` shows under ``/metrics``.

Route: the figures (bytes gathered per step, last-token savings) exist only
in the worker processes. vLLM 0.32's stat-logger plugins
(``vllm.stat_logger_plugins``) run in the frontend and see only scheduler
and iteration stats, and the KV-connector stats channel exists only when a
connector is configured. So each worker writes its figures in
``prometheus_client``'s multi-process file format (one file per kind and
process, :class:`_Files`) into a directory the frontend collects:

* ``PROMETHEUS_MULTIPROC_DIR`` when set (vLLM sets it for
  ``--api-server-count`` > 1, or the user did): vLLM's ``/metrics`` already
  collects every process's files there;
* otherwise (one API server, vLLM's default) vLLM 0.32 runs
  ``prometheus_client`` in single-process mode: ``/metrics`` shows the
  frontend's own registry and nothing from the engine core or the workers
  (which inherit no such directory). :func:`prepare_frontend`, called in
  the frontend before the engine starts, makes a private directory
  (``VLLM_CP_KV_METRICS_DIR``, inherited by the engine core and its
  workers) and adds a collector for it to the frontend's registry (removed
  at exit).

Offline (``LLM``: no directory) only the log line is written.

Names follow vLLM's (``vllm:`` prefix, units in the name, ``_total`` for
counters); labels: ``model_name`` and the shard ``rank``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time

from vllm.logger import init_logger

logger = init_logger("vllm." + __name__)  # under vLLM's log config
LOG_INTERVAL_S = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
PHASES = ("prefill", "decode")
METRICS_DIR_ENV = "VLLM_CP_KV_METRICS_DIR"
_FRONTEND_DIR: str | None = None


def prepare_frontend(usage_context=None, headless: bool = False) -> str | None:
    """Frontend, before the engine core starts: let ``/metrics`` show the
    workers' figures (see the module docstring). Called by the plugin's hook
    on ``EngineArgs.create_engine_config`` with its ``usage_context`` and
    ``headless`` arguments. Idempotent; returns the private directory, or
    ``None`` where none is needed: vLLM's multi-process mode is on, or this
    process serves no ``/metrics`` (not vLLM's ``OPENAI_API_SERVER``, e.g.
    offline ``LLM``, or ``headless``)."""
    global _FRONTEND_DIR
    if (os.environ.get("PROMETHEUS_MULTIPROC_DIR") or headless
            or getattr(usage_context, "name", None) != "OPENAI_API_SERVER"):
        return None
    if _FRONTEND_DIR is None:
        from prometheus_client import REGISTRY
        from prometheus_client.multiprocess import MultiProcessCollector

        path = tempfile.mkdtemp(prefix="vllm_cp_kv-metrics-")
        MultiProcessCollector(REGISTRY, path=path)  # reads the files at each scrape
        atexit.register(shutil.rmtree, path, True)
        os.environ[METRICS_DIR_ENV] = path  # inherited by the engine core and workers
        _FRONTEND_DIR = path
    return _FRONTEND_DIR


def metrics_dir() -> str | None:
    """Where this worker writes its metric files (``None``: nowhere)."""
    for name in ("PROMETHEUS_MULTIPROC_DIR", METRICS_DIR_ENV):
        path = os.environ.get(name)
        if path and os.path.isdir(path):
            return path
    return None


class ShardMetrics:
    """Per-worker figures; ``observe_*`` is called by the runtime."""

    def __init__(self, vllm_config, shard_size: int, rank: int, first_on_node: bool = False):
        self.rank, self.shard_size = rank, shard_size
        # the log line: shard rank 0, and the first worker of every node
        # (a headless node serves no /metrics: docs/deployment.md)
        self._logs = rank == 0 or first_on_node
        self.capacity_tokens = 0
        self._window = {"prefill_steps": 0, "decode_steps": 0, "prefill_bytes": 0,
                        "decode_bytes": 0, "saved_bytes": 0}
        self._last_log = time.monotonic()
        self._prom = None
        path = metrics_dir()
        if path is not None:
            model = vllm_config.model_config.served_model_name \
                if vllm_config.model_config is not None else ""
            self._prom = _PromMetrics(str(model), rank, _Files(path))
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
        if now - self._last_log < LOG_INTERVAL_S or not self._logs:
            return
        w, span = self._window, now - self._last_log
        per_decode = w["decode_bytes"] / max(w["decode_steps"], 1)
        logger.info(
            "cp_kv: shard group %d (rank %d), logical KV capacity %d tokens; last %.0f s: "
            "%d prefill steps gathered %.1f MiB, %d decode steps received "
            "%.1f KiB per step%s", self.shard_size, self.rank, self.capacity_tokens, span,
            w["prefill_steps"], w["prefill_bytes"] / 2**20, w["decode_steps"],
            per_decode / 2**10,
            f", last-token gather saved {w['saved_bytes'] / 2**20:.1f} MiB"
            if w["saved_bytes"] else "")
        self._window = dict.fromkeys(w, 0)
        self._last_log = now


class _PromMetrics:
    """The worker's Prometheus metrics (multi-process files)."""

    def __init__(self, model_name: str, rank: int, files: _Files):
        labels = {"model_name": model_name, "rank": str(rank)}
        self.shard_size = _Gauge(files, "vllm:cp_kv_shard_size",
                                 "Ranks in the KV shard group.", labels)
        self.capacity = _Gauge(files, "vllm:cp_kv_logical_capacity_tokens",
                               "Logical KV capacity of the shard group, in tokens.", labels)
        self.gathered = _Counter(
            files, "vllm:cp_kv_received_bytes",
            "Bytes this rank received from the other ranks of the shard group "
            "(prefill: full-view gathers; decode: queries, partial outputs and "
            "LSEs, or full-view gathers when materializing).", labels)
        self.steps = _Counter(files, "vllm:cp_kv_steps",
                              "Engine steps with sharded attention.", labels)
        self.saved = _Counter(
            files, "vllm:cp_kv_last_token_saved_bytes",
            "Bytes the last-token gather did not move at the end of PCP prefills.", labels)


class _Files:
    """``prometheus_client``'s multi-process file format, written directly:
    one memory-mapped file per kind in ``path`` (``counter_cpkv-<pid>.db``,
    ``gauge_mostrecent_cpkv-<pid>.db``), which ``MultiProcessCollector``
    reads like its own (the name after the kind is free for counters and
    ``mostrecent`` gauges). Direct, because ``prometheus_client`` decides
    between in-memory and file-backed values once, when it is imported, from
    ``PROMETHEUS_MULTIPROC_DIR``; a worker that learns of the directory later
    (``VLLM_CP_KV_METRICS_DIR``) cannot use its metric classes for it."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._files: dict = {}

    def write(self, kind: str, metric: str, sample: str, labels: dict, doc: str,
              value: float, timestamp: float = 0.0) -> None:
        from prometheus_client.mmap_dict import MmapedDict, mmap_key

        with self._lock:
            f = self._files.get(kind)
            if f is None:
                f = self._files[kind] = MmapedDict(
                    os.path.join(self.path, f"{kind}_cpkv-{os.getpid()}.db"))
            f.write_value(mmap_key(metric, sample, list(labels), list(labels.values()), doc),
                          float(value), timestamp)


class _Gauge:
    """A gauge whose most recent value wins across processes."""

    def __init__(self, files: _Files, name: str, doc: str, labels: dict):
        self.files, self.name, self.doc, self.labels_ = files, name, doc, labels

    def set(self, value: float) -> None:
        self.files.write("gauge_mostrecent", self.name, self.name, self.labels_, self.doc,
                         value, time.time())


class _Counter:
    """A counter with the worker's labels bound; ``labels(phase=..)`` adds more."""

    def __init__(self, files: _Files, name: str, doc: str, labels: dict):
        self.files, self.name, self.doc, self.labels_ = files, name, doc, labels
        self._values: dict[tuple, float] = {}

    def labels(self, **more) -> _CounterChild:
        return _CounterChild(self, {**self.labels_, **more})

    def inc(self, amount: float = 1.0) -> None:
        _CounterChild(self, self.labels_).inc(amount)


class _CounterChild:
    def __init__(self, counter: _Counter, labels: dict):
        self.counter, self.labels_ = counter, labels

    def inc(self, amount: float = 1.0) -> None:
        c = self.counter
        key = tuple(sorted(self.labels_.items()))
        c._values[key] = c._values.get(key, 0.0) + amount
        c.files.write("counter", c.name, c.name + "_total", self.labels_, c.doc,
                      c._values[key])
