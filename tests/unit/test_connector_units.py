"""Robustness rules of the disaggregated-prefill connector, in isolation
(real vLLM and real transports run them in the P/D tests). No assertion here
depends on how fast the machine is: waits are observed through a recording
event or a thread's completion, time through the ``now`` arguments.

* the empty-step wait (docs/disaggregated.md): on a step without forward,
  with a transfer pending, the worker waits for a transfer event for up to
  ``IDLE_STEP_WAIT_S`` instead of returning at once, and a finished transfer
  ends the wait; forward steps, idle connectors and ready results never wait;
* claims: a request whose manifest a decode reader fetched is not freed on
  expiry while the claim (a lease) lasts; its reader's done or the end of the
  lease releases it; blocks are freed only when every reader is done; the
  transport's progress loop runs exactly while a claim is outstanding;
* Mooncake's read retry: a failed batched READ is retried once, a second
  failure or a stuck read raises, a read whose claim would end first never
  starts. A stand-in engine replaces Mooncake's (its occasional 30 s stall
  cannot be provoked on purpose);
* the scheduler side: a fresh transfer token per finished prefill request
  (to the client and to the prefill workers, no block table to the client),
  the decode's params checked with the reason kept for the failure."""

import secrets
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import needs_vllm
from pd_support import FakeTransport, handshake, skip_or_fail

try:
    import msgspec  # noqa: F401
    import zmq  # noqa: F401
except ImportError:  # vLLM's dependencies
    skip_or_fail("pyzmq and msgspec (vLLM dependencies) are not installed")

from vllm_cp_kv.integration.connector.producer import MAX_LEASE_S, Producer  # noqa: E402
from vllm_cp_kv.integration.connector.schema import Done, Fetch, FetchReply, Ok  # noqa: E402
from vllm_cp_kv.integration.connector.side_channel import new_nonce  # noqa: E402
from vllm_cp_kv.integration.connector.worker import IDLE_STEP_WAIT_S, WorkerSide  # noqa: E402

TOKEN = secrets.token_urlsafe(32)
IDLE = SimpleNamespace(attn_metadata=None)  # vLLM's connector-only step
FORWARD = SimpleNamespace(attn_metadata={"layer.0": object()})


class RecordingEvent(threading.Event):
    """A real event that records the timeout of every wait."""

    def __init__(self):
        super().__init__()
        self.waits = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return super().wait(timeout)


class StubConsumer:
    def __init__(self, pending=False, done=()):
        self._pending, self._done = pending, set(done)

    def pending(self):
        return self._pending

    def ready(self):
        return bool(self._done)

    def take_results(self):
        done, self._done = self._done, set()
        return done, set()


def producer(expiry_s=60.0, transport=None):
    return Producer(handshake(), expiry_s, transport=transport)


def fetch(p, reader="r1", token=TOKEN, lease_s=100.0):
    return p.handle(Fetch(nonce=new_nonce(), request_id="r4", token=token, reader=reader,
                          lease_s=lease_s))


def done(p, reader="r1", readers=1, token=TOKEN):
    return p.handle(Done(nonce=new_nonce(), request_id="r4", token=token, reader=reader,
                         readers=readers))


# ---- the empty-step wait ------------------------------------------------------------
def test_empty_step_waits_while_a_transfer_is_pending():
    event = RecordingEvent()
    side = WorkerSide(consumer=StubConsumer(pending=True), event=event)
    side.start_step(IDLE)
    side.results()
    assert event.waits == [IDLE_STEP_WAIT_S]


def test_a_finished_transfer_ends_the_wait():
    """The wait is long here (10 minutes): only the event can end it."""
    event = RecordingEvent()
    consumer = StubConsumer(pending=True)
    side = WorkerSide(consumer=consumer, event=event, idle_wait_s=600)
    side.start_step(IDLE)
    out = {}
    step = threading.Thread(target=lambda: out.update(r=side.results()))
    step.start()
    while not event.waits:  # the step is waiting
        time.sleep(0.01)
    consumer._done, consumer._pending = {"r1"}, False
    event.set()  # what a receive thread does when it finishes
    step.join(timeout=60)
    assert not step.is_alive()
    assert out["r"][1] == {"r1"}


@pytest.mark.parametrize("case", ["forward step", "nothing pending", "result ready"])
def test_no_wait(case):
    event = RecordingEvent()
    consumer = StubConsumer(pending=case != "nothing pending",
                            done={"r3"} if case == "result ready" else ())
    side = WorkerSide(consumer=consumer, event=event)
    side.start_step(FORWARD if case == "forward step" else IDLE)
    side.results()
    assert event.waits == []


def test_a_producer_with_blocks_to_free_does_not_wait():
    event = RecordingEvent()
    p = producer()
    p.add("r4", [3, 4], 40, TOKEN)
    p.add("r5", [1], 16, TOKEN)
    side = WorkerSide(producer=p, event=event)
    side.start_step(IDLE)
    fetch(p)
    done(p)  # r4 read: its blocks may be freed at once
    assert side.results()[0] == {"r4"}
    assert event.waits == []
    side.results()  # r5 pending, nothing ready: waits
    assert event.waits == [IDLE_STEP_WAIT_S]


# ---- claims -------------------------------------------------------------------------------
def test_a_claimed_request_is_not_freed_on_expiry_until_its_reader_is_done():
    p = producer()
    now = time.monotonic()
    p.add("r4", [3, 4], 40, TOKEN, now=now - 61)  # expired
    reply = fetch(p)
    assert isinstance(reply, FetchReply)
    assert reply.manifest == [(0, 3), (2, 4)]  # rank 0 owns logical blocks 0, 2
    assert p.take_finished() == set()  # claimed: kept
    assert isinstance(done(p), Ok)
    assert p.take_finished() == {"r4"}  # done: freed


def test_a_claim_ends_with_its_lease():
    """A decode that fetched and died says nothing: its lease ends."""
    p = producer()
    now = time.monotonic()
    p.add("r4", [3, 4], 40, TOKEN, now=now - 61)
    granted = fetch(p, lease_s=100).lease_s
    assert 0 < granted <= 100
    assert p.take_finished(now=now + 50) == set()
    assert p.take_finished(now=now + 101) == {"r4"}


def test_claims_are_capped():
    p = producer(expiry_s=10)
    p.add("r4", [3, 4], 40, TOKEN)
    assert fetch(p, lease_s=3000).lease_s <= MAX_LEASE_S
    # re-fetching cannot pin the blocks for ever: no claim beyond expiry + the cap
    assert p.take_finished(now=time.monotonic() + 10 + MAX_LEASE_S + 1) == {"r4"}


def test_blocks_are_freed_only_when_every_reader_is_done():
    p = producer()
    p.add("r4", [3, 4], 40, TOKEN)
    fetch(p, "rank0-reader")
    fetch(p, "rank1-reader")
    done(p, "rank0-reader", readers=2)
    assert p.take_finished() == set()  # the other decode rank still reads
    done(p, "rank0-reader", readers=2)  # a repeated done counts once
    assert p.take_finished() == set()
    done(p, "rank1-reader", readers=2)
    assert p.take_finished() == {"r4"}


def test_a_done_while_another_reader_holds_a_claim_waits_for_it():
    p = producer()
    p.add("r4", [3, 4], 40, TOKEN)
    fetch(p, "retry-reader")  # e.g. a second decode the proxy retried on
    fetch(p, "first-reader")
    done(p, "first-reader", readers=1)
    assert p.take_finished() == set()
    done(p, "retry-reader", readers=1)
    assert p.take_finished() == {"r4"}


def test_progress_runs_while_a_claim_is_outstanding():
    from builders import free_port

    transport = FakeTransport()
    p = producer(transport=transport)
    p.add("r4", [3, 4], 40, TOKEN)
    p.serve("127.0.0.1", free_port(), None)
    try:
        time.sleep(0.05)
        assert transport.progressed == 0  # nobody reads: no polling
        fetch(p)
        wait_for(lambda: transport.progressed > 3)  # a reader: the loop drives progress
        done(p)
        p.take_finished()
        time.sleep(0.05)
        before = transport.progressed
        time.sleep(0.1)
        assert transport.progressed == before  # no claim left: the loop sleeps
    finally:
        p.close()


def wait_for(pred, timeout=30):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


# ---- Mooncake read retry ------------------------------------------------------------------
class FlakyEngine:
    """Stand-in for Mooncake's TransferEngine: the given return codes in turn
    (an int), or a read that blocks until released (``"hang"``)."""

    def __init__(self, codes):
        self.codes, self.calls = list(codes), 0
        self.release = threading.Event()

    def batch_transfer_sync_read(self, session, local, remote, sizes):
        self.calls += 1
        code = self.codes.pop(0)
        if code == "hang":
            self.release.wait(30)
            return 0
        return code


def mooncake_with(codes):
    from vllm_cp_kv.integration.connector.transfer import MooncakeTransport

    t = object.__new__(MooncakeTransport)
    t.engine, t._read_lock = FlakyEngine(codes), threading.Lock()
    return t


READS = [(1 << 20, 2 << 20, 4096)]


def test_mooncake_read_is_retried_once():
    t = mooncake_with([-1, 0])
    t.read({"session": "127.0.0.1:1"}, READS, timeout_s=5)
    assert t.engine.calls == 2


@pytest.mark.parametrize("codes,match", [([-1, -1], "failed"), (["hang"], "did not finish")])
def test_mooncake_read_fails_after_the_retry_or_a_stuck_read(codes, match, monkeypatch):
    from vllm_cp_kv.integration.connector import transfer

    monkeypatch.setattr(transfer, "MOONCAKE_ABORT_GRACE_S", 0.1)
    t = mooncake_with(codes)
    try:
        with pytest.raises(transfer.TransferError, match=match):
            t.read({"session": "127.0.0.1:1"}, READS, timeout_s=0.1)
    finally:
        t.engine.release.set()


def test_a_read_whose_claim_would_end_first_never_starts():
    from vllm_cp_kv.integration.connector.transfer import TransferError

    t = mooncake_with([0])
    with pytest.raises(TransferError, match="not started"):
        t.read({"session": "127.0.0.1:1"}, READS, timeout_s=5, start_by=time.monotonic() - 1)
    assert t.engine.calls == 0


def test_a_read_given_up_while_waiting_for_its_turn_never_starts(monkeypatch):
    """Reads are serialized; one abandoned behind a stuck read must not run later."""
    from vllm_cp_kv.integration.connector import transfer as transport

    monkeypatch.setattr(transport, "MOONCAKE_ABORT_GRACE_S", 0.1)
    t = mooncake_with(["hang", 0])
    first = threading.Thread(target=t.read, args=({"session": "s"}, READS, 30))
    first.start()
    wait_for(lambda: t.engine.calls == 1)
    with pytest.raises(transport.TransferError, match="did not start"):
        t.read({"session": "s"}, READS, timeout_s=0.1)
    t.engine.release.set()  # the stuck read ends; the abandoned one must not follow
    first.join(10)
    time.sleep(0.1)
    assert t.engine.calls == 1


# ---- scheduler side -----------------------------------------------------------------------
def finished_request(req_id, params, n=40):
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, prompt_token_ids=[1] * n,
                           status=RequestStatus.FINISHED_LENGTH_CAPPED)


@needs_vllm
def test_the_prefill_hands_out_a_fresh_token_per_request_and_no_block_table():
    from vllm_cp_kv.integration.connector.config import ConnectorConfig
    from vllm_cp_kv.integration.connector.params import parse_params
    from vllm_cp_kv.integration.connector.scheduler import SchedulerSide

    side = SchedulerSide(ConnectorConfig.from_extra({"side_channel_port": 5800}, True),
                         "engine", 2, 16, True, False)
    keep, a = side.request_finished(finished_request("a", {"do_remote_decode": True}), [3, 4])
    _, b = side.request_finished(finished_request("b", {"do_remote_decode": True}), [5, 6])
    assert keep and a["transfer_token"] != b["transfer_token"]
    assert len(a["transfer_token"]) >= 43 and "remote_block_ids" not in a
    assert parse_params(a).remote_port == 5800  # what the decode accepts
    meta = side.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1))
    assert meta.to_send["a"] == ([3, 4], 40, a["transfer_token"])  # to the prefill workers


@needs_vllm
def test_the_decode_scheduler_fails_bad_params_with_the_reason():
    from vllm_cp_kv.integration.connector.config import ConnectorConfig
    from vllm_cp_kv.integration.connector.scheduler import SchedulerSide

    side = SchedulerSide(ConnectorConfig.from_extra({}, False), "engine", 1, 16, False, True)
    blocks = SimpleNamespace(get_block_ids=lambda: [[7, 8, 9]])
    good = {"do_remote_prefill": True, "remote_request_id": "p-1", "remote_host": "127.0.0.1",
            "remote_port": 5700, "remote_num_tokens": 40, "shard_size": 2, "block_size": 16,
            "transfer_token": TOKEN}
    for req_id, params in (("ok", dict(good)), ("bad", dict(good, remote_port="5700"))):
        request = finished_request(req_id, params)
        assert side.get_num_new_matched_tokens(request, 0) == (40, True)
        side.update_state_after_alloc(request, blocks, 40)
        assert request.kv_transfer_params["do_remote_prefill"] is False  # one transfer
    meta = side.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1))
    ids, params, error = meta.to_recv["ok"]
    assert ids == [7, 8, 9] and params.transfer_token == TOKEN and error is None
    _, params, error = meta.to_recv["bad"]
    assert params is None and "remote_port" in error and "'p-1'" in error


# ---- an unsharded prefill's TP ranks ------------------------------------------------
def test_an_unsharded_prefills_other_tp_ranks_free_at_once_and_serve_nothing(monkeypatch):
    """cp_kv off on a TP=2 prefill: the decode reads rank 0 only (a shard
    size of 1), so TP rank 1 (a replica) reports each request sent at once;
    vLLM frees the blocks when every rank has, so rank 0's readers still
    decide. Before, rank 1 held every request until blocks_expiry_s (found
    on the H200: a P/D run with an unsharded TP=2 prefill timed out waiting
    for its cache to empty). Negative case: rank 0 holds the request until
    its reader is done."""
    import torch

    import vllm_cp_kv.integration.connector.worker as worker_mod
    from vllm_cp_kv.integration.connector.config import ConnectorConfig
    from vllm_cp_kv.integration.geometry import ShardGeometry

    monkeypatch.setattr(worker_mod, "make_transport", lambda *a: FakeTransport())
    served = []
    monkeypatch.setattr(Producer, "serve", lambda self, *a: served.append(a[1]))
    caches = [torch.zeros(8, 16, 576)]
    geometry = ShardGeometry(rank=0, size=1, block_size=16)
    sides = [WorkerSide.start(ConnectorConfig(port=6100), caches, geometry, rank, "e", 2,
                              is_producer=True, is_consumer=False) for rank in (0, 1)]
    assert served == [6100]  # rank 0 only
    for side in sides:
        side.producer.add("r4", [0, 1], 20, TOKEN)
    assert sides[1].producer.take_finished() == {"r4"}
    assert not sides[1].producer.pending()
    assert sides[0].producer.take_finished() == set()  # waits for its reader
    fetch(sides[0].producer)
    done(sides[0].producer)
    assert sides[0].producer.take_finished() == {"r4"}
