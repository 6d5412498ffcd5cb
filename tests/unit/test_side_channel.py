"""The disaggregated-prefill side channel under attack (loopback, no vLLM
engine): the prefill ranks' servers (``Producer.serve``) and the decode's
client (``SideChannelClient``, ``Consumer.receive``) driven directly.

* code execution: a pickle whose unpickling creates a marker file, sent raw
  over ZMQ and over plain TCP to a prefill rank, and served by a fake prefill
  peer to the decode: the marker is never created, the server answers a
  correct request afterwards, the decode fails the pull with a clean error;
* head-of-line blocking: idle and half-sent connections held open do not
  delay another request's fetch;
* per-request authorization: a fetch or done with another request's id, an
  unknown id or a wrong token is refused with one and the same answer, frees
  and releases nothing, and the owner's pull still completes;
* the optional shared secret (HMAC on requests and replies);
* a fuzz run of a few hundred random, truncated, oversized, deeply nested,
  many-framed and wrong-schema messages (fixed seed), after which a correct
  fetch is answered (tests/pd/test_peer_bounds.py: what peers can make the
  servers hold or wait for).

On the previous side channel (``multiprocessing.connection``, a fixed
authkey in the source) the pickle, fake-peer, idle-connection and
wrong-request cases all failed (see docs/disaggregated.md, Security).
"""

import random
import secrets
import socket
import threading
import time

import pytest

from builders import free_port
from pd_support import (FakeRouter, FakeTcpPeer, FakeTransport, claimed, handshake,
                        mp_connection_frame, pickled, serve_ranks, server_alive,
                        skip_or_fail)

try:
    import msgspec
    import zmq
except ImportError:  # vLLM's dependencies
    skip_or_fail("pyzmq and msgspec (vLLM dependencies) are not installed")

from vllm_cp_kv.integration.connector.consumer import Consumer  # noqa: E402
from vllm_cp_kv.integration.connector.params import parse_params  # noqa: E402
from vllm_cp_kv.integration.connector.schema import (  # noqa: E402
    Done, Error, Fetch, FetchReply, Ok, Release)
from vllm_cp_kv.integration.connector.side_channel import (  # noqa: E402
    MAX_FRAME_BYTES, MAX_REQUEST_BYTES, SideChannelClient, SideChannelError, new_nonce)

TOKENS = {"req-A": secrets.token_urlsafe(32), "req-B": secrets.token_urlsafe(32)}
TA, TB = TOKENS["req-A"], TOKENS["req-B"]
NUM_TOKENS, TABLE = 40, [3, 4, 5]  # 3 logical blocks of 16: rank 0 owns 0, 2; rank 1 owns 1
SECRET = b"0123456789abcdef-test-secret"
NO_TRANSFER = "no transfer for this request id and token"


def serve(secret=None, expiry_s=60.0):
    return serve_ranks(TOKENS, TABLE, NUM_TOKENS, secret, expiry_s)


@pytest.fixture
def prefill():
    s = serve()
    yield s
    for p in s.ranks:
        p.close()


def fetch(port, req="req-A", token=TA, secret=None, timeout=5.0, reader="reader-1",
          lease_s=300.0):
    with SideChannelClient("127.0.0.1", port, secret, timeout) as c:
        return c.ask(Fetch(nonce=new_nonce(), request_id=req, token=token, reader=reader,
                           lease_s=lease_s), FetchReply)


def done(port, req="req-A", token=TA, reader="reader-1", readers=1, secret=None):
    with SideChannelClient("127.0.0.1", port, secret, 5.0) as c:
        return c.ask(Done(nonce=new_nonce(), request_id=req, token=token, reader=reader,
                          readers=readers), Ok)


def release(port, req="req-A", token=TA, reader="reader-1"):
    with SideChannelClient("127.0.0.1", port, None, 5.0) as c:
        return c.ask(Release(nonce=new_nonce(), request_id=req, token=token, reader=reader), Ok)


def params_for(port, req="req-A", token=TA, **over):
    return parse_params({"do_remote_prefill": True, "remote_request_id": req,
                         "remote_host": "127.0.0.1", "remote_port": port,
                         "remote_num_tokens": NUM_TOKENS, "shard_size": 2, "block_size": 16,
                         "transfer_token": token, "transport": "nixl", **over})


def dealer(port):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def test_a_correct_fetch_gets_the_manifest_of_the_ranks_owned_blocks(prefill):
    reply = fetch(prefill.port)
    assert reply.manifest == [(0, 3), (2, 4)] and reply.handshake.shard.rank == 0
    assert fetch(prefill.port + 1).manifest == [(1, 3)]


def wait_for(pred, timeout=30):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


# ---- code execution ---------------------------------------------------------------
def test_a_pickled_payload_sent_to_the_prefill_runs_nothing(prefill, tmp_path):
    marker = tmp_path / "ran-on-prefill"
    payload = pickled(str(marker))
    sock = dealer(prefill.port)
    for frames in ([payload], [payload, b""], [payload, payload, payload]):
        sock.send_multipart(frames)
        assert sock.poll(5000), "the server stopped answering"
        body = sock.recv_multipart()[0]
        assert isinstance(msgspec.msgpack.decode(body, type=Error), Error)
    sock.close()
    req = zmq.Context.instance().socket(zmq.REQ)  # another framing: delimiter + payload
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"tcp://127.0.0.1:{prefill.port}")
    req.send(payload)
    for raw in (mp_connection_frame(payload), payload):  # plain TCP, no ZMTP at all
        with socket.create_connection(("127.0.0.1", prefill.port), timeout=5) as s:
            s.sendall(raw)
            time.sleep(0.2)
    time.sleep(0.5)
    req.close()
    assert not marker.exists()
    assert server_alive(prefill.ranks[0].server)
    assert fetch(prefill.port).manifest == [(0, 3), (2, 4)]  # still serving


@pytest.mark.parametrize("frames", [1, 2], ids=["one-frame", "two-frames"])
def test_a_fake_prefill_answering_with_a_pickle_runs_nothing_on_the_decode(tmp_path, frames):
    marker = tmp_path / "ran-on-decode"
    port = free_port(consecutive=2)
    fake = FakeRouter(port, [pickled(str(marker)), b""][:frames])
    transport = FakeTransport()
    consumer = Consumer(handshake(rank=0, shard_size=1), transport, timeout_s=5,
                        secret=None, tp_size=1)
    try:
        with pytest.raises(SideChannelError, match="malformed reply"):
            consumer.receive("decode-req", [10, 11, 12], params_for(port))
        assert fake.received == 1
    finally:
        fake.close()
    assert not marker.exists()
    assert transport.reads == []  # nothing moved


def test_a_fake_plain_tcp_peer_sending_a_pickle_runs_nothing_on_the_decode(tmp_path):
    marker = tmp_path / "ran-on-decode"
    port = free_port()
    fake = FakeTcpPeer(port, mp_connection_frame(pickled(str(marker))))
    try:  # the frame is never taken (no ZMTP handshake), or never answered
        with pytest.raises(SideChannelError, match="could not send|no answer"):
            fetch(port, timeout=1.0)
    finally:
        fake.close()
    assert not marker.exists()


# ---- head-of-line blocking --------------------------------------------------------
def test_idle_and_half_sent_connections_do_not_delay_another_request(prefill):
    port = prefill.port
    idle = socket.create_connection(("127.0.0.1", port))  # connects, says nothing
    greeting = socket.create_connection(("127.0.0.1", port))
    greeting.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03")  # half a ZMTP greeting
    framed = socket.create_connection(("127.0.0.1", port))
    framed.sendall(mp_connection_frame(b"x" * 1000)[:10])  # a frame announced, not sent
    deaf = dealer(port)  # sends requests, never reads the replies
    for _ in range(200):
        deaf.send_multipart([b"junk", b""])
    try:
        t0 = time.monotonic()
        assert fetch(port, timeout=10).manifest == [(0, 3), (2, 4)]
        assert time.monotonic() - t0 < 2.0  # generous: it takes milliseconds
    finally:
        for s in (idle, greeting, framed):
            s.close()
        deaf.close()


# ---- per-request authorization -----------------------------------------------------
def test_another_requests_id_or_a_wrong_token_is_refused_alike(prefill):
    wrong = secrets.token_urlsafe(32)
    reasons = set()
    for req, token in (("req-A", TB), ("req-B", TA), ("req-A", wrong), ("req-unknown", TA)):
        with pytest.raises(SideChannelError) as e:
            fetch(prefill.port, req, token)
        reasons.add(str(e.value))
    assert len(reasons) == 1 and NO_TRANSFER in reasons.pop()  # no oracle


def test_a_done_without_the_token_frees_and_releases_nothing(prefill):
    rank0 = prefill.ranks[0]
    fetch(prefill.port, reader="owner")  # the owner's claim
    for token in (TB, secrets.token_urlsafe(32)):
        with pytest.raises(SideChannelError, match=NO_TRANSFER):
            done(prefill.port, token=token, reader="owner")
        with pytest.raises(SideChannelError, match=NO_TRANSFER):
            release(prefill.port, token=token, reader="owner")
    assert rank0.take_finished() == set()
    assert claimed(rank0, "req-A")
    # even past its expiry (60 s) the claimed request is kept
    assert rank0.take_finished(now=time.monotonic() + 61) == {"req-B"}  # unclaimed: expired
    # the owner completes: done with the token frees it
    assert isinstance(done(prefill.port, reader="owner"), Ok)
    assert rank0.take_finished() == {"req-A"}
    with pytest.raises(SideChannelError, match=NO_TRANSFER):  # and it is gone
        fetch(prefill.port)
    assert fetch(prefill.port + 1, "req-B", TB).manifest  # rank 1 still serves req-B


def test_the_owner_pulls_its_request_through_the_consumer(prefill):
    transport = FakeTransport()
    consumer = Consumer(handshake(rank=0, shard_size=1), transport, timeout_s=5, secret=None,
                        tp_size=1)
    consumer.receive("decode-req", [10, 11, 12], params_for(prefill.port))
    # rank 0's blocks 0 and 2, then rank 1's block 1, into local slots 10, 12, 11
    (meta0, reads0, start0), (meta1, reads1, _) = transport.reads
    assert meta0["agent_name"] == "agent-0" and meta1["agent_name"] == "agent-1"
    page, base = 1152 * 16, 1 << 20  # cache 0 at the same address on both sides
    assert reads0[:2] == [(base + 3 * page, base + 10 * page, page),
                          (base + 4 * page, base + 12 * page, page)]
    assert start0 > time.monotonic()  # the read had to start before its claim ends
    assert all(p.take_finished() == {"req-A"} for p in prefill.ranks)  # done: freed


def test_a_fetch_before_the_prefill_workers_know_the_request_is_retried(prefill):
    """The prefill's workers learn of a finished request at its next engine
    step; a fast decode may ask before (seen with vLLM: 1 of 8 prompts)."""
    token = secrets.token_urlsafe(32)
    consumer = Consumer(handshake(rank=0, shard_size=1), FakeTransport(), timeout_s=30,
                        secret=None, tp_size=1)
    errors = []

    def pull():
        try:
            consumer.receive("decode-req", [10, 11, 12], params_for(prefill.port, "req-C", token))
        except Exception as e:
            errors.append(e)

    puller = threading.Thread(target=pull)
    puller.start()
    wait_for(lambda: prefill.ranks[0].server.answered >= 2)  # refused, asking again
    for p in prefill.ranks:
        p.add("req-C", TABLE, NUM_TOKENS, token)
    puller.join(timeout=30)
    assert not puller.is_alive() and not errors, errors
    assert all(p.take_finished() == {"req-C"} for p in prefill.ranks)


def test_the_pd_test_hooks_pause_between_ranks_and_drop_positions(prefill, monkeypatch):
    """The decode's P/D test hooks (scripts/gpu/onegpu/pd_hooks.py, outside
    the package; tests/pd/test_disaggregated.py's negative control and kill
    mid-transfer run them in a real decode): patched in here, a request
    naming their keys pauses between the ranks' reads and gets its blocks
    written in arrival order; a request without them pulls as before."""
    import pickle
    from types import SimpleNamespace

    from conftest import HARNESS
    from vllm_cp_kv.integration.connector import consumer as m
    from vllm_cp_kv.integration.connector import params as params_module

    monkeypatch.syspath_prepend(HARNESS)
    import pd_hooks

    for obj, name in ((m.Consumer, "receive"), (m, "check_complete"),
                      (m, "read_owned_blocks")):
        monkeypatch.setattr(obj, name, getattr(obj, name))  # restored afterwards
    lines = []
    monkeypatch.setattr(m, "logger", SimpleNamespace(info=lambda *a: lines.append(a[0] % a[1:])))
    pd_hooks.patch_consumer(m)
    scheduler = SimpleNamespace(check_params=params_module.check_params)
    pd_hooks.patch_scheduler(scheduler)  # the scheduler's parse of the raw dict
    raw = msgspec.structs.asdict(params_for(prefill.port))
    hooked, error = scheduler.check_params(
        dict(raw, cp_kv_test_pause_s=0.5, cp_kv_test_ignore_positions=True), NUM_TOKENS)
    assert error is None and isinstance(hooked, pd_hooks.HookedParams)
    assert pickle.loads(pickle.dumps(hooked)) == hooked  # to the worker processes
    assert scheduler.check_params(dict(raw, cp_kv_test_pause_s=10 ** 6), NUM_TOKENS)[0] is None
    plain = scheduler.check_params(dict(raw, remote_request_id="req-B", transfer_token=TB),
                                   NUM_TOKENS)[0]
    assert type(plain) is not pd_hooks.HookedParams
    page, base = 1152 * 16, 1 << 20
    transport = FakeTransport()
    consumer = Consumer(handshake(rank=0, shard_size=1), transport, timeout_s=5, secret=None,
                        tp_size=1)
    t0 = time.monotonic()
    consumer.receive("decode-hooked", [10, 11, 12], hooked)
    assert time.monotonic() - t0 >= 0.5
    assert [ln for ln in lines if "test hook" in ln] == [
        "cp_kv connector: test hook: request decode-hooked read rank 0's blocks; pausing "
        "0.5 s before rank 1's"]
    # without positions: rank 0's blocks 0 and 2 land in slots 10 and 11 (one
    # merged descriptor), rank 1's block 1 in slot 12
    assert transport.reads[0][1][0] == (base + 3 * page, base + 10 * page, 2 * page)
    assert transport.reads[1][1][0] == (base + 3 * page, base + 12 * page, page)
    transport.reads.clear()
    consumer.receive("decode-plain", [10, 11, 12], plain)
    assert sum("test hook" in ln for ln in lines) == 1  # no pause
    assert transport.reads[0][1][:2] == [(base + 3 * page, base + 10 * page, page),
                                         (base + 4 * page, base + 12 * page, page)]


def test_a_handshake_mismatch_moves_nothing(prefill):
    transport = FakeTransport()
    consumer = Consumer(handshake(rank=0, shard_size=1, block_size=32), transport, timeout_s=5,
                        secret=None, tp_size=1)
    with pytest.raises(Exception, match="handshake mismatch"):
        consumer.receive("decode-req", [10, 11, 12], params_for(prefill.port, block_size=32))
    assert transport.reads == []
    assert not claimed(prefill.ranks[0], "req-A")  # the failed pull released its claim
    assert prefill.ranks[0].take_finished() == set()  # but freed nothing


def test_another_fp8_format_is_a_handshake_mismatch():
    """Two FP8 caches (e4m3 and e5m2) are the same torch dtype (uint8) and
    page size: only the cache format tells them apart, and reading the
    other's bytes would decode garbage. ``fp8`` is vLLM's e4m3."""
    from vllm_cp_kv.integration.connector.schema import cache_format

    assert cache_format("fp8") == cache_format("fp8_e4m3") == "fp8_e4m3"
    assert cache_format(None) == cache_format("bfloat16") == "auto"
    assert cache_format("fp8_e5m2") == "fp8_e5m2"
    fp8 = serve_ranks(TOKENS, TABLE, NUM_TOKENS, None, 60.0, cache_format="fp8_e4m3")
    try:
        transport = FakeTransport()
        consumer = Consumer(handshake(rank=0, shard_size=1, cache_format="fp8_e5m2"),
                            transport, timeout_s=5, secret=None, tp_size=1)
        with pytest.raises(Exception, match="handshake mismatch.*cache_format"):
            consumer.receive("decode-req", [10, 11, 12], params_for(fp8.port))
        assert transport.reads == []
        assert not claimed(fp8.ranks[0], "req-A")
        # the same format passes the check (and reads)
        same = Consumer(handshake(rank=0, shard_size=1, cache_format="fp8_e4m3"),
                        transport, timeout_s=5, secret=None, tp_size=1)
        same.receive("decode-req", [10, 11, 12], params_for(fp8.port))
        assert transport.reads
    finally:
        for p in fp8.ranks:
            p.close()


# ---- shared secret -------------------------------------------------------------------
def test_the_shared_secret_authenticates_both_directions():
    """With a secret the sockets run CURVE with keys derived from it: a peer
    without it (or with another) never completes the handshake, so no frame
    of it reaches the other side (the prefill answers, and refuses, nothing)."""
    s = serve(secret=SECRET)
    plain = serve()
    try:
        # the decode lacks the secret: the frame is never taken, or never answered
        with pytest.raises(SideChannelError, match="could not send|no answer"):
            fetch(s.port, timeout=1)
        with pytest.raises(SideChannelError, match="CURVE handshake"):
            fetch(s.port, secret=b"another-secret-of-16+bytes", timeout=1)
        with pytest.raises(SideChannelError, match="CURVE handshake"):
            fetch(plain.port, secret=SECRET, timeout=1)  # the prefill lacks it
        assert s.ranks[0].server.answered == 0  # not one frame got through
        assert fetch(s.port, secret=SECRET).manifest == [(0, 3), (2, 4)]
    finally:
        for p in s.ranks + plain.ranks:
            p.close()


# ---- fuzz ------------------------------------------------------------------------------
def fuzz_messages(rng: random.Random, n: int):
    # well-formed, but an attacker's: the token is not the request's
    valid = msgspec.msgpack.encode(Fetch(nonce=b"n" * 16, request_id="req-A", token="W" * 43,
                                         reader="r", lease_s=10))
    wrong_schema = [
        {"type": "Hello"}, {"type": "Fetch"}, {"type": "Done", "readers": 0},
        {"type": "Fetch", "nonce": b"n" * 16, "request_id": 5, "token": TA, "reader": "r",
         "lease_s": 1},
        {"type": "Fetch", "nonce": b"n" * 16, "request_id": "req-A", "token": "short",
         "reader": "r", "lease_s": 1},
        {"type": "Fetch", "nonce": b"n" * 16, "request_id": "x" * 5000, "token": TA,
         "reader": "r", "lease_s": 1},
        {"type": "Fetch", "nonce": b"n" * 16, "request_id": "req-A", "token": TA,
         "reader": "r", "lease_s": float("nan")},
        {"type": "Done", "nonce": b"n" * 16, "request_id": "req-A", "token": TA,
         "reader": "r", "readers": 2 ** 63 - 1},
        {"type": "Done", "nonce": b"n" * 16, "request_id": "req-A", "token": TA,
         "reader": "r", "readers": "1"},
        [1, 2, 3], "Fetch", 7, None, {"type": "Fetch", "extra": list(range(1000))},
    ]
    deep = b"\x81\xa5extra" + b"\x91" * 3000 + b"\xc0"  # recursion while seeking the tag
    for _ in range(n):
        kind = rng.randrange(7)
        if kind == 5:  # deeply nested, possibly cut short
            yield [deep[:rng.randrange(len(deep) // 2, len(deep) + 1)], b""]
            continue
        if kind == 6:  # many frames in one message
            yield [valid] * rng.randrange(3, 60)
            continue
        if kind == 0:
            body = rng.randbytes(rng.randrange(0, 2000))
        elif kind == 1:
            body = valid[:rng.randrange(len(valid))]
        elif kind == 2:
            body = msgspec.msgpack.encode(rng.choice(wrong_schema))
        elif kind == 3:  # valid message, bytes flipped
            b = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            body = bytes(b)
        else:
            body = msgspec.msgpack.encode(msgspec.msgpack.Ext(rng.randrange(128), b"x"))
        yield [body] * rng.choice([1, 2, 2, 2, 3]) if kind != 3 else [body, b""]


def test_fuzzed_messages_leave_the_server_answering(prefill):
    rng = random.Random(20261201)
    rank0 = prefill.ranks[0]
    t0 = time.monotonic()
    sock = dealer(prefill.port)
    sent = 0
    for frames in fuzz_messages(rng, 300):
        sock.send_multipart(frames)
        sent += 1
    replies = 0
    while replies < sent and sock.poll(5000):
        body = sock.recv_multipart()[0]
        msgspec.msgpack.decode(body, type=Error)  # every answer is a refusal
        replies += 1
    assert replies == sent
    sock.close()
    for size in (MAX_REQUEST_BYTES + 1, MAX_FRAME_BYTES, MAX_FRAME_BYTES + 1):
        big = dealer(prefill.port)  # oversized frames: ZMQ drops the peer
        big.send_multipart([b"\x00" * size, b""])
        time.sleep(0.2)
        big.close()
    assert server_alive(rank0.server)
    assert fetch(prefill.port, timeout=5).manifest == [(0, 3), (2, 4)]
    assert rank0.take_finished() == set()  # nothing freed by the noise
    assert time.monotonic() - t0 < 60
