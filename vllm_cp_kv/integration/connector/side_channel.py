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
  sends a larger frame) and per-field bounds in the Structs;
* **optional shared secret** (:func:`load_secret`): each message carries an
  HMAC-SHA256 of its body under a direction tag; requests and replies both,
  so the decode also authenticates the prefill. Replies echo the request's
  random nonce, so a reply cannot be replayed to another request.

Wire format: two frames, ``body`` (msgpack) and ``mac`` (32 bytes, or empty
without a secret); the ROUTER adds the peer's identity frame in front.
Per-request authorization (the transfer token) is the prefill's business
(``producer.py``): this module only carries the token.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Annotated, Callable, Literal, Union

import msgspec
import zmq
from msgspec import Meta, Struct

logger = logging.getLogger("vllm." + __name__)  # under vLLM's log config when loaded

MAX_FRAME_BYTES = 4 << 20  # a manifest of 100k blocks is about 1 MiB
MAX_ID_CHARS = 256  # vLLM request ids are ~50 characters
MAX_BLOCKS = 1 << 20  # manifest entries, block ids
MAX_CACHES = 1 << 14  # registered caches (layers x caches per layer)
MAX_READERS = 1024  # decode ranks of one request
MAX_WIRE_LEASE_S = 3600.0  # what a message may carry; the prefill caps claims lower
SECRET_ENV = "VLLM_CP_KV_SIDE_CHANNEL_SECRET"
MIN_SECRET_BYTES = 16
_REQUEST_TAG = b"vllm_cp_kv side channel v1 request\0"
_REPLY_TAG = b"vllm_cp_kv side channel v1 reply\0"

# ---- message schema ---------------------------------------------------------
Nonce = Annotated[bytes, Meta(min_length=16, max_length=16)]
ReplyNonce = Annotated[bytes, Meta(max_length=16)]  # empty: reply to a malformed message
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
Token = Annotated[str, Meta(min_length=16, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]
ReaderId = Annotated[str, Meta(min_length=1, max_length=64)]
ShortStr = Annotated[str, Meta(max_length=64)]
U32 = Annotated[int, Meta(ge=0, lt=1 << 32)]
U64 = Annotated[int, Meta(ge=0)]  # msgpack ints are at most 64-bit
BlockId = Annotated[int, Meta(ge=0, lt=1 << 31)]


class Fetch(Struct, tag=True, forbid_unknown_fields=True):
    """Decode -> prefill: this request's handshake and manifest. Claims the
    blocks for ``lease_s`` (capped by the prefill) for reader ``reader``."""

    nonce: Nonce
    request_id: RequestId
    token: Token
    reader: ReaderId
    lease_s: Annotated[float, Meta(gt=0, le=MAX_WIRE_LEASE_S)]


class Done(Struct, tag=True, forbid_unknown_fields=True):
    """Decode -> prefill: ``reader`` has read (or given up on) the blocks;
    the prefill frees them once ``readers`` distinct readers are done."""

    nonce: Nonce
    request_id: RequestId
    token: Token
    reader: ReaderId
    readers: Annotated[int, Meta(ge=1, le=MAX_READERS)]


class Release(Struct, tag=True, forbid_unknown_fields=True):
    """Decode -> prefill: ``reader`` gave up (the request failed) and reads
    nothing more; its claim ends now. Frees nothing (the blocks expire)."""

    nonce: Nonce
    request_id: RequestId
    token: Token
    reader: ReaderId


class TransportMeta(Struct, forbid_unknown_fields=True):
    """What a reader needs to reach the prefill rank's memory (NIXL: agent
    name and metadata; Mooncake: its RPC session ``host:port``)."""

    agent_name: Annotated[str, Meta(max_length=128)] = ""
    agent_metadata: Annotated[bytes, Meta(max_length=1 << 20)] = b""
    session: Annotated[str, Meta(max_length=300)] = ""
    # NIXL: where the registered caches live (host memory, or a GPU's index)
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: Annotated[int, Meta(ge=0, lt=1 << 16)] = 0


class Handshake(Struct, forbid_unknown_fields=True):
    """A prefill rank's cache layout (one entry per registered cache)."""

    engine_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)]
    rank: Annotated[int, Meta(ge=0, lt=MAX_READERS)]
    shard_size: Annotated[int, Meta(ge=1, le=MAX_READERS)]
    block_size: Annotated[int, Meta(ge=1, le=1 << 16)]
    ownership_rule: ShortStr
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 31)]
    block_bytes: Annotated[list[Annotated[int, Meta(ge=1, lt=1 << 32)]],
                           Meta(max_length=MAX_CACHES)]
    dtype: Annotated[list[ShortStr], Meta(max_length=MAX_CACHES)]
    layer_addrs: Annotated[list[U64], Meta(max_length=MAX_CACHES)]
    transport: ShortStr
    transport_meta: TransportMeta


class FetchReply(Struct, tag=True, forbid_unknown_fields=True):
    """Prefill -> decode: the handshake, this rank's manifest
    ``[(logical block, block id)]`` and the granted claim (seconds)."""

    nonce: ReplyNonce
    handshake: Handshake
    manifest: Annotated[list[tuple[U32, BlockId]], Meta(max_length=MAX_BLOCKS)]
    lease_s: Annotated[float, Meta(gt=0, le=MAX_WIRE_LEASE_S)]


class Ok(Struct, tag=True, forbid_unknown_fields=True):
    nonce: ReplyNonce


class Error(Struct, tag=True, forbid_unknown_fields=True):
    nonce: ReplyNonce
    reason: Annotated[str, Meta(max_length=1024)]


Request = Union[Fetch, Done, Release]
_REQUEST_DECODER = msgspec.msgpack.Decoder(Request)
_REPLY_DECODERS = {t: msgspec.msgpack.Decoder(Union[t, Error]) for t in (FetchReply, Ok)}
_ENCODER = msgspec.msgpack.Encoder()


class SideChannelError(RuntimeError):
    """The peer did not answer in time, answered garbage, or refused."""


class Refused(SideChannelError):
    """The peer answered this request with an ``Error`` (its reason)."""


# ---- framing ----------------------------------------------------------------
def load_secret(env_name: str | None = None) -> bytes | None:
    """The deployment's shared side-channel secret, from the environment.

    ``env_name`` (extra config ``side_channel_secret_env``) names the variable
    and must then be set; otherwise ``VLLM_CP_KV_SIDE_CHANNEL_SECRET`` is used
    if set. ``None``: no secret (requests are still authorized by their
    per-request token). Never a constant in the source: a key anyone can read
    authenticates nobody.
    """
    name = env_name or SECRET_ENV
    value = os.environ.get(name)
    if not value:
        if env_name:
            raise ValueError(f"ShardedKVConnector: side_channel_secret_env names {name!r}, "
                             "which is not set (or empty) in the environment.")
        return None
    secret = value.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"ShardedKVConnector: the side-channel secret in {name} is "
                         f"{len(secret)} bytes; use at least {MIN_SECRET_BYTES} random bytes.")
    return secret


def _mac(secret: bytes | None, tag: bytes, body: bytes) -> bytes:
    return hmac.new(secret, tag + body, hashlib.sha256).digest() if secret else b""


def _seal(secret: bytes | None, tag: bytes, msg) -> list[bytes]:
    body = _ENCODER.encode(msg)
    return [body, _mac(secret, tag, body)]


def _authentic(secret: bytes | None, tag: bytes, body: bytes, mac: bytes) -> bool:
    return not secret or hmac.compare_digest(_mac(secret, tag, body), mac)


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


_context: zmq.Context | None = None
_context_lock = threading.Lock()


def context() -> zmq.Context:
    """This process's ZMQ context (thread-safe; sockets are per thread)."""
    global _context
    with _context_lock:
        if _context is None:
            _context = zmq.Context(io_threads=1)
        return _context


def _socket(kind: int, host: str) -> zmq.Socket:
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
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
        self.address = endpoint(_bind_address(host), port)
        self._sock = _socket(zmq.ROUTER, host)
        self._sock.bind(self.address)  # the configured host only
        self._stop = threading.Event()
        self.refused = 0  # malformed / unauthenticated messages answered with Error
        self.answered = 0  # messages answered, all kinds
        self._last_warning = 0.0
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def alive(self) -> bool:
        return self._thread.is_alive()

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
                    except Exception:
                        logger.exception("cp_kv side channel: periodic task failed")
        finally:
            self._sock.close(linger=0)

    def _drain(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self._answer(frames[1:])
            except Exception as e:  # never let one message stop the server
                logger.exception("cp_kv side channel: message not answered")
                reply = _seal(self.secret, _REPLY_TAG, Error(nonce=b"", reason=(
                    f"internal error: {type(e).__name__}")))
            self.answered += 1
            try:
                self._sock.send_multipart([frames[0], *reply], zmq.NOBLOCK)
            except zmq.ZMQError:  # the peer is gone or not reading: drop the reply
                pass

    def _answer(self, parts: list[bytes]) -> list[bytes]:
        if len(parts) != 2:
            return self._refuse(b"", f"malformed message: {len(parts)} frames, expected 2")
        body, mac = parts
        if not _authentic(self.secret, _REQUEST_TAG, body, mac):
            return self._refuse(b"", "side-channel authentication failed (shared secret "
                                     "missing or different)")
        try:
            msg = _REQUEST_DECODER.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._refuse(b"", f"malformed message: {str(e)[:200]}")
        try:
            reply = self.handler(msg)
        except Exception as e:  # a bug: answer, keep serving
            logger.exception("cp_kv side channel: handler failed")
            reply = Error(nonce=msg.nonce, reason=f"internal error: {type(e).__name__}")
        return _seal(self.secret, _REPLY_TAG, reply)

    def _refuse(self, nonce: bytes, reason: str) -> list[bytes]:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_warning > 10:  # a flood of junk must not flood the log
            self._last_warning = now
            logger.warning("cp_kv side channel %s: refused a message (%r); %d refused so far",
                           self.address, reason, self.refused)
        return _seal(self.secret, _REPLY_TAG, Error(nonce=nonce, reason=reason))


# ---- client (decode rank) ---------------------------------------------------------
class SideChannelClient:
    """One decode conversation with one prefill rank: a DEALER, every
    receive under ``timeout_s``. Used by one thread; close it after use."""

    def __init__(self, host: str, port: int, secret: bytes | None, timeout_s: float):
        self.address = endpoint(host, port)
        self.secret, self.timeout_s = secret, timeout_s
        self.claimed = False  # set by the caller once a Fetch was answered
        self._sock = _socket(zmq.DEALER, host)
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
        decoder = _REPLY_DECODERS[reply_type]
        try:
            self._sock.send_multipart(_seal(self.secret, _REQUEST_TAG, msg))
        except zmq.Again:
            raise SideChannelError(f"could not send to {self.address} in "
                                   f"{self.timeout_s:g} s") from None
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                raise SideChannelError(f"no answer from {self.address} in {timeout_s:g} s")
            parts = self._sock.recv_multipart(zmq.NOBLOCK)
            if len(parts) != 2:
                raise SideChannelError(f"malformed reply from {self.address}: "
                                       f"{len(parts)} frames")
            body, mac = parts
            if not _authentic(self.secret, _REPLY_TAG, body, mac):
                raise SideChannelError(f"reply from {self.address} failed authentication "
                                       "(shared secret missing or different there)")
            try:
                reply = decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
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
