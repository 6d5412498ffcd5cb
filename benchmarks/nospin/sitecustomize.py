"""Benchmark-only diagnostic (``pd_latency.py --no-spin``), never part of the
plugin: vLLM's shared-memory message queue keeps each reader (every worker
waiting for its next step, every engine waiting for its workers' answers)
spinning on ``sched_yield`` for ``busy_loop_s`` = 1 s after each message.
On a machine with fewer cores than the P/D pair has processes, those
spinners starve the other instance's forward. With this directory first on
``PYTHONPATH`` every process of a server sets that spin to 0 s, which shows
what the pair costs once the instances do not take each other's cores.
"""

import importlib.abc
import importlib.util
import sys

TARGET = "vllm.distributed.device_communicators.shm_broadcast"
BUSY_LOOP_S = 0.05  # not 0: with no spin at all, a reader misses a wake-up now and then (vLLM then rechecks after 5 s)


def _patch(module) -> None:
    orig = module.SpinCondition.__init__

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.busy_loop_s = BUSY_LOOP_S

    module.SpinCondition.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())
