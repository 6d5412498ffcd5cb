"""Scheduler side of the connector: which requests load or hand over KV.

Decode (consumer): a request with ``do_remote_prefill`` loads its whole
prompt from the prefill; its params are checked here (they are client input,
:mod:`.params`) and the result, good or not, goes to the workers with the
request's block table (a bad one fails the request's load there).

Prefill (producer): a request finished with ``do_remote_decode`` keeps its
blocks; ``request_finished`` makes its **transfer token**
(``secrets.token_urlsafe(32)``), returns it to the client in
``kv_transfer_params`` and hands it to the prefill workers with the block
table, which serve the request's manifest only to its holder.
"""

from __future__ import annotations

import queue
import secrets
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .config import ConnectorConfig
from ...core.ownership import CYCLIC
from .params import TransferParams, check_params
from .schema import MAX_ID_CHARS


@dataclass
class ShardedKVMetadata(KVConnectorMetadata):
    # decode: req_id -> (local block ids, -1 where the decode's own prefix cache
    # holds the block; checked params or None; error or None)
    to_recv: dict[str, tuple[list[int], TransferParams | None, str | None]] = field(
        default_factory=dict)
    # prefill: req_id -> (virtual block table, prompt tokens, transfer token)
    to_send: dict[str, tuple[list[int], int, str]] = field(default_factory=dict)


def _params(request) -> dict | None:
    params = request.kv_transfer_params
    return params if isinstance(params, dict) else None


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, shard_size: int, block_size: int,
                 is_producer: bool, is_consumer: bool):
        self.cfg, self.engine_id = cfg, engine_id
        self.shard_size, self.block_size = shard_size, block_size
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self._to_recv: dict = {}
        self._to_send: dict = {}
        self._pending_sends: set[str] = set()
        self._received = False  # a receive finished since the last step was built
        self._recving: set[str] = set()  # decode: reads handed to the workers, not yet done

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = _params(request)
        if self.is_consumer and params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = _params(request)
        if not (params and params.get("do_remote_prefill")):
            return
        asked = params["do_remote_prefill"]
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens == 0:
            return
        checked, error = check_params(dict(params, do_remote_prefill=asked),
                                      len(request.prompt_token_ids or []), self.cfg)
        if error:  # name the prefill's request in the decode's log line, bounded
            error += f" (prefill request {str(params.get('remote_request_id'))[:MAX_ID_CHARS]!r})"
        ids = list(blocks.get_block_ids()[0])
        # This decode's own prefix-cache hit (whole blocks, which vLLM asked the
        # connector about) leads the table: those blocks may be shared with
        # running requests and are not written (-1), as vLLM's NixlConnector
        # reads only the blocks it allocated. A sharded decode's table has
        # virtual blocks of block_size x shard_size tokens.
        local = len(request.prompt_token_ids or []) - num_external_tokens
        virtual = self.block_size * (self.shard_size if self.is_consumer else 1)
        for j in range(min(max(local, 0) // virtual, len(ids))):
            ids[j] = -1
        self._to_recv[request.request_id] = (ids, checked, error)
        self._recving.add(request.request_id)

    def build_connector_meta(self, scheduler_output) -> ShardedKVMetadata:
        meta = ShardedKVMetadata(to_recv=self._to_recv, to_send=self._to_send)
        self._to_recv, self._to_send, self._received = {}, {}, False
        return meta

    def request_finished(self, request, block_ids):
        from vllm.v1.request import RequestStatus

        self._recving.discard(request.request_id)  # a decode's request aborted mid-read
        params = _params(request)
        if not (self.is_producer and params and params.get("do_remote_decode") is True):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted or failed: free now, nothing to send
        table = list(block_ids)
        num_tokens = len(request.prompt_token_ids or [])
        token = secrets.token_urlsafe(32)
        self._to_send[request.request_id] = (table, num_tokens, token)
        self._pending_sends.add(request.request_id)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
            "remote_host": self.cfg.host, "remote_port": self.cfg.port,
            "remote_num_tokens": num_tokens, "shard_size": self.shard_size,
            "block_size": self.block_size, "ownership_rule": CYCLIC,
            "transport": self.cfg.transport, "transfer_token": token}

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            self._pending_sends.discard(req_id)
        if connector_output.finished_recving:  # those requests can be scheduled now
            self._received = True
        # a failed read is reported finished too (Consumer._run; vLLM's
        # aggregator over TP workers counts it as such)
        self._recving.difference_update(connector_output.finished_recving or ())

    def has_pending_push_work(self) -> bool:
        # keep the engine stepping so workers learn of finished transfers
        return bool(self._pending_sends)

    def has_undelivered_meta(self) -> bool:
        """Sends or receives the workers have not been told of yet, or a
        receive that finished since the last step was built (its request can
        be scheduled): the next step must come at once, not after an idle
        wait. (With vLLM's async scheduling, the GPU default, a request
        finishes after the next step was already scheduled: that step carried
        nothing, and an idle wait after it held the blocks back from the
        decode, measured 1.1 s a request on one H200.)"""
        return bool(self._to_send or self._to_recv or self._received)

    def has_reads_in_flight(self) -> bool:
        """The decode's workers are reading KV for a request (a pull takes
        milliseconds): an idle step's workers wait for it themselves
        (``WorkerSide._wait_for_transfer``, which returns when a read
        finishes), so the engine must not add its own wait on top: a pull that
        finished during the engine's wait reached the scheduler up to
        ``idle_step_s`` late."""
        return bool(self._recving)


def wait_for_client(input_queue, handle, timeout_s: float) -> bool:
    """An idle engine's pause (plugin.py item 25): wait up to ``timeout_s``
    for the engine core's next client call (a new request, an abort, a
    utility call) and handle it and any behind it, as vLLM's own input loop
    does; return at once when one arrives.

    Why: vLLM steps an engine whose only work is pending transfers in a
    tight loop (a finished request holding its blocks for the decode's
    reads, a decode waiting for a receive), and after each step every
    worker spins for a second on its message queue, which on a small
    machine starves the transfer threads and any process beside it. A
    sleep there (the connector's hook did that before) also holds back a
    request or abort that arrives meanwhile; this wait does not."""
    try:
        request = input_queue.get(timeout=timeout_s)
    except queue.Empty:
        return False
    handle(*request)
    while True:
        try:
            request = input_queue.get_nowait()
        except queue.Empty:
            return True
        handle(*request)
