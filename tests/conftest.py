import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # on sys.path: pytest.ini

import json
import queue
import subprocess
import threading

import pytest

MODELS_DIR = os.environ.get("VLLM_CP_KV_MODELS", os.path.join(ROOT, ".work", "models"))
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    # no inductor builds of vLLM's sampler helpers (scripts/cpu_env.sh says why)
    "TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1"),
    "NUMBA_THREADING_LAYER": os.environ.get("NUMBA_THREADING_LAYER", "workqueue"),
}


# vllm_cp_kv/tools/offline.py _fork_cpu_workers: the runs' engine cores and
# workers forked from the driver, which imported vLLM already, instead of
# spawned (a test-time saving; harness/run_vllm.py and pd_offline's roles)
FORK_WORKERS = {"CP_KV_TEST_FORK_WORKERS": "1", "OMP_NUM_THREADS": "1"}
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        if IN_CI:  # CI installs everything: a missing piece is a failure
            raise
        return False
    return True


needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")


def amx_available() -> bool:
    """Whether vLLM picks AMX_MLA here (else CPU_MLA, block 16)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


# The folders, by the heaviest thing a module needs (the first that fits):
#   pd/           a real KV transport (NIXL, Mooncake agents moving bytes) or a
#                 prefill/decode pair; may start vLLM engines too
#   vllm/         a real vLLM engine (run_generate, harness/run_vllm.py,
#                 ``vllm serve``), no P/D transport
#   distributed/  several processes (gloo groups of ranks, builders.spawn_ranks;
#                 child pytest runs), no vLLM engine
#   unit/         one process: torch, vLLM's config path, stand-ins (fakes of
#                 the transport, the groups, the engine loop); a one-off
#                 child interpreter for a check is fine
# (``distributed``, not ``dist``: pytest does not recurse into ``dist``.)
# The fast tier for the inner loop is tests/unit: ``bash scripts/test.sh
# tests/unit`` or ``-m quick`` (its marker, for selections across folders).
UNIT = os.path.join(ROOT, "tests", "unit")


def in_fast_tier(path) -> bool:
    """Whether the test module at ``path`` is in the fast tier (tests/unit)."""
    return os.path.commonpath([os.path.abspath(path), UNIT]) == UNIT


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the fast tier (the modules under tests/unit)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if in_fast_tier(item.path):
            item.add_marker(pytest.mark.quick)


def pytest_report_header(config):
    amx = amx_available()
    return (f"CPU MLA backend vLLM picks here: {'AMX_MLA (block 32)' if amx else 'CPU_MLA (block 16)'}"
            f"; the exact tests force CPU_MLA on every CPU"
            + ("" if amx else "; no AMX: the chunked-prefill test skips"))


@pytest.fixture(scope="session")
def tiny_dsv2():
    from vllm_cp_kv.tools.tiny_model import build

    return build(os.path.join(MODELS_DIR, "tiny-dsv2"))


@pytest.fixture(scope="session")
def held_out():
    """A tiny DeepSeek-V2 unlike the demo's (tools/tiny_model.build_held_out)."""
    from vllm_cp_kv.tools.tiny_model import build_held_out

    return build_held_out(os.path.join(MODELS_DIR, "held-out-dsv2"))


@pytest.fixture(scope="session")
def tiny_llama():
    from vllm_cp_kv.tools.tiny_model import build_llama

    return build_llama(os.path.join(MODELS_DIR, "tiny-llama"))


RUNNER = os.path.join(ROOT, "harness", "run_vllm.py")
# the one-GPU harness, its verification shims and the P/D test hooks
# (scripts/gpu/onegpu/patches.py): active in processes started with this
# folder on PYTHONPATH and a switch set
HARNESS = os.path.join(ROOT, "scripts", "gpu", "onegpu")


def harness_env(**switches) -> dict:
    """Environment for a process with the patches of HARNESS armed by
    ``switches`` (e.g. ``CPKV_TEST_HOOKS="1"``)."""
    return {**switches, "PYTHONPATH": os.pathsep.join(
        p for p in (HARNESS, os.environ.get("PYTHONPATH")) if p)}


class ForkServer:
    """One ``harness/forkserver.py`` for the session: runs of the runner fork
    from a process that imported vLLM once (about 10 s saved per run)."""

    def __init__(self):
        # OMP_NUM_THREADS=1 from the start: libgomp reads it when torch loads,
        # and the runs' forked workers inherit the pool (FORK_WORKERS)
        self.env = {**os.environ, **CPU_ENV, **FORK_WORKERS}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "harness", "forkserver.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env,
            cwd=ROOT)
        self.replies = queue.Queue()  # the server's answers, read as they come
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put({"pid": None, "rc": None})  # the server is gone

    def _reply(self, key, timeout):
        value = self.replies.get(timeout=timeout)[key]
        if value is None:
            raise RuntimeError(f"the fork server exited (rc {self.proc.wait()})")
        return value

    def takes(self, env: dict) -> bool:
        """Jobs whose interpreter start is the server's (same PYTHONPATH)."""
        return self.proc.poll() is None and \
            env.get("PYTHONPATH") == self.env.get("PYTHONPATH")

    def run(self, argv, env, log, timeout) -> int:
        job = {"argv": list(argv), "env": env, "cwd": ROOT, "log": log}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        pid = self._reply("pid", 120)
        try:
            return self._reply("rc", timeout)
        except queue.Empty:
            os.killpg(pid, 9)  # the run and the workers it started
            self._reply("rc", 60)
            raise subprocess.TimeoutExpired(argv, timeout) from None

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


_fork_server = None


def fork_server():
    global _fork_server
    if _fork_server is None and vllm_available():
        _fork_server = ForkServer()
    return _fork_server


def pytest_sessionfinish(session, exitstatus):
    if _fork_server is not None:
        _fork_server.close()


def run_generate(model, out_dir, name, *args, env=None, timeout=600):
    """Run harness/run_vllm.py as its own process (a fork of the session's
    fork server where the environment allows, else a fresh interpreter);
    return its JSON."""
    out = os.path.join(out_dir, f"{name}.json")
    log = os.path.join(out_dir, f"{name}.log")
    full_env = {**os.environ, **CPU_ENV, **FORK_WORKERS, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset
    argv = [model, out, *args]
    server = fork_server()
    if server is not None and server.takes(full_env):
        rc = server.run(argv, full_env, log, timeout)
    else:
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, RUNNER, *argv], env=full_env, cwd=ROOT,
                                stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    with open(log) as f:
        text = f.read()
    assert rc == 0, f"{name} failed, see {log}:\n{text[-3000:]}"
    with open(out) as f:
        res = json.load(f)
    res["log"] = text
    return res


@pytest.fixture(scope="session")
def tiny_mtp():
    """A tiny DeepSeek-V3 with one MTP layer (tools/tiny_model.build_mtp)."""
    from vllm_cp_kv.tools.tiny_model import build_mtp

    return build_mtp(os.path.join(MODELS_DIR, "tiny-dsv3-mtp"))
