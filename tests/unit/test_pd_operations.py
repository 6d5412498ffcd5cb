"""P/D as operators run it (issue 37), each a test that failed on the code
before it:

* no pause in vLLM's engine loop: the connector's scheduler hook returns at
  once on an idle step with sends pending (it slept ``idle_step_s``, 1 s on
  a prefill), and vLLM's own ``EngineCoreProc._process_engine_step`` with
  the plugin's item 25 handles a request that arrives while the engine has
  only transfers pending within 50 ms (it waits for client calls instead);
* bounded resources: 1,000 pulls queued start at most ``MAX_PULL_THREADS``
  threads; remote NIXL agents are evicted (a bound, an idle time) between
  reads, and a known agent name keeps refusing other metadata after its
  eviction; a malformed ZAP request leaves CURVE clients connecting; a flood
  of side-channel messages lets the lease sweep run between batches;
* no transfer token in what the plugin's log lines can print.
(A decode off loopback with a secret and no allow-list refused at startup:
tests/pd/test_peer_bounds.py.)
"""

import queue
import secrets
import threading
import time
from types import SimpleNamespace

import pytest

from builders import free_port
from pd_support import serve_ranks, skip_or_fail

try:
    import zmq
except ImportError:  # vLLM's dependencies
    skip_or_fail("pyzmq (a vLLM dependency) is not installed")

from vllm_cp_kv.integration.connector import consumer as consumer_mod  # noqa: E402
from vllm_cp_kv.integration.connector import auth  # noqa: E402
from vllm_cp_kv.integration.connector import side_channel as sc  # noqa: E402
from vllm_cp_kv.integration.connector.config import ConnectorConfig  # noqa: E402
from vllm_cp_kv.integration.connector.scheduler import SchedulerSide  # noqa: E402


# ---- the engine loop --------------------------------------------------------
def test_an_idle_step_with_sends_pending_returns_at_once():
    cfg = ConnectorConfig.from_extra({}, is_producer=True)
    assert cfg.idle_step_s == 1.0
    side = SchedulerSide(cfg, "engine", 2, 16, True, False)
    side._pending_sends.add("req-1")
    assert side.has_pending_push_work()
    empty = SimpleNamespace(total_num_scheduled_tokens=0)
    t0 = time.monotonic()
    for _ in range(5):
        side.build_connector_meta(empty)
    assert time.monotonic() - t0 < 0.05


class StubEngine:
    """What ``EngineCoreProc._process_engine_step`` (vLLM's own code, with
    the plugin's item 25 around it) touches: a step that runs no model while
    the scheduler still has work (transfers pending), the input queue, and
    the client-call handler."""

    def __init__(self, connector):
        self.scheduler = SimpleNamespace(connector=connector, has_requests=lambda: True)
        self.input_queue = queue.Queue()
        self.output_queue = queue.Queue()
        self.handled = []

    def step_fn(self):
        return {}, False  # no outputs, no model executed

    def post_step(self, model_executed):
        pass

    def _handle_client_request(self, kind, request):
        self.handled.append((kind, request, time.monotonic()))


@pytest.fixture
def engine_step():
    from conftest import vllm_available

    if not vllm_available():
        skip_or_fail("vLLM is not installed")
    from vllm.v1.engine.core import EngineCoreProc

    from vllm_cp_kv.integration import plugin

    plugin.register()  # installs item 25 (idempotent)
    return EngineCoreProc._process_engine_step


def test_a_request_during_an_idle_pending_send_step_is_handled_within_50_ms(engine_step):
    wait = 1.0  # the prefill's default idle_step_s
    engine = StubEngine(SimpleNamespace(cp_kv_idle_wait_s=lambda: wait))
    sent = {}

    def client():
        time.sleep(0.2)
        sent["at"] = time.monotonic()
        engine.input_queue.put(("ADD", "req-new"))

    threading.Thread(target=client).start()
    t0 = time.monotonic()
    assert engine_step(engine) is False
    returned = time.monotonic()
    assert [h[:2] for h in engine.handled] == [("ADD", "req-new")]
    assert engine.handled[0][2] - sent["at"] < 0.05
    assert returned - sent["at"] < 0.05 and returned - t0 < wait
    # nothing arrives: the idle engine waits idle_step_s, then polls again
    t0 = time.monotonic()
    engine_step(engine)
    assert 0.9 * wait <= time.monotonic() - t0 < wait + 0.5


def test_a_finished_request_not_yet_told_to_the_workers_steps_at_once(engine_step):
    """With vLLM's async scheduling (its GPU default) a request finishes
    after the next step was scheduled; that step carries nothing, and an idle
    wait after it held the blocks back from the decode for ``idle_step_s``
    (1.1 s a request through the example pair on one H200). The connector's
    own ``cp_kv_idle_wait_s`` on its scheduler side: no wait while a send is
    undelivered, ``idle_step_s`` once the workers were told."""
    from vllm_cp_kv.integration.connector.connector import ShardedKVConnector

    cfg = ConnectorConfig.from_extra({}, is_producer=True)
    connector = object.__new__(ShardedKVConnector)
    connector.cfg = cfg
    connector._scheduler = SchedulerSide(cfg, "engine", 2, 16, True, False)
    connector._scheduler._to_send["req-1"] = ([0, 1], 20, "token")  # request_finished's
    connector._scheduler._pending_sends.add("req-1")
    engine = StubEngine(connector)
    t0 = time.monotonic()
    engine_step(engine)
    assert time.monotonic() - t0 < 0.05  # stepped again at once
    meta = connector._scheduler.build_connector_meta(SimpleNamespace())
    assert list(meta.to_send) == ["req-1"]  # the next step tells the workers
    assert connector.cp_kv_idle_wait_s() == cfg.idle_step_s == 1.0
    t0 = time.monotonic()
    engine_step(engine)  # only the decode's reads pending: the idle wait
    assert 0.9 <= time.monotonic() - t0 < 1.5


def test_a_finished_pull_is_scheduled_without_an_idle_wait(engine_step):
    """The step whose output reports a finished pull schedules nothing; the
    next must come at once (the request can run now), not after the decode's
    ``idle_step_s``."""
    from vllm_cp_kv.integration.connector.connector import ShardedKVConnector

    cfg = ConnectorConfig.from_extra({"idle_step_s": 1.0}, is_producer=False)
    connector = object.__new__(ShardedKVConnector)
    connector.cfg = cfg
    connector._scheduler = SchedulerSide(cfg, "engine", 1, 16, False, True)
    connector._scheduler.update_connector_output(
        SimpleNamespace(finished_sending=None, finished_recving={"req-1"}))
    engine = StubEngine(connector)
    t0 = time.monotonic()
    engine_step(engine)
    assert time.monotonic() - t0 < 0.05
    connector._scheduler.build_connector_meta(SimpleNamespace())  # the step that schedules it
    assert connector.cp_kv_idle_wait_s() == 1.0


def test_a_decode_reading_kv_steps_without_the_engine_wait(engine_step):
    """While a read is in flight the decode's workers wait for it themselves
    (and return when it finishes); an engine wait on top delivered a pull
    that finished meanwhile up to ``idle_step_s`` late. Finished or failed,
    or the request gone, the engine waits again."""
    from vllm_cp_kv.integration.connector.connector import ShardedKVConnector

    cfg = ConnectorConfig.from_extra({"idle_step_s": 1.0}, is_producer=False)
    connector = object.__new__(ShardedKVConnector)
    connector.cfg = cfg
    side = connector._scheduler = SchedulerSide(cfg, "engine", 1, 16, False, True)
    for req_id in ("r1", "r2", "r3"):
        request = SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(20)),
                                  kv_transfer_params={"do_remote_prefill": True})
        side.update_state_after_alloc(
            request, SimpleNamespace(get_block_ids=lambda: ([3, 4],)), 20)
    side.build_connector_meta(SimpleNamespace())  # the workers were told: reads start
    engine = StubEngine(connector)
    t0 = time.monotonic()
    engine_step(engine)
    assert time.monotonic() - t0 < 0.05
    # r2 failed: reported finished as well (Consumer._run)
    side.update_connector_output(SimpleNamespace(finished_sending=None,
                                                 finished_recving={"r1", "r2"},
                                                 failed_recving={"r2"}))
    side.build_connector_meta(SimpleNamespace())
    assert side.has_reads_in_flight()  # r3 still reading
    side.request_finished(SimpleNamespace(request_id="r3", kv_transfer_params=None), [])
    assert not side.has_reads_in_flight() and connector.cp_kv_idle_wait_s() == 1.0


def test_data_parallel_engines_do_not_wait(engine_step):
    """A data-parallel rank that waited would hold up the other ranks'
    collectives: ``DPEngineCoreProc`` steps as vLLM's, cp_kv connector or
    not."""
    from vllm.v1.engine.core import DPEngineCoreProc

    class DPStub(DPEngineCoreProc):  # vLLM's class, none of its __init__
        __init__ = StubEngine.__init__
        step_fn, post_step = StubEngine.step_fn, StubEngine.post_step
        _handle_client_request = StubEngine._handle_client_request

    engine = DPStub(SimpleNamespace(cp_kv_idle_wait_s=lambda: 1.0))
    t0 = time.monotonic()
    for _ in range(5):
        engine_step(engine)
    assert time.monotonic() - t0 < 0.5


def test_other_engines_step_as_vllms(engine_step):
    engine = StubEngine(SimpleNamespace())  # another connector: no cp_kv wait
    t0 = time.monotonic()
    for _ in range(20):
        engine_step(engine)
    assert time.monotonic() - t0 < 0.5 and engine.handled == []


# ---- bounded resources -------------------------------------------------------
def test_a_thousand_pulls_queue_on_a_bounded_pool(monkeypatch):
    before = set(threading.enumerate())  # other tests' pools may still idle
    c, release, started = blocking_consumer(monkeypatch)
    for i in range(1000):  # from 100 prefills, 10 requests each
        c.start(f"req-{i}", [1], params(port=5000 + i % 100), None)
    time.sleep(0.3)
    running = [t for t in set(threading.enumerate()) - before if t.name == "cp_kv-receive"]
    assert len(running) == c.pool.threads == consumer_mod.MAX_PULL_THREADS
    assert len(set(threading.enumerate()) - before) < 50  # nothing else per pull
    assert c.pending() and len(started) == len(running)
    release.set()
    assert wait_until(lambda: not c.pending(), 30.0)
    done, failed = c.take_results()
    assert len(done) == 1000 and not failed and len(started) == 1000
    assert c.pool.threads == consumer_mod.MAX_PULL_THREADS


def params(host="127.0.0.1", port=5700):
    return SimpleNamespace(remote_request_id="p", remote_host=host, remote_port=port)


def blocking_consumer(monkeypatch):
    """A Consumer whose pulls block until released; started request ids."""
    from vllm_cp_kv.integration.connector.consumer import Consumer

    release, started = threading.Event(), []
    c = object.__new__(Consumer)
    Consumer.__init__(c, SimpleNamespace(shard=SimpleNamespace(rank=0)), None, 5.0, None, 1)

    def receive(req_id, local_ids, p, ready=None):
        started.append(req_id)
        release.wait(30)

    monkeypatch.setattr(c, "receive", receive)
    return c, release, started


def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_burst_of_pulls_does_not_queue_behind_one_idle_thread(monkeypatch):
    """One thread waits idle; a step's receives come in one quick loop: each
    must get a thread (before: every submit saw the same idle thread, and
    the burst ran one pull after another on it)."""
    c, release, started = blocking_consumer(monkeypatch)
    release.set()  # the first pull returns at once: its thread goes idle
    c.start("warm", [1], params(), None)
    assert wait_until(lambda: c.pool._idle == 1 and not c.pending())
    release.clear()
    for i in range(8):  # from 8 prefills: the per-peer cap does not apply
        c.start(f"req-{i}", [1], params(port=6000 + i), None)
    assert wait_until(lambda: len(started) == 9, 3.0), started
    assert c.pool.threads == 8
    release.set()


def test_a_silent_prefill_does_not_take_every_pull_thread(monkeypatch):
    """20 requests naming one prefill that never answers (here: pulls that
    block) run at most PULLS_PER_PEER at a time; a request from another
    prefill starts at once."""
    c, release, started = blocking_consumer(monkeypatch)
    for i in range(20):
        c.start(f"slow-{i}", [1], params(host="10.9.9.9", port=5700), None)
    assert wait_until(lambda: len(started) == consumer_mod.PULLS_PER_PEER)
    c.start("other", [1], params(port=5800), None)
    assert wait_until(lambda: "other" in started, 2.0)
    time.sleep(0.2)
    assert len([r for r in started if r.startswith("slow")]) == consumer_mod.PULLS_PER_PEER
    release.set()
    assert wait_until(lambda: not c.pending(), 30.0)
    done, failed = c.take_results()
    assert len(done) == 21 and not failed


class FakeAgent:
    """The remote-agent calls of a NIXL agent, recorded."""

    def __init__(self):
        self.loaded: list[str] = []
        self.removed: list[str] = []

    def add_remote_agent(self, metadata: bytes):
        self.loaded.append(metadata.decode())

    def remove_remote_agent(self, name: str):
        self.removed.append(name)
        self.loaded.remove(name)


def test_remote_nixl_agents_are_evicted_between_reads(monkeypatch):
    from vllm_cp_kv.integration.connector import transfer

    now = [1000.0]
    t = transfer.NixlTransport("127.0.0.1", agent=FakeAgent(), clock=lambda: now[0])
    # metadata that "loads" as the agent it names (the probe agent is NIXL's)
    monkeypatch.setattr(t, "_probe", lambda metadata: metadata.decode())
    bound = transfer.MAX_REMOTE_AGENTS

    def read_from(name):  # what _read does before the transfer itself
        t._remote_agent(name, name.encode())
        t._last_used[name] = t.clock()
        t._evict(keep=name)

    for i in range(bound + 6):
        now[0] += 1
        read_from(f"prefill-{i}")
    assert len(t.remote_agents) == len(t.agent.loaded) == bound
    assert t.agent.removed == [f"prefill-{i}" for i in range(6)]  # least recently used
    assert t.remote_agents[-1] == f"prefill-{bound + 5}"
    # every agent idle past the limit goes at the next read, but the one read
    now[0] += transfer.REMOTE_AGENT_IDLE_S + 1
    read_from("prefill-7")
    assert t.remote_agents == ["prefill-7"] and t.agent.loaded == ["prefill-7"]
    # an evicted name is still known: other metadata under it stays refused
    with pytest.raises(transfer.TransferError, match="other NIXL metadata"):
        t._remote_agent("prefill-3", b"prefill-3-forged")
    read_from("prefill-3")  # its own metadata loads again
    assert "prefill-3" in t.remote_agents


def test_a_flood_of_agent_names_does_not_free_a_name_in_use(monkeypatch):
    """A client that may point the decode at hosts of its choice loads more
    new agent names than the bound: the real prefill's name, in use, stays
    known, so its metadata forged under a new peer is still refused."""
    from vllm_cp_kv.integration.connector import transfer

    now = [1000.0]
    t = transfer.NixlTransport("127.0.0.1", agent=FakeAgent(), clock=lambda: now[0])
    monkeypatch.setattr(t, "_probe", lambda metadata: metadata.decode())
    monkeypatch.setattr(transfer, "MAX_AGENT_NAMES", 64)
    t._remote_agent("prefill-real", b"prefill-real")
    for i in range(200):
        now[0] += 1
        t._remote_agent("prefill-real", b"prefill-real")  # the real one keeps reading
        t._remote_agent(f"fake-{i}", f"fake-{i}".encode())
        t._last_used[f"fake-{i}"] = t.clock()
        t._evict(keep=f"fake-{i}")
    assert len(t._seen) <= 64 + transfer.MAX_REMOTE_AGENTS
    with pytest.raises(transfer.TransferError, match="other NIXL metadata"):
        t._remote_agent("prefill-real", b"prefill-real-forged")


def test_a_malformed_zap_request_leaves_curve_clients_connecting():
    """The process's ZAP handler (CURVE admission) answers a malformed request
    and keeps serving: a legitimate client of a server with a secret still
    completes its handshake and gets its answer."""
    secret, token = b"zap-test-secret-of-32-bytes!!!!!", secrets.token_urlsafe(32)
    s = serve_ranks({"req-A": token}, [3, 4, 5], 40, secret, 60.0)
    try:
        zap = sc.context().socket(zmq.REQ)
        zap.setsockopt(zmq.LINGER, 0)
        zap.setsockopt(zmq.RCVTIMEO, 2000)
        zap.connect(auth._ZapHandler.ENDPOINT)
        for bad in ([b"1.0"], [b"x"] * 3):  # too few frames for RFC 27
            zap.send_multipart(bad)
            assert zap.recv_multipart()[2] == b"400"
        zap.close()
        with sc.SideChannelClient("127.0.0.1", s.port, secret, 5.0) as c:
            reply = c.ask(sc.Release(nonce=sc.new_nonce(), request_id="req-A",
                                     token=token, reader="r"), sc.Ok)
        assert isinstance(reply, sc.Ok)
    finally:
        for p in s.ranks:
            p.close()


def test_a_flood_of_messages_lets_the_periodic_sweep_run():
    """The server answers at most ``MAX_DRAIN`` messages before its periodic
    task (the producer's sweep of expired claims) runs again: 1,000 messages
    waiting at once are answered with the sweep run between batches."""
    gate, sweeps, seen = threading.Event(), [0], []

    def handler(msg):
        if not seen:
            gate.wait(10)  # the flood queues up behind the first message
        seen.append(sweeps[0])
        return sc.Ok(nonce=msg.nonce)

    def sweep():
        sweeps[0] += 1

    port = free_port()
    server = sc.SideChannelServer("127.0.0.1", port, handler, on_idle=sweep, tick_s=0.05)
    try:
        sock = sc.context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        n = 1000
        for _ in range(n):
            msg = sc.Done(nonce=sc.new_nonce(), request_id="r", token="W" * 43, reader="x",
                          readers=1)
            sock.send_multipart(sc.seal(None, port, msg))
        time.sleep(0.5)  # all queued at the server
        gate.set()
        deadline = time.monotonic() + 30
        while len(seen) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(seen) == n
        # the sweep ran between the batches, not only after the flood
        assert seen[-1] - seen[1] >= (n - 1) // sc.MAX_DRAIN - 1
        sock.close()
    finally:
        server.close()


# ---- tokens in logs ---------------------------------------------------------------
def test_no_repr_a_log_line_may_print_shows_a_transfer_token():
    from vllm_cp_kv.integration.connector.params import parse_params

    token = secrets.token_urlsafe(32)
    params = parse_params({"do_remote_prefill": True, "remote_request_id": "req-A",
                           "remote_host": "127.0.0.1", "remote_port": 5700,
                           "remote_num_tokens": 40, "shard_size": 2, "block_size": 16,
                           "transfer_token": token})
    messages = [sc.Fetch(nonce=sc.new_nonce(), request_id="req-A", token=token, reader="r",
                         lease_s=10),
                sc.Done(nonce=sc.new_nonce(), request_id="req-A", token=token, reader="r",
                        readers=1),
                sc.Release(nonce=sc.new_nonce(), request_id="req-A", token=token, reader="r")]
    for obj in [params, *messages]:
        text = repr(obj) + str(obj) + f"{obj!r}"
        assert token not in text and "<redacted>" in text
    assert params.transfer_token == token  # the value itself is kept
    assert "req-A" in repr(params)
