"""The side channel's security (docs/disaggregated.md, Security): the
deployment's shared secret, the HMAC of every message under a direction tag
and the prefill rank's port, CURVE keys derived from the secret, and the
ZAP handler that admits only the derived client key, on this process's ZMQ
context (one per process: ZMQ allows one ZAP handler a context)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time

import zmq
import zmq.utils.z85

from .schema import ENCODER

logger = logging.getLogger("vllm." + __name__)  # under vLLM's log config when loaded

SECRET_ENV = "VLLM_CP_KV_SIDE_CHANNEL_SECRET"
MIN_SECRET_BYTES = 16
REQUEST_TAG = b"vllm_cp_kv side channel v2 request\0"
REPLY_TAG = b"vllm_cp_kv side channel v2 reply\0"


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


def message_mac(secret: bytes | None, tag: bytes, port: int, body: bytes) -> bytes:
    return hmac.new(secret, tag + port.to_bytes(2, "big") + body,
                    hashlib.sha256).digest() if secret else b""


def seal(secret: bytes | None, port: int, msg, request: bool = True) -> list[bytes]:
    """The two frames of ``msg`` (a request, or a reply) to or from the
    prefill rank serving on ``port``."""
    body = ENCODER.encode(msg)
    return [body, message_mac(secret, REQUEST_TAG if request else REPLY_TAG, port, body)]


def authentic(secret: bytes | None, tag: bytes, port: int, body: bytes, mac: bytes) -> bool:
    return not secret or hmac.compare_digest(message_mac(secret, tag, port, body), mac)


def curve_keys(secret: bytes) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
    """``((server public, server secret), (client public, client secret))``,
    Z85-encoded CURVE key pairs derived from the shared secret: every holder
    of the secret can derive them, nobody else can (a public key is only
    public among the holders)."""
    def pair(label: bytes) -> tuple[bytes, bytes]:
        secret_key = zmq.utils.z85.encode(hmac.new(secret, label, hashlib.sha256).digest())
        return zmq.curve_public(secret_key), secret_key

    return pair(b"vllm_cp_kv curve server"), pair(b"vllm_cp_kv curve client")


def use_curve(sock: zmq.Socket, secret: bytes, server: bool) -> None:
    """CURVE on ``sock`` with the keys derived from ``secret``: a server
    admits (ZAP) only the derived client key; a client expects the derived
    server key."""
    (server_public, server_secret), (client_public, client_secret) = curve_keys(secret)
    if server:
        admit(client_public)
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


def admit(client_public_z85: bytes) -> None:
    global _zap
    with _context_lock:
        if _zap is None:
            _zap = _ZapHandler(_context_locked())
        _zap.allowed.add(zmq.utils.z85.decode(client_public_z85))


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
