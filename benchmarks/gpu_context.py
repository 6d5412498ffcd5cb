"""First token on a prefix hit and over a multi-turn conversation (issue 51,
docs/context.md): vLLM 0.34 on one GPU through the one-GPU harness (real
NCCL between ranks sharing the GPU), CUDA graphs, TP=2, the trained
DeepSeek-V2 (models/recall-dsv2, 131K positions), random-token prompts.

Layouts, the same prompts: unsharded TP=2, vLLM's own DCP=2 (no plugin),
and the plugin sharded with the context read ``gathered``, ``owned`` and
``auto`` (the cost model's choice).

* ``hits``: prompts of 32,768 and 100,000 tokens, each alone
  (``run_vllm.py --series``), max_tokens 1: cold, then the prompt + 200 new
  tokens (a prefix hit of the whole prompt), then that again: 6 waves.
* ``turns``: 4 conversations of 30K-100K tokens, 8 waves, each appending a
  turn of 200-800 tokens (``run_vllm.py --turns``); every wave's time is one
  turn's first token (4 requests at once).
* ``hitswarm``, ``turnswarm``: the same after one unrelated cold prompt of
  20,000 tokens (``run_vllm.py --warmup-tokens``), so that the engine's
  first long prefill is not charged to the first cold wave;
* ``steps``: the decode step of 8 requests at 2K and 60K tokens
  (``run_vllm.py --time-decode``), for the README's table against DCP;
* ``colds``: eight distinct 32K prompts and two of 100K after a warm-up,
  each cold then hit twice (the summary's ``cold_median_over_dcp``);
  ``coldsnd``: six and three, without the prompt's detokenization;
* ``prof``, ``prof100``: two 32K (100K) prompts, the second one's cold wave
  profiled (``prof100h``: the second one's first hit, ``prof100first``: the
  first 100K cold prompt, both with the workers' Python stacks): vLLM's torch profiler on the workers (``PROFILE_ROOT``) and the
  main process under cProfile (``benchmarks/trace_steps.py`` sums traces).

Every run times each engine step (``run_vllm.py --step-times``); the
summary gives each wave's GPU span and the time outside it (``spans``).

Usage (on the GPU machine, after ``source scripts/gpu/setup_device.sh``):
    python benchmarks/gpu_context.py OUT_DIR [--runs all|NAME,...] [--budget-s 540]
    python benchmarks/gpu_context.py OUT_DIR --summarize   (here, afterwards)
Writes OUT_DIR/<run>.json|.log, OUT_DIR/summary.json (per run: wave seconds,
bytes of the owned-context steps; ratios to DCP and unsharded) and
OUT_DIR/context.png.
"""

from __future__ import annotations

import json
import os
import statistics

import torch

import gpu_onegpu as onegpu
from common import pyplot, save_figure, write_json
from vllm_cp_kv.core.context import OWNED_COLLECTIVES, Link, row_bytes

BASE = ["--backend", "FLASHMLA", "--max-model-len", "131200", "--max-tokens", "1",
        "--kv-bytes", str(4 << 30), "--max-num-seqs", "4", "--step-times"] + onegpu.GRAPHS
# where the ``prof`` task's torch profiler traces go, a folder per run
PROFILE_ROOT = os.environ.get("CPKV_PROFILE_ROOT", "/tmp/cpkv-prof")
LAYOUTS = {  # in the order they run: the comparisons the issue asks first
    "dcp": ["--tp", "2", "--dcp", "2", "--no-plugin"],
    "owned": ["--tp", "2", "--shard", "--stats", "--cp-kv", '{"context_path": "owned"}'],
    "auto": ["--tp", "2", "--shard", "--stats"],
    "gathered": ["--tp", "2", "--shard", "--stats", "--cp-kv", '{"context_path": "gathered"}'],
    "plain": ["--tp", "2", "--no-plugin"],
    # the workspace at vLLM's own context chunk (64K tokens, what DCP reads a
    # chunk in), set: what the default became on 2026-12-06 (it was 1% of
    # the KV budget, 37K tokens for this 3-layer model at 4 GiB; at
    # DeepSeek-V3 shapes 1% of 8 GiB or more is already over 64K)
    "ws64k": ["--tp", "2", "--shard", "--stats", "--cp-kv", '{"workspace_tokens": 65536}'],
    # PCP=2 (issue 51's owned path under PCP): vLLM's own PCP=2 (unsharded;
    # its DCP does not combine with PCP for dense MLA) and the plugin's PCP=2
    # reading the context each way
    "pcp2": ["--tp", "1", "--pcp", "2", "--no-plugin"],
    "pcp2-owned": ["--tp", "1", "--pcp", "2", "--shard", "--stats", "--cp-kv",
                   '{"context_path": "owned"}'],
    "pcp2-gathered": ["--tp", "1", "--pcp", "2", "--shard", "--stats", "--cp-kv",
                      '{"context_path": "gathered"}'],
    "pcp2-auto": ["--tp", "1", "--pcp", "2", "--shard", "--stats"],
}
# models/recall-dsv2 under TP=2 (the harness projection's shape)
RECALL_SHAPE = dict(size=2, heads=8, width=576, v_dim=512, elt=2, layers=3)
TASKS = {  # hits: waves 32K cold, +200 (hit), again; 100K cold, +200, again
    "hits": ["--token-prompts", "32768,100000", "--series", "--suffix-len", "200"],
    # the same after one unrelated cold 20K-token prompt (the engine's first
    # long prefill not charged to the 32K cold wave), and the turns likewise
    # (three distinct 32K prompts: three cold samples, the 1.05x bar's row)
    "hitswarm": ["--token-prompts", "32768,32768,32768,100000", "--series",
                 "--suffix-len", "200", "--warmup-tokens", "20000"],
    # ... and eight distinct 32K prompts, two of 100K: the median cold ratio
    # against DCP per length (one sample varies 0.14-0.21 s on the harness)
    "colds": ["--token-prompts", ",".join(["32768"] * 8 + ["100000"] * 2), "--series",
              "--suffix-len", "200", "--warmup-tokens", "20000"],
    # the torch profiler over the second 32K cold prompt (wave 3: the first
    # prompt's three waves warm up more), vLLM's traces per rank: where a
    # cold prefill's time goes, step by step (benchmarks/trace_steps.py)
    "prof": ["--token-prompts", "32768,32768", "--series", "--suffix-len", "200",
             "--warmup-tokens", "20000", "--profile-wave", "3"],
    # ... and the second of two 100K cold prompts (1.15x DCP's on 2026-12-07)
    "prof100": ["--token-prompts", "100000,100000", "--series", "--suffix-len", "200",
                "--warmup-tokens", "20000", "--profile-wave", "3"],
    # ... and the second 100K prompt's first hit (wave 4) with the workers'
    # Python stacks: where a 100K hit's host time goes
    "prof100h": ["--token-prompts", "100000,100000", "--series", "--suffix-len", "200",
                 "--warmup-tokens", "20000", "--profile-wave", "4", "--profile-stack"],
    # six distinct 32K prompts and three of 100K after the 20K warm-up, each
    # cold then hit twice, without vLLM's detokenization of the prompt at
    # the first token (run_vllm.py --no-detokenize: the same host code in
    # every layout, 155-289 ms at 100K, whose spread hid the layouts' own
    # difference); the first 100K prompt is the engine's first context over
    # the 64K workspace
    "coldsnd": ["--token-prompts", ",".join(["32768"] * 6 + ["100000"] * 3), "--series",
                "--suffix-len", "200", "--warmup-tokens", "20000", "--no-detokenize"],
    # ... and the first 100K cold prompt after the 20K warm-up (the engine's
    # first context over the 64K workspace: 1.075x DCP's on 2026-12-07) with
    # the workers' Python stacks
    "prof100first": ["--token-prompts", "100000", "--series", "--suffix-len", "200",
                     "--warmup-tokens", "20000", "--no-detokenize", "--profile-wave", "0",
                     "--profile-stack"],
    "turnswarm": ["--token-prompts", "30000,55000,80000,100000", "--waves", "8", "--turns",
                  "--warmup-tokens", "20000"],
    "turns": ["--token-prompts", "30000,55000,80000,100000", "--waves", "8", "--turns"],
    # decode step of 8 requests at 2K and 60K tokens (harness --time-decode)
    "steps": ["--token-prompts", "1000", "--max-num-seqs", "8", "--time-decode", "32",
              "--time-contexts", "2000,60000"],
}


# another copy of vllm_cp_kv (a folder holding it), run as layout
# ``variant`` (``auto``'s arguments): a change A/B'd in the same lease
VARIANT = os.environ.get("CPKV_VARIANT")


def runs() -> dict:
    """name -> (model, args, harness on, env), as gpu_onegpu's table."""
    layouts = {**LAYOUTS, **({"variant": LAYOUTS["auto"]} if VARIANT else {})}
    return {f"{t}-{lay}": ("recall", BASE + args + layouts[lay] + (
        ["--profile-dir", os.path.join(PROFILE_ROOT, f"{t}-{lay}")]
        if "--profile-wave" in args else []), True,
        {"CPKV_PACKAGE": VARIANT} if lay == "variant" else {})
            for t, args in TASKS.items() for lay in layouts}


def paths(waves: list) -> dict:
    """The plugin's per-wave path facts (rank 0's statistics): rows read
    owned, the most chunks a gathered context took (one all-gather each per
    layer; an owned row takes ``core.context.OWNED_COLLECTIVES`` per layer),
    and the bytes a rank received per prefill step."""
    out = {"owned_rows": [], "context_chunks": [], "prefill_bytes_per_step": []}
    for w in waves:
        s = next((s for s in (w.get("stats") or []) if s), None)
        if s is None:
            return {}
        out["owned_rows"].append(s["owned_context_rows"])
        out["context_chunks"].append(s["max_context_chunks"])
        out["prefill_bytes_per_step"].append(s["prefill_bytes"] // max(s["prefill_steps"], 1))
    return out


def spans(waves: list) -> dict:
    """Each wave's GPU span (``--step-times``, rank 0: from the first
    step's entry to the last step's exit, ms) and the rest of its time,
    outside the steps' GPU work (scheduling before the first step, output
    handling after the last: host time), and the host ms the last step
    spent in ``execute_model``. Where the harness recorded the machine
    clock (rows of 9): ``before_ms``, from the wave's start to the first
    step's entry on rank 0, ``after_ms``, from the last ``sample_tokens``'
    host exit to the wave's end, and ``sample_gpu_ms``, the GPU from the
    last step's exit to its ``sample_tokens``' exit."""
    out = {"gpu_span_ms": [], "outside_ms": [], "last_step_host_ms": []}
    clocked = all(w.get("clock") and w.get("step_times") and len(w["step_times"][-1]) > 8
                  and w["step_times"][-1][7] is not None for w in waves)
    if clocked:
        out.update(before_ms=[], after_ms=[], sample_gpu_ms=[])
    for w in waves:
        st = w.get("step_times")
        if not st or st[-1][3] is None:
            return {}
        span = st[-1][4] + st[-1][3]
        out["gpu_span_ms"].append(round(span, 1))
        out["outside_ms"].append(round(w["seconds"] * 1e3 - span, 1))
        out["last_step_host_ms"].append(round(st[-1][2], 1))
        if clocked:
            out["before_ms"].append(round((st[0][6] - w["clock"]) * 1e3, 1))
            out["after_ms"].append(round((w["clock"] + w["seconds"] - st[-1][7]) * 1e3, 1))
            out["sample_gpu_ms"].append(None if st[-1][8] is None else
                                        round(st[-1][8] - span, 1))
    return out


# DeepSeek-V3 at N = 8 over NVLink (../shared/research/vllm-cp-state.md:
# an 8-byte all-reduce about 2.3 us on 8xH200, a 0.5 MB one about 23 us;
# platform.md: NCCL all-gather busbw 136-285 GB/s from 8 MiB up): latency
# 20 us a collective (a conservative all-gather), 150 GB/s
NVLINK8 = Link(latency_s=20e-6, bytes_per_s=150e9)
DSV3 = dict(size=8, heads=128, width=576, v_dim=512, elt=2, layers=61)
CASES = {"hit32k": (200, 32768), "hit100k": (200, 100000),
         "turn-30k": (800, 30000), "turn-100k": (800, 100000)}


def project(link: Link, shape: dict, chunk_tokens: int | None = None) -> dict:
    """Each path's collective seconds for one request (``q`` new tokens over
    ``c`` cached) summed over the layers: owned ``OWNED_COLLECTIVES``
    collectives and its query/output bytes; gathered one all-gather per
    context chunk (``chunk_tokens``: the workspace; None: one) and the
    context's bytes. The model's pick is the cheaper."""
    out = {}
    for case, (q, c) in CASES.items():
        cost = row_bytes(torch.tensor([q]), torch.tensor([c]), size=shape["size"],
                         heads=shape["heads"], width=shape["width"], v_dim=shape["v_dim"],
                         elt=shape["elt"])
        chunks = 1 if not chunk_tokens else -(-c // chunk_tokens)
        owned = shape["layers"] * link.seconds(OWNED_COLLECTIVES, float(cost.owned[0]))
        gathered = shape["layers"] * link.seconds(chunks, float(cost.gathered[0]))
        out[case] = {"owned_s": round(owned, 6), "gathered_s": round(gathered, 6),
                     "owned_mb_per_layer": round(float(cost.owned[0]) / 1e6, 3),
                     "gathered_mb_per_layer": round(float(cost.gathered[0]) / 1e6, 3),
                     "pick": "owned" if owned < gathered else "gathered"}
    return out


def harness_link(results: dict) -> Link | None:
    """The link the plugin measured at start in an auto run (its statistics)."""
    for res in results.values():
        for wave in res.get("waves") or []:
            for s in wave.get("stats") or []:
                if s and s.get("link"):
                    return Link(s["link"]["latency_s"], s["link"]["bytes_per_s"])
    return None


def projections(results: dict, model_shape: dict) -> dict:
    """The paths' collective time at DeepSeek-V3 shapes on 8 H200s over
    NVLink, and at this run's model shapes on the measured harness link."""
    out = {"nvlink8_dsv3": {"link": vars(NVLINK8), "shape": DSV3,
                            "cases": project(NVLINK8, DSV3)}}
    link = harness_link(results)
    if link is not None:
        out["harness_measured"] = {"link": vars(link), "shape": model_shape,
                                   "cases": project(link, model_shape)}
    return out


def summarize(results: dict) -> dict:
    """Per task: each layout's wave seconds and its ratio to DCP's."""
    out = {}
    for task in TASKS:
        row = {}
        for lay in [*LAYOUTS, "variant"]:
            res = results.get(f"{task}-{lay}") or {}
            waves = res.get("waves") or []
            if not (waves or res.get("decode_steps")):
                row[lay] = {"rc": res.get("rc", "missing")}
                continue
            row[lay] = {"seconds": [round(w["seconds"], 4) for w in waves],
                        "prefix_hits": [w.get("prefix_cache_hits") for w in waves],
                        **(paths(waves) if waves else {}), **spans(waves)}
            if res.get("decode_steps"):  # the steps task: s per decode step
                row[lay]["decode_step_s"] = {d["context"]: round(d["seconds_per_step"], 5)
                                             for d in res["decode_steps"]}
        dcp = row.get("dcp", {}).get("seconds")
        for lay, r in row.items():
            if dcp and r.get("seconds"):
                r["over_dcp"] = [round(x / y, 3) for x, y in zip(r["seconds"], dcp)]
            # the PCP layouts against vLLM's own PCP=2 and the gathered path
            for base in ("pcp2", "pcp2-gathered"):
                ref = row.get(base, {}).get("seconds")
                if lay.startswith("pcp2-") and lay != base and ref and r.get("seconds"):
                    r[f"over_{base}"] = [round(x / y, 3) for x, y in zip(r["seconds"], ref)]
            steps = row.get("dcp", {}).get("decode_step_s")
            if steps and r.get("decode_step_s"):
                r["decode_over_dcp"] = {c: round(t / steps[c], 3)
                                        for c, t in r["decode_step_s"].items() if c in steps}
        if "--series" in TASKS[task]:  # the cold (hit) waves' median ratio per length
            lens = [int(x) for x in TASKS[task][TASKS[task].index("--token-prompts") + 1]
                    .split(",")]
            for r in row.values():
                if r.get("over_dcp"):
                    r["cold_median_over_dcp"] = {
                        n: statistics.median(r["over_dcp"][3 * i]
                                             for i, m in enumerate(lens) if m == n)
                        for n in sorted(set(lens))}
                    r["hit_median_over_dcp"] = {
                        n: statistics.median(r["over_dcp"][3 * i + k]
                                             for i, m in enumerate(lens) if m == n
                                             for k in (1, 2))
                        for n in sorted(set(lens))}
        out[task] = row
    return out


def plot(out_dir: str, table: dict) -> None:
    plt = pyplot(optional=True)
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(table), figsize=(5 * len(table), 4))
    for ax, (task, row) in zip(axes, table.items()):
        for lay, r in row.items():
            if r.get("seconds"):
                ax.plot(range(1, len(r["seconds"]) + 1), r["seconds"], marker="o", label=lay)
        ax.set(title=task, xlabel="wave (1: cold)", ylabel="first token (s)", yscale="log")
        ax.legend(fontsize=7)
    save_figure(fig, os.path.join(out_dir, "context.png"))


def main() -> None:
    a = onegpu.matrix_arguments(timeout=300).parse_args()
    results, path = onegpu.earlier_runs(a.out)
    if not a.summarize:
        table = runs()
        names = list(table) if a.runs == "all" else [
            n for g in a.runs.split(",") for n in (table if g == "all" else
                                                    [k for k in table if k.startswith(g)])]
        onegpu.run_table(table, names, a, results, path)
    proj = projections(results, RECALL_SHAPE)
    for res in results.values():
        res.pop("log", None)
    table = summarize(results)
    write_json(path, {"runs": results, "table": table, "projection": proj})
    plot(a.out, table)
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
