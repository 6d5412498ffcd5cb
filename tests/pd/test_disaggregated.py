"""Disaggregated prefill, real vLLM on CPU: the example's sharded prefill
server (TP=2, cp_kv), decode server (not sharded) and proxy, all started with
``vllm serve`` / the example scripts, over NIXL (UCX over TCP) and Mooncake
(TCP). The prefill and the decode each run in a network namespace of their
own (tests/hosts.py; the proxy, the fake peers and the client in the root
namespace); where namespaces cannot be made outside CI, all on loopback.

Reference: a single unsharded instance (offline LLM, same TP) on the same
prompts: identical greedy tokens. The decode log must report every prompt
token as received from the prefill ranks.

In the default suite (one NIXL server trio, a few minutes on 2 cores): the
identity test, and a decode pointed by a client's ``kv_transfer_params`` at a
fake prefill peer that answers with a pickle (nothing runs, the request fails
naming the reason in the decode's log, the decode serves on) or at a host its
``allowed_prefill_hosts`` does not list. Both also scrape ``/metrics``: the
connector's transfer figures (vLLM's KV-connector stats channel) count every
pull and failure and exactly the bytes of the blocks moved, and the prefill
shows the plugin's sharding figures, which its worker processes write.
Across namespaces: the prefill advertises and listens on its configured
address only (its side channel refuses on the host's other address), and
the prefill killed mid-transfer gives the client an error, leaks no block on
the decode, and the decode answers the next request.

Opt-in (``VLLM_CP_KV_RUN_PD_E2E=1``; adds the Mooncake trio, which runs with
a shared side-channel secret): the negative control (the same transfer with
the logical positions dropped, a decode-side test hook, must change the
output); malformed params (HTTP 400 with the reason), a wrong token, a
shard-size mismatch: each gives an error to the client, leaks no block (KV
usage back to zero on both servers) and the decode server answers the next
request."""

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from builders import free_port
from conftest import CPU_ENV, ROOT, harness_env, needs_vllm, run_generate
from hosts import Topology, make_hosts, post, scrape, store_port, wait_until
from pd_support import FakePrefill, FakeRouter, pickled

E2E = os.environ.get("VLLM_CP_KV_RUN_PD_E2E") == "1"
pytestmark = needs_vllm
opt_in = pytest.mark.skipif(
    not E2E, reason="opt-in (VLLM_CP_KV_RUN_PD_E2E=1): the Mooncake trio and the fault "
                    "tests take about 5 more minutes on 2 cores; see docs/disaggregated.md")
TRANSPORTS = ["nixl", "mooncake"] if E2E else ["nixl"]
EXAMPLES = os.path.join(ROOT, "examples", "disaggregated")
MAX_TOKENS = 32
DECODE_TP = 1
# prefill-side expiry of unclaimed blocks: long enough for a slow fp32 decode
# on 2 cores to claim them (20 s was not), short enough to test expiry
EXPIRY_S = 60
# Exact identity on CPU (docs/disaggregated.md, "Status"): fp32 with CPU_MLA
# (block 16) and PyTorch's rope instead of vLLM 0.32's CPU rotary kernel,
# which is wrong for MLA, on every server and in the reference.
EXACT_ARGS = ('--dtype float32 --attention-backend CPU_MLA '
              '--compilation-config {"custom_ops":["all","-rotary_embedding"]}')
# the Mooncake trio runs with a shared side-channel secret (HMAC), NIXL without
SECRET = {"mooncake": secrets.token_urlsafe(24)}
OTHER = 101  # host part of the prefill's second address (namespaces only)


def kv_usage(url):
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:kv_cache_usage_perc{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_cache_usage_perc metric")


def page_bytes(model):
    """One KV block of every layer (the MLA latent, fp32, block 16), from the
    model config."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    return cfg["num_hidden_layers"] * 16 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4


def check_transfer_figures(servers):
    """The decode's figures equal what the tests sent (``servers.moved``: the
    prompt lengths of the pulls that worked; ``servers.failed``: the pulls
    that failed), through vLLM's KV-connector stats channel."""
    ok, failed = len(servers.moved), servers.failed

    def decode(sample, **labels):
        return sum(scrape(servers.url(servers.dp), sample, role="decode", **labels))

    wait_until(lambda: decode("vllm:cp_kv_transfers_total", result="ok") == ok
               and decode("vllm:cp_kv_transfers_total", result="failed") == failed,
               30, f"{ok} pulls and {failed} failures in the decode's /metrics")
    blocks = sum(-(-n // 16) for n in servers.moved) * DECODE_TP
    assert decode("vllm:cp_kv_transfer_blocks_total") == blocks
    assert decode("vllm:cp_kv_transfer_bytes_total") == blocks * page_bytes(servers.model)
    assert decode("vllm:cp_kv_transfer_seconds_count") == ok


class Servers:
    """The trio, each server where ``topo`` puts it: the prefill and the
    decode in namespaces of their own where they can be made (tests/hosts.py),
    the proxy, the fake peers and the test's client in the root namespace."""

    def __init__(self, model, transport, workdir, topo, decode_tp=DECODE_TP, sharded=False):
        self.model, self.transport, self.dir, self.topo = model, transport, workdir, topo
        self.pp, self.dp, self.xp = free_port(), free_port(), free_port()
        self.side = free_port(consecutive=2)
        self.fake = free_port(consecutive=2)  # where a test's fake prefill peer listens
        self.host = {role: topo.addr(role) for role in ("prefill", "decode", "proxy")}
        self._role = {self.pp: "prefill", self.dp: "decode", self.xp: "proxy"}
        bin_dir = os.path.dirname(sys.executable)
        env = {**os.environ, **CPU_ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}",
               "EXPIRY_S": str(EXPIRY_S), "EXTRA_ARGS": EXACT_ARGS, "BLOCK_SIZE": "16",
               "EAGER": "1"}
        env.pop("VLLM_CP_KV_SIDE_CHANNEL_SECRET", None)
        if transport in SECRET:
            env["VLLM_CP_KV_SIDE_CHANNEL_SECRET"] = SECRET[transport]
        self.procs = {}
        self.logs = {}
        self.moved, self.failed = [], 0  # pulls the tests made (check_transfer_figures)
        self._start("prefill", ["bash", f"{EXAMPLES}/start_prefill.sh", model, str(self.pp),
                                transport, str(self.side)],
                    {**env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
        allowed = [f"{self.host['prefill']}:{self.side}", f"{self.host['proxy']}:{self.fake}"]
        self._start("decode", ["bash", f"{EXAMPLES}/start_decode.sh", model, str(self.dp),
                               transport],
                    {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind" if decode_tp == 1 else "0|1",
                     "TP": str(decode_tp), "ALLOWED_PREFILL_HOSTS": json.dumps(allowed),
                     **({"SHARDED": "1"} if sharded else {}),
                     # the test hooks of the negative control and the kill
                     # mid-transfer (scripts/gpu/onegpu/pd_hooks.py)
                     **harness_env(CPKV_TEST_HOOKS="1")})
        self._start("proxy", [sys.executable, f"{EXAMPLES}/proxy.py", "--prefill",
                              self.url(self.pp), "--decode", self.url(self.dp),
                              "--host", self.host["proxy"], "--port", str(self.xp)], env)
        for name, port in (("prefill", self.pp), ("decode", self.dp), ("proxy", self.xp)):
            wait_until(lambda p=port: urllib.request.urlopen(
                f"{self.url(p)}/health", timeout=5).status == 200, 400, name)

    def url(self, port):
        return f"http://{self.host[self._role[port]]}:{port}"

    def _start(self, name, cmd, env):
        path = os.path.join(self.dir, f"{name}-{self.transport}.log")
        self.logs[name] = path
        env = {**env, **self.topo.env(name), "HOST": self.host[name]}
        self.procs[name] = subprocess.Popen(self.topo.wrap(name, cmd), env=env, cwd=ROOT,
                                            start_new_session=True,
                                            stdout=open(path, "w"), stderr=subprocess.STDOUT)

    def log(self, name):
        with open(self.logs[name]) as f:
            return f.read()

    def kill(self, name):
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)

    def stop(self):
        for name in list(self.procs):
            self.kill(name)

    def completion(self, port, prompt, request_id=None, **extra):
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "return_token_ids": True, **extra}
        headers = {"X-Request-Id": request_id} if request_id else None
        return post(f"{self.url(port)}/v1/completions", body, headers=headers)

    def num_tokens(self, prompt):
        status, out = post(f"{self.url(self.dp)}/tokenize",
                           {"model": self.model, "prompt": prompt})
        assert status == 200, out
        return out["count"]

    def prefill_params(self, prompt):
        status, out = self.completion(self.pp, prompt, max_tokens=1,
                                      kv_transfer_params={"do_remote_decode": True})
        assert status == 200, out
        return out["kv_transfer_params"]


@pytest.fixture(scope="module")
def reference(tiny_dsv2, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pd_ref"))
    return run_generate(tiny_dsv2, d, "reference", "--tp", str(DECODE_TP), "--block-size", "16",
                        "--dtype", "float32", "--backend", "CPU_MLA", "--torch-rope")


@pytest.fixture(scope="module")
def topo():
    """The prefill and the decode on hosts of their own (network namespaces;
    the prefill's interface has a second address, which nothing may listen
    on); where namespaces cannot be made (not root, and not under CI), all
    on loopback."""
    hosts = make_hosts(["prefill", "decode"], fallback=True)
    if hosts is not None:
        hosts.add_address("prefill", hosts.address(OTHER))
    yield Topology(hosts)
    if hosts is not None:
        hosts.close()


@pytest.fixture(scope="module", params=TRANSPORTS)
def servers(request, tiny_dsv2, tmp_path_factory, topo):
    s = Servers(tiny_dsv2, request.param, str(tmp_path_factory.mktemp(f"pd_{request.param}")),
                topo)
    yield s
    s.stop()


def test_sharded_prefill_to_unsharded_decode_matches_single_instance(servers, reference):
    from vllm_cp_kv.tools.tiny_model import prompts

    texts = prompts(len(reference["tokens"]))
    got = []
    for text in texts:
        status, out = servers.completion(servers.xp, text)  # through the proxy
        assert status == 200, out
        got.append(out["choices"][0])
    for i, (choice, ref_tokens) in enumerate(zip(got, reference["tokens"])):
        assert choice["token_ids"] == ref_tokens, f"prompt {i}"
        assert choice["text"] == reference["texts"][i]
    # the decode side received every prompt token from the prefill ranks
    log = servers.log("decode")
    received = [int(line.split(" received ")[1].split(" tokens")[0])
                for line in log.splitlines() if "cp_kv connector: request" in line
                and " received " in line]
    assert sorted(received) == sorted(reference["prompt_lens"] * DECODE_TP), received
    assert "from 2 prefill ranks" in log
    # no leaked blocks: both servers return to an empty cache
    wait_until(lambda: kv_usage(servers.url(servers.dp)) == 0.0, 60, "decode KV usage 0")
    wait_until(lambda: kv_usage(servers.url(servers.pp)) == 0.0, 60, "prefill KV usage 0")
    # /metrics: the transfers (vLLM's stats channel) ...
    servers.moved += reference["prompt_lens"]
    check_transfer_figures(servers)
    for rank in ("0", "1"):  # every prefill rank served every request once
        wait_until(lambda r=rank: sum(scrape(servers.url(servers.pp), "vllm:cp_kv_transfers_total",
                                             role="prefill", rank=r, result="ok"))
                   == len(texts), 30, f"prefill rank {rank}'s served requests")
    # ... and the plugin's sharding figures, written by the prefill's workers
    for rank in ("0", "1"):
        assert scrape(servers.url(servers.pp), "vllm:cp_kv_shard_size", rank=rank) == [2.0]
        assert scrape(servers.url(servers.pp), "vllm:cp_kv_logical_capacity_tokens", rank=rank)[0] > 0
        assert sum(scrape(servers.url(servers.pp), "vllm:cp_kv_steps_total", rank=rank)) > 0
    # streamed through the proxy (what `vllm bench serve` sends): the same text
    assert streamed_text(servers, texts[0]) == reference["texts"][0]
    servers.moved.append(reference["prompt_lens"][0])


def streamed_text(servers, prompt):
    """The text of a ``"stream": true`` completion through the proxy, from
    its server-sent events (more than one: it was streamed)."""
    body = {"model": servers.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{servers.url(servers.xp)}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers.get("content-type", "").startswith("text/event-stream")
        events = [line[len(b"data: "):].strip() for line in r if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) > 2, events
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def decode_log_has(servers, phrase, timeout=30):
    wait_until(lambda: phrase in servers.log("decode"), timeout, f"'{phrase}' in the decode log")


def decode_serves_on(servers):
    wait_until(lambda: kv_usage(servers.url(servers.dp)) == 0.0, 60, "decode KV usage 0 after a failure")
    status, out = servers.completion(servers.dp, "The next request works.")
    assert status == 200 and out["choices"][0]["token_ids"], out


def test_a_fake_prefill_peer_runs_nothing_on_the_decode(servers, tmp_path):
    """A client points the decode (through kv_transfer_params) at a peer of
    its choice that answers with a pickle whose unpickling would create a
    marker file; the previous side channel (multiprocessing.connection) ran
    it. Then at a host the decode's allow-list does not name."""
    text = "A client may name any host in the params it sends. " * 3
    # what a prefill would answer, made up (no prefill blocks wait for it)
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_request_id": "cmpl-made-up-0-0000", "remote_host": servers.host["proxy"],
              "remote_port": servers.side, "remote_num_tokens": servers.num_tokens(text),
              "shard_size": 2, "block_size": 16, "ownership_rule": "cyclic",
              "transport": servers.transport, "transfer_token": secrets.token_urlsafe(32)}
    marker = tmp_path / "ran-on-decode"
    fakes = [FakeRouter(servers.fake + r, [pickled(str(marker)), b""], servers.host["proxy"])
             for r in range(2)]
    request_id = f"fake-peer-{servers.transport}"
    try:
        status, out = servers.completion(servers.dp, text, request_id=request_id,
                                         kv_transfer_params=dict(params,
                                                                 remote_port=servers.fake))
        assert status != 200, out
        # the reason, under the request's name, in the decode's log
        reason = ("CURVE handshake" if servers.transport in SECRET else "malformed reply")
        decode_log_has(servers, f"request cmpl-{request_id}-0")
        line = next(l for l in servers.log("decode").splitlines()
                    if f"cmpl-{request_id}-0" in l and "failed to receive its KV" in l)
        assert reason in line, line
        # it talked to the fake peer; with a secret (CURVE) not one frame got through
        assert fakes[0].received == 0 if servers.transport in SECRET else fakes[0].received >= 1
    finally:
        for f in fakes:
            f.close()
    assert not marker.exists()
    decode_serves_on(servers)
    servers.failed += 1
    # a prefill host the allow-list does not name: refused before any connection
    status, out = servers.completion(servers.dp, text, request_id=f"{request_id}-off-list",
                                     kv_transfer_params=dict(params, remote_host="192.0.2.1"))
    assert status != 200, out
    phrase = "allowed_prefill_hosts does not list"
    if status == 400:  # the frontend check (patch_input_processor) answered
        assert phrase in out["error"]["message"], out
    else:  # without it, the decode's scheduler refuses the load
        decode_log_has(servers, phrase)
        servers.failed += 1
    decode_serves_on(servers)
    check_transfer_figures(servers)  # the failed pull counted, nothing else


def test_a_fake_peers_nixl_metadata_leaves_the_real_prefill_working(servers, reference):
    """The attack that broke the decode until restart (no allow-list naming
    only the real prefill, no secret): a client makes a prefill request of
    its own, fetches its handshakes from the prefill ranks as a decode would
    (learning the real agent's metadata), then points the decode at a fake
    prefill answering that handshake with the metadata cut by one byte under
    a new agent name. Before, NIXL then lost the real agent and every later
    request failed (``metadata for remote agent ... not found``); now the
    fake's metadata is refused and the next P/D request through the real
    prefill gives the single instance's tokens."""
    import msgspec

    from vllm_cp_kv.integration.connector import side_channel as sc
    from vllm_cp_kv.tools.tiny_model import prompts

    if servers.transport != "nixl":
        pytest.skip("NIXL's remote agents (Mooncake sessions are checked against the host)")
    text = "An attacker first asks the prefill for a request of its own. " * 3
    own = servers.prefill_params(text)
    replies = []
    for r in range(2):  # fetch and free the own request's blocks, as a decode would
        with sc.SideChannelClient(servers.host["prefill"], servers.side + r, None, 30) as c:
            ask = dict(nonce=sc.new_nonce(), request_id=own["remote_request_id"],
                       token=own["transfer_token"], reader="attacker")
            # the prefill's workers learn of the finished request at its next
            # engine step: a fast asker is refused until then (a decode retries too)
            deadline = time.monotonic() + 30
            while True:
                try:
                    replies.append(c.ask(sc.Fetch(lease_s=30, **ask), sc.FetchReply))
                    break
                except sc.Refused:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
                    ask["nonce"] = sc.new_nonce()
            c.ask(sc.Done(**dict(ask, nonce=sc.new_nonce()), readers=1), sc.Ok)
    meta = replies[0].handshake.transport_meta
    cut = msgspec.structs.replace(meta, agent_name="fake-" + secrets.token_hex(4),
                                  agent_metadata=meta.agent_metadata[:-1])

    def answer(r):
        hs = msgspec.structs.replace(replies[r].handshake, transport_meta=cut)
        return lambda msg: sc.FetchReply(
            nonce=msg.nonce, handshake=hs, manifest=replies[r].manifest,
            lease_s=msg.lease_s) if isinstance(msg, sc.Fetch) else sc.Ok(nonce=msg.nonce)

    fakes = [FakePrefill(servers.fake + r, answer(r), host=servers.host["proxy"])
             for r in range(2)]
    try:
        fake = dict(own, remote_host=servers.host["proxy"], remote_port=servers.fake,
                    transfer_token=secrets.token_urlsafe(32))
        status, out = servers.completion(servers.dp, text, request_id="fake-nixl-meta",
                                         kv_transfer_params=fake)
        assert status != 200, out
        servers.failed += 1
    finally:
        for f in fakes:
            f.close()
    first = prompts(1)[0]
    status, out = servers.completion(servers.xp, first)  # through the real prefill
    assert status == 200, (out, [ln for ln in servers.log("decode").splitlines()
                                 if "failed to receive" in ln][-1:])
    assert out["choices"][0]["token_ids"] == reference["tokens"][0]
    servers.moved.append(reference["prompt_lens"][0])
    decode_log_has(servers, "does not load")  # the fake's metadata, refused
    check_transfer_figures(servers)


def test_the_prefill_listens_on_and_advertises_its_address_only(servers, topo):
    """Across hosts: the prefill answers with its configured address
    (``SIDE_HOST``), its side-channel sockets are bound to that address
    alone (from the decode's namespace: that address connects, the prefill
    host's other address refuses), and every socket the prefill's processes
    listen on is on that address, except torch.distributed's store where
    vLLM has one and Mooncake's (docs/deployment.md)."""
    if topo.hosts is None:
        pytest.skip("needs network namespaces (root): the trio runs on loopback here")
    hosts, addr = topo.hosts, servers.host["prefill"]
    text = "Every rank sends only its owned blocks with their logical positions. " * 3
    params = servers.prefill_params(text)
    assert params["remote_host"] == addr and params["remote_port"] == servers.side, params
    status, out = servers.completion(servers.dp, text, kv_transfer_params=params)
    assert status == 200 and out["choices"][0]["token_ids"], out  # and it pulls from there
    servers.moved.append(servers.num_tokens(text))
    listening = hosts.listening("prefill")
    for port in (servers.side, servers.side + 1):  # one side channel per prefill rank
        assert [h for h, p in listening if p == port] == [addr], (port, listening)
    assert hosts.connect("decode", servers.side, addr, hosts.address(OTHER)) == [
        "open", "ConnectionRefusedError"]
    store = store_port(servers.log("prefill"))  # one node: None
    off = [(h, p) for h, p in listening if h != addr and p != store]
    if servers.transport == "mooncake":
        # Mooncake's transfer engine binds its handshake RPC server and its
        # TCP transport to every address, two sockets a rank, and takes no
        # address to bind (docs/deployment.md: firewall them)
        assert len(off) == 4 and all(h in ("0.0.0.0", "*") for h, _ in off), off
    else:
        assert not off, off


@opt_in
def test_dropping_logical_positions_changes_the_output(servers, reference):
    """Negative control: the receiver without the position mapping."""
    from vllm_cp_kv.tools.tiny_model import prompts

    # MLA attention over cached keys does not depend on where a *full* block
    # sits (its rope position is in k_pe; the sum over keys is order-free), so
    # the control needs a prompt whose partially filled last block moves when
    # blocks are written in arrival order (rank 0's, then rank 1's): an odd
    # number (>= 3) of 16-token blocks, the last one partial.
    def moves(n, bs=16):
        return -(-n // bs) % 2 == 1 and n > 2 * bs and n % bs != 0

    lens = reference["prompt_lens"]
    i = max((k for k in range(len(lens)) if moves(lens[k])), key=lambda k: lens[k])
    text = prompts(len(reference["tokens"]))[i]
    params = servers.prefill_params(text)
    status, out = servers.completion(servers.dp, text, kv_transfer_params=dict(
        params, cp_kv_test_ignore_positions=True))
    assert status == 200, out
    assert out["choices"][0]["token_ids"] != reference["tokens"][i]


def _expect_failure(servers, text, params, phrase):
    """Refused by the decode's connector at run time: HTTP 500, the reason
    in the decode log."""
    status, out = servers.completion(servers.dp, text, kv_transfer_params=params)
    assert status != 200, out
    decode_log_has(servers, phrase)
    decode_serves_on(servers)


def _expect_refused(servers, text, params, phrase):
    """Refused by the frontend: HTTP 400 with the reason (needs the plugin's
    patch_input_processor)."""
    status, out = servers.completion(servers.dp, text, kv_transfer_params=params)
    assert status == 400 and phrase in out["error"]["message"], (status, out)
    decode_serves_on(servers)


@opt_in
def test_malformed_out_of_range_and_mismatched_params_fail_cleanly(servers):
    if servers.transport != "nixl":
        pytest.skip("fault tests run on NIXL only (same connector code path)")
    text = "Each logical block lives on exactly one rank of the shard group. " * 4
    good = servers.prefill_params(text)
    # found at run time (the prefill's blocks must still be there: first)
    _expect_failure(servers, text, dict(good, shard_size=4), "handshake mismatch")
    _expect_failure(servers, text + " More.", good, "tokens but the prompt has")
    # refused by the frontend
    missing = {k: v for k, v in good.items() if k != "transfer_token"}
    _expect_refused(servers, text, missing, "missing required field `transfer_token`")
    _expect_refused(servers, text, dict(good, remote_port=str(good["remote_port"])),
                    "Expected `int`, got `str`")
    _expect_refused(servers, text, dict(good, remote_block_ids=[10 ** 12]), "remote_block_ids")
    # the prefill side frees the unclaimed blocks after its expiry
    wait_until(lambda: kv_usage(servers.url(servers.pp)) == 0.0, EXPIRY_S + 90,
               "prefill KV usage 0 after expiry")
    assert f"expired after {EXPIRY_S} s" in servers.log("prefill")


@opt_in
def test_a_wrong_token_is_refused_and_the_owner_still_completes(servers):
    if servers.transport != "nixl":
        pytest.skip("fault tests run on NIXL only (same connector code path)")
    text = "Only the holder of a request's transfer token may read its blocks. " * 3
    params = servers.prefill_params(text)
    stolen = dict(params, transfer_token=secrets.token_urlsafe(32))
    status, out = servers.completion(servers.dp, text, kv_transfer_params=stolen)
    assert status != 200, out
    decode_log_has(servers, "no transfer for this request id and token")
    # the refusals claimed and freed nothing: the owner's pull works
    status, out = servers.completion(servers.dp, text, kv_transfer_params=params)
    assert status == 200 and out["choices"][0]["token_ids"], out


def test_prefill_killed_mid_transfer(servers):
    if servers.transport != "nixl":
        pytest.skip("fault tests run on NIXL only (same connector code path)")
    text = "The lazy dog sleeps while the fox jumps. " * 10
    params = servers.prefill_params(text)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=servers.completion(
        servers.dp, text, request_id="killed-mid-transfer",
        kv_transfer_params=dict(params, cp_kv_test_pause_s=15))))
    t.start()
    # the test hook logs when rank 0's blocks are read and the pull pauses
    decode_log_has(servers, "test hook: request cmpl-killed-mid-transfer-0", timeout=120)
    servers.kill("prefill")
    t.join(timeout=200)
    status, out = result["r"]
    assert status != 200, out
    decode_log_has(servers, "failed to receive its KV")
    decode_serves_on(servers)


@opt_in
def test_sharded_decode_through_the_example_scripts(tiny_dsv2, reference, topo, tmp_path):
    """``SHARDED=1 TP=2`` on the example decode (start_decode.sh), the
    prefill and the decode on hosts of their own where namespaces can be
    made: the single instance's tokens; each decode rank receives exactly the
    blocks it owns (block j on rank j mod 2: its log lines and its /metrics);
    a prefill killed mid-transfer fails that request and leaves no block held
    (the decode's KV usage back to 0)."""
    import re

    from vllm_cp_kv.tools.tiny_model import prompts

    s = Servers(tiny_dsv2, "nixl", str(tmp_path), topo, decode_tp=2, sharded=True)
    try:
        for i, text in enumerate(prompts(len(reference["tokens"]))):
            status, out = s.completion(s.xp, text)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == reference["tokens"][i], f"prompt {i}"
        got = {0: [], 1: []}
        for m in re.finditer(r"received (\d+) tokens \((\d+) blocks.* \(decode rank (\d)/2",
                             s.log("decode")):
            got[int(m[3])].append((int(m[1]), int(m[2])))
        for d in (0, 1):
            owned = [[j for j in range(-(-n // 16)) if j % 2 == d] for n in reference["prompt_lens"]]
            want = sorted((sum(min(16, n - 16 * j) for j in js), len(js))
                          for n, js in zip(reference["prompt_lens"], owned))
            assert sorted(got[d]) == want, (d, got[d])
            blocks = sum(len(js) for js in owned)
            wait_until(lambda d=d, b=blocks: sum(scrape(
                s.url(s.dp), "vllm:cp_kv_transfer_blocks_total", role="decode",
                rank=str(d))) == b, 30, f"decode rank {d}'s {blocks} blocks in /metrics")
        wait_until(lambda: kv_usage(s.url(s.dp)) == 0.0, 60, "decode KV usage 0")
        # decode rank 1 reads its blocks after the pause, from the killed rank
        test_prefill_killed_mid_transfer(s)
    finally:
        s.stop()
