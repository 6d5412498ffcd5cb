"""vLLM's offline ``LLM`` for the tools, the demo, the tests and benchmarks:
one place that turns the few settings they vary into engine arguments.

``engine_kwargs(model, ...)`` returns the keyword arguments of
``vllm.LLM``; ``build_llm`` constructs it. What each option sets:

* ``tp``, ``pcp``, ``dcp``: ``tensor_parallel_size``, and the prefill / decode
  context-parallel sizes where above 1 (``dcp``: vLLM's own DCP, no plugin);
* ``shard`` / ``cp_kv``: ``additional_config={"cp_kv": {"enable": True,
  **cp_kv}}`` (``cp_kv``, even ``{}``, also enables);
* ``gpu_mem``: ``gpu_memory_utilization`` with vLLM's custom all-reduce off
  (the GPU checks); ``kv_bytes``: ``kv_cache_memory_bytes`` per rank (no
  memory profiling; on CPU ``VLLM_CPU_KVCACHE_SPACE``, where set, wins);
* ``eager``: ``enforce_eager`` (default True: the CPU tests); False runs
  vLLM's CUDA graphs, in its default mode unless ``graph_mode`` (a
  ``cudagraph_mode`` name) or ``capture_sizes`` say otherwise;
* ``rope``: ``"torch"`` runs PyTorch's rope instead of vLLM 0.32's CPU
  rotary kernel, which is wrong for MLA (CPU runs that must be exact:
  float32, ``backend="CPU_MLA"``, block size 16); ``"kernel"`` asks for the
  kernel (a negative control);
* ``kv_role`` (``kv_producer`` / ``kv_consumer``) with ``kv_extra``: the
  cp_kv connector (``kv_connector_extra_config``, docs/disaggregated.md);
* anything else (``max_model_len``, ``enable_prefix_caching``, ...) goes to
  ``LLM`` as given.

``CP_KV_TEST_FORK_WORKERS=1`` (the test suite's, ``tests/conftest.py``; not a
serving option) forks vLLM's CPU engine core and workers from this process
instead of spawning them: :func:`_fork_cpu_workers`.
"""

from __future__ import annotations

import os

ROPE = {"torch": "-rotary_embedding", "kernel": "+rotary_embedding"}


def kv_transfer_config(role: str, extra: dict | None = None) -> dict:
    """vLLM's ``kv_transfer_config`` for the cp_kv connector in ``role``."""
    return {"kv_connector": "ShardedKVConnector",
            "kv_connector_module_path": "vllm_cp_kv.integration.connector",
            "kv_role": role, "kv_connector_extra_config": dict(extra or {})}


def engine_kwargs(model: str, *, tp: int = 1, pcp: int = 1, dcp: int = 1,
                  shard: bool = False, cp_kv: dict | None = None, dtype: str | None = None,
                  backend: str | None = None, block_size: int | None = None,
                  kv_bytes: int | None = None, gpu_mem: float | None = None,
                  rope: str | None = None, eager: bool = True, kv_role: str | None = None,
                  kv_extra: dict | None = None, graph_mode: str | None = None,
                  capture_sizes: list[int] | None = None,
                  prefill_graph_sizes: list[int] | None = None, **extra) -> dict:
    """The keyword arguments of ``vllm.LLM`` (see the module docstring)."""
    kw = dict(model=model, tokenizer=model, tensor_parallel_size=tp, seed=0,
              enforce_eager=eager)
    if dtype:
        kw["dtype"] = dtype
    if pcp > 1:
        kw["prefill_context_parallel_size"] = pcp
    if dcp > 1:
        kw["decode_context_parallel_size"] = dcp
    if gpu_mem:
        kw.update(gpu_memory_utilization=gpu_mem, disable_custom_all_reduce=True)
    if kv_bytes:
        kw["kv_cache_memory_bytes"] = kv_bytes
    if block_size:
        kw["block_size"] = block_size
    if backend:
        kw["attention_config"] = {"backend": backend}
    compilation = {}
    if rope:
        compilation["custom_ops"] = ["all", ROPE[rope]]
    if graph_mode:
        compilation["cudagraph_mode"] = graph_mode
    if capture_sizes:
        compilation["cudagraph_capture_sizes"] = list(capture_sizes)
    if prefill_graph_sizes is not None:  # vLLM 0.34's V2 runner; [] captures none
        compilation["prefill_cudagraph_capture_token_sizes"] = list(prefill_graph_sizes)
    if compilation:
        kw["compilation_config"] = compilation
    if shard or cp_kv is not None:
        kw["additional_config"] = {"cp_kv": {"enable": True, **(cp_kv or {})}}
    if kv_role:
        kw["kv_transfer_config"] = kv_transfer_config(kv_role, kv_extra)
    kw.update(extra)
    return kw


def build_llm(model: str, **options):
    """``vllm.LLM(**engine_kwargs(model, **options))``."""
    from vllm import LLM

    if os.environ.get("CP_KV_TEST_FORK_WORKERS") == "1":
        _fork_cpu_workers()
    return LLM(**engine_kwargs(model, **options))


def _fork_cpu_workers() -> None:
    """A test-time saving on CPU (``CP_KV_TEST_FORK_WORKERS=1``, which
    ``tests/conftest.py`` sets with ``OMP_NUM_THREADS=1``): vLLM's CPU
    platform has the engine core (with ``VLLM_ENABLE_V1_MULTIPROCESSING``) and
    the executor's workers spawned, each importing torch and vLLM anew (7 s
    of a TP=2 run's 24 s on 2 cores, 18 s of a TP=4 run's); this process has
    both imported, so they are forked from it. They are the same separate
    processes, running the same code; the driver runs no OpenMP pool of its
    own (``OMP_NUM_THREADS=1``: forked workers under a driver with a 2-thread
    pool ran 3 times slower), and each worker sets and binds its one thread
    as a spawned one does. The one patch of vLLM here (registry item 29 of
    ``integration/vllm_api.py``, checked by ``vllm-cp-kv compat``): its CPU
    platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while checking the
    config; this sets ``fork`` right after."""
    from vllm.platforms.cpu import CpuPlatform

    update = CpuPlatform.check_and_update_config.__func__
    if getattr(update, "cp_kv_forks", False):
        return

    def check_and_update_config(cls, vllm_config):
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config.cp_kv_forks = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _counters(llm, names) -> dict:
    """vLLM's own counters ``vllm:<name>`` of an ``LLM``, summed over labels
    (needs ``disable_log_stats=False``)."""
    got = dict.fromkeys(names, 0)
    for m in llm.get_metrics():
        key = m.name.split(":", 1)[-1]
        if m.name.startswith("vllm:") and key in got:
            got[key] += int(m.value)
    return got


def prefix_cache_counters(llm) -> dict:
    """``{"prefix_cache_queries": q, "prefix_cache_hits": h}`` (tokens)."""
    return _counters(llm, ("prefix_cache_queries", "prefix_cache_hits"))


def spec_decode_counters(llm) -> dict:
    """vLLM's speculative-decoding counters: drafts, draft tokens, accepted
    tokens."""
    return _counters(llm, ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                           "spec_decode_num_accepted_tokens"))
