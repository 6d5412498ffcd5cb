"""The trained recall model's accuracy in every GPU mode (issue 50,
docs/accuracy.md): vLLM 0.34 on one H200 through the one-GPU harness (real
NCCL between ranks sharing the GPU), CUDA graphs (vLLM's default mode), the
same prompts unsharded and sharded, at lengths from 8K to 128K.

Usage (on the GPU machine, after ``source scripts/gpu/setup_device.sh``):
    python benchmarks/gpu_recall.py OUT_DIR [--runs all|NAME,...] [--budget-s 540]
    python benchmarks/gpu_recall.py OUT_DIR --summarize   (here, afterwards)

Each sharded run is checked against its unsharded layout: accuracy within
each other's 95% Wilson interval (``recall.within``) at every length, and
per position bucket; each P/D run (``pd_offline --recall``) its decode's
answers against its own unsharded reference. Writes OUT_DIR/<run>.json|.log, OUT_DIR/summary.json
(runs and checks) and OUT_DIR/recall.png (accuracy against context length,
with intervals).
"""

from __future__ import annotations

import json
import os

import gpu_onegpu as onegpu
from common import pyplot, save_figure, write_json
from vllm_cp_kv.tools import recall

FM = ["--backend", "FLASHMLA"]


def task(lengths: str, per_bucket: int, kv_gib: int) -> list:
    """The recall prompts (``per_bucket`` per position bucket at each of
    ``lengths``), their answers' tokens, and the KV bytes each rank gets."""
    return ["--recall", lengths, "--recall-per-bucket", str(per_bucket),
            "--max-tokens", str(recall.VALUE_LEN), "--max-model-len", "131200",
            "--kv-bytes", str(kv_gib << 30)] + onegpu.GRAPHS


# 32K-token steps: a 128K prompt in 4 chunks (vLLM's default 16K makes 8, and
# each chunk of a sharded run gathers the cached context before it: issue 51)
TASK = task("8192,32768,131072", 2, 3) + ["--max-num-seqs", "4",
                                           "--max-num-batched-tokens", "32768"]
# the second wave all prefix hits: every first-wave block still cached (at 3
# GiB a rank the 8K-128K prompts evicted each other: no hits)
WAVES = task("32768,131072", 1, 8) + ["--max-num-seqs", "4",
                                      "--max-num-batched-tokens", "32768", "--waves", "2"]
# P/D: a sharded prefill into an unsharded TP=1 decode and into a sharded TP=2
# one, graded against pd_offline's own unsharded reference (the decode's TP);
# every prompt's KV held by the prefill until the decode reads it: 6 GiB a rank
PD = task("32768,131072", 1, 6) + ["--block-size", "64"] + FM
# the reads zero-copy over cuda_ipc: UCX's default on a GPU without NVLink
# stages them through host memory over TCP (0.7-1.5 MB/s on the harness, the
# H100 lease: every P/D row timed out); docs/disaggregated.md
ZCOPY = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
SHARD = ["--shard", "--stats"]
LAYOUTS = {"tp1": ["--tp", "1"], "tp2": ["--tp", "2"], "tp4": ["--tp", "4"],
           "pcp2": ["--tp", "1", "--pcp", "2"], "pcp2tp2": ["--tp", "2", "--pcp", "2"]}


def runs() -> dict:
    """name -> (model, args, harness on, env), as gpu_onegpu's table."""
    r = {"tp1-plain": ("recall", LAYOUTS["tp1"] + FM + TASK + ["--no-plugin"], False, {})}
    for lay in ("tp2", "tp4", "pcp2", "pcp2tp2"):
        r[f"{lay}-plain"] = ("recall", LAYOUTS[lay] + FM + TASK + ["--no-plugin"], True, {})
        r[f"{lay}-shard"] = ("recall", LAYOUTS[lay] + FM + TASK + SHARD, True, {})
    fp8 = LAYOUTS["tp2"] + FM + TASK + ["--kv-cache-dtype", "fp8"]
    r["tp2-fp8-plain"] = ("recall", fp8 + ["--no-plugin"], True, {})
    r["tp2-fp8-shard"] = ("recall", fp8 + SHARD, True, {})
    # where the sharded FP8 run died at vLLM's warm-up on the H100 (an illegal
    # memory access reported after the FLASHMLA FP8 kernel): the same run with
    # every launch synchronous (the failing kernel named), and with the
    # settings of the FP8 runs that passed (8 requests, 16K-token steps)
    r["tp2-fp8-shard-sync"] = ("recall", fp8 + SHARD, True, {"CUDA_LAUNCH_BLOCKING": "1"})
    r["tp2-fp8-shard-s8"] = ("recall", fp8 + SHARD + ["--max-num-seqs", "8",
                                                      "--max-num-batched-tokens", "16384",
                                                      "--kv-bytes", str(4 << 30)], True, {})
    waves = LAYOUTS["tp2"] + FM + WAVES
    r["tp2-prefix-plain"] = ("recall", waves + ["--no-plugin"], True, {})
    r["tp2-prefix-shard"] = ("recall", waves + SHARD, True, {})
    # PCP=2 with the hits' context read owned (issue 51: the pieces of each
    # short prefill exchanged over the shard group)
    pcp_waves = LAYOUTS["pcp2"] + FM + WAVES
    r["pcp2-prefix-plain"] = ("recall", pcp_waves + ["--no-plugin"], True, {})
    r["pcp2-prefix-shard"] = ("recall", pcp_waves + SHARD + [
        "--cp-kv", '{"context_path": "owned"}'], True, {})
    r["pd-tp2-into-tp1"] = ("pd:recall", ["--prefill-tp", "2", "--prefill-pcp", "1",
                                          "--port", "6100"] + PD, True, ZCOPY)
    r["pd-pcp2-into-tp2-shard"] = ("pd:recall", ["--prefill-tp", "1", "--prefill-pcp", "2",
                                                 "--decode-tp", "2", "--decode-shard",
                                                 "--port", "6150"] + PD, True, ZCOPY)
    return r


PAIRS = [(f"{x}-shard", f"{x}-plain") for x in ("tp2", "tp4", "pcp2", "pcp2tp2", "tp2-fp8",
                                                "tp2-prefix", "pcp2-prefix")]


def compare(a: dict, b: dict) -> dict:
    """Two runs' accuracies (``recall`` of each) at every length and bucket."""
    per = {}
    for length in a:
        x, y = a[length], b[length]
        per[length] = {"shard": x["accuracy"], "plain": y["accuracy"],
                       "within": recall.within(x, y),
                       "buckets_within": all(recall.within(p, q) for p, q in
                                             zip(x["buckets"], y["buckets"]))}
    return {"ok": bool(per) and all(v["within"] and v["buckets_within"] for v in per.values()),
            "lengths": per}


def checks(results: dict) -> dict:
    out = {}
    for shard, plain in PAIRS:
        a, b = results.get(shard, {}).get("recall"), results.get(plain, {}).get("recall")
        if not a or not b:
            out[shard] = {"ok": False, "why": "missing run"}
            continue
        hits = (results[shard].get("waves") or [{}])[-1].get("prefix_cache_hits")
        c = out[shard] = compare(a, b)
        if "prefix" in shard:  # the graded wave must have hit the cache
            c.update(prefix_hits=hits, ok=c["ok"] and bool(hits))
            # ... and read its context owned on every rank (rows per rank)
            stats = [x for x in (results[shard]["waves"][-1].get("stats") or []) if x]
            c["owned_rows"] = [x.get("owned_context_rows") for x in stats]
            c["ok"] = c["ok"] and bool(stats) and min(c["owned_rows"]) > 0
    for name in (n for n, r in runs().items() if r[0].startswith("pd")):
        rec = results.get(name, {}).get("recall")  # the decode's against the reference's
        if not rec:
            out[name] = {"ok": False, "why": "missing run"}
            continue
        c = out[name] = compare(rec["decode"], rec["reference"])
        arrived = results[name]["checks"]["every_prompt_token_received"]
        c.update(every_prompt_token_received=arrived, ok=c["ok"] and arrived)
    return out


def plot(out_dir: str, results: dict) -> None:
    plt = pyplot(optional=True)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, res) in enumerate(sorted(results.items())):
        rec = res.get("recall")
        if rec and "decode" in rec:  # P/D: the decode's answers
            rec = rec["decode"]
        if not rec:
            continue
        xs = [int(k) * 1.012 ** i for k in rec]  # side by side where they agree
        ys = [rec[k]["accuracy"] for k in rec]
        err = [[y - rec[k]["interval"][0] for k, y in zip(rec, ys)],
               [rec[k]["interval"][1] - y for k, y in zip(rec, ys)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, lw=1,
                    ls="--" if name.endswith("plain") else "-", label=name)
    ax.set(xscale="log", xlabel="context tokens", ylabel="exact-match accuracy",
           ylim=(0, 1.05), title=f"recall-dsv2, vLLM 0.34, one GPU, CUDA graphs "
                                 f"({os.path.basename(os.path.normpath(out_dir))})")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, os.path.join(out_dir, "recall.png"))


def main() -> None:
    ap = onegpu.matrix_arguments(timeout=420)
    a = ap.parse_args()
    results, path = onegpu.earlier_runs(a.out)
    if not a.summarize:
        table = runs()
        names = list(table) if a.runs == "all" else a.runs.split(",")
        onegpu.run_table(table, names, a, results, path)
    for res in results.values():  # the logs stay in their own files
        res.pop("log", None)
    cks = checks(results)
    write_json(path, {"runs": results, "checks": cks})
    plot(a.out, results)
    print(json.dumps({k: v["ok"] for k, v in cks.items()}, indent=1))


if __name__ == "__main__":
    main()
