"""Collectives between the ranks of one group on one host through a shared
host-memory file (the one-GPU harness's ``ONEGPU_COMM=shm``). Not part of
the package.

Why: over gloo every collective of two ranks sharing the GPU is a TCP round
trip between the processes (about 1.5 ms each in ``vllm serve``, measured:
h200x1-2026-12-02-serve-onegpu), so a run's time is mostly the harness's
collectives, and a configuration with more collectives per layer (the
shard-aware decode's query and output exchange) pays for the harness, not
for its own work. Here a collective is one device-to-host copy into this
rank's slot, a counter store, a spin on the peers' counters and one
host-to-device copy of every rank's slot (tens of microseconds for a decode
step's tensors). Still not NCCL over NVLink: each copy waits for the
stream's queued work (a host sync per collective), which on a small model in
eager mode, whose host is the bottleneck anyway, costs little.

Layout of the file (``/dev/shm/onegpu-<random>``, created by the group's
rank 0, opened by the others, unlinked once every rank has it mapped):
two counters per rank (the epoch it wrote, the epoch it finished reading),
one 64-byte line each, then two slots per rank (even and odd epochs) of
``ONEGPU_SHM_SLOT_MIB`` MiB. Epoch ``e`` writes slot ``e % 2`` once every
rank has read epoch ``e - 2``, so a slot is never overwritten while a peer
reads it. Every rank of the group calls the same collectives in the same
order (as with any backend), so epochs agree; a tensor larger than a slot
returns None (the caller falls back to torch.distributed), the same
decision on every rank since the shapes agree.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import torch
import torch.distributed as dist

LINE = 64  # bytes per counter: one cache line, so ranks do not share one
TIMEOUT_S = float(os.environ.get("ONEGPU_SHM_TIMEOUT_S", "600"))


class ShmExchange:
    """Every rank's tensor, rank-major, through the shared file."""

    def __init__(self, cpu_group, name: str):
        self.rank = dist.get_rank(cpu_group)
        self.n = dist.get_world_size(cpu_group)
        self.name = name
        self.slot = int(os.environ.get("ONEGPU_SHM_SLOT_MIB", "16")) << 20
        token = torch.zeros(16, dtype=torch.uint8)
        if self.rank == 0:
            token.copy_(torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.uint8))
        dist.broadcast(token, src=dist.get_global_rank(cpu_group, 0), group=cpu_group)
        path = f"/dev/shm/onegpu-{bytes(token.tolist()).hex()}"
        header = 2 * self.n * LINE
        size = header + 2 * self.n * self.slot
        if self.rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
        dist.barrier(group=cpu_group)
        fd = os.open(path, os.O_RDWR)
        self._mm = mmap.mmap(fd, size)
        os.close(fd)
        dist.barrier(group=cpu_group)  # every rank has it mapped
        if self.rank == 0:
            os.unlink(path)
        counters = np.frombuffer(self._mm, dtype=np.int64, count=header // 8)
        counters = counters.reshape(2, self.n, LINE // 8)
        self._written, self._read = counters[0, :, 0], counters[1, :, 0]
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header,
                                      count=2 * self.n * self.slot).view(2, self.n, self.slot)
        self.epoch = 0

    def _wait(self, counter: np.ndarray, epoch: int) -> None:
        if epoch <= 0 or counter.min() >= epoch:
            return
        deadline = time.monotonic() + TIMEOUT_S
        while counter.min() < epoch:
            os.sched_yield()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"onegpu shm {self.name}: rank {self.rank} waited {TIMEOUT_S:.0f} s "
                    f"for epoch {epoch} (counters {counter.tolist()}): a peer is gone")

    def exchange(self, x: torch.Tensor) -> torch.Tensor | None:
        """``[n, *x.shape]`` on ``x``'s device: every rank's ``x`` (the
        same shape and dtype on every rank), or None if it does not fit."""
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot or nbytes == 0:
            return None
        self.epoch += 1
        e, s = self.epoch, self.epoch % 2
        self._wait(self._read, e - 2)  # the slot's last readers are done
        mine = self._data[s, self.rank, :nbytes].view(x.dtype).view(x.shape)
        mine.copy_(x)  # device to host: waits for the stream's queued work
        self._written[self.rank] = e
        self._wait(self._written, e)
        every = self._data[s, :, :nbytes].view(x.dtype).reshape((self.n,) + tuple(x.shape))
        out = every.to(x.device, copy=True)  # returns once the host slots are read
        self._read[self.rank] = e
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self.exchange(x)
        if parts is None:
            return None
        out = parts[0].clone()
        for k in range(1, self.n):  # rank order: the same sum on every rank
            out += parts[k]
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        parts = self.exchange(x)
        return None if parts is None else torch.cat(parts.unbind(0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        total = self.all_reduce(x)
        if total is None:
            return None
        return total.chunk(self.n, dim=dim)[self.rank].contiguous()
