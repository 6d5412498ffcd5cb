"""KV connector for disaggregated prefill from a sharded prefill instance.

Load it with::

    --kv-transfer-config '{"kv_connector": "ShardedKVConnector",
        "kv_connector_module_path": "vllm_cp_kv.integration.connector",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_connector_extra_config": {"transport": "nixl" | "mooncake",
                                      "side_channel_port": 5700}}'

Prefill (producer, sharded with ``cp_kv``, TP = shard group N): every rank
serves, on ``side_channel_port + rank``, a handshake (shard size, block size,
ownership rule, cache layout, transport metadata) and, per finished request,
the manifest of the blocks it owns with their logical positions
(:mod:`vllm_cp_kv.core.manifest`). Blocks are freed when the decode side has
read them, or after ``blocks_expiry_s``.

Decode (consumer, not sharded; any TP, every TP rank holds the whole latent
cache and pulls every block): per request it asks every prefill rank
for its handshake and manifest, refuses any mismatch or out-of-range entry
before a byte moves, then READs each rank's owned blocks straight into its own
block-table slots (contiguous runs merged into one descriptor per layer). Any
failure (refused metadata, a dead or slow prefill rank) fails the request
with an error to the client and frees its blocks (vLLM's
``kv_load_failure_policy="fail"``).

Why not vLLM's NixlConnector / MooncakeConnector: positions there are implicit
rank arithmetic, Mooncake has no sharded-producer support at all, and neither
runs without an accelerator as shipped; this connector carries explicit
positions and works the same over both transports.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Listener
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
    KVConnectorTransferResults, SupportsHMA)
from vllm.logger import init_logger

from ..core.manifest import (ManifestError, check_complete, owned_manifest,
                             validate_manifest, without_positions)
from ..core.ownership import num_logical_blocks
from .transfer import make_transport, read_owned_blocks

logger = init_logger("vllm." + __name__)  # under vLLM's log config
AUTHKEY = b"vllm_cp_kv"
RULE = "cyclic"
# Test hooks, honoured only when this variable is 1 on the decode server:
# kv_transfer_params "cp_kv_test_pause_s" pauses between prefill ranks' reads
# (a test kills the prefill mid-transfer), "cp_kv_test_ignore_positions" drops
# the logical positions (negative control: the output must change).
TEST_HOOKS_ENV = "VLLM_CP_KV_TEST_HOOKS"
SIDE_CHANNEL_IDLE_S = 60.0  # a side-channel conversation ends after this silence
# ... unless it holds a claim (a decode rank fetched a manifest and may still be
# reading those blocks): then only after this long, or when the decode closes
CLAIM_HOLD_MAX_S = 600.0
# While transfers are pending and nothing else runs, vLLM's engine polls the
# connector in a loop of empty steps (no forward). On such a step the worker
# waits up to this long for a transfer to finish instead of returning at once:
# the polling of the engine and of every worker otherwise takes the CPU from
# the transfer threads (on a 2-core machine, receives of a few dozen tokens
# took 1-18 s and a side-channel handshake timed out after 30 s).
IDLE_STEP_WAIT_S = 0.005
PARAM_KEYS = ("remote_host", "remote_port", "remote_request_id", "remote_block_ids",
              "remote_num_tokens", "shard_size", "block_size")


@dataclass
class ShardedKVMetadata(KVConnectorMetadata):
    # decode: req_id -> (local block ids, kv_transfer_params, error or None)
    to_recv: dict[str, tuple[list[int], dict, str | None]] = field(default_factory=dict)
    # prefill: req_id -> (virtual block table, prompt tokens)
    to_send: dict[str, tuple[list[int], int]] = field(default_factory=dict)


def check_params(params: dict, num_prompt_tokens: int) -> str | None:
    """Why ``kv_transfer_params`` cannot be used (``None`` if they can)."""
    missing = [k for k in PARAM_KEYS if k not in params]
    if missing:
        return f"malformed kv_transfer_params: missing {missing}"
    try:
        ints = [int(params[k]) for k in ("remote_port", "remote_num_tokens",
                                         "shard_size", "block_size")]
        table = [int(b) for b in params["remote_block_ids"]]
    except (TypeError, ValueError) as e:
        return f"malformed kv_transfer_params: {e}"
    port, num_tokens, size, block_size = ints
    if size < 1 or block_size < 1 or not 0 < port < 65536:
        return f"malformed kv_transfer_params: shard_size={size}, block_size={block_size}, port={port}"
    if num_tokens != num_prompt_tokens:
        return (f"kv_transfer_params cover {num_tokens} tokens but the prompt has "
                f"{num_prompt_tokens}")
    need = -(-num_logical_blocks(num_tokens, block_size) // size)
    if len(table) < need or min(table, default=0) < 0:
        return (f"out-of-range kv_transfer_params: {len(table)} remote blocks for "
                f"{num_tokens} tokens (need {need}), ids {table[:8]}")
    return None


class ShardedKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        self.transport_name = extra.get("transport", "nixl")
        self.port = int(extra.get("side_channel_port", 5700))
        self.host = extra.get("side_channel_host",
                              os.environ.get("VLLM_HOST_IP") or "127.0.0.1")
        self.timeout_s = float(extra.get("transfer_timeout_s", 30))
        self.expiry_s = float(extra.get("blocks_expiry_s", 120))
        # pause of an empty engine step while transfers are pending (seconds);
        # the producer only waits to free blocks, the consumer waits for data
        self.idle_step_s = float(extra.get(
            "idle_step_s", 1.0 if cfg.is_kv_producer else 0.01))
        self.is_producer = cfg.is_kv_producer
        self.is_consumer = cfg.is_kv_consumer
        parallel = vllm_config.parallel_config
        self.shard_size = parallel.decode_context_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = cfg.engine_id
        if self.is_consumer and self.shard_size > 1:
            raise ValueError(
                "ShardedKVConnector: the decode (kv_consumer) instance must not be "
                f"sharded (got shard size {self.shard_size}); drop cp_kv there.")
        # every decode TP rank holds the whole (replicated) latent cache and
        # pulls every block; the prefill frees once all of them are done
        self.tp_size = parallel.tensor_parallel_size
        # scheduler side
        self._to_recv: dict = {}
        self._to_send: dict = {}
        self._pending_sends: set[str] = set()
        # worker side
        self._caches: list[torch.Tensor] = []
        self._transport = None
        self._handshake: dict = {}
        self._lock = threading.Lock()
        self._sending: dict[str, tuple[list[int], int, float]] = {}
        self._queued_recv: dict[str, tuple[list[int], dict, str | None]] = {}
        self._readers_done: dict[str, int] = {}
        # prefill: open conversations that fetched a request's manifest; its
        # blocks are not freed on expiry while a reader may still read them
        self._claims: dict[str, int] = {}
        self._active_readers = 0  # open side-channel conversations (producer)
        self._readers_present = threading.Event()
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._receiving = 0  # receive threads running (consumer)
        self._transfer_event = threading.Event()  # a transfer finished
        self._idle_step = False  # this step runs no forward
        self.stats: dict[str, dict] = {}

    # ==============================
    # Scheduler-side methods
    # ==============================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params
        if self.is_consumer and params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill")):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens == 0:
            return
        error = check_params(params, len(request.prompt_token_ids or []))
        self._to_recv[request.request_id] = (
            list(blocks.get_block_ids()[0]), dict(params), error)

    def build_connector_meta(self, scheduler_output) -> ShardedKVMetadata:
        meta = ShardedKVMetadata(to_recv=self._to_recv, to_send=self._to_send)
        self._to_recv, self._to_send = {}, {}
        if scheduler_output.total_num_scheduled_tokens == 0 and not (meta.to_recv or meta.to_send):
            # vLLM steps an idle engine in a tight loop while finished requests
            # hold blocks for a transfer (and while a decode waits for one), and
            # every step keeps each worker spinning for a second; throttle those
            # empty steps so they do not starve the machine.
            time.sleep(self.idle_step_s)
        return meta

    def request_finished(self, request, block_ids):
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not (self.is_producer and params and params.get("do_remote_decode")):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted or failed: free now, nothing to send
        table = list(block_ids)
        num_tokens = len(request.prompt_token_ids or [])
        self._to_send[request.request_id] = (table, num_tokens)
        self._pending_sends.add(request.request_id)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_host": self.host, "remote_port": self.port,
            "remote_block_ids": table, "remote_num_tokens": num_tokens,
            "shard_size": self.shard_size, "block_size": self.block_size,
            "ownership_rule": RULE, "transport": self.transport_name}

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids[0])

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._pending_sends.discard(req_id)

    def has_pending_push_work(self) -> bool:
        # keep the engine stepping so workers learn of finished transfers
        return bool(self._pending_sends)

    # ==============================
    # Worker-side methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._caches = list(kv_caches.values())
        for t in self._caches:
            assert t.is_contiguous(), "ShardedKVConnector needs contiguous caches"
        first = self._caches[0]
        self.rank = get_tensor_model_parallel_rank()
        self._transport = make_transport(self.transport_name, self.host)
        self._handshake = {
            "engine_id": self.engine_id, "rank": self.rank,
            "shard_size": self.shard_size, "block_size": self.block_size,
            "ownership_rule": RULE, "num_layers": len(self._caches),
            # one entry per registered cache, each with its own page size (the
            # MLA latent; the sparse indexer K/scale cache once sparse models
            # are supported)
            "block_bytes": [t[0].numel() * t.element_size() for t in self._caches],
            "num_blocks": first.shape[0],
            "dtype": [str(t.dtype) for t in self._caches],
            "transport": self.transport_name,
            "transport_meta": self._transport.register(self._caches),
            "layer_addrs": [t.data_ptr() for t in self._caches],
        }
        if self.is_producer:
            # many decode threads connect at once (one per request): a deep backlog
            listener = Listener((self.host, self.port + self.rank), backlog=128,
                                authkey=AUTHKEY)
            threading.Thread(target=self._serve, args=(listener,), daemon=True,
                             name=f"cp_kv-side-channel-{self.rank}").start()
            threading.Thread(target=self._progress_loop, daemon=True,
                             name=f"cp_kv-progress-{self.rank}").start()
            logger.info("cp_kv connector: prefill rank %d/%d serves %s on %s:%d",
                        self.rank, self.shard_size, self.transport_name, self.host,
                        self.port + self.rank)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        now = time.monotonic()
        with self._lock:
            for req_id, (table, num_tokens) in connector_metadata.to_send.items():
                self._sending[req_id] = (table, num_tokens, now + self.expiry_s)
        # Start reading only at the end of this step: vLLM zeroes newly
        # allocated blocks at the start of the step, after this binding.
        self._queued_recv.update(connector_metadata.to_recv)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        # transfers run in background threads (see get_transfer_results);
        # vLLM's connector-only steps bind no attention metadata
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        for req_id, (local_ids, params, error) in self._queued_recv.items():
            with self._lock:
                self._receiving += 1
            threading.Thread(target=self._receive, args=(req_id, local_ids, params, error),
                             daemon=True).start()
        self._queued_recv = {}
        if self._idle_step:
            self._wait_for_transfer_event()
        now = time.monotonic()
        with self._lock:
            for req_id, (_, _, expiry) in list(self._sending.items()):
                if now > expiry and not self._claims.get(req_id):
                    logger.warning("cp_kv connector: request %s expired after %g s "
                                   "without a transfer; freeing its blocks", req_id,
                                   self.expiry_s)
                    del self._sending[req_id]
                    self._readers_done.pop(req_id, None)
                    self._done_sending.add(req_id)
            results = KVConnectorTransferResults(
                finished_sending=self._done_sending, finished_recving=self._done_recving,
                failed_recving=self._failed_recving)
            self._done_sending, self._done_recving, self._failed_recving = set(), set(), set()
        return results

    def _wait_for_transfer_event(self) -> None:
        """On a step without forward: give pending transfers the CPU for up
        to ``IDLE_STEP_WAIT_S``, returning as soon as one finishes."""
        with self._lock:
            nothing_new = not (self._done_sending or self._done_recving)
            pending = self._receiving > 0 or bool(self._sending)
        if nothing_new and pending:
            self._transfer_event.wait(IDLE_STEP_WAIT_S)
        self._transfer_event.clear()

    # ---- prefill: side channel -------------------------------------------
    def _serve(self, listener: Listener) -> None:
        while True:
            try:
                conn = listener.accept()
            except Exception:  # bad auth or a dropped connection
                continue
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

    def _serve_one(self, conn) -> None:
        """One decode rank's conversation. While it may be pulling blocks
        (from its first message to the end of the conversation) it counts as
        an active reader, for which one shared loop drives the transport's
        progress (one loop however many readers: per-conversation polling
        loops starved small machines' cores).

        A request whose manifest this conversation fetched stays *claimed*
        until the decode says done or the conversation ends (the decode gave
        up, closed, or died): its blocks are not freed on expiry in between,
        so a slow read never sees them reused."""
        idle_since = time.monotonic()
        claimed: set[str] = set()
        self._reader_active(+1)
        with conn:
            try:
                while time.monotonic() - idle_since < (
                        CLAIM_HOLD_MAX_S if claimed else SIDE_CHANNEL_IDLE_S):
                    if not conn.poll(0.05):
                        continue
                    op, arg = conn.recv()
                    conn.send(self._answer(op, arg, claimed))
                    idle_since = time.monotonic()
            except (EOFError, OSError):
                pass
            finally:
                with self._lock:
                    for req_id in claimed:
                        self._release_claim(req_id)
                self._reader_active(-1)

    def _release_claim(self, req_id: str) -> None:
        left = self._claims.get(req_id, 0) - 1
        if left > 0:
            self._claims[req_id] = left
        else:
            self._claims.pop(req_id, None)

    def _reader_active(self, delta: int) -> None:
        with self._lock:
            self._active_readers += delta
            if self._active_readers > 0:
                self._readers_present.set()
            else:
                self._readers_present.clear()

    def _progress_loop(self) -> None:
        """Drive the transport's progress while any reader is active."""
        while True:
            self._readers_present.wait()
            self._transport.progress()
            time.sleep(0.001)

    def _answer(self, op: str, arg: Any, claimed: set[str]):
        if op == "hello":
            return {"ok": True, "handshake": self._handshake}
        with self._lock:
            entry = self._sending.get(arg[0] if op == "done" else arg)
            if op == "manifest":
                if entry is None:
                    return {"ok": False, "error": f"prefill rank {self.rank} has no "
                            f"blocks for request {arg!r} (unknown or expired)"}
                if arg not in claimed:
                    claimed.add(arg)
                    self._claims[arg] = self._claims.get(arg, 0) + 1
                table, num_tokens, _ = entry
                return {"ok": True, "manifest": owned_manifest(
                    self.rank, self.shard_size, self.block_size, table, num_tokens)}
            if op == "done":  # arg: (request id, decode TP size)
                req_id, readers = arg
                if req_id in claimed:
                    claimed.discard(req_id)
                    self._release_claim(req_id)
                if entry is None:
                    return {"ok": True}
                done = self._readers_done.get(req_id, 0) + 1
                if done >= int(readers):
                    self._readers_done.pop(req_id, None)
                    del self._sending[req_id]
                    self._done_sending.add(req_id)
                    self._transfer_event.set()
                else:
                    self._readers_done[req_id] = done
                return {"ok": True}
        return {"ok": False, "error": f"unknown side-channel op {op!r}"}

    # ---- decode: pull ------------------------------------------------------
    def _ask(self, conn, op, arg):
        conn.send((op, arg))
        if not conn.poll(self.timeout_s):
            raise ManifestError(f"prefill side channel did not answer {op!r} in "
                                f"{self.timeout_s:g} s")
        reply = conn.recv()
        if not reply.get("ok"):
            raise ManifestError(reply.get("error", "refused"))
        return reply

    def _check_handshake(self, hs: dict, rank: int, params: dict) -> None:
        mine = self._handshake
        want = {"rank": rank, "shard_size": int(params["shard_size"]),
                "block_size": self.block_size, "ownership_rule": RULE,
                "num_layers": mine["num_layers"], "block_bytes": mine["block_bytes"],
                "dtype": mine["dtype"], "transport": self.transport_name}
        bad = {k: (hs.get(k), v) for k, v in want.items() if hs.get(k) != v}
        if bad:
            raise ManifestError("handshake mismatch with prefill rank "
                                f"{rank} (theirs, ours): {bad}")

    def _receive(self, req_id: str, local_ids: list[int], params: dict,
                 error: str | None) -> None:
        t0 = time.monotonic()
        conns = []
        try:
            if error:
                raise ManifestError(error)
            size, host, port = int(params["shard_size"]), params["remote_host"], int(params["remote_port"])
            num_tokens = int(params["remote_num_tokens"])
            n_blocks = num_logical_blocks(num_tokens, self.block_size)
            remote_req = params["remote_request_id"]
            if len(local_ids) < n_blocks or max(local_ids[:n_blocks]) >= self._handshake["num_blocks"]:
                raise ManifestError(f"local block ids {local_ids[:8]} cannot hold "
                                    f"{n_blocks} blocks")
            handshakes, manifests = {}, {}
            for r in range(size):  # all metadata first: nothing moves on a mismatch
                conn = Client((host, port + r), authkey=AUTHKEY)
                conns.append(conn)
                hs = self._ask(conn, "hello", None)["handshake"]
                self._check_handshake(hs, r, params)
                handshakes[r] = hs
                manifests[r] = validate_manifest(
                    self._ask(conn, "manifest", remote_req)["manifest"], r, size,
                    n_blocks, hs["num_blocks"])
            check_complete(manifests, n_blocks)
            hooks = os.environ.get(TEST_HOOKS_ENV) == "1"
            pause = float(params.get("cp_kv_test_pause_s", 0)) if hooks else 0.0
            if hooks and params.get("cp_kv_test_ignore_positions"):
                manifests = without_positions(manifests)
            num_descs = read_owned_blocks(
                self._transport, manifests, handshakes, local_ids,
                self._handshake["layer_addrs"], self._handshake["block_bytes"],
                self.timeout_s, pause)
            for conn in conns:  # best effort: the prefill side also frees on expiry
                try:
                    self._ask(conn, "done", (remote_req, self.tp_size))
                except Exception as e:
                    logger.warning("cp_kv connector: could not confirm request %s to "
                                   "the prefill side: %s", req_id, e)
            self.stats[req_id] = {"tokens": num_tokens, "blocks": n_blocks,
                                  "descriptors": num_descs, "ranks": size,
                                  "seconds": time.monotonic() - t0}
            logger.info("cp_kv connector: request %s received %d tokens (%d blocks, "
                        "%d descriptors) from %d prefill ranks in %.3f s", req_id,
                        num_tokens, n_blocks, num_descs, size, time.monotonic() - t0)
            failed = False
        except Exception as e:  # refused metadata, dead peer, timeout
            logger.error("cp_kv connector: request %s failed to receive its KV: %s: %s",
                         req_id, type(e).__name__, e)
            failed = True
        finally:
            for conn in conns:
                conn.close()
        with self._lock:
            self._receiving -= 1
            self._done_recving.add(req_id)
            if failed:
                self._failed_recving.add(req_id)
        self._transfer_event.set()
