"""Decode worker: pull one request's KV from every prefill rank.

Per request, on one of at most ``MAX_PULL_THREADS`` threads (a bounded
pool; more requests queue, and at most ``PULLS_PER_PEER`` of them run
against one prefill, so a slow or fake one cannot take every thread from
the others): ask every prefill rank (side channel; the whole exchange with
all ranks under one ``transfer_timeout_s``, so a slow or fake peer holds a
request that long at most once it runs, whatever ``shard_size`` it names)
for its handshake and manifest with the request's transfer token (a
refusal is asked again for up to ``FETCH_RETRY_S``: the prefill's workers
learn of a finished request at its next engine step, and the decode can be
faster), refuse any mismatch or out-of-range entry before a byte moves
(:mod:`vllm_cp_kv.core.manifest`), READ each rank's owned blocks straight
into this rank's block-table slots, then tell every rank it is done.
Any failure fails the request (vLLM's ``kv_load_failure_policy="fail"``) and
is logged on the decode as ``cp_kv connector: request <id> (prefill request
<id>) failed to receive its KV: <reason>`` (for refused params the prefill's
request id ends the reason instead): vLLM 0.32 gives the client only
"Internal server error" for a failed load.

The fetch claims the blocks on the prefill for a lease (``producer.py``). The
reads of a request run rank after rank, so the lease asked for covers all of
them: ``shard_size x`` the transport's longest read
(:meth:`Transport.read_bound_s`; Mooncake: ``READ_ATTEMPTS x timeout +
MOONCAKE_ABORT_GRACE_S``) plus ``LEASE_MARGIN_S``. A read that could still be
running when its lease ends (it waited behind other requests' reads) is not
started: the request fails rather than read blocks the prefill may reuse.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from typing import Callable

import msgspec

from ...core.manifest import ManifestError, check_complete, for_decode_rank, validate_manifest
from ...core.ownership import CPShardSpec, num_logical_blocks
from .counters import TransferCounters
from .params import TransferParams
from .schema import MAX_WIRE_LEASE_S, Done, Fetch, FetchReply, Handshake, Ok, Release
from .side_channel import (RateLimitedLog, Refused, SideChannelClient, SideChannelError,
                           new_nonce)
from .transfer import ReadNotAborted, read_owned_blocks

logger = logging.getLogger("vllm." + __name__)  # under vLLM's log config when loaded
LEASE_MARGIN_S = 30.0
# A refused fetch is asked again for this long (at most transfer_timeout_s):
# the prefill's workers learn of a finished request at its next engine step.
FETCH_RETRY_S = 10.0
# Done / Release are best effort (the prefill ends claims and frees blocks by
# itself): a dead prefill must not hold the request this long per rank.
NOTICE_TIMEOUT_S = 5.0
# Pulls run on at most this many threads per decode rank; more wait in a
# queue (each pull's deadlines start when it runs: a queued pull cannot
# overrun a claim it has not made yet).
MAX_PULL_THREADS = 8
# ... and at most this many of them against one prefill (its side channel's
# host:port): the others stay free for requests from other prefills.
PULLS_PER_PEER = 4


class PullPool:
    """A bounded pool of daemon threads for the pulls: however many requests
    a client sends, at most ``size`` threads, started as work comes; the rest
    queue, in order per peer, the peers in turn, at most ``per_peer``
    running for one peer.

    A waiting thread is claimed when work is submitted (``_idle`` counts the
    unclaimed ones), so a burst of submits starts as many threads as it
    needs instead of queueing behind one that has not woken yet."""

    def __init__(self, size: int = MAX_PULL_THREADS, per_peer: int = PULLS_PER_PEER,
                 name: str = "cp_kv-receive"):
        self.size, self.per_peer, self.name = size, per_peer, name
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, deque] = OrderedDict()
        self._running: dict[str, int] = {}
        self._threads = 0
        self._idle = 0

    def submit(self, fn: Callable, *args, peer: str = "") -> None:
        with self._cond:
            self._queues.setdefault(peer, deque()).append((fn, args))
            if self._idle:
                self._idle -= 1
                self._cond.notify()
            elif self._threads < self.size:
                self._threads += 1
                threading.Thread(target=self._serve, daemon=True, name=self.name).start()

    @property
    def threads(self) -> int:
        return self._threads

    def _next(self):
        """Under the lock: the first task of the first peer below its cap
        (that peer then goes last), or None."""
        for peer, tasks in self._queues.items():
            if self._running.get(peer, 0) < self.per_peer:
                task = tasks.popleft()
                if tasks:
                    self._queues.move_to_end(peer)
                else:
                    del self._queues[peer]
                self._running[peer] = self._running.get(peer, 0) + 1
                return peer, task
        return None

    def _serve(self) -> None:
        while True:
            with self._cond:
                got = self._next()
                while got is None:
                    self._idle += 1  # claimed (decremented) by the submit that wakes us
                    self._cond.wait()
                    got = self._next()
            peer, (fn, args) = got
            try:
                fn(*args)
            except Exception as e:  # fn handles its own failures; never lose the thread
                logger.error("cp_kv connector: a pull task failed: %r", e)
            finally:
                with self._cond:
                    self._running[peer] -= 1
                    if not self._running[peer]:
                        del self._running[peer]


class Consumer:
    """One decode rank's pulls. ``start`` and ``take_results`` run on the
    worker's thread, the pulls on their own."""

    def __init__(self, local: Handshake, transport, timeout_s: float, secret: bytes | None,
                 tp_size: int, on_finished: Callable[[], None] = lambda: None,
                 counters: TransferCounters | None = None):
        self.local, self.transport = local, transport
        self.timeout_s, self.secret, self.tp_size = timeout_s, secret, tp_size
        self._on_finished = on_finished
        self.counters = counters if counters is not None else TransferCounters(local.shard.rank)
        self._lock = threading.Lock()
        self._receiving = 0
        self._done: set[str] = set()
        self._failed: set[str] = set()
        # a peer's unanswered notices (the failed request itself is one line each)
        self._notice_log = RateLimitedLog(logger)
        self.pool = PullPool()

    def start(self, req_id: str, local_ids: list[int], params: TransferParams | None,
              error: str | None, ready=None) -> None:
        """Pull in a thread. ``local_ids[j]``: the local block for logical
        block j, or -1 where this decode's own prefix cache already holds it
        (not read). ``ready``: something with ``synchronize()`` (a CUDA event
        recorded after vLLM zeroed the new blocks) to wait for before the
        first byte lands."""
        with self._lock:
            self._receiving += 1
        peer = f"{params.remote_host}:{params.remote_port}" if params else ""
        self.pool.submit(self._run, req_id, local_ids, params, error, ready, peer=peer)

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) since the last call."""
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def pending(self) -> bool:
        with self._lock:
            return self._receiving > 0

    def ready(self) -> bool:
        with self._lock:
            return bool(self._done)

    def _run(self, req_id, local_ids, params, error, ready=None) -> None:
        failed = True
        try:
            if error:
                raise ManifestError(error)
            self.receive(req_id, local_ids, params, ready)
            failed = False
        except Exception as e:  # refused metadata, dead or fake peer, timeout
            remote = f" (prefill request {params.remote_request_id})" if params else ""
            logger.error("cp_kv connector: request %s%s failed to receive its KV: %s: %s",
                         req_id, remote, type(e).__name__, e)
            self.counters.pull_failed()
        with self._lock:
            self._receiving -= 1
            self._done.add(req_id)
            if failed:
                self._failed.add(req_id)
        self._on_finished()

    def lease_s(self, shard_size: int) -> float:
        """The claim to ask each prefill rank for (see the module docstring)."""
        bound = shard_size * self.transport.read_bound_s(self.timeout_s) + LEASE_MARGIN_S
        return min(bound, MAX_WIRE_LEASE_S)

    def receive(self, req_id: str, local_ids: list[int], p: TransferParams,
                ready=None) -> None:
        t0 = time.monotonic()
        shard = self.local.shard  # this decode rank's own layout (size 1: unsharded)
        mine = CPShardSpec(shard.rank, shard.size, shard.block_size)
        n_blocks = num_logical_blocks(p.remote_num_tokens, shard.block_size)
        n_cols = -(-n_blocks // shard.size)  # columns of the decode's virtual table
        ids = list(local_ids[:n_cols])
        # columns this decode's prefix cache holds (-1) lead the table; they are
        # shared with other requests and must not be written
        cached = next((j for j, b in enumerate(ids) if b >= 0), len(ids))
        wanted = ids[cached:]
        if (len(ids) < n_cols or not wanted or min(wanted) < 0
                or max(wanted) >= self.local.num_blocks):
            raise ManifestError(f"local block ids {local_ids[:8]} cannot hold {n_blocks} blocks")
        reader = secrets.token_hex(8)  # this pull's name in the prefill's claims
        lease_s = self.lease_s(p.shard_size)
        bound = self.transport.read_bound_s(self.timeout_s)
        exchange_end = t0 + self.timeout_s  # every rank's answer, all together
        clients, peers, manifests, start_by = [], {}, {}, {}
        try:
            for r in range(p.shard_size):  # all metadata first: nothing moves on a mismatch
                left = exchange_end - time.monotonic()
                if left <= 0:
                    raise SideChannelError(
                        f"the side-channel exchange with {p.shard_size} prefill ranks did "
                        f"not finish in {self.timeout_s:g} s (rank {r} not asked)")
                client = SideChannelClient(p.remote_host, p.remote_port + r, self.secret, left)
                clients.append(client)
                asked, reply = self._fetch(client, p, reader, lease_s, exchange_end)
                client.claimed = True
                hs = reply.handshake
                self.check_handshake(hs, r, p)
                manifests[r] = validate_manifest(reply.manifest, r, p.shard_size, n_blocks,
                                                 hs.num_blocks)
                peers[r] = {"layer_addrs": hs.layer_addrs,
                            "transport_meta": msgspec.structs.asdict(hs.transport_meta)}
                # our clock started before theirs: the claim ends after this
                start_by[r] = asked + reply.lease_s - bound
            check_complete(manifests, n_blocks)  # every rank's together: the whole request
            # this rank's share, past its own prefix-cache hits
            manifests = for_decode_rank(manifests, mine, first_column=cached)
            blocks = sum(len(m) for m in manifests.values())
            if ready is not None:  # vLLM's zeroing of the new blocks has run
                ready.synchronize()
            num_descs, nbytes = read_owned_blocks(
                self.transport, manifests, peers, local_ids, self.local.layer_addrs,
                self.local.block_bytes, self.timeout_s, start_by=start_by,
                decode_size=shard.size)
            self._tell(clients, req_id, Done, p, reader, readers=self.tp_size)
            seconds = time.monotonic() - t0
            self.counters.pull_ok(nbytes, blocks, seconds)
        except ReadNotAborted:
            raise  # data may still land: the claims must run out by themselves
        except Exception:
            # end the claims at once (the prefill frees the blocks on expiry,
            # so a client may still retry the request)
            self._tell([c for c in clients if c.claimed], req_id, Release, p, reader)
            raise
        finally:
            for client in clients:
                client.close()
        received = sum(min(shard.block_size, p.remote_num_tokens - j * shard.block_size)
                       for m in manifests.values() for j, _ in m)
        logger.info("cp_kv connector: request %s received %d tokens (%d blocks, %d "
                    "descriptors, %d bytes) from %d prefill ranks in %.3f s%s%s", req_id,
                    received, blocks, num_descs, nbytes, p.shard_size, seconds,
                    f"; {cached} leading blocks from this decode's prefix cache"
                    if cached else "",
                    f" (decode rank {shard.rank}/{shard.size}: its owned blocks)"
                    if shard.size > 1 else "")

    def _fetch(self, client: SideChannelClient, p: TransferParams, reader: str,
               lease_s: float, exchange_end: float) -> tuple[float, FetchReply]:
        """``(time asked, reply)``, by ``exchange_end`` at the latest. A
        refusal is retried for up to ``FETCH_RETRY_S``: the prefill's
        workers learn of a finished request at its next engine step, and a
        fast decode can ask before that (the refusal cannot say why: an
        unknown request and a wrong token get the same answer, so a wrong
        token fails after that long)."""
        deadline = min(time.monotonic() + min(self.timeout_s, FETCH_RETRY_S), exchange_end)
        pause = 0.02
        while True:
            asked = time.monotonic()
            try:
                return asked, client.ask(Fetch(
                    nonce=new_nonce(), request_id=p.remote_request_id, token=p.transfer_token,
                    reader=reader, lease_s=lease_s), FetchReply,
                    timeout_s=max(exchange_end - asked, 0.001))
            except Refused:
                if time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def _tell(self, clients, req_id, kind, p: TransferParams, reader: str, **fields) -> None:
        """Best effort ``Done``/``Release`` to each rank, all within
        ``NOTICE_TIMEOUT_S`` (the prefill side also ends claims and frees
        blocks by itself)."""
        end = time.monotonic() + min(self.timeout_s, NOTICE_TIMEOUT_S)
        for client in clients:
            try:
                client.ask(kind(nonce=new_nonce(), request_id=p.remote_request_id,
                                token=p.transfer_token, reader=reader, **fields), Ok,
                           timeout_s=max(end - time.monotonic(), 0.001))
            except Exception as e:
                self._notice_log.warning("cp_kv connector: request %s: no %s confirmed by "
                                         "%s: %s", req_id, kind.__name__, client.address, e)

    def check_handshake(self, hs: Handshake, rank: int, p: TransferParams) -> None:
        mine = self.local
        # the prefill's geometry, whole: rank r of the request's shard group,
        # with this decode's block size and ownership rule
        want = {"rank": rank, "size": p.shard_size, "block_size": mine.shard.block_size,
                "rule": mine.shard.rule, "block_bytes": mine.block_bytes,
                "dtype": mine.dtype, "cache_format": mine.cache_format,
                "transport": mine.transport, "caches": len(mine.layer_addrs)}
        got = {k: getattr(hs.shard, k) for k in ("rank", "size", "block_size", "rule")}
        got.update(block_bytes=hs.block_bytes, dtype=hs.dtype, cache_format=hs.cache_format,
                   transport=hs.transport, caches=len(hs.layer_addrs))
        bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
        if bad:
            raise ManifestError(f"handshake mismatch with prefill rank {rank} "
                                f"(theirs, ours): {bad}")
        if hs.transport == "mooncake":  # reads go where the session names: the prefill only
            host = hs.transport_meta.session.rpartition(":")[0].strip("[]").lower()
            if host != p.remote_host.strip("[]").lower():
                raise ManifestError(f"prefill rank {rank}'s Mooncake session is on {host!r}, "
                                    f"not on the prefill host {p.remote_host!r}: refused")
