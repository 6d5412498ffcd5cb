"""What each connector worker counts about transfers (no vLLM needed here).

Every worker keeps one :class:`TransferCounters`; the producer (prefill rank)
and the consumer (decode rank) record into it from their threads, and the
connector hands the counts since the last step to vLLM's KV-connector stats
channel once per engine step (``get_kv_connector_stats``, see
:mod:`.stats`), which sums them over the workers and reports them in the
frontend (the ``KV Transfer metrics:`` log line and Prometheus).

The snapshot (``take``) is a plain dict (it crosses processes), keyed by
role and shard rank so that the frontend can label every figure with the
rank that counted it::

    {"decode":  {"0": {"ok": 3, "failed": 0, "bytes": 98304, "blocks": 12,
                       "seconds": [0.021, 0.018, 0.030]}},
     "prefill": {"1": {"served": 3, "released": 0, "expired": 0,
                       "expired_blocks": 0}}}

Decode (per pull, i.e. per request and decode rank: every decode rank reads
every block): ``ok``/``failed`` pulls, ``bytes`` read (blocks x page bytes
over every registered cache), ``blocks`` (logical blocks read), ``seconds``
of each successful pull (first side-channel fetch to the last ``Done``).
Prefill (per rank): ``served`` requests whose every reader said ``Done``
(blocks freed), ``released`` readers that gave up while holding a claim
(``Release``, once per reader), ``expired`` requests freed on expiry without
a transfer and their ``expired_blocks`` (this rank's blocks of them: one per
virtual block of the request).
"""

from __future__ import annotations

import threading

DECODE_KEYS = ("ok", "failed", "bytes", "blocks")
PREFILL_KEYS = ("served", "released", "expired", "expired_blocks")


class TransferCounters:
    """One worker's transfer counts since the last :meth:`take` (thread-safe)."""

    def __init__(self, rank: int):
        self.rank = str(rank)
        self._lock = threading.Lock()
        self._decode: dict | None = None
        self._prefill: dict | None = None

    # ---- decode ------------------------------------------------------------------
    def pull_ok(self, nbytes: int, blocks: int, seconds: float) -> None:
        with self._lock:
            d = self._decode_entry()
            d["ok"] += 1
            d["bytes"] += int(nbytes)
            d["blocks"] += int(blocks)
            d["seconds"].append(float(seconds))

    def pull_failed(self) -> None:
        with self._lock:
            self._decode_entry()["failed"] += 1

    # ---- prefill -----------------------------------------------------------------
    def served(self) -> None:
        with self._lock:
            self._prefill_entry()["served"] += 1

    def released(self) -> None:
        with self._lock:
            self._prefill_entry()["released"] += 1

    def expired(self, blocks: int) -> None:
        with self._lock:
            p = self._prefill_entry()
            p["expired"] += 1
            p["expired_blocks"] += int(blocks)

    # ---- hand-off ----------------------------------------------------------------
    def take(self) -> dict | None:
        """The counts since the last call (``None``: nothing happened)."""
        with self._lock:
            out = {}
            if self._decode is not None:
                out["decode"] = {self.rank: self._decode}
            if self._prefill is not None:
                out["prefill"] = {self.rank: self._prefill}
            self._decode = self._prefill = None
        return out or None

    def _decode_entry(self) -> dict:
        if self._decode is None:
            self._decode = {**dict.fromkeys(DECODE_KEYS, 0), "seconds": []}
        return self._decode

    def _prefill_entry(self) -> dict:
        if self._prefill is None:
            self._prefill = dict.fromkeys(PREFILL_KEYS, 0)
        return self._prefill


def merge(into: dict, other: dict) -> dict:
    """Add snapshot ``other`` to ``into`` (in place; ranks kept apart)."""
    for role, ranks in other.items():
        mine = into.setdefault(role, {})
        for rank, counts in ranks.items():
            _add(mine.setdefault(rank, {}), counts)
    return into


def totals(data: dict, role: str) -> dict:
    """Sums over the ranks of one role (``seconds`` concatenated)."""
    out: dict = {}
    for counts in (data.get(role) or {}).values():
        _add(out, counts)
    return out


def _add(into: dict, counts: dict) -> None:
    """Add one rank's counts to ``into`` (lists extended into new lists)."""
    for key, value in counts.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = into.get(key, 0) + value
