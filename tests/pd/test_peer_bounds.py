"""What a stranger can make the P/D servers do or hold (docs/disaggregated.md,
Security), on loopback, no vLLM engine: each test is an attack that worked
on the code before these bounds.

* a fake prefill's NIXL metadata (the real prefill's, cut short, under a new
  agent name) broke every later read from the real prefill until restart:
  now it is refused and the real prefill's reads go on (real NIXL agents);
* a multipart message that never completes: ZMQ held every part (10 x 4 MiB
  held +49 MiB); now a prefill rank takes frames of 64 KiB at most, and with
  a secret no frame of a peer without it is delivered (CURVE);
* a deeply nested message raised RecursionError, past the caught errors, and
  every one logged a traceback: now it is a refusal and one rate-limited line;
* under a secret a captured Fetch replayed (to the same rank or another
  rank's port) was answered: now refused;
* a slow fake peer naming many ranks held a request for ranks x timeout: now
  one deadline for the whole exchange, and at most ``max_shard_size`` ranks;
* a decode on a non-loopback host with neither allow-list nor secret started
  (any client could point it anywhere): now it refuses to start.
"""

import gc
import logging
import secrets
import subprocess
import sys
import time

import pytest

from builders import free_port
from conftest import CPU_ENV, needs_vllm
from pd_support import (FakePrefill, FakeTransport, handshake, serve_ranks, server_alive,
                        skip_or_fail)

try:
    import msgspec
    import zmq
except ImportError:  # vLLM's dependencies
    skip_or_fail("pyzmq and msgspec (vLLM dependencies) are not installed")

from vllm_cp_kv.integration.connector import auth  # noqa: E402
from vllm_cp_kv.integration.connector import side_channel as sc  # noqa: E402
from vllm_cp_kv.integration.connector.config import (  # noqa: E402
    ConnectorConfig, check_decode_exposure)
from vllm_cp_kv.integration.connector.consumer import (  # noqa: E402
    NOTICE_TIMEOUT_S, Consumer)
from vllm_cp_kv.integration.connector.params import ParamsError, parse_params  # noqa: E402

SECRET = b"0123456789abcdef-bounds-secret"
TOKEN = secrets.token_urlsafe(32)
TABLE, NUM_TOKENS = [3, 4, 5], 40


def serve(secret=None):
    """Two prefill ranks serving request "req-A" (40 tokens, blocks 3, 4, 5)."""
    s = serve_ranks({"req-A": TOKEN}, TABLE, NUM_TOKENS, secret)
    return s.port, s.ranks


def fetch_msg(req="req-A", token=TOKEN):
    return sc.Fetch(nonce=sc.new_nonce(), request_id=req, token=token, reader="r1", lease_s=10)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


# ---- NIXL: a fake peer's metadata ---------------------------------------------------------
def test_a_fake_peers_cut_metadata_leaves_the_real_prefill_readable():
    """Real NIXL agents in this process (UCX loopback): the reader first gets
    the real prefill's agent metadata cut short under new names (cuts that
    made NIXL keep the real agent's connection without its metadata), then
    the real metadata under the known name: the reads must work, and the
    bytes must be the prefill's."""
    import threading

    try:
        from vllm_cp_kv.integration.connector.transfer import NixlTransport, TransferError
        reader, prefill = NixlTransport("127.0.0.1"), NixlTransport("127.0.0.1")
    except ImportError:
        skip_or_fail("NIXL is not installed")
    import torch

    src, dst = torch.arange(4096, dtype=torch.float32), torch.zeros(4096)
    real = prefill.register([src])
    reader.register([dst])
    stop = threading.Event()

    def serve_reads():  # the prefill side's progress (no progress thread)
        while not stop.is_set():
            prefill.progress()
            time.sleep(0.0005)

    threading.Thread(target=serve_reads, daemon=True).start()
    reads = [(src.data_ptr() + 64, dst.data_ptr(), 1024)]
    blob = real["agent_metadata"]
    try:
        for k, cut in enumerate([len(blob) - 1, len(blob) - 8, len(blob) // 2, 40]):
            fake = dict(real, agent_name=f"fake-{k}", agent_metadata=blob[:cut])
            with pytest.raises(TransferError, match="refused"):
                reader.read(fake, reads, 3)
            dst.zero_()
            reader.read(real, reads, 3)  # NIXL_ERR_NOT_FOUND here before
            assert torch.equal(dst[:256], src[16:272])
        # the whole real metadata under another name, other metadata under
        # the real name: refused, and the real prefill still reads
        with pytest.raises(TransferError, match="not 'fake-whole'"):
            reader.read(dict(real, agent_name="fake-whole"), reads, 3)
        other = NixlTransport("127.0.0.1").register([torch.zeros(16)])
        with pytest.raises(TransferError, match="other NIXL metadata"):
            reader.read(dict(real, agent_metadata=other["agent_metadata"]), reads, 3)
        dst.zero_()
        reader.read(real, reads, 3)
        assert torch.equal(dst[:256], src[16:272])
    finally:
        stop.set()


# ---- what a peer can make a prefill rank hold --------------------------------------------
# A peer speaking ZMTP over a raw socket (a ZMQ socket would not send the
# parts of an unfinished message at all): the NULL greeting, READY as a
# DEALER, then parts flagged MORE, never the last one.
ATTACKER = r"""
import socket, struct, sys, time
port, frames, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection(("127.0.0.1", port))
s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00")
          + b"\x00" * 32)
def prop(name, value):
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
ready = b"\x05READY" + prop(b"Socket-Type", b"DEALER") + prop(b"Identity", b"")
s.sendall(bytes([0x04, len(ready)]) + ready)
part = bytes([0x03]) + struct.pack(">Q", size) + b"x" * size  # MORE | LONG
try:
    for _ in range(frames):
        s.sendall(part)
except OSError:  # the rank dropped us
    pass
print("sent", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("secret,frames,size", [
    (None, 10, 4 << 20), (SECRET, 10, 4 << 20), (SECRET, 4000, 60000)],
    ids=["no-secret-4MiB-parts", "secret-4MiB-parts", "secret-many-60KB-parts"])
def test_an_unfinished_multipart_message_holds_little_memory(secret, frames, size):
    """10 parts of 4 MiB of a message that never ends: before, the rank held
    +40 MiB, secret or not (the MAC is checked on whole messages). Now a
    prefill rank drops a peer whose frame exceeds 64 KiB, and with a secret
    a peer without it cannot deliver a frame at all (CURVE), so 4,000 parts
    of 60 KB are not held either. Without a secret such small parts can be
    held (seen: up to +228 MiB for 240 MB sent; libzmq bounds only the frame
    size): the residual risk docs/disaggregated.md states. Bound: 16 MiB of
    this process's resident memory (the attacker is another process)."""
    port, ranks = serve(secret)
    try:
        gc.collect()
        before = rss_bytes()
        attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(port), str(frames),
                                     str(size)], stdout=subprocess.PIPE, text=True)
        try:
            assert attacker.stdout.readline().strip() == "sent"
            time.sleep(3)  # ZMQ's I/O thread has read what it would hold
            grown = rss_bytes() - before
            assert grown < 16 << 20, f"the rank holds {grown / 2**20:.1f} MiB more"
            assert ranks[0].server.answered == 0  # and nothing reached the handler
        finally:
            attacker.kill()
            attacker.wait()
        # the rank still serves a correct request
        with sc.SideChannelClient("127.0.0.1", port, secret, 5.0) as c:
            assert c.ask(fetch_msg(), sc.FetchReply).manifest == [(0, 3), (2, 4)]
    finally:
        for p in ranks:
            p.close()


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_deeply_nested_message_is_a_refusal_and_one_log_line():
    """100 messages nested 5,000 levels deep: before, 100 tracebacks in 0.02 s;
    now each gets an Error reply and the log has one line, no traceback."""
    port, ranks = serve()
    log = sc.logger
    handler = Records()
    log.addHandler(handler)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        # a map whose first key is unknown: finding the union's tag means
        # skipping its value, a list in a list ... in a list, 5,000 deep
        deep = b"\x81\xa5extra" + b"\x91" * 5000 + b"\xc0"
        for _ in range(100):
            sock.send_multipart([deep, b""])
        reasons = []
        for _ in range(100):
            assert sock.poll(5000)
            reasons.append(msgspec.msgpack.decode(sock.recv_multipart()[0], type=sc.Error).reason)
        assert all("RecursionError" in r for r in reasons), reasons[:2]
        mine = [r for r in handler.records if r.name == sc.logger.name]
        assert len(mine) <= 1 and not any(r.exc_info for r in mine), \
            [r.getMessage() for r in mine]
        assert ranks[0].server.refused == 100 and server_alive(ranks[0].server)
    finally:
        log.removeHandler(handler)
        sock.close()
        for p in ranks:
            p.close()


def test_a_replayed_or_redirected_request_is_refused_under_the_secret():
    """A captured Fetch, sent again to its rank and to the other rank's port:
    before, both got the manifest (and re-took the claim)."""
    port, ranks = serve(SECRET)
    try:
        frames = sc.seal(SECRET, port, fetch_msg())  # what a capture would hold
        with sc.SideChannelClient("127.0.0.1", port, SECRET, 5.0) as c:
            assert raw(c, frames).manifest == [(0, 3), (2, 4)]
            assert "replayed" in raw(c, frames).reason
        with sc.SideChannelClient("127.0.0.1", port + 1, SECRET, 5.0) as c:
            assert "authentication failed" in raw(c, frames).reason
        with sc.SideChannelClient("127.0.0.1", port + 1, SECRET, 5.0) as c:
            assert c.ask(fetch_msg(), sc.FetchReply).manifest == [(1, 3)]  # a fresh one works
    finally:
        for p in ranks:
            p.close()


def raw(client, frames):
    """Send already sealed frames on the client's (CURVE) socket; the reply."""
    client._sock.send_multipart(frames)
    assert client._sock.poll(5000)
    return msgspec.msgpack.decode(client._sock.recv_multipart()[0],
                                  type=sc.FetchReply | sc.Error)


# ---- what a peer can make a decode request wait for --------------------------------------
def test_a_slow_fake_peer_with_many_ranks_holds_a_request_one_deadline():
    """16 fake ranks, each answering a valid handshake after 1 s, and a 3 s
    timeout: before, 16 s (each rank its own timeout); now the request fails
    within the one deadline, plus the one bound on its best-effort Release
    notices to the ranks that answered (the fakes answer those after 1 s
    too, each). And more ranks than ``max_shard_size`` are refused before
    any connection."""
    ranks = 16
    port = free_port(consecutive=ranks)

    def answer_for(r):
        def answer(msg):
            return sc.FetchReply(nonce=msg.nonce, handshake=handshake(rank=r, shard_size=ranks),
                                 manifest=[(0, 3)] if r == 0 else [], lease_s=30)
        return answer

    fakes = [FakePrefill(port + r, answer_for(r), delay_s=1.0) for r in range(ranks)]
    consumer = Consumer(handshake(rank=0, shard_size=1), FakeTransport(), timeout_s=3,
                        secret=None, tp_size=1)
    cfg = ConnectorConfig()
    params = parse_params({"do_remote_prefill": True, "remote_request_id": "req-A",
                           "remote_host": "127.0.0.1", "remote_port": port,
                           "remote_num_tokens": 16, "shard_size": ranks, "block_size": 16,
                           "transfer_token": TOKEN, "transport": "nixl"}, cfg)
    try:
        t0 = time.monotonic()
        with pytest.raises(sc.SideChannelError, match="did not finish|no answer"):
            consumer.receive("decode-req", [10], params)
        assert time.monotonic() - t0 < 3 + min(3, NOTICE_TIMEOUT_S) + 0.5
        assert sum(f.received for f in fakes) < ranks  # not every rank was asked
    finally:
        for f in fakes:
            f.close()
    too_many = dict(msgspec.structs.asdict(params), shard_size=cfg.max_shard_size + 1)
    with pytest.raises(ParamsError, match="max_shard_size"):
        parse_params(too_many, cfg)


def test_a_decode_beyond_loopback_without_allow_list_refuses_to_start(monkeypatch):
    """The decode's host: side_channel_host or VLLM_HOST_IP where set, else
    the machine's address as vLLM takes it (``get_ip()``, passed here). A
    shared secret alone does not let it start: clients would still choose
    the hosts and ports it connects to."""
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)

    def cfg(**extra):
        return ConnectorConfig.from_extra(extra, is_producer=False)

    for exposed, machine in ((cfg(side_channel_host="10.1.2.3"), None),
                             (cfg(), "10.1.2.3")):  # nothing set: vLLM's get_ip()
        with pytest.raises(ValueError, match="allow_any_prefill"):
            check_decode_exposure(exposed, machine)
    for ok, machine in ((cfg(side_channel_host="10.1.2.3", allowed_prefill_hosts=["10.1.2.4"]),
                         None),
                        (cfg(side_channel_host="10.1.2.3", allow_any_prefill=True), None),
                        (cfg(side_channel_host="127.0.0.1"), "10.1.2.3"),
                        (cfg(side_channel_host="localhost"), None),
                        (cfg(side_channel_host="::1"), None), (cfg(), "127.0.0.1")):
        check_decode_exposure(ok, machine)
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")  # a loopback-only setup, as the tests'
    check_decode_exposure(cfg(), "10.1.2.3")
    monkeypatch.delenv("VLLM_HOST_IP")
    monkeypatch.setenv(auth.SECRET_ENV, "a-deployment-secret-of-32-bytes!")
    with pytest.raises(ValueError, match="a shared secret authenticates"):
        check_decode_exposure(cfg(side_channel_host="10.1.2.3"), None)
    check_decode_exposure(cfg(side_channel_host="10.1.2.3",
                              allowed_prefill_hosts=["10.1.2.4:5700"]), None)
    with pytest.raises(ValueError, match="allow_any_prefill must be true or false"):
        cfg(allow_any_prefill="yes")


DECODE = r"""
import sys
from vllm_cp_kv.tools.offline import build_llm
build_llm(sys.argv[1], max_model_len=512, kv_role="kv_consumer",
          kv_extra={"transport": "nixl", "side_channel_host": "10.1.2.3"})
print("STARTED", flush=True)
"""


@needs_vllm
def test_a_real_decode_server_beyond_loopback_refuses_to_start(tiny_dsv2):
    """The same through vLLM's own engine start: the decode names a
    non-loopback side_channel_host, sets neither allow-list nor secret."""
    import os

    env = {k: v for k, v in os.environ.items() if k != auth.SECRET_ENV}
    env.update(CPU_ENV, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-c", DECODE, tiny_dsv2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    assert "not loopback" in proc.stderr and "allow_any_prefill" in proc.stderr, \
        proc.stderr[-2000:]
