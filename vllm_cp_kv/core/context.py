"""A prefill row's cached context, attended where it lives (issue 51).

A prefill row of ``q`` new tokens over ``c`` cached tokens attends to its
context either

* **gathered**: the owned blocks of the context are all-gathered into the
  full view (``core/plan.py``) and vLLM's context attention reads them:
  per layer about ``c * W * e * (N - 1) / N`` bytes into each rank (``W``
  the latent width, 576, ``e`` its bytes), one all-gather per context chunk
  whatever the number of rows; or
* **owned**: like a decode (``core/decode.py``), each rank attends with the
  row's queries of all ``H`` heads, absorbed into the latent space, to the
  context tokens it owns, and the ranks' partial outputs merge by LSE; then
  the row's new-token attention merges in as a context chunk's does. Per
  layer ``q * H * (W e + 4 + V e)`` bytes cross ranks (queries gathered,
  LSEs gathered, outputs of width ``V``, 512, reduce-scattered; each
  ``(N - 1) / N``), three collectives, and no byte grows with ``c``.

Owned pays in collectives and in ``H`` times the query bytes; gathered pays
in context bytes. :func:`choose_owned` picks per batch, from the bytes each
row would move and the shard group's measured latency and bandwidth
(:class:`Link`), the cheaper of: every row the cheaper way for it, all
gathered, all owned. The context of an owned row is a prefix of its paged
sequence on every rank (``ownership.owned_token_count``), so a decode
kernel runs on it unchanged with the row's ``q`` queries as ``q * H``
query heads and no causal mask (:func:`padded_rows`): every new token sees
every context token, the new tokens' own attention is vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CONTEXT_PATHS = ("auto", "gathered", "owned")


@dataclass(frozen=True)
class Link:
    """A shard group's collective cost: ``latency_s + bytes / bandwidth``
    (measured at start, the same on every rank: each decision must be)."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, collectives: int, nbytes: float) -> float:
        return collectives * self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class RowCost:
    """What one layer moves into a rank for each row, both ways (host)."""

    owned: torch.Tensor  # [R] float64 bytes
    gathered: torch.Tensor  # [R] float64 bytes


OWNED_COLLECTIVES = 3  # query all-gather, LSE all-gather, output reduce-scatter


def row_bytes(query_lens: torch.Tensor, context_lens: torch.Tensor, *, size: int,
              heads: int, width: int, v_dim: int, elt: int) -> RowCost:
    """Bytes into one rank per layer for each row (``query_lens``,
    ``context_lens``: host ``[R]``) read owned or gathered; ``heads``: all
    ``H`` (under TP a rank computes ``H / N`` and gathers the rest)."""
    share = (size - 1) / size
    q = query_lens.double()
    owned = q * heads * (width * elt * share + 4 * (size - 1) + v_dim * elt * share)
    gathered = context_lens.double() * width * elt * share
    return RowCost(owned=owned, gathered=gathered)


def choose_owned(query_lens: torch.Tensor, context_lens: torch.Tensor, cost: RowCost,
                 link: Link, *, mode: str = "auto", max_query: int = 512) -> torch.Tensor:
    """Rows (host ``[R]`` bool) whose context is read owned.

    Candidates: rows with a context and at most ``max_query`` new tokens.
    ``mode`` "owned" takes every candidate, "gathered" none; "auto" the
    cheapest of three choices by ``link``: each candidate the way that moves
    fewer bytes for it, none, all (ties: fewer owned rows). The gathered
    side costs one collective per layer whenever some row is read that way
    (more with several context chunks, which only makes owned cheaper)."""
    if mode not in CONTEXT_PATHS:
        raise ValueError(f"context path must be one of {CONTEXT_PATHS}, got {mode!r}")
    has_context = context_lens > 0
    cand = has_context & (query_lens <= max_query) & (query_lens > 0)
    if mode != "auto" or not bool(cand.any()):
        return cand if mode == "owned" else torch.zeros_like(cand)

    def seconds(owned: torch.Tensor) -> float:
        gathered = has_context & ~owned
        return (link.seconds(OWNED_COLLECTIVES if bool(owned.any()) else 0,
                             float(cost.owned[owned].sum()))
                + link.seconds(1 if bool(gathered.any()) else 0,
                               float(cost.gathered[gathered].sum())))

    options = [torch.zeros_like(cand), cand & (cost.owned < cost.gathered), cand]
    return min(options, key=lambda o: (seconds(o), int(o.sum())))


@dataclass(frozen=True)
class PaddedRows:
    """The owned rows' queries as ``[R, S, ...]`` (``S`` the longest row's
    new tokens; shorter rows padded, their padding discarded): ``index``
    ``[R * S]`` the prefill token of each slot (0 in padding) and ``valid``
    ``[R * S]`` bool."""

    index: torch.Tensor
    valid: torch.Tensor
    width: int  # S


def padded_rows(query_start: torch.Tensor, query_lens: torch.Tensor) -> PaddedRows:
    """``query_start``, ``query_lens``: host ``[R]`` first token (within the
    prefill tokens) and count of each owned row."""
    s = int(query_lens.max()) if query_lens.numel() else 0
    slot = torch.arange(s)
    valid = slot[None, :] < query_lens[:, None]
    index = torch.where(valid, query_start[:, None] + slot[None, :], 0)
    return PaddedRows(index=index.flatten(), valid=valid.flatten(), width=s)
