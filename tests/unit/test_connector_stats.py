"""The connector's transfer figures, the GPU-facing choices and the worker
metric files, without an engine (seconds; real vLLM runs them in
tests/pd/test_disaggregated.py, which scrapes ``/metrics``).

* transfer figures: what a decode pull and a prefill rank count (bytes =
  blocks x page bytes of every cache; served, released, expired), vLLM's
  stats channel (worker snapshot, sum over workers, the frontend's rebuild
  from the msgpack'd dict, the ``KV Transfer metrics`` figures) and the
  Prometheus series recorded from it;
* a decode's own prefix-cache hit: the leading blocks are not read (shared
  blocks are never written), the rest land where they belong;
* GPU choices checked with stand-ins: NIXL memory type and device id of a
  CUDA tensor (``VRAM``, its index) and of host memory (``DRAM``, 0), on
  registration and on both sides of a read; the shard rank from vLLM's DCP
  group (PCP) and the TP rank on the decode; the V2 runner's empty steps;
* the sharding figures' files: written in ``prometheus_client``'s
  multi-process format and read back by its collector.
"""

import os
import pickle
import secrets
import time
from functools import partial
from types import SimpleNamespace

import pytest

from conftest import needs_vllm
from pd_support import FakeTransport, handshake, serve_ranks, skip_or_fail

try:
    import msgspec
    import zmq  # noqa: F401
except ImportError:  # vLLM's dependencies
    skip_or_fail("pyzmq and msgspec (vLLM dependencies) are not installed")

from vllm_cp_kv.integration.connector.consumer import Consumer  # noqa: E402
from vllm_cp_kv.integration.connector.counters import TransferCounters, merge  # noqa: E402
from vllm_cp_kv.integration.connector.params import parse_params  # noqa: E402
from vllm_cp_kv.integration.connector.producer import Producer  # noqa: E402
from vllm_cp_kv.integration.connector.schema import Done, Fetch, Release  # noqa: E402
from vllm_cp_kv.integration.connector.side_channel import new_nonce  # noqa: E402
from vllm_cp_kv.integration.connector.transfer import (  # noqa: E402
    NixlTransport, TransferError, memory_kind, nixl_descs)

TOKEN = secrets.token_urlsafe(32)
NUM_TOKENS, TABLE = 40, [3, 4, 5]  # 3 logical blocks of 16: rank 0 owns 0, 2; rank 1 owns 1
PAGE = 1152 * 16  # pd_support.handshake: 2 caches of this many bytes per block


# ---- what is counted -----------------------------------------------------------------
@pytest.fixture
def prefill():
    s = serve_ranks({"req": TOKEN}, TABLE, NUM_TOKENS)
    yield s
    for p in s.ranks:
        p.close()


def params_for(port, **over):
    return parse_params({"do_remote_prefill": True, "remote_request_id": "req",
                         "remote_host": "127.0.0.1", "remote_port": port,
                         "remote_num_tokens": NUM_TOKENS, "shard_size": 2, "block_size": 16,
                         "transfer_token": TOKEN, "transport": "nixl", **over})


def test_a_pull_counts_the_bytes_of_every_cache_and_the_prefill_its_served_request(prefill):
    consumer = Consumer(handshake(rank=0, shard_size=1), FakeTransport(), timeout_s=5,
                        secret=None, tp_size=1)
    consumer.receive("decode-req", [10, 11, 12], params_for(prefill.port))
    got = consumer.counters.take()["decode"]["0"]
    assert got["ok"] == 1 and got["failed"] == 0 and got["blocks"] == 3
    assert got["bytes"] == 3 * 2 * PAGE  # 3 blocks x 2 caches x page bytes
    assert len(got["seconds"]) == 1 and got["seconds"][0] > 0
    assert consumer.counters.take() is None  # taken once
    for p in prefill.ranks:
        assert p.take_finished() == {"req"}
        assert p.counters.take() == {"prefill": {str(p.rank): {
            "served": 1, "released": 0, "expired": 0, "expired_blocks": 0}}}


def test_a_failed_pull_is_counted_once(prefill):
    consumer = Consumer(handshake(rank=0, shard_size=1, block_size=32), FakeTransport(),
                        timeout_s=5, secret=None, tp_size=1)
    consumer.start("decode-req", [10, 11, 12], params_for(prefill.port, block_size=32), None)
    while consumer.pending():
        time.sleep(0.01)
    assert consumer.take_results() == ({"decode-req"}, {"decode-req"})
    assert consumer.counters.take()["decode"]["0"] == {
        "ok": 0, "failed": 1, "bytes": 0, "blocks": 0, "seconds": []}
    released = sum((p.counters.take() or {}).get("prefill", {}).get(str(p.rank), {})
                   .get("released", 0) for p in prefill.ranks)
    assert released == 1  # the rank that answered the fetch got the Release


def test_expiry_counts_the_requests_blocks():
    p = Producer(handshake(rank=1), expiry_s=10.0, transport=FakeTransport())
    p.add("old", [7, 8, 9, 10], 100, TOKEN, now=0.0)
    assert p.take_finished(now=11.0) == {"old"}
    assert p.counters.take() == {"prefill": {"1": {"served": 0, "released": 0, "expired": 1,
                                                   "expired_blocks": 4}}}


def test_a_reader_that_gives_up_counts_once():
    """Only a reader holding a claim counts, however often it says Release."""
    p = Producer(handshake(), 60.0, transport=FakeTransport())
    p.add("req", TABLE, NUM_TOKENS, TOKEN)
    p.handle(Fetch(nonce=new_nonce(), request_id="req", token=TOKEN, reader="r", lease_s=30))
    for reader in ("r", "r", "never-fetched"):
        p.handle(Release(nonce=new_nonce(), request_id="req", token=TOKEN, reader=reader))
    assert p.counters.take()["prefill"]["0"]["released"] == 1


def test_a_wrong_token_counts_nothing():
    p = Producer(handshake(), 60.0, transport=FakeTransport())
    p.add("req", TABLE, NUM_TOKENS, TOKEN)
    wrong = secrets.token_urlsafe(32)
    p.handle(Release(nonce=new_nonce(), request_id="req", token=wrong, reader="r"))
    p.handle(Done(nonce=new_nonce(), request_id="req", token=wrong, reader="r", readers=1))
    assert p.counters.take() is None


def test_a_decode_prefix_cache_hit_is_not_read_or_written(prefill):
    """The decode's own cache holds logical block 0 (-1 in its table): only
    blocks 1 and 2 are read, into their own slots."""
    transport = FakeTransport()
    consumer = Consumer(handshake(rank=0, shard_size=1), transport, timeout_s=5, secret=None,
                        tp_size=1)
    consumer.receive("decode-req", [-1, 11, 12], params_for(prefill.port))
    base = 1 << 20  # cache 0 at the same address on both sides (pd_support.handshake)
    (_, reads0, _), (_, reads1, _) = transport.reads
    assert reads0[0] == (base + 4 * PAGE, base + 12 * PAGE, PAGE)  # rank 0: only block 2
    assert reads1[0] == (base + 3 * PAGE, base + 11 * PAGE, PAGE)  # rank 1: block 1
    assert len(reads0) == len(reads1) == 2  # one per cache
    assert consumer.counters.take()["decode"]["0"]["bytes"] == 2 * 2 * PAGE
    assert all(p.take_finished() == {"req"} for p in prefill.ranks)  # done all the same


@needs_vllm
def test_the_decode_scheduler_marks_its_prefix_cache_hit():
    from vllm_cp_kv.integration.connector.config import ConnectorConfig
    from vllm_cp_kv.integration.connector.scheduler import SchedulerSide

    side = SchedulerSide(ConnectorConfig.from_extra({}, False), "engine", 1, 16, False, True)
    params = {"do_remote_prefill": True, "remote_request_id": "p-1", "remote_host": "127.0.0.1",
              "remote_port": 5700, "remote_num_tokens": 40, "shard_size": 2, "block_size": 16,
              "transfer_token": TOKEN}
    request = SimpleNamespace(request_id="r", kv_transfer_params=params,
                              prompt_token_ids=[1] * 40)
    assert side.get_num_new_matched_tokens(request, 16) == (24, True)
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: [[7, 8, 9]]),
                                  24)
    ids, checked, error = side.build_connector_meta(
        SimpleNamespace(total_num_scheduled_tokens=1)).to_recv["r"]
    assert ids == [-1, 8, 9] and error is None and checked.remote_num_tokens == 40


# ---- vLLM's stats channel and Prometheus ----------------------------------------------
def snapshot(role, rank, **counts):
    c = TransferCounters(rank)
    if role == "decode":
        for n, b, s in counts.get("pulls", []):
            c.pull_ok(n, b, s)
        for _ in range(counts.get("failed", 0)):
            c.pull_failed()
    else:
        for _ in range(counts.get("served", 0)):
            c.served()
        for blocks in counts.get("expired", []):
            c.expired(blocks)
    return c.take()


@needs_vllm
def test_the_stats_sum_over_workers_and_survive_the_trip_to_the_frontend():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_cp_kv.integration.connector.connector import ShardedKVConnector
    from vllm_cp_kv.integration.connector.stats import ShardedKVStats

    assert ShardedKVConnector.build_kv_connector_stats().is_empty()
    w0 = ShardedKVStats(data=snapshot("prefill", 0, served=2, expired=[3]))
    w1 = ShardedKVStats(data=snapshot("prefill", 1, served=2))
    dec = ShardedKVStats(data=snapshot("decode", 0, pulls=[(1000, 2, 0.01), (3000, 4, 0.03)],
                                       failed=1))
    # engine: the first worker's object accumulates the others (pickled from workers)
    total = pickle.loads(pickle.dumps(w0)).aggregate(w1).aggregate(dec)
    # the engine core's outputs cross to the frontend through vLLM's msgpack
    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=total.to_dict()))
    back = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out))
    rebuilt = ShardedKVConnector.build_kv_connector_stats(
        back.scheduler_stats.kv_connector_stats)
    assert not rebuilt.is_empty()
    figures = rebuilt.reduce()
    assert figures["Pulls ok"] == 2 and figures["Pulls failed"] == 1
    assert figures["Blocks received"] == 6 and figures["MB received"] == round(4000 / 2**20, 3)
    assert figures["Avg pull time (ms)"] == 20.0
    assert figures["Requests served"] == 4 and figures["Expired reqs"] == 1
    assert figures["Expired blocks"] == 3
    # the frontend's logger accumulates intervals the same way
    assert merge({}, rebuilt.data)["prefill"]["1"]["served"] == 2


@needs_vllm
def test_the_prometheus_series_follow_the_stats():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from vllm_cp_kv.integration.connector.connector import ShardedKVConnector

    registry = CollectorRegistry()
    types = {t: partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, decode_context_parallel_size=1))
    prom = ShardedKVConnector.build_prom_metrics(cfg, types, ["model_name", "engine"],
                                                 {0: ["m", "0"]})

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    # zero-valued series exist before anything happened, for both decode ranks
    assert value("vllm:cp_kv_transfers_total", role="decode", rank="1", result="failed") == 0
    prom.observe(merge(snapshot("decode", 0, pulls=[(1000, 2, 0.01), (3000, 4, 0.03)]),
                       snapshot("decode", 1, failed=1)), 0)
    prom.observe(snapshot("prefill", 0, served=1, expired=[5]), 0)
    assert value("vllm:cp_kv_transfers_total", role="decode", rank="0", result="ok") == 2
    assert value("vllm:cp_kv_transfers_total", role="decode", rank="1", result="failed") == 1
    assert value("vllm:cp_kv_transfer_bytes_total", role="decode", rank="0") == 4000
    assert value("vllm:cp_kv_transfer_blocks_total", role="decode", rank="0") == 6
    assert value("vllm:cp_kv_transfer_seconds_count", role="decode", rank="0") == 2
    assert value("vllm:cp_kv_transfer_seconds_sum", role="decode", rank="0") == \
        pytest.approx(0.04)
    assert value("vllm:cp_kv_transfers_total", role="prefill", rank="0", result="ok") == 1
    assert value("vllm:cp_kv_expired_requests_total", role="prefill", rank="0") == 1
    assert value("vllm:cp_kv_expired_blocks_total", role="prefill", rank="0") == 5


# ---- GPU choices, with stand-ins ---------------------------------------------------------
def tensor_like(device_type, index=None, ptr=4096, numel=8, size=2):
    return SimpleNamespace(device=SimpleNamespace(type=device_type, index=index),
                           data_ptr=lambda: ptr, numel=lambda: numel,
                           element_size=lambda: size)


class RecordingAgent:
    def __init__(self):
        self.registered, self.descs = [], []

    def register_memory(self, descs, mem_type):
        self.registered.append((descs, mem_type))

    def get_agent_metadata(self):
        return b"meta"

    def get_xfer_descs(self, descs, mem_type):
        self.descs.append((descs, mem_type))
        return (descs, mem_type)


def test_nixl_memory_type_and_device_of_gpu_and_host_memory():
    assert memory_kind(tensor_like("cuda", 1)) == ("VRAM", 1)
    assert memory_kind(tensor_like("cuda", None)) == ("VRAM", 0)
    assert memory_kind(tensor_like("cpu")) == ("DRAM", 0)
    with pytest.raises(TransferError, match="not supported"):
        memory_kind(tensor_like("xpu", 0))
    agent = RecordingAgent()
    reads = [(0x1000, 0x9000, 64), (0x2000, 0xA000, 128)]  # (remote, local, bytes)
    local, remote = nixl_descs(agent, reads, ("VRAM", 0), ("VRAM", 1))
    assert local == ([(0x9000, 64, 0), (0xA000, 128, 0)], "VRAM")
    assert remote == ([(0x1000, 64, 1), (0x2000, 128, 1)], "VRAM")
    # a host-memory peer (what a CPU prefill advertises, and older handshakes)
    _, remote = nixl_descs(agent, reads, ("VRAM", 0), ("DRAM", 0))
    assert remote == ([(0x1000, 64, 0), (0x2000, 128, 0)], "DRAM")


def test_nixl_registers_cuda_caches_as_vram_of_their_device():
    t = object.__new__(NixlTransport)  # no agent: a recording stand-in
    t.agent, t.agent_name = RecordingAgent(), "a"
    t._agent_thread = SimpleNamespace(submit=lambda fn, *a: SimpleNamespace(
        result=lambda: t.__dict__.setdefault("bound", a)))  # torch.cuda.set_device(1)
    caches = [tensor_like("cuda", 1, ptr=8192 * k, numel=100) for k in (1, 2)]
    meta = t.register(caches)
    assert meta["mem_type"] == "VRAM" and meta["device_id"] == 1 and t.bound == (1,)
    assert t.agent.registered == [([(8192, 200, 1, ""), (16384, 200, 1, "")], "VRAM")]
    with pytest.raises(TransferError, match="more than one device"):
        t.register([tensor_like("cuda", 0), tensor_like("cuda", 1)])
    cpu = object.__new__(NixlTransport)
    cpu.agent, cpu.agent_name = RecordingAgent(), "b"
    meta = cpu.register([tensor_like("cpu", ptr=4096, numel=10)])
    assert (meta["mem_type"], meta["device_id"]) == ("DRAM", 0)
    assert cpu.agent.registered == [([(4096, 20, 0, "")], "DRAM")]


def test_the_transport_meta_carries_memory_type_and_device():
    from vllm_cp_kv.integration.connector.schema import TransportMeta

    meta = msgspec.msgpack.decode(msgspec.msgpack.encode(TransportMeta(
        agent_name="a", mem_type="VRAM", device_id=3)), type=TransportMeta)
    assert (meta.mem_type, meta.device_id) == ("VRAM", 3)
    assert TransportMeta().mem_type == "DRAM"
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"mem_type": "GPU"}), type=TransportMeta)


@needs_vllm
def test_the_shard_rank_is_the_dcp_rank_when_sharded_and_the_tp_rank_otherwise():
    from vllm_cp_kv.integration.connector.connector import side_rank
    from vllm_cp_kv.integration.geometry import ShardGeometry, shard_rank

    # PCP=2, TP=1: both ranks have TP rank 0; the DCP group (= PCP) tells them apart
    for r in range(2):
        assert shard_rank(2, SimpleNamespace(world_size=2, rank_in_group=r)) == r
        geometry = ShardGeometry(rank=r, size=2, block_size=16, axis="pcp")
        assert side_rank(geometry, tp_rank=0) == r
    assert shard_rank(1) == 0  # nothing sharded: one rank holds every block
    # the unsharded decode reads as its TP rank
    assert side_rank(ShardGeometry(rank=0, size=1, block_size=16), tp_rank=1) == 1
    with pytest.raises(ValueError, match="DCP group has 4 ranks"):
        shard_rank(2, SimpleNamespace(world_size=4, rank_in_group=0))


@needs_vllm
def test_v2_runner_steps_with_a_forward_are_not_empty_steps():
    from vllm_cp_kv.integration.connector.worker import WorkerSide

    side = WorkerSide()
    no_forward = SimpleNamespace(attn_metadata=None)
    side.start_step(no_forward, {})  # V2: no batch, no load kwargs
    assert side._idle_step
    side.start_step(no_forward, {"scheduler_output": object(), "num_tokens": 7})  # V2 forward
    assert not side._idle_step
    side.start_step(SimpleNamespace(attn_metadata={"layer": 1}))  # V1 forward
    assert not side._idle_step
    assert side.stats() is None


# ---- the sharding figures' files ------------------------------------------------------------
@needs_vllm
def test_worker_metric_files_read_back_by_prometheus_collector(tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from vllm_cp_kv.integration import metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(tmp_path))
    cfg = SimpleNamespace(model_config=SimpleNamespace(served_model_name="m"))
    m = metrics.ShardMetrics(cfg, shard_size=2, rank=1)
    m.set_capacity(1234)
    m.set_capacity(5678)  # the most recent value wins
    m.observe_step("prefill", 100)
    m.observe_step("prefill", 50)
    m.observe_step("decode", 7)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "m", "rank": "1", **labels})

    assert value("vllm:cp_kv_shard_size") == 2
    assert value("vllm:cp_kv_logical_capacity_tokens") == 5678
    assert value("vllm:cp_kv_steps_total", phase="prefill") == 2
    assert value("vllm:cp_kv_received_bytes_total", phase="prefill") == 150
    assert value("vllm:cp_kv_received_bytes_total", phase="decode") == 7
    # without a directory (offline): no files, only the log line
    monkeypatch.delenv(metrics.METRICS_DIR_ENV)
    assert metrics.ShardMetrics(cfg, 2, 0)._prom is None


@needs_vllm
def test_prepare_frontend_only_for_an_api_server_without_multiprocess_mode(monkeypatch):
    from vllm.usage.usage_lib import UsageContext

    from vllm_cp_kv.integration import metrics

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent")
    assert metrics.prepare_frontend(UsageContext.OPENAI_API_SERVER) is None
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    assert metrics.prepare_frontend(UsageContext.LLM_CLASS) is None
    assert metrics.prepare_frontend(UsageContext.OPENAI_API_SERVER, headless=True) is None


@needs_vllm
def test_prepare_frontend_makes_worker_figures_collectable(monkeypatch):
    """One API server (no multi-process mode): the frontend's registry
    collects what a worker writes into the directory it exports."""
    import prometheus_client
    from vllm.usage.usage_lib import UsageContext

    from vllm_cp_kv.integration import metrics

    registry = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", registry)  # the frontend's
    monkeypatch.setattr(metrics, "_FRONTEND_DIR", None)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, "")  # restored afterwards
    path = metrics.prepare_frontend(UsageContext.OPENAI_API_SERVER)
    assert path and os.environ[metrics.METRICS_DIR_ENV] == path
    assert metrics.prepare_frontend(UsageContext.OPENAI_API_SERVER) == path  # once
    # a worker (it inherits the variable)
    cfg = SimpleNamespace(model_config=SimpleNamespace(served_model_name="m"))
    metrics.ShardMetrics(cfg, shard_size=2, rank=0).observe_step("decode", 5)
    labels = {"model_name": "m", "rank": "0"}
    assert registry.get_sample_value("vllm:cp_kv_shard_size", labels) == 2
    assert registry.get_sample_value("vllm:cp_kv_steps_total", {**labels, "phase": "decode"}) == 1
