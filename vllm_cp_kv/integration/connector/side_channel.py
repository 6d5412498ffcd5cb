"""The side channel between prefill and decode workers: typed messages over ZMQ.

What it carries: a decode rank asks a prefill rank for the metadata of one
finished request (``Fetch``: the rank's cache layout, transport metadata and
the manifest of the blocks it owns) and later says it has read them
(``Done``) or gave up (``Release``). The KV bytes themselves move over NIXL or Mooncake, not here.

Why this shape (the first version was ``multiprocessing.connection``, which
unpickles every message: anyone who could reach a prefill rank's port, or
answer a decode that a client pointed at a host of its choice, ran code
there):

* **nothing is deserialized into code**: every message is one msgpack-encoded
  msgspec ``Struct`` of a closed tagged union, decoded with a typed decoder
  (ints are ints, strings are bounded, lists are bounded, no ext types); a
  message that does not decode or fails a bound gets an ``Error`` reply;
* **no head-of-line blocking**: one ROUTER socket per prefill rank, served by
  one thread that never waits on a peer (ZMQ's I/O thread assembles frames;
  only complete messages reach the handler, replies are sent without
  blocking), so an idle, slow or half-sent connection delays nobody; on the
  decode side every receive runs under a timeout;
* **sizes bounded**: ``zmq.MAXMSGSIZE`` on both sides (ZMQ drops a peer that
  sends a larger frame: 64 KiB towards a prefill rank, whose requests are a
  few hundred bytes; 4 MiB towards the decode, for manifests) and
  per-field bounds in the Structs. ZMQ holds the frames of an unfinished
  multipart message without a limit on their number; without a secret a
  peer that reaches the port can make a rank hold memory until it
  disconnects (docs/disaggregated.md, Security);
* **optional shared secret** (:func:`load_secret`): the sockets run ZMQ's
  CURVE security with keys derived from the secret (:func:`curve_keys`) and
  a ZAP handler that admits only the derived client key, so a peer without
  the secret cannot get a single frame delivered (nor read one); on top,
  each message carries an HMAC-SHA256 of its body under a direction tag and
  the prefill rank's port, requests and replies both, so the decode also
  authenticates the prefill and a message for one rank is refused by
  another. Replies echo the request's random nonce (a reply cannot be
  replayed to another request), and a prefill rank refuses a request whose
  nonce it has seen (a replayed request);
* **errors contained**: every decode failure (deep nesting included) is a
  refusal, and every log line a peer can cause is rate-limited.

Wire format: two frames, ``body`` (msgpack) and ``mac`` (32 bytes, or empty
without a secret); the ROUTER adds the peer's identity frame in front.
Per-request authorization (the transfer token) is the prefill's business
(``producer.py``): this module only carries the token.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable

import zmq

from .auth import REPLY_TAG, REQUEST_TAG, authentic, context, seal, use_curve
from .schema import (DECODE_ERRORS, REPLY_DECODERS, REQUEST_DECODER, Done, Error, Fetch,
                     FetchReply, Ok, Release)

logger = logging.getLogger("vllm." + __name__)  # under vLLM's log config when loaded

MAX_FRAME_BYTES = 4 << 20  # a manifest of 100k blocks is about 1 MiB
MAX_REQUEST_BYTES = 64 << 10  # a request (Fetch, Done, Release) is < 1 KiB
REPLAY_WINDOW = 1 << 16  # request nonces a prefill rank remembers
LOG_EVERY_S = 10.0  # at most one log line per this long for what peers cause
MAX_DRAIN = 64  # messages a server answers before it runs its periodic task again


class SideChannelError(RuntimeError):
    """The peer did not answer in time, answered garbage, or refused."""


class Refused(SideChannelError):
    """The peer answered this request with an ``Error`` (its reason)."""


class RateLimitedLog:
    """At most one line per ``LOG_EVERY_S`` for what peers can cause, with
    the count of the lines left out; tracebacks are never logged for them."""

    def __init__(self, log: logging.Logger | None = None):
        self._log = log or logger
        self._last, self._skipped = 0.0, 0
        self._lock = threading.Lock()  # the decode's receive threads share one

    def warning(self, fmt: str, *args) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < LOG_EVERY_S:
                self._skipped += 1
                return
            skipped, self._last, self._skipped = self._skipped, now, 0
        self._log.warning(fmt + ("" if not skipped else " (%d similar lines left out)"),
                          *args, *((skipped,) if skipped else ()))


def endpoint(host: str, port: int) -> str:
    """ZMQ TCP endpoint (IPv6 literals in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _bind_address(host: str) -> str:
    """ZMQ binds to IP literals (or interface names), not host names: resolve."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def _socket(kind: int, host: str, max_frame_bytes: int) -> zmq.Socket:
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


# ---- server (prefill rank) ----------------------------------------------------
class SideChannelServer:
    """One prefill rank's side channel: a ROUTER on ``host:port`` and one
    thread that answers each complete request with ``handler(request)``.

    The handler runs on this thread and must not block (it takes a lock and
    builds a manifest). ``on_idle`` runs about every ``tick_s`` (the
    producer sweeps expired claims there). A malformed, unauthenticated or
    unknown message gets an ``Error`` reply and nothing else happens.
    """

    def __init__(self, host: str, port: int, handler: Callable, secret: bytes | None = None,
                 on_idle: Callable[[], None] | None = None, tick_s: float = 0.1,
                 name: str = "cp_kv-side-channel"):
        self.handler, self.secret, self.on_idle, self.tick_s = handler, secret, on_idle, tick_s
        self.port = port
        self.address = endpoint(_bind_address(host), port)
        self._sock = _socket(zmq.ROUTER, host, MAX_REQUEST_BYTES)
        if secret:  # nobody without the secret gets a frame delivered
            use_curve(self._sock, secret, server=True)
        self._sock.bind(self.address)  # the configured host only
        self._stop = threading.Event()
        self.refused = 0  # malformed / unauthenticated messages answered with Error
        self.answered = 0  # messages answered, all kinds
        self._log = RateLimitedLog()
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # request nonces (replays)
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(int(self.tick_s * 1000)):
                    self._drain()
                if self.on_idle is not None:
                    try:
                        self.on_idle()
                    except Exception as e:
                        self._log.warning("cp_kv side channel %s: periodic task failed: %r",
                                          self.address, e)
        finally:
            self._sock.close(linger=0)

    def _drain(self) -> None:
        """Answer what is waiting, at most ``MAX_DRAIN`` messages: under a
        flood the loop still comes back to ``on_idle`` (the producer's sweep
        of expired claims) every pass."""
        for _ in range(MAX_DRAIN):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self._answer(frames[1:])
            except Exception as e:  # never let one message stop the server
                self._log.warning("cp_kv side channel %s: message not answered: %r",
                                  self.address, e)
                reply = self._seal(Error(nonce=b"", reason=f"internal error: {type(e).__name__}"))
            self.answered += 1
            try:
                self._sock.send_multipart([frames[0], *reply], zmq.NOBLOCK)
            except zmq.ZMQError:  # the peer is gone or not reading: drop the reply
                pass

    def _answer(self, parts: list[bytes]) -> list[bytes]:
        if len(parts) != 2:
            return self._refuse(b"", f"malformed message: {len(parts)} frames, expected 2")
        body, mac = parts
        if not authentic(self.secret, REQUEST_TAG, self.port, body, mac):
            return self._refuse(b"", "side-channel authentication failed (shared secret "
                                     "missing or different, or a message for another rank)")
        try:
            msg = REQUEST_DECODER.decode(body)
        except DECODE_ERRORS as e:
            return self._refuse(b"", f"malformed message: {type(e).__name__}: {str(e)[:200]}")
        if msg.nonce in self._seen:
            return self._refuse(msg.nonce, "replayed message (nonce seen before)")
        self._seen[msg.nonce] = None
        if len(self._seen) > REPLAY_WINDOW:
            self._seen.popitem(last=False)
        try:
            reply = self.handler(msg)
        except Exception as e:  # a bug: answer, keep serving
            self._log.warning("cp_kv side channel %s: handler failed: %r", self.address, e)
            reply = Error(nonce=msg.nonce, reason=f"internal error: {type(e).__name__}")
        return self._seal(reply)

    def _seal(self, reply) -> list[bytes]:
        return seal(self.secret, self.port, reply, request=False)

    def _refuse(self, nonce: bytes, reason: str) -> list[bytes]:
        self.refused += 1
        self._log.warning("cp_kv side channel %s: refused a message (%r); %d refused so far",
                          self.address, reason, self.refused)
        return self._seal(Error(nonce=nonce, reason=reason))


# ---- client (decode rank) ---------------------------------------------------------
class SideChannelClient:
    """One decode conversation with one prefill rank: a DEALER, every
    receive under ``timeout_s``. Used by one thread; close it after use."""

    def __init__(self, host: str, port: int, secret: bytes | None, timeout_s: float):
        self.address = endpoint(host, port)
        self.port, self.secret, self.timeout_s = port, secret, timeout_s
        self.claimed = False  # set by the caller once a Fetch was answered
        self._sock = _socket(zmq.DEALER, host, MAX_FRAME_BYTES)
        if secret:  # CURVE: only a prefill holding the secret completes the handshake
            use_curve(self._sock, secret, server=False)
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        self._sock.connect(self.address)

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def ask(self, msg: Fetch | Done | Release, reply_type: type,
            timeout_s: float | None = None) -> FetchReply | Ok:
        """Send ``msg``; return the peer's ``reply_type`` answer to it
        (within ``timeout_s``, by default the client's).

        Raises SideChannelError on a timeout, a refusal (the peer's reason),
        an unauthenticated or malformed reply. Replies to other requests
        (another nonce) are skipped."""
        decoder = REPLY_DECODERS[reply_type]
        # Under CURVE an unfinished handshake shows either way: the send times
        # out (no peer took the frame) or the reply never comes.
        hint = (" (with a shared secret, a peer without it or with another cannot "
                "complete the CURVE handshake)" if self.secret else "")
        try:
            self._sock.send_multipart(seal(self.secret, self.port, msg))
        except zmq.Again:
            raise SideChannelError(f"could not send to {self.address} in "
                                   f"{self.timeout_s:g} s{hint}") from None
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                raise SideChannelError(
                    f"no answer from {self.address} in {timeout_s:g} s{hint}")
            parts = self._sock.recv_multipart(zmq.NOBLOCK)
            if len(parts) != 2:
                raise SideChannelError(f"malformed reply from {self.address}: "
                                       f"{len(parts)} frames")
            body, mac = parts
            if not authentic(self.secret, REPLY_TAG, self.port, body, mac):
                raise SideChannelError(f"reply from {self.address} failed authentication "
                                       "(shared secret missing or different there)")
            try:
                reply = decoder.decode(body)
            except DECODE_ERRORS as e:
                raise SideChannelError(f"malformed reply from {self.address}: "
                                       f"{str(e)[:200]}") from None
            if isinstance(reply, Error) and not reply.nonce:
                raise SideChannelError(f"{self.address} refused the message: {reply.reason}")
            if reply.nonce != msg.nonce:
                continue  # a late answer to an earlier request
            if isinstance(reply, Error):
                raise Refused(reply.reason)
            return reply


def new_nonce() -> bytes:
    return os.urandom(16)
