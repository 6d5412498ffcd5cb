"""Shared helpers of every benchmark and GPU check (run as ``python
benchmarks/NAME.py``; importing this module puts the repository root on
``sys.path``, for ``vllm_cp_kv`` and ``harness`` where neither is
installed): result directories, JSON and plot writing, run metadata
(machine, commit, date), process spawn, CUDA-event timing."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# the vLLM driver the tests and GPU checks share (one generation per process)
RUN_VLLM = os.path.join(ROOT, "harness", "run_vllm.py")

# NVLink multicast must stay off on the lent machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, n, port, fn, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=n, device_id=torch.device("cuda", rank))
    try:
        fn(rank, n, *args)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn, n: int, *args) -> None:
    """Run ``fn(rank, n, *args)`` on ``n`` GPUs, one process each."""
    mp.spawn(_entry, args=(n, free_port(), fn, args), nprocs=n, join=True)


def time_ms(fn, iters: int = 20, warmup: int = 3, sync_group: bool = True) -> float:
    """Median of ``iters`` CUDA-event timings of ``fn()`` (ms)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if sync_group and dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# ---- results ---------------------------------------------------------------------
def wait_health(url: str, proc, timeout: float = 900) -> None:
    """Until ``url``/health answers 200; fails when ``proc`` (the server) exits."""
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not become ready")


def result_dir(path: str | None = None) -> str:
    """``path`` (default ``benchmarks/results``), created if missing."""
    path = path or RESULTS
    os.makedirs(path, exist_ok=True)
    return path


def write_json(path: str, data: dict, indent: int | None = 1) -> None:
    """``data`` as JSON at ``path`` (its folder created if missing)."""
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)


def pyplot(optional: bool = False):
    """``matplotlib.pyplot`` on the Agg backend; with ``optional``, None
    where matplotlib is missing (the GPU payload has none: plot here)."""
    try:
        import matplotlib
    except ImportError:
        if optional:
            return None
        raise
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 110) -> str:
    """Lay out, write and close ``fig``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


# ---- metadata -------------------------------------------------------------------
def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def commit() -> str | None:
    """The checkout's commit (``-dirty`` with uncommitted changes to tracked
    files); None outside a git checkout (the GPU machine's copy)."""
    def git(*args) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", ROOT, *args], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    rev = git("rev-parse", "--short=12", "HEAD")
    if not rev:
        return None
    return rev + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def meta() -> dict:
    """Where and when a run ran: date, machine (CPU model and count), commit."""
    return {"date": now(), "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
            "commit": commit()}


def header() -> dict:
    """GPU runs: the GPU, their count, torch, date and commit."""
    return {"gpu": torch.cuda.get_device_name(0), "num_gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "date": now(), "commit": commit()}


def graph_time(body, replays: int = 10):
    """Median time of ``body`` captured in a CUDA graph (None if capture fails)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()  # warm up on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return time_ms(graph.replay, iters=replays)
    except Exception as e:  # capture not supported here
        print("graph capture failed:", type(e).__name__, str(e)[:200])
        return None
