"""Prefill worker: the finished requests it serves, their claims and expiry.

Each prefill rank keeps, per finished request, the virtual block table, the
prompt length and the request's **transfer token** (made by the scheduler in
``request_finished`` and returned to the client in ``kv_transfer_params``).
It answers side-channel requests (:mod:`.side_channel`) only for the right
``(request id, token)`` pair; an unknown id and a wrong token get the same
answer, so the channel reveals nothing about other requests, and nothing
(layer addresses, transport metadata, manifests) is handed out without a
token.

Claims: a decode reader that fetched a manifest may still be reading those
blocks, so they must not be freed (and reused) under it. There is no
connection to watch (ZMQ), so a claim is a **lease**: taken by a fetch for
the time the reader asked for (its longest possible read, see
``consumer.py``), capped at ``MAX_LEASE_S`` and at ``expiry + MAX_LEASE_S``
after the hand-over so that a token holder cannot pin memory for ever;
released by that reader's ``Done`` (read) or ``Release`` (gave up). Blocks
are freed when every reader is done and no lease is left, or after
``blocks_expiry_s`` when no lease is left. A wrong-token ``Done`` or
``Release`` frees and releases nothing.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ...core.manifest import ManifestError, owned_manifest
from .counters import TransferCounters
from .schema import Done, Error, Fetch, FetchReply, Handshake, Ok, Release
from .side_channel import RateLimitedLog, SideChannelServer

logger = logging.getLogger("vllm." + __name__)  # under vLLM's log config when loaded
MAX_LEASE_S = 600.0  # the longest claim one fetch takes
_DUMMY_TOKEN = "x" * 43


@dataclass
class Served:
    table: list[int]
    num_tokens: int
    token: str
    expires: float  # monotonic: freed after this unless claimed
    lease_limit: float  # no claim lasts beyond this
    leases: dict[str, float] = field(default_factory=dict)  # reader -> claimed until
    done: set[str] = field(default_factory=set)  # readers that said done
    readers: int = 0  # readers the decode has (from its Done)


class Producer:
    """One prefill rank's served requests. ``handle`` runs on the side
    channel's thread, ``add``/``take_finished`` on the worker's."""

    def __init__(self, handshake: Handshake, expiry_s: float,
                 on_finished: Callable[[], None] = lambda: None, transport=None,
                 counters: TransferCounters | None = None, replica: bool = False):
        self.shard = handshake.shard  # the geometry this rank serves under
        self.rank = self.shard.rank
        self.handshake, self.expiry_s, self.transport = handshake, expiry_s, transport
        self.counters = counters if counters is not None else TransferCounters(self.rank)
        self._on_finished = on_finished
        self._lock = threading.Lock()
        self._served: dict[str, Served] = {}
        # a replica (an unsharded prefill's TP rank > 0) serves no reader:
        # every request it is handed is finished at once
        self.replica = replica
        self._finished: set[str] = set()
        self._leased = threading.Event()  # some claim is outstanding: drive progress
        self._stop = threading.Event()
        self.server: SideChannelServer | None = None
        # what clients and decodes can cause, one line per 10 s each
        self._expired_log, self._claim_log, self._progress_log = (
            RateLimitedLog(logger), RateLimitedLog(logger), RateLimitedLog(logger))

    # ---- worker thread ------------------------------------------------------------
    def add(self, req_id: str, table: list[int], num_tokens: int, token: str,
            now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if self.replica:
                self._finished.add(req_id)
                self._on_finished()
                return
            self._served[req_id] = Served(list(table), num_tokens, token, now + self.expiry_s,
                                          now + self.expiry_s + MAX_LEASE_S)

    def take_finished(self, now: float | None = None) -> set[str]:
        """Requests whose blocks may be freed now (read by every reader, or
        expired), each reported once."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for req_id, entry in list(self._served.items()):
                if self._settle(req_id, entry, now):
                    continue
                if now > entry.expires and not entry.leases:
                    self._expired_log.warning(
                        "cp_kv connector: request %s expired after %g s without a "
                        "transfer; freeing its blocks", req_id, self.expiry_s)
                    self.counters.expired(len(entry.table))
                    self._finish(req_id)
            self._update_leased()
            finished, self._finished = self._finished, set()
        return finished

    def pending(self) -> bool:
        """Some request still waits for its readers."""
        with self._lock:
            return bool(self._served)

    def ready(self) -> bool:
        """Some request's blocks may be freed now."""
        with self._lock:
            return bool(self._finished)

    # ---- side-channel thread ------------------------------------------------------
    def handle(self, msg: Fetch | Done | Release) -> FetchReply | Ok | Error:
        now = time.monotonic()
        with self._lock:
            entry = self._lookup(msg.request_id, msg.token)
            if entry is None:
                return Error(nonce=msg.nonce, reason=(
                    f"prefill rank {self.rank} has no transfer for this request id and "
                    "token (unknown, expired, already read or wrong token)"))
            if isinstance(msg, Fetch):
                return self._fetch(msg, entry, now)
            claimed = entry.leases.pop(msg.reader, None) is not None
            if isinstance(msg, Release):
                if claimed:  # one per reader that gave up, however often it says so
                    self.counters.released()
                self._update_leased()
                return Ok(nonce=msg.nonce)
            if len(entry.done) < 1024:
                entry.done.add(msg.reader)
            entry.readers = max(entry.readers, msg.readers)
            self._settle(msg.request_id, entry, now)
            self._update_leased()
            return Ok(nonce=msg.nonce)

    def _fetch(self, msg: Fetch, entry: Served, now: float) -> FetchReply | Error:
        # The grant is a duration, clamped as one: (now + x) - now need not give x back.
        granted = min(msg.lease_s, MAX_LEASE_S, entry.lease_limit - now)
        if granted <= 0 or (msg.reader not in entry.leases and len(entry.leases) >= 1024):
            return Error(nonce=msg.nonce, reason=f"prefill rank {self.rank}: no more claims "
                                                 "on this request")
        try:
            manifest = owned_manifest(self.rank, self.shard.size, self.shard.block_size,
                                      entry.table, entry.num_tokens)
        except ManifestError as e:
            return Error(nonce=msg.nonce, reason=f"prefill rank {self.rank}: {e}")
        entry.leases[msg.reader] = now + granted
        self._leased.set()
        return FetchReply(nonce=msg.nonce, handshake=self.handshake, manifest=manifest,
                          lease_s=granted)

    # ---- under the lock -----------------------------------------------------------
    def _lookup(self, req_id: str, token: str) -> Served | None:
        entry = self._served.get(req_id)
        # compare with something either way: the time taken says nothing either
        ok = hmac.compare_digest(token.encode(), (entry.token if entry else _DUMMY_TOKEN).encode())
        return entry if ok and entry is not None else None

    def _settle(self, req_id: str, entry: Served, now: float) -> bool:
        """Drop ended leases; free the request if every reader is done and
        none still holds a claim. Returns whether it was freed."""
        for reader, until in list(entry.leases.items()):
            if until <= now:
                del entry.leases[reader]
                if reader not in entry.done:
                    self._claim_log.warning("cp_kv connector: request %s: a decode "
                                            "reader's claim ended without a done", req_id)
        if entry.readers and len(entry.done) >= entry.readers and not entry.leases:
            self.counters.served()
            self._finish(req_id)
            return True
        return False

    def _finish(self, req_id: str) -> None:
        del self._served[req_id]
        self._finished.add(req_id)
        self._on_finished()

    def _update_leased(self) -> None:
        if any(e.leases for e in self._served.values()):
            self._leased.set()
        else:
            self._leased.clear()

    def _sweep(self) -> None:
        """Periodic (side-channel thread): end timed-out claims."""
        now = time.monotonic()
        with self._lock:
            for req_id, entry in list(self._served.items()):
                self._settle(req_id, entry, now)
            self._update_leased()

    # ---- serving ------------------------------------------------------------------
    def serve(self, host: str, port: int, secret: bytes | None) -> None:
        """Answer the side channel on ``host:port`` and drive the transport's
        progress while any claim is outstanding (NIXL without a progress
        thread serves a peer's READ only when driven; one loop per rank however
        many readers: per-reader polling loops starved small machines)."""
        self.server = SideChannelServer(host, port, self.handle, secret, on_idle=self._sweep,
                                        name=f"cp_kv-side-channel-{self.rank}")
        threading.Thread(target=self._progress_loop, daemon=True,
                         name=f"cp_kv-progress-{self.rank}").start()

    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            if not self._leased.wait(0.5):
                continue
            try:
                self.transport.progress()
            except Exception as e:
                self._progress_log.warning("cp_kv connector: transport progress failed: %r", e)
                time.sleep(0.1)
            time.sleep(0.001)

    def close(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.close()
