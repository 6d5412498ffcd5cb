"""Worker side of the connector: registration, the per-step hand-off of
requests to the producer (prefill) or consumer (decode), and the empty-step
wait.

While transfers are pending and nothing else runs, vLLM's engine polls the
connector in a loop of empty steps (no forward). On such a step the worker
waits up to ``IDLE_STEP_WAIT_S`` for a transfer to finish instead of
returning at once (woken at once by a finished transfer): the polling of the
engine and of every worker otherwise takes the CPU from the transfer threads
(on a 2-core machine, receives of a few dozen tokens took 1-18 s and a
side-channel handshake timed out after 30 s).
"""

from __future__ import annotations

import logging
import threading

import torch

from .config import ConnectorConfig
from .consumer import Consumer
from .counters import TransferCounters
from .producer import Producer
from .schema import Handshake, ShardLayout, TransportMeta, cache_format
from .transfer import make_transport

logger = logging.getLogger("vllm." + __name__)  # under vLLM's log config when loaded
IDLE_STEP_WAIT_S = 0.005


class WorkerSide:
    def __init__(self, producer: Producer | None = None, consumer: Consumer | None = None,
                 event: threading.Event | None = None, idle_wait_s: float = IDLE_STEP_WAIT_S):
        self.producer, self.consumer = producer, consumer
        self.event = event if event is not None else threading.Event()  # a transfer finished
        self.idle_wait_s = idle_wait_s
        self._queued_recv: dict = {}
        self._idle_step = False  # this step runs no forward
        self.counters = TransferCounters(0)  # replaced in start (the worker's rank)
        self.device: torch.device | None = None  # where the registered caches live

    @classmethod
    def start(cls, cfg: ConnectorConfig, caches: list[torch.Tensor], geometry, rank: int,
              engine_id: str, tp_size: int, is_producer: bool, is_consumer: bool,
              kv_cache_dtype: str = "auto") -> WorkerSide:
        """Register the caches with the transport; a prefill rank starts
        serving its side channel on ``cfg.host:cfg.port + rank``.
        ``geometry``: the worker's ``ShardGeometry`` (sent whole in the
        handshake); ``rank``: the shard rank on a sharded prefill, the TP
        rank on the decode (``connector.side_rank``)."""
        if not all(t.is_contiguous() for t in caches):
            raise ValueError("cp_kv: ShardedKVConnector needs contiguous KV caches")
        transport = make_transport(cfg.transport, cfg.host)
        handshake = Handshake(
            engine_id=str(engine_id or ""), shard=ShardLayout.of(geometry),
            num_blocks=caches[0].shape[0],
            # one entry per registered cache, each with its own page size (the
            # MLA latent; for sparse models also the indexer K/scale cache)
            block_bytes=[t[0].numel() * t.element_size() for t in caches],
            dtype=[str(t.dtype) for t in caches], layer_addrs=[t.data_ptr() for t in caches],
            transport=cfg.transport, transport_meta=TransportMeta(**transport.register(caches)),
            cache_format=cache_format(kv_cache_dtype))
        side = cls()
        side.counters = TransferCounters(rank)
        side.device = caches[0].device
        if is_producer and rank >= geometry.size:
            # an unsharded prefill's TP rank > 0: its latent cache is a replica
            # of rank 0's, which decodes read (ranks 0 .. size - 1); it serves
            # nothing and reports each request sent at once, so that vLLM frees
            # the blocks when rank 0's readers are done (not at expiry)
            side.producer = Producer(handshake, cfg.expiry_s, side.event.set, transport,
                                     side.counters, replica=True)
            logger.info("cp_kv connector: prefill TP rank %d holds a replica of the "
                        "unsharded cache; the decode reads rank 0's", rank)
        elif is_producer:
            side.producer = Producer(handshake, cfg.expiry_s, side.event.set, transport,
                                     side.counters)
            side.producer.serve(cfg.host, cfg.port + rank, cfg.secret)
            logger.info("cp_kv connector: prefill rank %d/%d serves %s, side channel on %s:%d "
                        "(%s)", rank, geometry.size, cfg.transport, cfg.host, cfg.port + rank,
                        "HMAC secret set" if cfg.secret else "no shared secret")
        if is_consumer:
            side.consumer = Consumer(handshake, transport, cfg.timeout_s, cfg.secret, tp_size,
                                     side.event.set, side.counters)
        return side

    def bind(self, meta) -> None:
        for req_id, (table, num_tokens, token) in meta.to_send.items():
            self.producer.add(req_id, table, num_tokens, token)
        # Start reading only at the end of this step: vLLM zeroes newly
        # allocated blocks at the start of the step, after this binding.
        self._queued_recv.update(meta.to_recv)

    def start_step(self, forward_context, load_kwargs: dict | None = None) -> None:
        # A step without forward: vLLM's connector-only steps bind no attention
        # metadata (V1 runner), and the V2 runner (GPU) passes no load kwargs
        # then; with a forward it passes the batch (and starts the load after
        # the forward, outside the forward context).
        self._idle_step = (getattr(forward_context, "attn_metadata", None) is None
                           and not load_kwargs)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving)."""
        ready = self._blocks_zeroed() if self._queued_recv else None
        for req_id, (local_ids, params, error) in self._queued_recv.items():
            self.consumer.start(req_id, local_ids, params, error, ready)
        self._queued_recv = {}
        if self._idle_step:
            self._wait_for_transfer()
        sending = self.producer.take_finished() if self.producer else set()
        recving, failed = self.consumer.take_results() if self.consumer else (set(), set())
        return sending, recving, failed

    def _blocks_zeroed(self):
        """On a GPU, vLLM zeroes new blocks with a kernel on the current
        stream, which may still be queued when the step returns; a transport
        writes through its own streams (UCX cuda_ipc / cuda_copy). An event
        recorded here is waited for by the receive threads (not by this one)
        before the first byte lands. ``None`` on CPU (the zeroing ran)."""
        if self.device is None or self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stats(self) -> dict | None:
        """Transfer counts since the last call (:mod:`.counters`)."""
        return self.counters.take()

    def _wait_for_transfer(self) -> None:
        parts = [p for p in (self.producer, self.consumer) if p is not None]
        if any(p.pending() for p in parts) and not any(p.ready() for p in parts):
            self.event.wait(self.idle_wait_s)
        self.event.clear()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
