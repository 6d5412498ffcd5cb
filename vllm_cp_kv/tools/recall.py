"""Associative recall: a long-context task whose answers are right or wrong.

A prompt is random filler with *records* spread over it, each
``KEY key v1 v2 v3 v4`` (a one-token key, unique in the prompt, then a
four-token value, all value tokens distinct), ending with a query
``KEY key`` for one record: the right answer is that record's four value
tokens, found only by attending back to it (an induction lookup). The
queried record (the *needle*) lies in one of ``BUCKETS`` equal parts of the
context, so a bad rank or a bad block shows in its bucket; :func:`grade`
also reports the shard rank that owns the needle's block. The first answer
token comes from the prefill, the other three from decode steps, so both
paths are read.

``models/recall-dsv2`` is a small DeepSeek-V2 (MLA) trained on this task by
``scripts/train_recall.py``; docs/accuracy.md says how and what its figures
mean. Run the evaluation through vLLM with::

    python -m vllm_cp_kv.tools.recall models/recall-dsv2 --lengths 2048,8192 \
        --per-bucket 4 [--tp 2] [--pcp 2] [--shard] [--out result.json]

Token ids (vocabulary 4096, the model's word-level tokenizer; the task uses
ids only): ``KEY`` 3, keys 16-1039, values 1040-2575, filler 2576-4095.
"""

from __future__ import annotations

import math

import torch

from ..core.ownership import CPShardSpec

KEY = 3
KEY_TOKENS = (16, 1040)
VALUE_TOKENS = (1040, 2576)
FILLER = (2576, 4096)
VOCAB = 4096
VALUE_LEN = 4
RECORD = 2 + VALUE_LEN  # KEY key v1..v4
RECORDS = 64  # records in a context (fewer where it is short)
SLOT = 24  # context tokens a record needs at least
ALIGN = 16  # a record's value never straddles a 16-token block (any block size 16k)
BUCKETS = 8
SPREAD = 256  # context tokens per record in the evaluation prompts, at least


def _randint(gen: torch.Generator, lo: int, hi: int, n: int = 1) -> list[int]:
    return torch.randint(lo, hi, (n,), generator=gen).tolist()


def context(length: int, gen: torch.Generator, records: int = RECORDS):
    """``length`` tokens of filler with ``records`` records (unique keys,
    ``min(records, length // SLOT)`` of them), one at a random place in each
    of that many equal segments, its value inside one ``ALIGN`` block.
    Returns ``(ids, [(position of the record, key, value), ...])``."""
    count = min(records, length // SLOT)
    ids = _randint(gen, *FILLER, n=length)
    keys = _distinct(gen, KEY_TOKENS, count)
    values = _distinct(gen, VALUE_TOKENS, count * VALUE_LEN)
    placed = []
    for i, key in enumerate(keys):
        lo, hi = i * length // count, (i + 1) * length // count - RECORD - ALIGN
        pos = _randint(gen, lo, hi + 1)[0]
        first = (pos + 2) % ALIGN  # the value's first token, in its block
        pos += ALIGN - first if first > ALIGN - VALUE_LEN else 0
        value = tuple(values[i * VALUE_LEN:(i + 1) * VALUE_LEN])
        ids[pos:pos + RECORD] = [KEY, key, *value]
        placed.append((pos, key, value))
    return ids, placed


def _distinct(gen: torch.Generator, span: tuple, n: int) -> list[int]:
    return (torch.randperm(span[1] - span[0], generator=gen)[:n] + span[0]).tolist()


def training_batch(length: int, rows: int, gen: torch.Generator):
    """``rows`` training sequences of ``length`` tokens, made on
    ``gen``'s device: a context laid out as :func:`context` lays it out,
    then ``min(32, length // 32)`` queries, each a whole record repeating a
    random record of the context. Returns ``(ids, mask)``, ``mask`` true at
    the queries' value tokens (the only ones that can be predicted)."""
    dev = gen.device
    queries = max(1, min(32, length // 32))
    ctx = length - queries * RECORD
    n = min(RECORDS, ctx // SLOT)

    def rand(hi, *shape):  # uniform integers below ``hi`` (a tensor or int)
        return (torch.rand(*shape, generator=gen, device=dev) * hi).long()

    def distinct(span, k):
        order = torch.rand(rows, span[1] - span[0], generator=gen, device=dev).argsort(-1)
        return order[:, :k] + span[0]

    ids = rand(FILLER[1] - FILLER[0], rows, length) + FILLER[0]
    seg = torch.arange(n + 1, device=dev) * ctx // n
    lo, span = seg[:-1], seg[1:] - seg[:-1] - RECORD - ALIGN + 1
    pos = lo + rand(span, rows, n)
    first = (pos + 2) % ALIGN
    pos = pos + torch.where(first > ALIGN - VALUE_LEN, ALIGN - first, 0)
    records = torch.cat([torch.full((rows, n, 1), KEY, device=dev),
                         distinct(KEY_TOKENS, n)[..., None],
                         distinct(VALUE_TOKENS, n * VALUE_LEN).view(rows, n, VALUE_LEN)], -1)
    at = (pos[..., None] + torch.arange(RECORD, device=dev)).view(rows, -1)
    ids.scatter_(1, at, records.view(rows, -1))
    pick = rand(n, rows, queries)[..., None].expand(-1, -1, RECORD)
    ids[:, ctx:] = records.gather(1, pick).reshape(rows, -1)
    mask = torch.zeros(rows, length, dtype=torch.bool, device=dev)
    mask[:, ctx:] = (torch.arange(queries * RECORD, device=dev) % RECORD >= 2)
    return ids, mask


def prompts(length: int, per_bucket: int, seed: int = 0) -> list[dict]:
    """``BUCKETS * per_bucket`` prompts of exactly ``length`` tokens, each
    a context ending with a query ``KEY key``; the needle of prompt
    ``i`` lies in bucket ``i % BUCKETS`` of the context. Deterministic in
    ``(length, per_bucket position, seed)``."""
    out = []
    for i in range(BUCKETS * per_bucket):
        gen = torch.Generator().manual_seed(1_000_003 * seed + 7919 * length + i)
        # sparser than in training where short: a record's window then
        # spans many blocks, so needles land on every rank
        ids, placed = context(length - 2, gen, max(BUCKETS, min(RECORDS, length // SPREAD)))
        bucket = i % BUCKETS
        lo, hi = bucket * (length - 2) / BUCKETS, (bucket + 1) * (length - 2) / BUCKETS
        inside = [r for r in placed if lo <= r[0] < hi]
        if not inside:
            raise ValueError(f"length {length} is too short for {BUCKETS} buckets")
        pos, key, value = inside[_randint(gen, 0, len(inside))[0]]
        out.append({"ids": ids + [KEY, key], "answer": list(value),
                    "needle": pos + 2, "bucket": bucket})
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of ``k`` right out of ``n``."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _tally(flags: list[bool]) -> dict:
    k, n = sum(flags), len(flags)
    lo, hi = wilson(k, n)
    return {"right": k, "n": n, "accuracy": k / n if n else None, "interval": [lo, hi]}


def grade(items: list[dict], outputs: list[list[int]], *, ranks: int = 1,
          block_size: int = 16) -> dict:
    """Exact match of each output's first ``VALUE_LEN`` tokens with the
    answer: overall, per needle bucket and per owning shard rank (of the
    needle's value tokens, by :class:`CPShardSpec`'s rule), with Wilson
    intervals."""
    right = [list(o[:VALUE_LEN]) == it["answer"] for it, o in zip(items, outputs)]
    first = [bool(o) and o[0] == it["answer"][0] for it, o in zip(items, outputs)]
    spec = CPShardSpec(0, ranks, block_size)
    owner = spec.owner_of(torch.tensor([it["needle"] for it in items]) // block_size).tolist()
    return {**_tally(right), "first_token": _tally(first)["accuracy"],
            "buckets": [_tally([r for r, it in zip(right, items) if it["bucket"] == b])
                        for b in range(BUCKETS)],
            "owners": [_tally([r for r, o in zip(right, owner) if o == k])
                       for k in range(ranks)],
            "right_each": right}


def grade_lengths(items: list[dict], outputs: list[list[int]], **kw) -> dict:
    """:func:`grade` per context length of ``items`` (a run's prompts of
    several lengths): ``{str(length): grade}``."""
    out = {}
    for length in sorted({len(it["ids"]) for it in items}):
        pick = [i for i, it in enumerate(items) if len(it["ids"]) == length]
        out[str(length)] = grade([items[i] for i in pick], [outputs[i] for i in pick], **kw)
    return out


def within(a: dict, b: dict) -> bool:
    """Whether two accuracies agree: each inside the other's interval."""
    return (b["interval"][0] <= a["accuracy"] <= b["interval"][1]
            and a["interval"][0] <= b["accuracy"] <= a["interval"][1])


def main() -> None:
    import argparse
    import json

    from .offline import build_llm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--lengths", default="2000")
    ap.add_argument("--per-bucket", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pcp", type=int, default=1)
    ap.add_argument("--shard", action="store_true", help="cp_kv on")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--backend", default=None, help="e.g. CPU_MLA, FLASHMLA")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--rope", choices=["torch", "kernel"], default=None,
                    help="torch: PyTorch's rope (vLLM 0.32's CPU kernel is wrong for MLA)")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (vLLM's default)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = build_llm(a.model, tp=a.tp, pcp=a.pcp, shard=a.shard, dtype=a.dtype,
                    backend=a.backend, block_size=a.block_size, rope=a.rope,
                    eager=not a.graphs, max_model_len=max(lengths) + 16)
    sp = SamplingParams(temperature=0.0, max_tokens=VALUE_LEN)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    report = {}
    for length in lengths:
        items = prompts(length, a.per_bucket)
        outs = llm.generate([TokensPrompt(prompt_token_ids=it["ids"]) for it in items], sp)
        got = grade(items, [list(o.outputs[0].token_ids) for o in outs],
                    ranks=a.tp * a.pcp if a.shard else 1, block_size=block)
        got.pop("right_each")
        report[length] = got
        print(f"{length}: {got['right']}/{got['n']} = {got['accuracy']:.3f} "
              f"[{got['interval'][0]:.3f}, {got['interval'][1]:.3f}]", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
