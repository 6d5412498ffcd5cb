"""KV connector for disaggregated prefill from a sharded prefill instance.

Load it with::

    --kv-transfer-config '{"kv_connector": "ShardedKVConnector",
        "kv_connector_module_path": "vllm_cp_kv.integration.connector",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_connector_extra_config": {"transport": "nixl" | "mooncake",
                                      "side_channel_port": 5700}}'

Prefill (producer, sharded with ``cp_kv`` over TP, or on GPU over the PCP
group; the shard rank is the rank in vLLM's DCP group): a finished request
keeps its blocks and its client gets ``kv_transfer_params`` with a
per-request transfer token; every shard rank serves, on ``side_channel_port +
rank``, the handshake (cache layout, transport metadata) and the manifest of
the blocks it owns with their logical positions
(:mod:`vllm_cp_kv.core.manifest`), to the token's holder only. Blocks are
freed when the decode side has read them, or after ``blocks_expiry_s``.

Decode (consumer, not sharded; any TP, every TP rank holds the whole latent
cache and pulls every block): per request it checks the params, asks every
prefill rank for its handshake and manifest, refuses any mismatch or
out-of-range entry before a byte moves, then READs each rank's owned blocks
straight into its own block-table slots (contiguous runs merged into one
descriptor per layer). Any failure fails the request (vLLM's
``kv_load_failure_policy="fail"``); the reason is in the decode's log.

Modules, by responsibility:

* :mod:`.params`: the ``kv_transfer_params`` schema and checks (also the
  frontend hook that refuses bad params with HTTP 400);
* :mod:`.config`: the extra config;
* :mod:`.side_channel`: the typed ZMQ protocol (messages, server, client,
  optional HMAC secret);
* :mod:`.scheduler`: scheduler-side bookkeeping (tokens made here);
* :mod:`.producer`: prefill worker (served requests, claims, expiry);
* :mod:`.consumer`: decode worker (the pull);
* :mod:`.worker`: registration, per-step hand-off, empty-step wait;
* :mod:`.transfer`: the NIXL and Mooncake byte movers (host or GPU memory);
* :mod:`.counters`, :mod:`.stats`: transfer figures through vLLM's
  KV-connector stats channel (log line and Prometheus);
* :mod:`.connector`: the vLLM interface, delegating to the above.

Why not vLLM's NixlConnector / MooncakeConnector: positions there are implicit
rank arithmetic, Mooncake has no sharded-producer support at all, and neither
runs without an accelerator as shipped; this connector carries explicit
positions and works the same over both transports.
"""

__all__ = ["ShardedKVConnector", "ShardedKVMetadata"]


def __getattr__(name: str):
    # lazily: the transport, side-channel and params modules import without
    # vLLM (tests, benchmarks); the connector class needs it
    if name == "ShardedKVConnector":
        from .connector import ShardedKVConnector

        return ShardedKVConnector
    if name == "ShardedKVMetadata":
        from .scheduler import ShardedKVMetadata

        return ShardedKVMetadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
