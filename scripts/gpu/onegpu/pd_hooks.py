"""Test-only: the decode's P/D test hooks (patches.py no. 9, switch
``CPKV_TEST_HOOKS=1``). Not part of the package.

Why it exists: two checks need a decode that misbehaves on purpose, and the
connector must not carry code for that (nor its ``kv_transfer_params``
schema fields for it). With this folder on PYTHONPATH and the switch set,
the decode honours two more keys of a request's ``kv_transfer_params``:

* ``cp_kv_test_pause_s`` (0 to 600): the pull pauses that long between the
  prefill ranks' reads and logs ``cp_kv connector: test hook: request <id>
  read rank 0's blocks; pausing ...`` (tests/pd/test_disaggregated.py kills the
  prefill there);
* ``cp_kv_test_ignore_positions`` (bool): the blocks are written in arrival
  order, rank by rank, without their logical positions
  (``core.manifest.without_positions``): the negative control, whose output
  must change.

``CPKV_TEST_IGNORE_POSITIONS=1`` as well drops the positions of every pull
of the process (``pd_offline``, whose params come from its prefill:
benchmarks/gpu_onegpu.py, run ``pd-pcp2-shard2-nixl-dropped``).
``CPKV_TEST_WRONG_DECODE_RANK=1``: a sharded decode rank takes the blocks
the next decode rank owns (the consumer's ``for_decode_rank`` asked for
rank + 1): the negative control of a sharded decode, tests/pd/test_pd_sharded_decode.py.

How: ``TransferParams`` ignores unknown keys, so the keys reach the decode's
scheduler, where ``scheduler.check_params`` parses the raw dict; only the
parsed struct goes on to the workers (with the scheduler output, pickled
where the workers are processes of their own). Patched there, a request
that names a hook key gets a :class:`HookedParams` (``TransferParams`` with
the two values, bounded; it unpickles in the workers by this module's
name). In the worker the patched ``Consumer.receive`` notes its request's
hooks for its thread (each pull has one); the consumer module's
``check_complete``, called once every rank's manifest is in, then drops the
positions (before the decode's own prefix-cache hits are cut off, as the
connector did with the hook inside), and its ``read_owned_blocks`` is given
a ``before_rank`` that pauses.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Annotated

import msgspec
from msgspec import Meta

from vllm_cp_kv.core.manifest import without_positions
from vllm_cp_kv.integration.connector.params import TransferParams

KEYS = ("cp_kv_test_pause_s", "cp_kv_test_ignore_positions")
_pull = threading.local()  # this thread's pull: its request id and hooks


class HookedParams(TransferParams):
    """``TransferParams`` with the hooks' keys."""

    cp_kv_test_pause_s: Annotated[float, Meta(ge=0, le=600)] = 0.0
    cp_kv_test_ignore_positions: bool = False


def patch_scheduler(m) -> None:
    orig = m.check_params

    @functools.wraps(orig)
    def check_params(params, num_prompt_tokens, cfg=None):
        p, error = orig(params, num_prompt_tokens, cfg)
        if p is None or not any(k in params for k in KEYS):
            return p, error
        try:
            return msgspec.convert(params, HookedParams, strict=True), None
        except msgspec.ValidationError as e:
            return None, f"malformed kv_transfer_params (test hooks): {e}"

    m.check_params = check_params


def patch_consumer(m) -> None:
    receive, check_complete, read = m.Consumer.receive, m.check_complete, m.read_owned_blocks
    everywhere = os.environ.get("CPKV_TEST_IGNORE_POSITIONS") == "1"

    @functools.wraps(receive)
    def hooked_receive(self, req_id, local_ids, p, ready=None):
        _pull.req_id, _pull.pause = req_id, getattr(p, "cp_kv_test_pause_s", 0.0)
        _pull.ignore = everywhere or getattr(p, "cp_kv_test_ignore_positions", False)
        try:
            return receive(self, req_id, local_ids, p, ready)
        finally:
            _pull.__dict__.clear()

    @functools.wraps(check_complete)
    def hooked_check_complete(manifests, *args, **kwargs):
        check_complete(manifests, *args, **kwargs)
        if getattr(_pull, "ignore", False):
            manifests.update(without_positions(manifests))

    @functools.wraps(read)
    def hooked_read(*args, **kwargs):
        pause = getattr(_pull, "pause", 0.0)
        if pause:
            kwargs["before_rank"] = functools.partial(_pause, m.logger, _pull.req_id, pause)
        return read(*args, **kwargs)

    m.Consumer.receive = hooked_receive
    m.check_complete, m.read_owned_blocks = hooked_check_complete, hooked_read
    if os.environ.get("CPKV_TEST_WRONG_DECODE_RANK") == "1":
        share = m.for_decode_rank

        @functools.wraps(share)
        def wrong_rank(manifests, decode, first_column=0):
            other = type(decode)((decode.rank + 1) % decode.size, decode.size,
                                 decode.block_size)
            return share(manifests, other, first_column)

        m.for_decode_rank = wrong_rank


def _pause(logger, req_id: str, pause_s: float, rank: int) -> None:
    if rank:
        logger.info("cp_kv connector: test hook: request %s read rank %d's blocks; "
                    "pausing %g s before rank %d's", req_id, rank - 1, pause_s, rank)
        time.sleep(pause_s)
