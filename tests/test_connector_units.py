"""Two robustness rules of the disaggregated-prefill connector, timed here in
isolation (real vLLM and real transports run them in the P/D tests):

* the empty-step wait (docs/disaggregated.md): on a step without forward,
  with a transfer pending, the worker gives the transfer threads up to
  ``IDLE_STEP_WAIT_S`` instead of returning at once, and returns as soon as
  one finishes; forward steps and idle connectors never wait. The
  connector's worker state is built bare (no vLLM engine).
* claims: a request whose manifest an open side-channel conversation
  fetched is not freed on expiry until that decode says done or the
  conversation ends (so a slow read never sees its blocks reused).
* Mooncake's read retry: a failed batched READ is retried once, a second
  failure or a stuck read raises. A stand-in engine replaces Mooncake's
  (its occasional 30 s stall cannot be provoked on purpose)."""

import threading
import time
from types import SimpleNamespace

import pytest

from conftest import needs_vllm

pytestmark = needs_vllm


@pytest.fixture
def connector(monkeypatch):
    from vllm_cp_kv.integration import connector as mod

    monkeypatch.setattr(mod, "IDLE_STEP_WAIT_S", 0.5)  # long enough to time
    c = object.__new__(mod.ShardedKVConnector)
    c._lock = threading.Lock()
    c._queued_recv, c._sending, c._readers_done = {}, {}, {}
    c._done_sending, c._done_recving, c._failed_recving = set(), set(), set()
    c._receiving, c._transfer_event = 0, threading.Event()
    c.expiry_s = 60.0
    c._claims, c._active_readers, c._readers_present = {}, 0, threading.Event()
    c.rank, c.shard_size, c.block_size = 0, 2, 16
    return c


def timed(c, forward_context):
    c.start_load_kv(forward_context)
    t0 = time.monotonic()
    results = c.get_transfer_results(set())
    return time.monotonic() - t0, results


def test_empty_step_waits_while_a_transfer_is_pending(connector):
    connector._receiving = 1
    waited, _ = timed(connector, SimpleNamespace(attn_metadata=None))
    assert waited >= 0.45


def test_a_finished_transfer_ends_the_wait(connector):
    connector._receiving = 1

    def finish():
        time.sleep(0.05)
        with connector._lock:
            connector._receiving -= 1
            connector._done_recving.add("r1")
        connector._transfer_event.set()

    threading.Thread(target=finish).start()
    waited, results = timed(connector, SimpleNamespace(attn_metadata=None))
    assert waited < 0.4
    assert results.finished_recving == {"r1"}


@pytest.mark.parametrize("case", ["forward step", "nothing pending", "result ready"])
def test_no_wait(connector, case):
    ctx = SimpleNamespace(attn_metadata=None)
    if case == "forward step":
        connector._receiving = 1
        ctx = SimpleNamespace(attn_metadata={"layer.0": object()})
    elif case == "result ready":
        connector._sending["r2"] = ([1], 16, time.monotonic() + 60)
        connector._done_sending.add("r3")
    waited, _ = timed(connector, ctx)
    assert waited < 0.1


def test_a_claimed_request_is_not_freed_on_expiry_until_its_reader_leaves(connector):
    import multiprocessing

    connector._sending["r4"] = ([3, 4], 40, time.monotonic() - 1)  # expired
    decode, prefill = multiprocessing.Pipe()
    served = threading.Thread(target=connector._serve_one, args=(prefill,))
    served.start()
    decode.send(("manifest", "r4"))
    assert decode.recv()["manifest"] == [(0, 3), (2, 4)]  # rank 0 owns blocks 0, 2
    ctx = SimpleNamespace(attn_metadata={"layer.0": object()})
    _, results = timed(connector, ctx)
    assert "r4" not in results.finished_sending  # still claimed: kept
    decode.close()  # the decode gave up (or died): the claim ends
    served.join(timeout=10)
    _, results = timed(connector, ctx)
    assert results.finished_sending == {"r4"}  # now freed on expiry


class FlakyEngine:
    """Stand-in for Mooncake's TransferEngine: the given return codes in turn
    (an int), or a read that blocks (``"hang"``)."""

    def __init__(self, codes):
        self.codes, self.calls = list(codes), 0

    def batch_transfer_sync_read(self, session, local, remote, sizes):
        self.calls += 1
        code = self.codes.pop(0)
        if code == "hang":
            time.sleep(5)
            return 0
        return code


def mooncake_with(codes):
    from vllm_cp_kv.integration.transfer import MooncakeTransport

    t = object.__new__(MooncakeTransport)
    t.engine, t._read_lock = FlakyEngine(codes), threading.Lock()
    return t


READS = [(1 << 20, 2 << 20, 4096)]


def test_mooncake_read_is_retried_once():
    t = mooncake_with([-1, 0])
    t.read({"session": "127.0.0.1:1"}, READS, timeout_s=5)
    assert t.engine.calls == 2


@pytest.mark.parametrize("codes,match", [([-1, -1], "failed"), (["hang"], "did not finish")])
def test_mooncake_read_fails_after_the_retry_or_a_stuck_read(codes, match):
    from vllm_cp_kv.integration.transfer import TransferError

    t = mooncake_with(codes)
    with pytest.raises(TransferError, match=match):
        t.read({"session": "127.0.0.1:1"}, READS, timeout_s=0.2)
