import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import json
import subprocess

import pytest

MODELS_DIR = os.environ.get("VLLM_CP_KV_MODELS", os.path.join(ROOT, ".work", "models"))
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


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


def run_generate(model, out_dir, name, *args, env=None, timeout=600):
    """Run harness/run_vllm.py in a fresh process; return its JSON."""
    out = os.path.join(out_dir, f"{name}.json")
    full_env = {**os.environ, **CPU_ENV, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset
    proc = subprocess.run(
        [sys.executable, RUNNER, model, out, *args],
        env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    log = os.path.join(out_dir, f"{name}.log")
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{name} failed, see {log}:\n{proc.stderr[-3000:]}"
    with open(out) as f:
        res = json.load(f)
    res["log"] = proc.stdout + proc.stderr
    return res


@pytest.fixture(scope="session")
def tiny_mtp():
    """A tiny DeepSeek-V3 with one MTP layer (tools/tiny_model.build_mtp)."""
    from vllm_cp_kv.tools.tiny_model import build_mtp

    return build_mtp(os.path.join(MODELS_DIR, "tiny-dsv3-mtp"))
