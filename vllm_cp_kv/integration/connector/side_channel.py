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

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Annotated, Callable, Literal, Union

import msgspec
import zmq
import zmq.utils.z85
from msgspec import Meta, Struct

logger = logging.getLogger("vllm." + __name__)  # under vLLM's log config when loaded

MAX_FRAME_BYTES = 4 << 20  # a manifest of 100k blocks is about 1 MiB
MAX_REQUEST_BYTES = 64 << 10  # a request (Fetch, Done, Release) is < 1 KiB
REPLAY_WINDOW = 1 << 16  # request nonces a prefill rank remembers
LOG_EVERY_S = 10.0  # at most one log line per this long for what peers cause
MAX_DRAIN = 64  # messages a server answers before it runs its periodic task again
MAX_ID_CHARS = 256  # vLLM request ids are ~50 characters
MAX_BLOCKS = 1 << 20  # manifest entries, block ids
MAX_CACHES = 1 << 14  # registered caches (layers x caches per layer)
MAX_READERS = 1024  # decode ranks of one request
MAX_WIRE_LEASE_S = 3600.0  # what a message may carry; the prefill caps claims lower
SECRET_ENV = "VLLM_CP_KV_SIDE_CHANNEL_SECRET"
MIN_SECRET_BYTES = 16
_REQUEST_TAG = b"vllm_cp_kv side channel v2 request\0"
_REPLY_TAG = b"vllm_cp_kv side channel v2 reply\0"
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError)

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


def redacted_repr(struct, secret: str) -> str:
    """``Type(field=value, ...)`` with the ``secret`` field's value hidden:
    a transfer token is the key to its request's KV (docs/disaggregated.md,
    Security), so no repr a log line may print shows it."""
    parts = (f"{f}={'<redacted>' if f == secret else repr(getattr(struct, f))}"
             for f in struct.__struct_fields__)
    return f"{type(struct).__name__}({', '.join(parts)})"


class Fetch(Struct, tag=True, forbid_unknown_fields=True):
    """Decode -> prefill: this request's handshake and manifest. Claims the
    blocks for ``lease_s`` (capped by the prefill) for reader ``reader``."""

    nonce: Nonce
    request_id: RequestId
    token: Token
    reader: ReaderId
    lease_s: Annotated[float, Meta(gt=0, le=MAX_WIRE_LEASE_S)]

    def __repr__(self) -> str:
        return redacted_repr(self, "token")


class Done(Struct, tag=True, forbid_unknown_fields=True):
    """Decode -> prefill: ``reader`` has read (or given up on) the blocks;
    the prefill frees them once ``readers`` distinct readers are done."""

    nonce: Nonce
    request_id: RequestId
    token: Token
    reader: ReaderId
    readers: Annotated[int, Meta(ge=1, le=MAX_READERS)]

    def __repr__(self) -> str:
        return redacted_repr(self, "token")


class Release(Struct, tag=True, forbid_unknown_fields=True):
    """Decode -> prefill: ``reader`` gave up (the request failed) and reads
    nothing more; its claim ends now. Frees nothing (the blocks expire)."""

    nonce: Nonce
    request_id: RequestId
    token: Token
    reader: ReaderId

    def __repr__(self) -> str:
        return redacted_repr(self, "token")


class TransportMeta(Struct, forbid_unknown_fields=True):
    """What a reader needs to reach the prefill rank's memory (NIXL: agent
    name and metadata; Mooncake: its RPC session ``host:port``)."""

    agent_name: Annotated[str, Meta(max_length=128)] = ""
    agent_metadata: Annotated[bytes, Meta(max_length=1 << 20)] = b""
    session: Annotated[str, Meta(max_length=300)] = ""
    # NIXL: where the registered caches live (host memory, or a GPU's index)
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    device_id: Annotated[int, Meta(ge=0, lt=1 << 16)] = 0


class ShardLayout(Struct, frozen=True, forbid_unknown_fields=True):
    """The worker's shard geometry, whole (``integration/geometry.py``
    ``ShardGeometry``: rank, size, block size, ownership rule, axis)."""

    rank: Annotated[int, Meta(ge=0, lt=MAX_READERS)]
    size: Annotated[int, Meta(ge=1, le=MAX_READERS)]
    block_size: Annotated[int, Meta(ge=1, le=1 << 16)]
    rule: ShortStr
    axis: ShortStr = "tp"

    @classmethod
    def of(cls, geometry) -> "ShardLayout":
        return cls(rank=geometry.rank, size=geometry.size, block_size=geometry.block_size,
                   rule=geometry.rule, axis=geometry.axis)


class Handshake(Struct, forbid_unknown_fields=True):
    """A prefill rank's cache layout (one entry per registered cache)."""

    engine_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)]
    shard: ShardLayout
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 31)]
    block_bytes: Annotated[list[Annotated[int, Meta(ge=1, lt=1 << 32)]],
                           Meta(max_length=MAX_CACHES)]
    dtype: Annotated[list[ShortStr], Meta(max_length=MAX_CACHES)]
    layer_addrs: Annotated[list[U64], Meta(max_length=MAX_CACHES)]
    transport: ShortStr
    transport_meta: TransportMeta
    # vLLM's --kv-cache-dtype (normalized: ``cache_format``): two FP8 formats
    # are the same torch dtype (uint8) and page size, but not the same bytes
    cache_format: ShortStr = "auto"


def cache_format(kv_cache_dtype) -> str:
    """vLLM's ``--kv-cache-dtype`` as the format of the cache's bytes: an
    FP8 format by name (``fp8`` is ``fp8_e4m3``, vLLM's meaning on CUDA),
    else ``auto``: a 16-bit cache's format is its torch dtype, which the
    handshake's ``dtype`` carries (``auto`` on a bf16 model and ``bfloat16``
    hold the same bytes). vLLM's per-layer FP8 scales are not compared: both
    sides must load them alike (the same checkpoint; no ``calculate_kv_scales``
    on one side only)."""
    name = str(kv_cache_dtype or "auto")
    if not name.startswith("fp8"):
        return "auto"
    return "fp8_e4m3" if name == "fp8" else name


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


def _mac(secret: bytes | None, tag: bytes, port: int, body: bytes) -> bytes:
    return hmac.new(secret, tag + port.to_bytes(2, "big") + body,
                    hashlib.sha256).digest() if secret else b""


def seal(secret: bytes | None, port: int, msg, request: bool = True) -> list[bytes]:
    """The two frames of ``msg`` (a request, or a reply) to or from the
    prefill rank serving on ``port``."""
    body = _ENCODER.encode(msg)
    return [body, _mac(secret, _REQUEST_TAG if request else _REPLY_TAG, port, body)]


def _authentic(secret: bytes | None, tag: bytes, port: int, body: bytes, mac: bytes) -> bool:
    return not secret or hmac.compare_digest(_mac(secret, tag, port, body), mac)


def curve_keys(secret: bytes) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
    """``((server public, server secret), (client public, client secret))``,
    Z85-encoded CURVE key pairs derived from the shared secret: every holder
    of the secret can derive them, nobody else can (a public key is only
    public among the holders)."""
    def pair(label: bytes) -> tuple[bytes, bytes]:
        secret_key = zmq.utils.z85.encode(hmac.new(secret, label, hashlib.sha256).digest())
        return zmq.curve_public(secret_key), secret_key

    return pair(b"vllm_cp_kv curve server"), pair(b"vllm_cp_kv curve client")


def _use_curve(sock: zmq.Socket, secret: bytes, server: bool) -> None:
    """CURVE on ``sock`` with the keys derived from ``secret``: a server
    admits (ZAP) only the derived client key; a client expects the derived
    server key."""
    (server_public, server_secret), (client_public, client_secret) = curve_keys(secret)
    if server:
        _admit(client_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, b"vllm_cp_kv")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, server_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, client_secret)


class _ZapHandler:
    """ZMQ's authentication hook for this process's context (RFC 27): admits
    a CURVE client only with a key derived from a secret some server of this
    process was given. One thread, for the process's lifetime."""

    ENDPOINT = "inproc://zeromq.zap.01"

    def __init__(self, ctx: zmq.Context):
        self.allowed: set[bytes] = set()  # raw 32-byte client public keys
        self._sock = ctx.socket(zmq.REP)
        self._sock.bind(self.ENDPOINT)
        threading.Thread(target=self._loop, daemon=True, name="cp_kv-zap").start()

    REFUSED = [b"1.0", b"", b"400", b"malformed ZAP request", b"", b""]

    def _loop(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart()
            except zmq.ContextTerminated:  # the context is closing
                return
            except zmq.ZMQError as e:  # a REP socket out of step: answer to get back
                logger.warning("cp_kv side channel: ZAP receive failed: %r", e)
                frames = None
            try:  # every receive is answered, so the REP socket stays in step
                out = self.REFUSED if frames is None else self.reply(frames)
            except Exception as e:  # one bad frame must not stop the handler
                logger.warning("cp_kv side channel: ZAP request refused: %r", e)
                out = self.REFUSED
            try:
                self._sock.send_multipart(out)
            except zmq.ContextTerminated:
                return
            except zmq.ZMQError as e:
                logger.warning("cp_kv side channel: ZAP request not answered: %r", e)
                time.sleep(0.01)  # no busy loop if the socket stays unusable

    def reply(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request (RFC 27): 200 for a CURVE client with
        an admitted key, else 400; a malformed request (too few frames) is
        answered 400 with whatever it carried, so the REP socket stays in
        step for the next one."""
        version = frames[0] if frames else b"1.0"
        request_id = frames[1] if len(frames) > 1 else b""
        ok = (len(frames) > 6 and frames[5] == b"CURVE" and frames[6] in self.allowed)
        return [version, request_id, b"200" if ok else b"400",
                b"OK" if ok else b"unknown client key", b"", b""]


_zap: _ZapHandler | None = None


def _admit(client_public_z85: bytes) -> None:
    global _zap
    with _context_lock:
        if _zap is None:
            _zap = _ZapHandler(_context_locked())
        _zap.allowed.add(zmq.utils.z85.decode(client_public_z85))


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


_context: zmq.Context | None = None
_context_lock = threading.Lock()


def context() -> zmq.Context:
    """This process's ZMQ context (thread-safe; sockets are per thread)."""
    with _context_lock:
        return _context_locked()


def _context_locked() -> zmq.Context:
    global _context
    if _context is None:
        _context = zmq.Context(io_threads=1)
    return _context


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
            _use_curve(self._sock, secret, server=True)
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
        if not _authentic(self.secret, _REQUEST_TAG, self.port, body, mac):
            return self._refuse(b"", "side-channel authentication failed (shared secret "
                                     "missing or different, or a message for another rank)")
        try:
            msg = _REQUEST_DECODER.decode(body)
        except _DECODE_ERRORS as e:
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
            _use_curve(self._sock, secret, server=False)
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
            self._sock.send_multipart(seal(self.secret, self.port, msg))
        except zmq.Again:
            raise SideChannelError(f"could not send to {self.address} in "
                                   f"{self.timeout_s:g} s") from None
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                raise SideChannelError(
                    f"no answer from {self.address} in {timeout_s:g} s" + (
                        " (with a shared secret, a peer without it or with another "
                        "cannot complete the CURVE handshake)" if self.secret else ""))
            parts = self._sock.recv_multipart(zmq.NOBLOCK)
            if len(parts) != 2:
                raise SideChannelError(f"malformed reply from {self.address}: "
                                       f"{len(parts)} frames")
            body, mac = parts
            if not _authentic(self.secret, _REPLY_TAG, self.port, body, mac):
                raise SideChannelError(f"reply from {self.address} failed authentication "
                                       "(shared secret missing or different there)")
            try:
                reply = decoder.decode(body)
            except _DECODE_ERRORS as e:
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
