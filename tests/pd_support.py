"""Helpers for the disaggregated-prefill tests: hostile payloads, fake peers,
stand-in transports, and the CI rule for missing dependencies."""

import pickle
import socket
import threading

import pytest


def skip_or_fail(reason: str) -> None:
    """Skip locally; under CI (``CI=true``) a missing dependency is a failure."""
    from conftest import IN_CI

    if IN_CI:
        pytest.fail(f"{reason} (CI: required)")
    pytest.skip(reason, allow_module_level=True)


class Marker:
    """Unpickling this creates ``path``: proof that a peer ran our code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickled(path: str) -> bytes:
    return pickle.dumps(Marker(path))


def mp_connection_frame(payload: bytes) -> bytes:
    """A message as ``multiprocessing.connection`` frames it (length prefix)."""
    return len(payload).to_bytes(4, "big", signed=True) + payload


class FakeRouter:
    """A hostile prefill rank: a ZMQ ROUTER answering every message with
    ``reply_frames`` (e.g. a pickle)."""

    def __init__(self, port: int, reply_frames: list[bytes], host: str = "127.0.0.1"):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host}:{port}")
        self.reply, self.received = reply_frames, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            if self._sock.poll(50):
                frames = self._sock.recv_multipart()
                self.received += 1
                self._sock.send_multipart([frames[0], *self.reply])

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


class FakePrefill:
    """A fake prefill rank that speaks the protocol: decodes each request
    and answers ``answer(msg)`` (a reply Struct, echoing ``msg.nonce``) after
    ``delay_s``, without a secret. One thread, one ROUTER."""

    def __init__(self, port: int, answer, delay_s: float = 0.0, host: str = "127.0.0.1"):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host}:{port}")
        self.port, self.answer, self.delay_s, self.received = port, answer, delay_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        import msgspec

        from vllm_cp_kv.integration.connector.auth import seal
        from vllm_cp_kv.integration.connector.schema import Request

        decoder = msgspec.msgpack.Decoder(Request)
        while not self._stop.is_set():
            if self._sock.poll(50):
                frames = self._sock.recv_multipart()
                self.received += 1
                msg = decoder.decode(frames[1])
                if self._stop.wait(self.delay_s):
                    return
                self._sock.send_multipart([frames[0], *seal(None, self.port,
                                                            self.answer(msg), request=False)])

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


class FakeTcpPeer:
    """A hostile peer speaking plain TCP: writes ``payload`` to every
    connection (e.g. a ``multiprocessing.connection``-framed pickle)."""

    def __init__(self, port: int, payload: bytes):
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", port))
        self._srv.listen(16)
        self._srv.settimeout(0.1)
        self.payload, self.accepted, self._conns = payload, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except OSError:
                continue
            self.accepted += 1
            self._conns.append(conn)
            try:
                conn.sendall(self.payload)
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self._thread.join(5)
        for c in self._conns:
            c.close()
        self._srv.close()


class FakeTransport:
    """Records reads instead of moving bytes; counts progress calls."""

    name = "nixl"

    def __init__(self):
        self.reads, self.progressed = [], 0

    def register(self, tensors):
        return {"agent_name": "fake", "agent_metadata": b"meta"}

    def read(self, peer_meta, reads, timeout_s, start_by=None):
        self.reads.append((peer_meta, reads, start_by))

    def read_bound_s(self, timeout_s):
        return timeout_s

    def progress(self):
        self.progressed += 1


def handshake(rank=0, shard_size=2, block_size=16, num_blocks=64, caches=2, transport="nixl",
              cache_format="auto"):
    from vllm_cp_kv.integration.connector.schema import Handshake, ShardLayout, TransportMeta

    return Handshake(engine_id="engine", num_blocks=num_blocks,
                     shard=ShardLayout(rank=rank, size=shard_size, block_size=block_size,
                                       rule="cyclic"),
                     block_bytes=[1152 * block_size] * caches, dtype=["torch.bfloat16"] * caches,
                     layer_addrs=[(1 << 20) * (k + 1) for k in range(caches)],
                     transport=transport, cache_format=cache_format,
                     transport_meta=TransportMeta(agent_name=f"agent-{rank}",
                                                  agent_metadata=b"meta"))


def claimed(producer, req_id: str, now: float | None = None) -> bool:
    """Whether a reader holds a lease on ``req_id`` at prefill rank
    ``producer`` (a ``Producer``), read from its state."""
    import time

    now = time.monotonic() if now is None else now
    with producer._lock:
        entry = producer._served.get(req_id)
        return entry is not None and any(t > now for t in entry.leases.values())


def server_alive(server) -> bool:
    """Whether a ``SideChannelServer``'s thread still serves."""
    return server._thread.is_alive()


def serve_ranks(requests: dict, table, num_tokens: int, secret=None, expiry_s: float = 60.0,
                cache_format: str = "auto"):
    """Two prefill ranks (``Producer``, shard size 2, block 16, a FakeTransport)
    on consecutive free ports, serving each ``requests`` id with its token on
    ``table``. Returns a namespace with ``port`` (rank 0's) and ``ranks``."""
    from types import SimpleNamespace

    from builders import free_port
    from vllm_cp_kv.integration.connector.producer import Producer

    port = free_port(consecutive=2)
    ranks = []
    for r in range(2):
        p = Producer(handshake(rank=r, cache_format=cache_format), expiry_s,
                     transport=FakeTransport())
        p.serve("127.0.0.1", port + r, secret)
        for req, token in requests.items():
            p.add(req, table, num_tokens, token)
        ranks.append(p)
    return SimpleNamespace(port=port, ranks=ranks)
