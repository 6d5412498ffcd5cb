"""Network namespaces standing in for hosts, and the calls the tests make to
the servers they start on them (``post``, ``scrape``, ``wait_until``).

``Hosts(names)`` makes one namespace per name, each with an interface
``eth0`` on a private /24 of the benchmarking range (198.18.0.0/15), joined
by a bridge in a namespace of its own; the root namespace (where pytest and
its clients run) joins the bridge too, at ``.254``. Nothing else is
touched: no routes, no forwarding, no firewall rules; ``close`` removes
everything it made. Every namespace has its own loopback, so a server bound
to 127.0.0.1 in one is unreachable from the others, as on separate hosts.

What the namespaces do not separate: the file system and ``/dev/shm``
(vLLM 0.32's CPU TP group uses shared memory across its ranks whatever the
node, see docs/deployment.md), CPU cores and the process table.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

SUBNETS = 512  # /24s in 198.18.0.0/15


def _ip(*args, ns=None):
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, names):
        n = os.getpid() % SUBNETS
        net = self.net = f"198.{18 + n // 256}.{n % 256}"
        self.tag = f"cpkv{os.getpid()}"
        self.ns = {name: f"{self.tag}-{name}" for name in names}
        self.addr = {name: f"{net}.{i + 1}" for i, name in enumerate(names)}
        self.root_addr = f"{net}.254"
        self._switch = f"{self.tag}-sw"
        self._made = []
        try:
            self._make(net)
        except Exception:
            self.close()
            raise

    def _make(self, net):
        _ip("netns", "add", self._switch)
        self._made.append(("netns", self._switch))
        _ip("link", "add", "br0", "type", "bridge", ns=self._switch)
        _ip("link", "set", "br0", "up", ns=self._switch)
        for i, (name, ns) in enumerate(self.ns.items()):
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            a, b = f"{self.tag}h{i}", f"{self.tag}s{i}"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", b, "netns", self._switch)
            _ip("link", "set", b, "master", "br0", "up", ns=self._switch)
            _ip("link", "set", a, "netns", ns)
            _ip("link", "set", a, "name", "eth0", ns=ns)
            _ip("addr", "add", f"{self.addr[name]}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        root, peer = f"{self.tag}r", f"{self.tag}rs"
        _ip("link", "add", root, "type", "veth", "peer", "name", peer)
        self._made.append(("link", root))
        _ip("link", "set", peer, "netns", self._switch)
        _ip("link", "set", peer, "master", "br0", "up", ns=self._switch)
        _ip("addr", "add", f"{self.root_addr}/24", "dev", root)
        _ip("link", "set", root, "up")

    def address(self, host_part: int) -> str:
        return f"{self.net}.{host_part}"

    def add_address(self, name, addr):
        """A second address on ``name``'s interface (same subnet)."""
        _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=self.ns[name])

    def wrap(self, name, cmd):
        """``cmd`` run inside ``name``'s namespace."""
        return ["ip", "netns", "exec", self.ns[name], *cmd]

    def run(self, name, cmd, **kw):
        return subprocess.run(self.wrap(name, cmd), capture_output=True, text=True, **kw)

    def listening(self, name):
        """(address, port) of every TCP socket listening in ``name``."""
        out = self.run(name, ["ss", "-Hltn"], check=True).stdout
        found = []
        for line in out.splitlines():
            local = line.split()[3]
            host, port = local.rsplit(":", 1)
            found.append((host.strip("[]"), int(port)))
        return found

    def connect(self, name, port, *addrs):
        """From inside ``name``: connect to ``port`` at each of ``addrs``;
        ``"open"`` or the error's class name for each."""
        out = self.run(name, [sys.executable, "-c", _CONNECT, str(port), *addrs],
                       check=True, timeout=60).stdout
        return out.split()

    def close(self):
        for kind, what in reversed(self._made):
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", what], capture_output=True)
            else:
                subprocess.run(["ip", "link", "del", what], capture_output=True)
        self._made = []


def make_hosts(names, fallback: bool = False):
    """``Hosts(names)``; where namespaces cannot be made: a failure under CI,
    else ``None`` with ``fallback`` (the caller runs on loopback), else a
    skip naming why."""
    from pd_support import skip_or_fail

    from conftest import IN_CI

    why = None
    if shutil.which("ip") is None or shutil.which("ss") is None:
        why = "needs iproute2 (ip, ss)"
    elif os.geteuid() != 0:
        why = "network namespaces need root"
    if why is None:
        try:
            _remove_stale()
            return Hosts(names)
        except subprocess.CalledProcessError as e:
            why = f"cannot make network namespaces: {' '.join(e.cmd)}: {e.stderr.strip()}"
    if fallback and not IN_CI:
        print(f"hosts: {why}; running on loopback")
        return None
    skip_or_fail(why)


_CONNECT = """import socket, sys
for host in sys.argv[2:]:
    try:
        socket.create_connection((host, int(sys.argv[1])), timeout=5).close()
        print("open")
    except OSError as e:
        print(type(e).__name__)
"""


def store_port(log: str) -> int | None:
    """torch.distributed's store port from a vLLM log (vLLM binds that store
    to every address); None where the ranks rendezvous through a file (one
    node)."""
    m = re.search(r"distributed_init_method=tcp://[\d.]+:(\d+)", log)
    return int(m[1]) if m else None


def _remove_stale():
    """Namespaces and links an earlier, killed test run left (named after a
    process that no longer exists)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    names += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    for name in names:
        m = re.match(r"cpkv(\d+)", name)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            kind = "netns" if "-" in name else "link"
            subprocess.run(["ip", kind, "del", name], capture_output=True)


class Topology:
    """Where each role runs: in its namespace of ``hosts`` (roles it names)
    or, for the others and without ``hosts``, in the root namespace, the
    test's. ``addr`` is the address a role binds and is reached at."""

    def __init__(self, hosts: Hosts | None):
        self.hosts = hosts

    def addr(self, role: str) -> str:
        if self.hosts is None:
            return "127.0.0.1"
        return self.hosts.addr.get(role, self.hosts.root_addr)

    def _inside(self, role: str) -> bool:
        return self.hosts is not None and role in self.hosts.ns

    def wrap(self, role: str, cmd: list) -> list:
        return self.hosts.wrap(role, cmd) if self._inside(role) else cmd

    def env(self, role: str) -> dict:
        """What vLLM, gloo and UCX need to use the role's interface. UCX
        would take its shared-memory transports between namespaces of one
        machine (one /dev/shm, one process table): TCP only, as between
        hosts without RDMA."""
        env = {"VLLM_HOST_IP": self.addr(role)}
        if self._inside(role):
            env.update(GLOO_SOCKET_IFNAME="eth0", UCX_NET_DEVICES="eth0", UCX_TLS="tcp")
        return env


# Talking to the servers the tests start (pd/test_disaggregated.py,
# vllm/test_multinode.py)
def post(url, body, timeout=300, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def scrape(url, sample, **labels):
    """Values of ``sample`` under ``/metrics`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return [s.value for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]


def wait_until(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")
