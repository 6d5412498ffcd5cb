"""Shared helpers for the GPU benchmarks: process spawn, CUDA-event timing."""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

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


def header() -> dict:
    return {"gpu": torch.cuda.get_device_name(0), "num_gpus": torch.cuda.device_count(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


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
