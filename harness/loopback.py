"""Owner processes on one machine for the transfer test and benchmark.

Each owner runs ``target(rank, *args, to_recv, from_recv)`` in its own
(spawned) process: it registers its memory, puts ``(rank, info)`` on
``to_recv`` and serves reads until told on ``from_recv``
(:func:`serve_until_done`).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from contextlib import contextmanager


def transport_available(name: str) -> bool:
    """Whether the transport's Python package imports here."""
    try:
        __import__("nixl._api" if name == "nixl" else "mooncake.engine")
        return True
    except Exception:
        return False


@contextmanager
def owner_processes(target, size: int, *args, timeout_s: float = 120):
    """Start ``size`` owners; yields ``{rank: info}``; stops and joins them."""
    ctx = mp.get_context("spawn")
    to_recv, from_recv = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, to_recv, from_recv))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        yield dict(to_recv.get(timeout=timeout_s) for _ in range(size))
    finally:
        for _ in procs:
            from_recv.put("done")
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def serve_until_done(transport, from_recv) -> None:
    """Drive the transport's progress (NIXL without a progress thread needs
    it to serve a peer's READ) until the receiver says it is done."""
    while True:
        try:
            from_recv.get(timeout=0.001 if transport.name == "nixl" else None)
            return
        except queue.Empty:
            transport.progress()
