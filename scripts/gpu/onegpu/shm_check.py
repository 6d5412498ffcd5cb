"""Checks :mod:`shm_comm` against torch: two and three processes on one
device (``cuda:0`` where there is one, else the CPU) exchange random
tensors of several shapes and dtypes for 50 rounds, each result compared
with the same collective computed from every rank's input; a tensor over a
slot must be refused (the caller's fallback), and the shared file must be
gone. Then times a small kernel with and without a decode-sized all-reduce
after it. Prints one line per rank; exits non-zero on a mismatch.

Usage: python scripts/gpu/onegpu/shm_check.py
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "..", "..", "benchmarks")]
from common import free_port  # noqa: E402


def _run(rank: int, n: int, port: int) -> None:
    from shm_comm import ShmExchange

    os.environ["ONEGPU_SHM_SLOT_MIB"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    ex = ShmExchange(dist.group.WORLD, "check")
    gen = torch.Generator().manual_seed(1)  # every rank draws every rank's input
    for it in range(50):
        shape = (1 + it % 5, 4 * n, 3 + it % 7)
        xs = [torch.randn(shape, generator=gen) for _ in range(n)]
        for dtype in (torch.float32, torch.bfloat16):
            ys = [x.to(dtype) for x in xs]
            mine = ys[rank].to(dev)
            total = ys[0].clone()
            for y in ys[1:]:
                total += y
            got = ex.all_reduce(mine)
            assert got.device == mine.device and torch.equal(got.cpu(), total), "all_reduce"
            for d in (0, 1, 2, -1):  # vLLM passes negative dims as they come
                assert torch.equal(ex.all_gather(mine, d).cpu(), torch.cat(ys, d)), "all_gather"
            for d in (1, -2):
                want = total.chunk(n, d)[rank]
                assert torch.equal(ex.reduce_scatter(mine, d).cpu(), want), "reduce_scatter"
        flags = [x > 0 for x in xs]
        assert torch.equal(ex.all_gather(flags[rank].to(dev), 0).cpu(), torch.cat(flags, 0))
    assert ex.exchange(torch.zeros(1 << 19, device=dev)) is None  # 2 MiB > a 1 MiB slot
    dist.barrier()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("onegpu-")], "file left"
    # what one collective costs here: a decode-sized all-reduce after a small
    # kernel (each process's stream must drain first), against the kernel alone
    w, x = torch.randn(256, 256, device=dev), torch.randn(8, 256, device=dev)
    per = {}
    for name, comm in (("kernel", False), ("kernel+all_reduce", True)):
        for _ in range(20):
            y = x @ w
            if comm:
                ex.all_reduce(y)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            y = x @ w
            if comm:
                ex.all_reduce(y)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        per[name] = (time.perf_counter() - t0) / 200 * 1e6
    timing = ", ".join(f"{k} {v:.0f} us" for k, v in per.items())
    print(f"shm_check: n={n} rank {rank} on {dev}: {ex.epoch - 220} collectives equal "
          f"torch's; {timing}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    for n in (2, 3):
        mp.spawn(_run, args=(n, free_port()), nprocs=n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
