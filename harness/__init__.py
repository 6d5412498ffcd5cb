"""Scaffolding the tests (``tests/``) and the benchmarks and GPU checks
(``benchmarks/``) share; not part of the package (``vllm_cp_kv``), not
shipped:

* ``run_vllm.py``: the vLLM driver, one offline generation per process with
  the verification aids (poisoned caches, a corrupted owned block, sorted
  top-k rows, indexer dumps, the plugin's per-rank totals), JSON out;
* ``reference.py``: independent references (vLLM's slot-mapping kernel
  transcribed, float64 attention), never the package's ownership formula;
* ``loopback.py``: owner processes serving blocks over NIXL or Mooncake on
  one machine (tests/pd/test_transfer_dist.py, benchmarks/pd_transfer.py).

The P/D test hooks and the one-GPU harness are import-time patches and live
with the other patches in ``scripts/gpu/onegpu`` (``pd_hooks.py``).
"""
