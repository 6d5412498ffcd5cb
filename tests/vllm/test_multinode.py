"""Sharded TP=2 across two hosts, real vLLM on CPU: vLLM's own multi-node
launch for its multiprocessing executor, one rank per host (network
namespaces, tests/hosts.py). Node 0 runs ``vllm serve --nnodes 2
--node-rank 0`` with the API server on its address, node 1 ``vllm serve
--nnodes 2 --node-rank 1 --headless``; every address a process binds or
advertises comes from ``--host``, ``--master-addr`` and each node's
``VLLM_HOST_IP`` and ``GLOO_SOCKET_IFNAME``.

Reference: the same two-node layout without the plugin, fp32, CPU_MLA,
PyTorch rope. The sharded layout gives exactly its greedy tokens (logprobs
within 1e-4) and twice its KV capacity (engine's figure, equal memory), with
the debug checks on and holding on both nodes. Node 0's ``/metrics`` shows
rank 0's sharding figures; a headless node serves no ``/metrics``, so
rank 1's are in node 1's log line (docs/deployment.md). Nothing either node
listens on is off its own address except torch.distributed's store.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest

from builders import free_port
from conftest import CPU_ENV, ROOT, needs_vllm
from hosts import make_hosts, post, scrape, store_port, wait_until

pytestmark = needs_vllm
NODES = ("node0", "node1")
MAX_TOKENS = 24
EXACT = ["--dtype", "float32", "--attention-backend", "CPU_MLA", "--compilation-config",
         '{"custom_ops":["all","-rotary_embedding"]}', "--block-size", "16",
         "--max-model-len", "1024", "--max-num-seqs", "8", "--enforce-eager"]


@pytest.fixture(scope="module")
def hosts():
    h = make_hosts(list(NODES))
    yield h
    h.close()


class TwoNodes:
    def __init__(self, model, hosts, workdir, name, shard):
        self.model, self.hosts, self.dir, self.name = model, hosts, workdir, name
        self.port, master = free_port(), free_port()
        self.url = f"http://{hosts.addr['node0']}:{self.port}"
        cmd = ["vllm", "serve", model, "--tensor-parallel-size", "2", "--nnodes", "2",
               "--master-addr", hosts.addr["node0"], "--master-port", str(master), *EXACT]
        if shard:
            cmd += ["--additional-config", '{"cp_kv": {"enable": true}}']
        env = {**os.environ, **CPU_ENV, "VLLM_CP_KV_DEBUG": "1", "VLLM_LOG_STATS_INTERVAL": "1",
               "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
        self.procs, self.logs = [], []
        for rank, node in enumerate(NODES):
            extra = ["--host", hosts.addr[node], "--port", str(self.port)] if rank == 0 \
                else ["--headless"]
            log = os.path.join(workdir, f"{name}-{node}.log")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                hosts.wrap(node, cmd + ["--node-rank", str(rank), *extra]), cwd=ROOT,
                env={**env, "VLLM_HOST_IP": hosts.addr[node], "GLOO_SOCKET_IFNAME": "eth0",
                     "VLLM_CPU_OMP_THREADS_BIND": str(rank)},
                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True))

        def up():
            assert all(p.poll() is None for p in self.procs), f"{name}: a node exited"
            return urllib.request.urlopen(f"{self.url}/health", timeout=5).status == 200
        wait_until(up, 400, f"{name}: both nodes serving")

    def log(self, rank):
        with open(self.logs[rank]) as f:
            return f.read()

    def generate(self, texts):
        """Greedy completions of every text, sent together (one batch)."""
        out = [None] * len(texts)

        def one(i):
            out[i] = post(f"{self.url}/v1/completions", {
                "model": self.model, "prompt": texts[i], "max_tokens": MAX_TOKENS,
                "temperature": 0, "logprobs": 1, "return_token_ids": True})
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for status, body in out:
            assert status == 200, body
        return [body["choices"][0] for _, body in out]

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=60)


@pytest.fixture(scope="module")
def runs(tiny_dsv2, hosts, tmp_path_factory):
    from vllm_cp_kv.tools.tiny_model import prompts

    d = str(tmp_path_factory.mktemp("multinode"))
    texts = prompts(6)
    out = {}
    for name, shard in (("plain", False), ("shard", True)):
        nodes = TwoNodes(tiny_dsv2, hosts, d, name, shard)
        try:
            res = {"choices": nodes.generate(texts),
                   "listening": {n: hosts.listening(n) for n in NODES}}
            if shard:  # the log line is written within a second of a step
                wait_until(lambda: "cp_kv: shard group 2 (rank 1)" in nodes.log(1), 30,
                           "node 1's sharding log line")
                res["metrics"] = {m: scrape(nodes.url, f"vllm:cp_kv_{m}") for m in
                                  ("shard_size", "logical_capacity_tokens", "steps_total")}
                res["metric_ranks"] = sorted({r for r in ("0", "1") if scrape(
                    nodes.url, "vllm:cp_kv_shard_size", rank=r)})
            res["logs"] = [nodes.log(0), nodes.log(1)]
        finally:
            nodes.stop()
        out[name] = res
    return out


def capacity(log):
    return int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))


def test_sharded_tp_across_two_hosts_equals_unsharded(runs):
    plain, shard = runs["plain"]["choices"], runs["shard"]["choices"]
    for i, (a, b) in enumerate(zip(plain, shard)):
        assert a["token_ids"] == b["token_ids"], f"prompt {i}"
        diff = max(abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"],
                                               b["logprobs"]["token_logprobs"]))
        assert diff < 1e-4, (i, diff)
    for rank, log in enumerate(runs["shard"]["logs"]):  # each node's worker is sharded
        assert "cp_kv: KV shard group of 2 ranks" in log, rank
        assert "debug invariants hold (owned writes, plan coverage)" in log, rank
        assert "LSE-merged decode equals attention over the materialized full view" in log
    assert not any("cp_kv: KV shard group" in log for log in runs["plain"]["logs"])


def test_twice_the_capacity_of_the_unsharded_layout(runs):
    ratio = capacity(runs["shard"]["logs"][0]) / capacity(runs["plain"]["logs"][0])
    assert ratio >= 1.95, ratio  # 2x, less the bounded scratch


def test_where_each_nodes_sharding_figures_are(runs):
    shard = runs["shard"]
    assert shard["metric_ranks"] == ["0"]  # node 0's /metrics: its own rank
    assert shard["metrics"]["shard_size"] == [2.0]
    assert shard["metrics"]["logical_capacity_tokens"] == [capacity(shard["logs"][0])]
    assert sum(shard["metrics"]["steps_total"]) > 0
    line = next(ln for ln in shard["logs"][1].splitlines()
                if "cp_kv: shard group 2 (rank 1)" in ln)
    assert f"logical KV capacity {capacity(shard['logs'][0])} tokens" in line, line


def test_every_node_listens_on_its_own_address(runs, hosts):
    for name in ("plain", "shard"):
        log, listening = runs[name]["logs"][0], runs[name]["listening"]
        store = store_port(log)
        assert store is not None  # two nodes rendezvous over TCP
        for node in NODES:
            off = [(h, p) for h, p in listening[node]
                   if h != hosts.addr[node] and not (node == "node0" and p == store)]
            assert not off, (name, node, off)


LISTEN = """import socket, sys, time
socks = []
for host in sys.argv[1:]:
    s = socket.socket()
    s.bind((host, 0))
    s.listen()
    socks.append(s)
    print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


def test_the_hosts_separate_loopbacks_and_see_a_socket_on_every_address(hosts):
    """The fixture itself, negative controls of the checks above: a socket
    bound to every address shows up as off the node's address, and a
    node's 127.0.0.1 is not the root namespace's."""
    proc = subprocess.Popen(hosts.wrap("node1", [sys.executable, "-c", LISTEN, "0.0.0.0",
                                                 "127.0.0.1", hosts.addr["node1"]]),
                            stdout=subprocess.PIPE, text=True)
    try:
        anywhere, loop, own = (int(proc.stdout.readline()) for _ in range(3))
        found = dict((p, h) for h, p in hosts.listening("node1"))
        assert found[anywhere] in ("0.0.0.0", "*") and found[loop] == "127.0.0.1"
        assert found[own] == hosts.addr["node1"]
        with pytest.raises(ConnectionRefusedError):  # the root's loopback, not node 1's
            socket.create_connection(("127.0.0.1", loop), timeout=5)
        socket.create_connection((hosts.addr["node1"], own), timeout=5).close()
        assert hosts.connect("node0", own, hosts.addr["node1"]) == ["open"]
    finally:
        proc.kill()
        proc.wait()
