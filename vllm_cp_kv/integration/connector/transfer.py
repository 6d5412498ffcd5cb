"""Byte movers for the disaggregated-prefill connector: NIXL and Mooncake.

Both run on CPU machines as shipped here (NIXL over UCX, Mooncake over TCP).
The connector only ever asks for batched one-sided READs of
``(remote_addr, local_addr, nbytes)`` ranges from registered memory.

GPU memory (NIXL): a cache on a CUDA device is registered and described as
NIXL memory type ``VRAM`` with its device index (host memory: ``DRAM``, 0),
on both sides: the handshake carries the prefill's type and device
(``TransportMeta``), so the reader describes the remote ranges as they were
registered there. UCX picks the path; between GPUs of one host that is its
``cuda_ipc`` transport, which ``UCX_TLS`` must then allow (its default,
``all``, does). UCX uses cuda_ipc zero-copy for reads only where it detects
NVLink (otherwise ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``; without it a read is
staged through host memory over TCP: slow but correct). Mooncake: see
docs/disaggregated.md (its TCP transport stages GPU memory through host
buffers).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ...core.manifest import merge_runs, read_descriptors
from .side_channel import RateLimitedLog

logger = logging.getLogger("vllm." + __name__)  # under vLLM's log config when loaded
READ_ATTEMPTS = 2  # Mooncake: see MooncakeTransport.read
# NIXL: poll a read's state without sleeping for this long, then sleep this
# long between polls, by the local memory type (a GPU read over cuda_ipc takes
# 0.05-3 ms; on a CPU host the peer may need the core the reader spins on)
NIXL_POLL = {"VRAM": (0.005, 0.0001), "DRAM": (0.0002, 0.0005)}
MOONCAKE_ABORT_GRACE_S = 40.0  # > Mooncake's own 30 s limit on a stalled read


class TransferError(RuntimeError):
    """A transfer failed or did not finish in time."""


class ReadNotAborted(TransferError):
    """A read gave up on, but still in the transport's hands: data may
    still land, and the peer's blocks must stay claimed."""


class Transport:
    name = "base"

    def register(self, tensors: list[torch.Tensor]) -> dict:
        """Register memory peers may read; returns metadata for the handshake."""
        raise NotImplementedError

    def read(self, peer_meta: dict, reads: list[tuple[int, int, int]],
             timeout_s: float, start_by: float | None = None) -> None:
        """Blocking batched READ ``(remote_addr, local_addr, nbytes)``.

        ``start_by`` (monotonic): refuse to start the read after this (the
        decode's claim on the blocks would end before the read could)."""
        raise NotImplementedError

    def read_bound_s(self, timeout_s: float) -> float:
        """The longest one ``read`` may take once started, data still landing."""
        return timeout_s

    def progress(self) -> None:
        """Let the engine serve a peer's READ (no-op where it runs by itself)."""


# Remote NIXL agents a decode keeps loaded: at most this many, and none idle
# for longer than REMOTE_AGENT_IDLE_S (each prefill instance is one agent a
# rank; a restarted prefill is a new one). The least recently used idle
# agent goes first; an agent a read is using is never removed.
MAX_REMOTE_AGENTS = 64
REMOTE_AGENT_IDLE_S = 600.0
# Names of agents seen (evicted ones too) with a digest of their metadata,
# so a known name with other metadata stays refused after its eviction.
MAX_AGENT_NAMES = 4096


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, host: str, agent=None, clock=time.monotonic):
        self.agent_name = f"cpkv-{uuid.uuid4().hex[:12]}"
        self.agent = agent if agent is not None else _nixl_agent(self.agent_name)
        self.clock = clock
        # remote agents loaded, by name: exactly the metadata loaded under it,
        # least recently used first, and when each was last used
        self._peers: OrderedDict[str, bytes] = OrderedDict()
        self._last_used: dict[str, float] = {}
        self._seen: OrderedDict[str, bytes] = OrderedDict()  # name -> metadata digest
        self._probe_agent, self._probes = None, 0  # see _probe
        # UCX workers are not thread-safe, and receives run in one thread per
        # request: every agent call after registration runs on this one
        # thread, in order (reads are short; side-channel work stays parallel).
        self._agent_thread = ThreadPoolExecutor(1, thread_name_prefix="cp_kv-nixl")

    mem_type, device_id = "DRAM", 0  # of the registered caches (set by register)

    def register(self, tensors):
        kinds = {memory_kind(t) for t in tensors}
        if len(kinds) != 1:
            raise TransferError(f"caches on more than one device: {sorted(kinds)}")
        self.mem_type, self.device_id = kinds.pop()
        if self.mem_type == "VRAM":  # UCX's CUDA transports on the agent's thread
            self._agent_thread.submit(torch.cuda.set_device, self.device_id).result()
        self.agent.register_memory(
            [(t.data_ptr(), t.numel() * t.element_size(), self.device_id, "")
             for t in tensors], self.mem_type)
        return {"agent_name": self.agent_name,
                "agent_metadata": self.agent.get_agent_metadata(),
                "mem_type": self.mem_type, "device_id": self.device_id}

    def progress(self):
        self._agent_thread.submit(self.agent.get_new_notifs).result()

    def read(self, peer_meta, reads, timeout_s, start_by=None):
        if reads:
            self._agent_thread.submit(self._read, peer_meta, reads, timeout_s,
                                      start_by).result()

    def _remote_agent(self, name: str, metadata: bytes) -> str:
        """The remote agent to read from, loaded once per name and metadata.

        Why so careful: the name and the metadata come from the peer, and
        NIXL keys remote agents by the name *inside* the metadata. A fake
        peer that sent the real prefill's metadata cut short, under a new
        name, left NIXL holding the real agent's connection without its
        metadata: every later read from the real prefill failed (``metadata
        for remote agent ... not found``; loading it again fails too) until
        restart. So metadata never seen before is first loaded into a
        throwaway probe agent (:meth:`_probe`); only metadata that loads
        there whole, as the agent it claims to be, reaches this agent. A
        known name with other metadata is refused (the first peer to use a
        name keeps it: see docs/disaggregated.md, Security)."""
        digest = hashlib.sha256(metadata).digest()
        seen = self._seen.get(name)
        if seen is not None and seen != digest:
            raise TransferError(f"a peer sent other NIXL metadata for the known agent "
                                f"{name!r}: refused")
        if seen is not None:  # in use: the last a flood of new names would push out
            self._seen.move_to_end(name)
        if name in self._peers:
            self._peers.move_to_end(name)
            return name
        loaded = self._probe(metadata)
        if loaded != name:
            raise TransferError(f"the peer's NIXL metadata is agent {loaded!r}'s, not "
                                f"{name!r}: refused")
        self.agent.add_remote_agent(metadata)
        self._peers[name] = metadata
        self._seen[name] = digest
        self._seen.move_to_end(name)
        # forget the least recently used names beyond the bound, never one
        # whose agent is loaded
        for old in [n for n in self._seen if n not in self._peers][
                :max(len(self._seen) - MAX_AGENT_NAMES, 0)]:
            del self._seen[old]
        return name

    def _evict(self, keep: str | None = None) -> None:
        """Remove remote agents idle past ``REMOTE_AGENT_IDLE_S``, then the
        least recently used beyond ``MAX_REMOTE_AGENTS`` (never ``keep``,
        the one a read is about to use). On the agent thread, between reads:
        no read of an evicted agent is in flight."""
        now = self.clock()
        for name in list(self._peers):
            over = len(self._peers) > MAX_REMOTE_AGENTS
            idle = now - self._last_used.get(name, now) > REMOTE_AGENT_IDLE_S
            if name != keep and (over or idle):
                self._remove_remote(name)

    def _remove_remote(self, name: str) -> None:
        self._peers.pop(name, None)
        self._last_used.pop(name, None)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:  # already gone: nothing to free
            logger.debug("cp_kv connector: removing NIXL agent %s: %r", name, e)

    @property
    def remote_agents(self) -> list[str]:
        """The remote agents loaded now, least recently used first."""
        return list(self._peers)

    def _probe(self, metadata: bytes) -> str:
        """Load ``metadata`` into the probe agent (made on first use, made
        anew after a failed load, whose half-loaded state it may keep) and
        unload it; the agent name it holds."""
        if self._probe_agent is None:
            self._probes += 1
            self._probe_agent = _nixl_agent(f"{self.agent_name}-probe{self._probes}")
        try:
            loaded = self._probe_agent.add_remote_agent(metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            self._probe_agent.remove_remote_agent(loaded)
        except Exception as e:
            self._probe_agent = None
            raise TransferError(f"the peer's NIXL agent metadata does not load "
                                f"({type(e).__name__}): refused") from None
        return loaded

    def _read(self, peer_meta, reads, timeout_s, start_by):
        _check_start(start_by)  # on the agent thread: after waiting for other reads
        name = self._remote_agent(peer_meta["agent_name"], peer_meta["agent_metadata"])
        self._last_used[name] = self.clock()
        self._evict(keep=name)
        local, remote = nixl_descs(self.agent, reads, (self.mem_type, self.device_id),
                                   (peer_meta.get("mem_type") or "DRAM",
                                    int(peer_meta.get("device_id") or 0)))
        handle = self.agent.initialize_xfer("READ", local, remote, name)
        try:
            state = self.agent.transfer(handle)
            start = time.monotonic()
            deadline = start + timeout_s
            while state not in ("DONE", "ERR"):
                now = time.monotonic()
                if now > deadline:
                    raise TransferError(f"NIXL read did not finish in {timeout_s:g} s")
                spin, step = NIXL_POLL[self.mem_type]
                if now - start > spin:
                    time.sleep(step)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError("NIXL read failed (peer gone?)")
        finally:
            self.agent.release_xfer_handle(handle)


def _nixl_agent(name: str):
    """A NIXL agent over UCX without a progress thread: it busy-polls a core
    for the agent's lifetime. Progress is driven only while a transfer is
    expected: by the reader while it polls, by the served side through
    ``progress()``."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


class MooncakeTransport(Transport):
    name = "mooncake"
    _retry_log = RateLimitedLog(logger)  # a peer's failed reads, for the process

    def __init__(self, host: str):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferError(f"Mooncake TransferEngine.initialize failed (rc={rc})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        # Concurrent batch reads from several receive threads fail (-1) in
        # Mooncake's P2P handshake path; one read at a time, as for NIXL.
        self._read_lock = threading.Lock()

    def register(self, tensors):
        for t in tensors:
            rc = self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size())
            if rc != 0:
                raise TransferError(f"Mooncake register_memory failed (rc={rc})")
        return {"session": self.session}

    def read_bound_s(self, timeout_s):
        return READ_ATTEMPTS * timeout_s + MOONCAKE_ABORT_GRACE_S

    def read(self, peer_meta, reads, timeout_s, start_by=None):
        """One batched READ; retried once when Mooncake reports a failure.

        Why the retry: over TCP, Mooncake now and then stalls one READ and
        drops it after its own 30 s ("no transfer progress within 30s;
        dropping connection"); here that happened when the decode worker
        shared a core with the prefill rank it read from, and a retry
        sometimes went through. A dead peer fails both attempts at once
        (connection refused). A stalled read gives up after
        ``READ_ATTEMPTS * timeout_s``, plus up to ``MOONCAKE_ABORT_GRACE_S``
        when the last attempt is still in Mooncake's hands (see _read_once).
        """
        if not reads:
            return
        deadline = time.monotonic() + READ_ATTEMPTS * timeout_s
        for attempt in range(1, READ_ATTEMPTS + 1):
            result = self._read_once(peer_meta, reads, deadline - time.monotonic(), start_by)
            if result == 0:
                return
            if isinstance(result, TransferError):  # not started: no retry
                raise result
            if attempt < READ_ATTEMPTS:
                self._retry_log.warning("cp_kv: Mooncake read of %d ranges from %s failed "
                                        "(%r); retrying", len(reads), peer_meta["session"],
                                        result)
        raise TransferError(f"Mooncake read failed ({result!r}; peer gone?)")

    def _read_once(self, peer_meta, reads, wait_s: float, start_by):
        """Mooncake's return code (0: done) or the exception it raised.

        The deadline counts the wait for another request's read (reads are
        serialized), so a read ends at most ``read_bound_s`` after it starts.
        A read given up on while it still waits for its turn never starts."""
        result: list = []
        state = {"abandoned": False, "started": False}
        state_lock = threading.Lock()

        def run():
            try:
                with self._read_lock:
                    with state_lock:
                        if state["abandoned"]:
                            raise TransferError("Mooncake read abandoned before it started")
                        _check_start(start_by)
                        state["started"] = True
                    result.append(self.engine.batch_transfer_sync_read(
                        peer_meta["session"], [la for _, la, _ in reads],
                        [ra for ra, _, _ in reads], [n for _, _, n in reads]))
            except Exception as e:  # reported by the caller
                result.append(e)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(max(wait_s, 0.0))
        if worker.is_alive():
            with state_lock:
                state["abandoned"] = True
                started = state["started"]
            if not started:  # still waiting for its turn: it never will
                raise TransferError(f"Mooncake read did not start in {wait_s:.3g} s")
            # Mooncake gives up on a stalled read by itself (30 s): wait for
            # that, so that no read still lands in blocks the decode is about
            # to free and reuse
            worker.join(MOONCAKE_ABORT_GRACE_S)
            if worker.is_alive():
                raise ReadNotAborted(f"Mooncake read did not finish in {wait_s:.3g} s "
                                     "and was not aborted")
            raise TransferError(f"Mooncake read did not finish in {wait_s:.3g} s")
        return result[0]


def memory_kind(tensor) -> tuple[str, int]:
    """NIXL's memory type and device id for ``tensor``: ``("VRAM", index)``
    on a CUDA device, ``("DRAM", 0)`` in host memory."""
    device = tensor.device
    if device.type == "cuda":
        return "VRAM", int(device.index if device.index is not None else 0)
    if device.type != "cpu":
        raise TransferError(f"memory on {device} is not supported (CPU or CUDA)")
    return "DRAM", 0


def nixl_descs(agent, reads: list[tuple[int, int, int]], local_kind: tuple[str, int],
               remote_kind: tuple[str, int]):
    """NIXL descriptor lists (local, remote) for ``(remote_addr, local_addr,
    nbytes)`` reads; each side's ranges carry that side's device id and use
    its memory type, as registered there."""
    (lt, ld), (rt, rd) = local_kind, remote_kind
    return (agent.get_xfer_descs([(la, n, ld) for _, la, n in reads], lt),
            agent.get_xfer_descs([(ra, n, rd) for ra, _, n in reads], rt))


def _check_start(start_by: float | None) -> None:
    if start_by is not None and time.monotonic() > start_by:
        raise TransferError("read not started: the prefill's claim on the blocks could end "
                            "before it finishes (it waited too long for other reads)")


TRANSPORTS = {"nixl": NixlTransport, "mooncake": MooncakeTransport}


def make_transport(name: str, host: str) -> Transport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; accepted: {sorted(TRANSPORTS)}.")
    return TRANSPORTS[name](host)


def read_owned_blocks(transport: Transport, manifests: dict[int, list[tuple[int, int]]],
                      peers: dict[int, dict], local_block_ids: list[int],
                      local_addrs: list[int], page_bytes: list[int], timeout_s: float,
                      before_rank: Callable[[int], None] | None = None,
                      start_by: dict[int, float] | None = None,
                      decode_size: int = 1) -> tuple[int, int]:
    """READ every rank's entries (checked manifests, this decode rank's
    share: ``core.manifest.for_decode_rank``) into their local slots
    (logical block ``j`` into ``local_block_ids[j // decode_size]``), one
    batched read per rank, runs consecutive on both sides merged;
    ``peers[r]`` has the rank's ``layer_addrs`` and ``transport_meta``.
    ``before_rank(r)``: the caller's callback before rank r's read (the
    harness's P/D hooks pause a pull there, ``scripts/gpu/onegpu/pd_hooks.py``);
    ``start_by[r]``: see ``Transport.read``.
    Returns ``(read descriptors issued, bytes they moved)``."""
    num_descs = nbytes = 0
    for r, entries in manifests.items():
        if before_rank is not None:
            before_rank(r)
        reads = read_descriptors(merge_runs(entries, local_block_ids, decode_size),
                                 peers[r]["layer_addrs"], local_addrs, page_bytes)
        num_descs += len(reads)
        nbytes += sum(n for _, _, n in reads)
        if start_by is None:
            transport.read(peers[r]["transport_meta"], reads, timeout_s)
        else:
            transport.read(peers[r]["transport_meta"], reads, timeout_s, start_by=start_by[r])
    return num_descs, nbytes
