"""The connector's settings (``kv_connector_extra_config``), checked once.

Unknown keys are refused: a misspelt security setting (``allowed_prefil_hosts``)
must not silently leave the decode open.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from .auth import load_secret
from .schema import MAX_READERS

TRANSPORTS = ("nixl", "mooncake")
KEYS = ("transport", "side_channel_host", "side_channel_port", "transfer_timeout_s",
        "blocks_expiry_s", "idle_step_s", "side_channel_secret_env", "allowed_prefill_hosts",
        "max_shard_size", "allow_any_prefill")
MAX_SHARD_SIZE = 64  # default bound of a request's prefill ranks (shard_size)


def _number(extra: dict, key: str, default: float, low: float, high: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"ShardedKVConnector: {key} must be a number in [{low:g}, {high:g}], "
                         f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ConnectorConfig:
    transport: str = "nixl"
    host: str = "127.0.0.1"  # side channel: bound here, advertised to the decode
    port: int = 5700  # prefill rank r serves on port + r
    timeout_s: float = 30.0  # decode: a request's side-channel exchange, and every read
    expiry_s: float = 120.0  # prefill: unclaimed blocks are freed after this
    # longest wait of an idle engine (only transfers pending) for a client
    # request before it steps again to poll the transfers; a request, an abort
    # or any other client call ends the wait at once (plugin.py item 25)
    idle_step_s: float = 1.0
    secret: bytes | None = field(default=None, repr=False)
    # decode: prefill hosts (``host`` or ``host:port``) the params may name; None: any
    allowed_prefill_hosts: tuple[str, ...] | None = None
    max_shard_size: int = MAX_SHARD_SIZE  # decode: most prefill ranks a request may name
    host_set: bool = False  # host came from side_channel_host or VLLM_HOST_IP
    # decode on a non-loopback host without an allow-list (a secret does not
    # count: clients still choose the hosts): start anyway
    allow_any_prefill: bool = False

    @classmethod
    def from_extra(cls, extra: dict | None, is_producer: bool) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(f"ShardedKVConnector: unknown kv_connector_extra_config keys "
                             f"{unknown}; accepted: {list(KEYS)}")
        transport = extra.get("transport", "nixl")
        if transport not in TRANSPORTS:
            raise ValueError(f"ShardedKVConnector: unknown transport {transport!r}; "
                             f"accepted: {list(TRANSPORTS)}")
        host = extra.get("side_channel_host", os.environ.get("VLLM_HOST_IP") or "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ValueError(f"ShardedKVConnector: side_channel_host must be a host, got {host!r}")
        allowed = extra.get("allowed_prefill_hosts")
        if allowed is not None:
            if (not isinstance(allowed, list)
                    or not all(isinstance(h, str) and h for h in allowed)):
                raise ValueError("ShardedKVConnector: allowed_prefill_hosts must be a list of "
                                 f"'host' or 'host:port' strings, got {allowed!r}")
            allowed = tuple(allowed)
        allow_any = extra.get("allow_any_prefill", False)
        if not isinstance(allow_any, bool):
            raise ValueError("ShardedKVConnector: allow_any_prefill must be true or false, "
                             f"got {allow_any!r}")
        secret_env = extra.get("side_channel_secret_env")
        if secret_env is not None and (not isinstance(secret_env, str) or not secret_env):
            raise ValueError("ShardedKVConnector: side_channel_secret_env must name an "
                             f"environment variable, got {secret_env!r}")
        return cls(
            transport=transport, host=host,
            host_set="side_channel_host" in extra or bool(os.environ.get("VLLM_HOST_IP")),
            port=int(_number(extra, "side_channel_port", 5700, 1, 65535)),
            timeout_s=_number(extra, "transfer_timeout_s", 30.0, 0.1, 3600),
            expiry_s=_number(extra, "blocks_expiry_s", 120.0, 0.1, 86400),
            # the producer only waits to free blocks, the consumer waits for data
            idle_step_s=_number(extra, "idle_step_s", 1.0 if is_producer else 0.01, 0, 60),
            secret=load_secret(secret_env), allowed_prefill_hosts=allowed,
            max_shard_size=int(_number(extra, "max_shard_size", MAX_SHARD_SIZE, 1, MAX_READERS)),
            allow_any_prefill=allow_any)


def check_decode_exposure(cfg: ConnectorConfig, machine_host: str | None = None) -> None:
    """A decode (kv_consumer) reachable beyond this host fetches from
    whatever prefill a client's ``kv_transfer_params`` name (it connects to
    any host and up to ``max_shard_size`` ports, and holds the request while
    a silent listener lets it wait): off loopback it refuses to start
    without an allow-list of prefill hosts, unless ``allow_any_prefill``
    says so. A shared secret alone is not enough: it authenticates the
    prefills that answer, but clients still choose where the decode
    connects (a port scan from the decode's host). Loopback-only setups are
    unchanged.

    The decode's host: ``side_channel_host`` or ``VLLM_HOST_IP`` where set
    (``cfg.host``), else ``machine_host``, the address vLLM itself takes for
    this machine (``get_ip()``): vLLM's HTTP server and the transports'
    listeners are on the network by default."""
    if cfg.allowed_prefill_hosts is not None or cfg.allow_any_prefill:
        return
    host = cfg.host if cfg.host_set or machine_host is None else machine_host
    if not is_loopback(host):
        raise ValueError(
            f"ShardedKVConnector: this decode runs on {host} (not loopback) without "
            "allowed_prefill_hosts, so any client could make it connect to any host and "
            "ports it names (a shared secret authenticates the prefills that answer, not "
            "where the decode connects). Set allowed_prefill_hosts (the prefill hosts, or "
            "host:port, it may fetch from), or \"allow_any_prefill\": true in "
            "kv_connector_extra_config if every client is trusted (docs/disaggregated.md, "
            "Security).")


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP literal (no name resolution)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_allowed(allowed: tuple[str, ...] | None, host: str, port: int) -> bool:
    """Whether the params' prefill ``host``/``port`` is on the allow-list.

    Entries are ``host`` (any port) or ``host:port`` (that side-channel base
    port; ``[v6addr]:port`` for IPv6). Compared as strings, case-insensitive,
    no name resolution: list what the prefill advertises (its
    ``side_channel_host``)."""
    if allowed is None:
        return True
    host = host.lower()
    for entry in allowed:
        entry = entry.lower()
        if entry == host or entry == f"[{host}]":
            return True
        if entry.startswith("["):
            name, _, rest = entry[1:].partition("]")
            entry_port = rest[1:] if rest.startswith(":") else None
        elif entry.count(":") == 1:
            name, entry_port = entry.split(":")
        else:
            continue  # a bare IPv6 address: compared above
        if name == host and entry_port == str(port):
            return True
    return False
