"""Every multi-rank GPU path of cp_kv in real vLLM 0.32 on ONE GPU, in
vLLM's default mode: CUDA graphs on (FULL_AND_PIECEWISE, default capture
sizes), every rank on GPU 0 with real NCCL (the one-GPU harness,
scripts/gpu/onegpu, ``ONEGPU_COMM=nccl``: a distinct ``NCCL_HOSTID`` per
rank), several runs at a time. Runs that are eager say why in their name:
``-debug`` (``VLLM_CP_KV_DEBUG=1`` checks on the host, which a replayed graph
skips; the plugin refuses it with graphs), ``-eager`` (a reference: graphs
against eager), ``-old`` (the plugin before the captured decode was fixed:
the negative control, in graphs mode).

Usage (on the GPU machine, after ``source scripts/gpu/setup_device.sh``):
    python benchmarks/gpu_onegpu.py OUT_DIR [--runs GROUP|NAME,...]
        [--budget-s 540] [--parallel 6] [--comm nccl|gloo|shm]
    python benchmarks/gpu_onegpu.py OUT_DIR --summarize   (here, afterwards)
    python benchmarks/gpu_onegpu.py OUT_DIR --against OLD_DIR  (a re-run of
        runs whose references are in OLD_DIR: same tokens, statistics, hits)

The runs are data (benchmarks/onegpu_runs.py), the checks apart
(benchmarks/onegpu_checks.py). GROUPs, one per section of the table, by what
they check: ``graphs`` (the captured decode: TP=2 on FLASH_ATTN_MLA, FLASHMLA
and TRITON_MLA in FULL_AND_PIECEWISE and FULL_DECODE_ONLY against TP=2
unsharded with graphs, sharded eager with the debug checks, TP=1, prompts of
1 token to 40K; the negative control), ``tp4``, ``materialize`` (the
materializing decode), ``pcp`` (PCP=2 dense and MoE, PCP=2 x TP=2, P/D from
it), ``sparse`` (both sparse backends under PCP), ``prefix`` (prefix hits,
the chunked context with and without the prefetch), ``mtp`` (k=1..3 under
TP=2, k=2 under PCP and PCP x TP), ``fp8``, ``fp8-pcp``, ``fp8-refs``,
``fp8-triton``, ``fp8-chunk`` (FP8 KV: TP=2 per backend, PCP=2, the
references where vLLM's own fails, TRITON_MLA under PCP and PCP x TP, the
chunked context), ``pd`` (P/D over NIXL and Mooncake, the dropped-positions
control); ``timing`` (decode step times, runs of ``graphs``), ``accuracy``
(the trained model's runs of benchmarks/gpu_recall.py: where they ran, the
verdicts of TP=2, TP=4, PCP=2, PCP=2 x TP=2, FP8, prefix hits and P/D are
its accuracy against unsharded, the token comparisons kept beside); ``all``
(``graphs``, ``more`` and ``accuracy``); and the groups of earlier leases
by name (``more``, ``again``, ``v034``, ``pcp-tp``, ...: ``ALIASES``).

Runs go through ``harness/run_vllm.py`` (and ``vllm_cp_kv.tools.pd_offline``)
as in benchmarks/gpu_vllm_checks.py, with a fixed KV budget per rank
(``--kv-bytes``: no memory profiling, so ranks that share the GPU do not
count each other's memory) and a small ``gpu_memory_utilization``, so that
up to ``--parallel`` runs share the GPU. Writes OUT_DIR/<run>.json|.log,
OUT_DIR/summary.json (runs, checks, wall seconds, capture seconds and graph
memory per rank from vLLM's logs), OUT_DIR/onegpu.png, and prints the checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import gpu_vllm_checks as checks  # model builders, run loading
from common import ROOT, RUN_VLLM, pyplot, result_dir, save_figure, write_json
from onegpu_checks import _ok, agree, agreement, compare, mtp_rows_ok, pair, within_floor
from onegpu_runs import DEBUG, GRAPHS, SHARD, groups, runs
from vllm_cp_kv.tools import tiny_model

# what benchmarks/gpu_recall.py and benchmarks/gpu_sparse.py take from here
__all__ = ["DEBUG", "GRAPHS", "SHARD", "_ok", "agree", "agreement", "compare", "matrix_arguments",
           "model_dir", "model_of", "mtp_rows_ok", "pair", "run_table", "runs", "within_floor"]

HARNESS = os.path.join(ROOT, "scripts", "gpu", "onegpu")
KV = str(4 << 30)  # per rank: the scratch view is < 2%
BASE = ["--gpu-mem", "0.05", "--kv-bytes", KV]


def model_dir(kind: str) -> str:
    """``moe``, ``dense`` (6 heads) and ``dense8`` (8 heads, TP=4) with GPU
    head sizes and 16K positions (prompts up to 8K); ``dsv32`` as
    gpu_vllm_checks builds it."""
    if kind == "dsv32":
        return checks.model_dir(kind)
    if kind == "recall":  # the trained model (docs/accuracy.md), committed
        return os.path.join(ROOT, "models", "recall-dsv2")
    if kind in ("mtp", "mtp-moe"):
        return tiny_model.build_mtp(os.path.join(checks.MODELS, "onegpu-" + kind),
                                    gpu_heads=True, max_positions=16384, moe=kind == "mtp-moe")
    # 64K positions: the graphs group's prompts reach 40K tokens
    return tiny_model.build(os.path.join(checks.MODELS, "onegpu64k-" + kind), gpu_heads=True,
                            moe=kind == "moe", heads=8 if kind == "dense8" else 6,
                            max_positions=65536)


COMM = ["nccl"]  # --comm: the harness's collectives


def env_for(harness: bool, extra: dict) -> dict:
    extra = dict(extra)
    package = extra.pop("CPKV_PACKAGE", None)  # another copy of vllm_cp_kv first
    env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}
    paths = [p for p in env.get("PYTHONPATH", "").split(":") if p and p != HARNESS]
    if harness:
        env["ONEGPU"] = "1"
        env["ONEGPU_COMM"] = COMM[0]
        env["CUDA_VISIBLE_DEVICES"] = "0"
        paths.insert(0, HARNESS)
    if package:
        paths.insert(0, package)
    env["PYTHONPATH"] = ":".join(paths)
    return env


def model_of(kind: str) -> str:
    """The model a run's kind names: ``MODEL``, ``"pd:MODEL"``, or ``"pd"``
    (the MoE model)."""
    if kind.startswith("pd"):
        return kind.partition(":")[2] or "moe"
    return kind


def run_one(name: str, spec, out: str, timeout: float) -> dict:
    kind, args, harness, extra = spec
    t0 = time.time()
    if kind.startswith("pd"):  # "pd" (the moe model) or "pd:MODEL"
        work = os.path.join(out, name)
        # P/D runs may run at the same time: each its own side-channel ports
        # (another table's P/D runs pass their own --port, which comes later)
        mine = sorted(n for n, r in runs().items() if r[0] == "pd")
        port = 5700 + 10 * mine.index(name) if name in mine else 0
        cmd = [sys.executable, "-m", "vllm_cp_kv.tools.pd_offline",
               model_dir(model_of(kind)), work,
               "--device", "cuda", "--gpu-mem", "0.05", "--decode-gpu-mem", "0.05",
               "--kv-bytes", KV, "--port", str(port), "--timeout", str(int(timeout) - 20),
               *args]
    else:
        cmd = [sys.executable, RUN_VLLM, model_dir(kind),
               os.path.join(out, f"{name}.json"), *BASE, *args]
    rc = checks.run_logged(cmd, env_for(harness, extra), os.path.join(out, f"{name}.log"),
                           timeout, "CMD " + " ".join(cmd) + f"\nENV {extra} harness={harness}\n")
    if kind.startswith("pd"):
        path = os.path.join(out, name, "pd_result.json")
        res = {"name": name, "rc": rc}
        if os.path.exists(path):
            with open(path) as f:
                res.update(json.load(f))
            res["drop_positions"] = extra.get("CPKV_TEST_IGNORE_POSITIONS") == "1"
        res["wall_s"] = round(time.time() - t0, 1)
        return res
    return checks.load_run(out, name, rc, wall_s=round(time.time() - t0, 1),
                           graph_capture=capture_figures(os.path.join(out, f"{name}.log")))


CAPTURE = re.compile(r"Graph capturing finished in (\d+) secs, took ([-\d.]+) GiB")


def capture_figures(log: str) -> list:
    """vLLM's own line per rank: capture seconds and graph memory (GiB, the
    device's free memory before and after, so ranks and runs that share the
    GPU blur it)."""
    if not os.path.exists(log):
        return []
    with open(log, errors="replace") as f:
        return [{"seconds": int(m[1]), "gib": float(m[2])} for m in CAPTURE.finditer(f.read())]


def report(out_dir, results):
    # the checks of this lease's runs only (none of a pair ran: left out)
    cks = {k: c for k, c in compare(results).items() if c.get("rc") != [None, None]
           and (k != "noise-floor" or c["ok"])}
    write_json(os.path.join(out_dir, "summary.json"), {"runs": results, "checks": cks})
    plot(out_dir, cks)
    print("\ncheck | ok | figures")
    for key, c in cks.items():
        figs = {k: c[k] for k in ("capacity_ratio", "same_tokens", "rc", "why",
                                  "multi_query_decode_steps") if k in c}
        if "agreement" in c:
            figs["identical"] = f"{c['agreement']['identical']}/{c['agreement']['of']}"
        if "unsharded_tp2_vs_tp1" in c:
            u = c["unsharded_tp2_vs_tp1"]
            figs["tp2_vs_tp1_unsharded"] = f"{u['identical']}/{u['of']}"
        print(f"{key} | {c.get('ok')} | {json.dumps(figs)}")
    print("wall_s per run:", {n: r.get("wall_s") for n, r in results.items()})


def plot(out_dir, cks):
    plt = pyplot(optional=True)
    if plt is None:
        return
    items = {k: c for k, c in cks.items() if "capacity_ratio" in c}
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(range(len(items)), [c["capacity_ratio"] for c in items.values()],
           color=["tab:green" if c.get("ok") else "tab:red" for c in items.values()])
    ax.set_xticks(range(len(items)), list(items), rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("KV capacity, sharded / unsharded")
    ax.set_title("one H200, ranks on NCCL, CUDA graphs (green: every check holds)", fontsize=9)
    save_figure(fig, os.path.join(out_dir, "onegpu.png"), dpi=120)


def against(out: str, old: str) -> dict:
    """Each run of ``out`` against the same run in ``old`` (a re-run after a
    change that must not change behaviour): tokens of every wave, the shard
    statistics' step counts and bytes, prefix-cache hits, P/D identity.
    Writes OUT_DIR/against.json."""
    keys = ("prefill_steps", "decode_steps", "prefill_bytes", "decode_bytes", "")

    def load(folder, name):
        path = os.path.join(folder, name + ".json")
        if not os.path.exists(path):  # P/D runs keep their result in a folder
            path = os.path.join(folder, name, "pd_result.json")
        with open(path) as f:
            return json.load(f)

    def facts(r):
        waves = r["waves"] if isinstance(r.get("waves"), list) else [r]
        per_wave = [w["stats"] for w in waves if w.get("stats")]
        # runs with per-wave statistics: their sums are the run's totals
        totals = [{k: sum(wave[i][k] for wave in per_wave) for k in keys[:-1]}
                  for i in range(len(per_wave[0]))] if len(per_wave) == len(waves) > 1 \
            else [{k: s.get(k) for k in keys[:-1]} for s in r.get("stats") or []]
        return {"tokens": [w.get("tokens") for w in waves],
                "hits": [w.get("prefix_cache_hits") for w in waves],
                "stats": totals, "identical": r.get("identical")}

    with open(os.path.join(out, "summary.json")) as f:
        names = sorted(json.load(f)["runs"])
    report = {}
    for name in names:
        new, ref = facts(load(out, name)), facts(load(old, name))
        stats_known = bool(ref["stats"])  # older runs of some kinds kept none
        report[name] = {"same_tokens": new["tokens"] == ref["tokens"],
                        "same_hits": new["hits"] == ref["hits"],
                        "same_stats": new["stats"] == ref["stats"] if stats_known else None,
                        "same_identity": new["identical"] == ref["identical"],
                        "stats": new["stats"][:1]}
        print(name, {k: v for k, v in report[name].items() if k != "stats"})
    write_json(os.path.join(out, "against.json"), {"old": old, "runs": report})
    return report


def earlier_runs(out: str) -> tuple[dict, str]:
    """``out`` made if missing, the runs of its ``summary.json`` (earlier
    calls of the lease; {} if none) and that file's path."""
    result_dir(out)
    path = os.path.join(out, "summary.json")
    if not os.path.exists(path):
        return {}, path
    with open(path) as f:
        return json.load(f)["runs"], path


def matrix_arguments(timeout: float) -> argparse.ArgumentParser:
    """The arguments of a matrix of runs (this one and gpu_sparse.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--runs", default="all")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--parallel", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=timeout)
    ap.add_argument("--summarize", action="store_true")
    return ap


def main() -> None:
    ap = matrix_arguments(timeout=240)
    ap.add_argument("--comm", default="nccl", choices=["nccl", "gloo", "shm"],
                    help="the harness's collectives (gloo and shm: eager runs only)")
    ap.add_argument("--against", help="compare with the same runs in this folder")
    a = ap.parse_args()
    if a.against:
        return against(a.out, a.against)
    COMM[0] = a.comm
    checks.OUT_DIR[0] = a.out
    result_dir(a.out)
    path = os.path.join(a.out, "summary.json")
    results = {}
    if os.path.exists(path):  # earlier calls of the lease
        with open(path) as f:
            results = json.load(f)["runs"]
    if a.summarize:  # P/D runs: their folder's pd_result.json, which a run cut
        for name in results:  # short after every role finished gets from pd_offline
            path = os.path.join(a.out, name, "pd_result.json")  # --summarize
            if name.startswith("pd-") and os.path.exists(path):
                with open(path) as f:
                    results[name] = {**results[name], **json.load(f), "name": name}
        return report(a.out, results)
    table = runs()
    named = groups(table)
    names = [n for part in a.runs.split(",") for n in named.get(part, [part])]
    for kind in {table[n][0] for n in names}:  # build the models before the clock runs
        model_dir(model_of(kind))
    run_table(table, names, a, results, path)
    report(a.out, results)


def run_table(table: dict, names: list, a, results: dict, path: str) -> None:
    """Run ``names`` of ``table``, ``a.parallel`` at a time, each stopped by
    ``a.timeout`` or the budget left of ``a.budget_s``; ``results`` (and
    ``path``) updated after each."""
    start = time.time()

    def go(name):
        left = a.budget_s - (time.time() - start)
        if left < 90:
            return name, {"name": name, "rc": "skipped (budget)"}
        res = run_one(name, table[name], a.out, min(a.timeout, left - 10))
        print(f"{name}: rc={res['rc']} {res['wall_s']} s", flush=True)
        return name, res

    with ThreadPoolExecutor(a.parallel) as pool:
        for name, res in pool.map(go, names):
            if res["rc"] == "skipped (budget)" and name in results:
                continue  # an earlier call's result stays
            results[name] = res
            write_json(path, {"runs": results})


if __name__ == "__main__":
    main()
