"""The connector's empty-step wait (docs/disaggregated.md): on a step without
forward, with a transfer pending, the worker gives the transfer threads up to
``IDLE_STEP_WAIT_S`` instead of returning at once, and returns as soon as one
finishes; forward steps and idle connectors never wait. Real vLLM runs it in
the P/D tests; here the connector's worker state is built bare (no vLLM
engine) to time the wait."""

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
