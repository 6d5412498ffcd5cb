"""Where a profiled wave's time goes: reads the torch profiler traces that
``gpu_context.py``'s ``prof`` task writes (vLLM's ``profiler_config``, one
``*.pt.trace.json.gz`` per rank) and sums, per trace:

* the GPU's span (first kernel start to last kernel end), its busy time (the
  union of kernel and copy intervals) and so its idle time, with the idle
  gaps over 0.5 ms;
* kernel time by kind (NCCL, attention, GEMM, other) and the NCCL kernel
  count (each one collective);
* the host's CUDA runtime calls that wait for the device (synchronize,
  device-to-host copies), their count and time;
* vLLM's own annotated host ranges (``user_annotation``), time per name.

With Python stacks in the trace (``run_vllm.py --profile-stack``) it also
gives each wait of over a millisecond with the Python frames around it, and
the Python functions with the most host time of their own (``stacks``).

Usage: python benchmarks/trace_steps.py TRACE_DIR [TRACE_DIR ...] [--out F.json]
Compare two runs of the same wave (vLLM's DCP and the plugin) side by side.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
from collections import Counter

KINDS = (("nccl", ("nccl",)), ("attention", ("flash", "mla", "fmha", "attn")),
         ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")))
WAITS = ("Synchronize", "cudaMemcpy ", "cudaMemcpy(")  # calls that wait for the GPU


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(x in low for x in keys)), "other")


def coverage(spans: list, gap_us: float = 500) -> tuple[float, list]:
    """One pass over ``(start, end)`` intervals (us): the length of their
    union (ms) and the gaps between them longer than ``gap_us`` (ms)."""
    total, end, gaps = 0.0, None, []
    for s, e in sorted(spans):
        if end is not None and s - end > gap_us:
            gaps.append(round((s - end) / 1e3, 3))
        if end is None or e > end:
            total += e - (s if end is None else max(s, end))
            end = e
    return total / 1e3, gaps


def stacks(events: list, min_wait_ms: float = 1.0, depth: int = 8, top: int = 15) -> dict:
    """The host's waits over ``min_wait_ms`` with the innermost ``depth``
    Python frames around each, and the ``top`` Python functions by their
    own time (a frame's time less its child frames'), ms."""
    frames: dict = {}
    for e in events:
        if e.get("cat") == "python_function":
            frames.setdefault(e["tid"], []).append(e)
    own: Counter = Counter()
    for evs in frames.values():  # one sweep per thread: nesting by interval
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        open_: list = []
        for e in evs:
            while open_ and open_[-1]["ts"] + open_[-1].get("dur", 0) <= e["ts"]:
                open_.pop()
            if open_:
                own[open_[-1]["name"]] -= e.get("dur", 0) / 1e3
            own[e["name"]] += e.get("dur", 0) / 1e3
            open_.append(e)
    waits = []
    for w in events:
        if w.get("cat") == "cuda_runtime" and any(x in w["name"] for x in WAITS) \
                and w.get("dur", 0) >= min_wait_ms * 1e3:
            around = [e["name"] for e in frames.get(w["tid"], [])
                      if e["ts"] <= w["ts"] and e["ts"] + e.get("dur", 0) >= w["ts"] + w["dur"]]
            waits.append({"call": w["name"], "ms": round(w["dur"] / 1e3, 3),
                          "frames": around[-depth:]})
    return {"waits": sorted(waits, key=lambda x: -x["ms"]),
            "own_ms": {k: round(v, 3) for k, v in own.most_common(top)}}


def summarize(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out: dict = {"trace": os.path.basename(path), "gpu_events": len(gpu)}
    if not gpu:
        return out
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu]
    span_ms = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3
    busy, gaps = coverage(spans)
    by_kind: Counter = Counter()
    by_name: Counter = Counter()
    nccl = 0
    for e in gpu:
        k = kind_of(e["name"]) if e["cat"] == "kernel" else e["cat"]
        by_kind[k] += e.get("dur", 0) / 1e3
        by_name[e["name"]] += e.get("dur", 0) / 1e3
        nccl += k == "nccl"
    waits: Counter = Counter()
    wait_n: Counter = Counter()
    notes: Counter = Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" and any(w in e["name"] for w in WAITS):
            waits[e["name"]] += e.get("dur", 0) / 1e3
            wait_n[e["name"]] += 1
        elif e.get("cat") == "user_annotation":
            notes[e["name"]] += e.get("dur", 0) / 1e3
    out.update(
        gpu_span_ms=round(span_ms, 3), gpu_busy_ms=round(busy, 3),
        gpu_idle_ms=round(span_ms - busy, 3), idle_gaps_over_half_ms=gaps,
        kernel_ms_by_kind={k: round(v, 3) for k, v in by_kind.most_common()},
        nccl_kernels=nccl,
        host_waits={k: {"n": wait_n[k], "ms": round(v, 3)} for k, v in waits.most_common(8)},
        annotations_ms={k: round(v, 3) for k, v in notes.most_common(25)},
        top_kernels_ms={k: round(v, 3) for k, v in by_name.most_common(15)})
    if any(e.get("cat") == "python_function" for e in events):
        out["stacks"] = stacks(events)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {d: [summarize(p) for p in sorted(glob.glob(os.path.join(d, "**", "*trace.json*"),
                                                      recursive=True))]
           for d in a.dirs}
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
