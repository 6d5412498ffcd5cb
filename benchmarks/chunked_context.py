"""Prefill of a long cached context: chunked workspace vs one gather of the
whole view, real vLLM on CPU (TP=2, float32, CPU_MLA, PyTorch rope), in one run.

Usage: python benchmarks/chunked_context.py OUT_DIR [--context 3000] [--prompts 2]
           [--waves 5] [--workspaces 256,1024] [--new-tokens 32] [--model DIR]

Wave 1 prefills ``--prompts`` prompts of ``--context`` tokens; every later
wave sends each prompt again with the same ``--new-tokens`` suffix, so its
prefill reads the whole cached context (a prefix-cache hit) and computes the
suffix (one output token). The baseline reads the context in one gather
(a workspace larger than any context: today's single gather); the others
through a workspace of each of ``--workspaces`` tokens, so the context takes
``context / workspace`` chunks per layer, each gathered, attended to by
vLLM's context-chunk attention and merged by LSE. Each configuration is a
fresh engine on the demo's 12-layer tiny DeepSeek-V2; the median time of
the later waves is reported with its ratio to the single gather, the chunks
per step and the bytes each rank received (the same in every configuration:
chunking moves the same blocks), and whether the tokens equal the single
gather's. Writes ``chunked_context.json`` and ``chunked_context.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from common import ROOT, RUN_VLLM, meta, pyplot, result_dir, save_figure, write_json

SINGLE = 1 << 30  # a workspace no context reaches: the one gather


def run_config(a, name: str, workspace: int) -> dict:
    out = os.path.join(a.out_dir, f"{name}.json")
    prompts = ",".join([str(a.context)] * a.prompts)
    cmd = [sys.executable, RUN_VLLM, a.model, out, "--shard", "--dtype", "float32",
           "--backend", "CPU_MLA", "--torch-rope", "--token-prompts", prompts,
           "--max-model-len", str(a.context + a.new_tokens + 16), "--max-tokens", "1",
           "--suffix-len", str(a.new_tokens), "--waves", str(a.waves), "--stats",
           "--max-num-seqs", str(a.prompts),
           "--cp-kv", json.dumps({"workspace_tokens": workspace})]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(out + ".log", "w") as log:
        subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                       check=True, timeout=1800)
    with open(out) as f:
        run = json.load(f)
    later = run["waves"][1:]
    stats = [s for s in later[0]["stats"] if s]
    return {"workspace_tokens": workspace, "scratch_log": _scratch_line(out + ".log"),
            "wave_seconds": [w["seconds"] for w in later],
            "median_seconds": statistics.median(w["seconds"] for w in later),
            "max_context_chunks": max(s["max_context_chunks"] for s in stats),
            "prefill_bytes_per_rank": [s["prefill_bytes"] for s in stats],
            "hits": [w["prefix_cache_hits"] for w in later],
            "tokens": [w["tokens"] for w in later]}


def _scratch_line(log: str) -> str | None:
    with open(log) as f:
        return next((line.split("cp_kv: ", 1)[1].strip() for line in f
                     if "scratch full view" in line), None)


def plot(res: dict, path: str) -> None:
    names = list(res["configs"])
    fig, ax = pyplot().subplots(figsize=(6, 3.8))
    ratios = [res["configs"][k]["ratio_to_single"] for k in names]
    ax.bar(names, ratios, color=["gray"] + ["tab:blue"] * (len(names) - 1))
    for i, (k, r) in enumerate(zip(names, ratios)):
        ax.text(i, r, f"{r:.2f}x\n{res['configs'][k]['max_context_chunks']} chunks",
                ha="center", va="bottom")
    ax.set_ylabel("prefill wave time / single gather")
    ax.set_title(f"{res['prompts']} x {res['context']}-token cached context + "
                 f"{res['new_tokens']} new (CPU, TP=2)")
    ax.set_ylim(0, max(ratios) * 1.3)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--workspaces", default="256,1024")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    if a.model is None:
        from vllm_cp_kv.tools.tiny_model import build_demo

        a.model = build_demo(os.path.join(ROOT, ".work", "models", "tiny-dsv2-12l"))
    result_dir(a.out_dir)
    res = {k: getattr(a, k) for k in ("context", "prompts", "waves", "new_tokens", "model")}
    res.update(meta(), configs={})
    configs = [("single", SINGLE)] + [(f"ws{w}", int(w)) for w in a.workspaces.split(",")]
    for name, workspace in configs:
        res["configs"][name] = run_config(a, name, workspace)
        print(name, res["configs"][name]["median_seconds"], flush=True)
    single = res["configs"]["single"]
    for run in res["configs"].values():
        run["ratio_to_single"] = run["median_seconds"] / single["median_seconds"]
        run["tokens_equal_single"] = run["tokens"] == single["tokens"]
        run["bytes_equal_single"] = run["prefill_bytes_per_rank"] == single[
            "prefill_bytes_per_rank"]
    write_json(os.path.join(a.out_dir, "chunked_context.json"), res)
    plot(res, os.path.join(a.out_dir, "chunked_context.png"))
    for name, run in res["configs"].items():
        print(f"{name:8s} {run['median_seconds']:.3f} s  {run['ratio_to_single']:.2f}x  "
              f"chunks {run['max_context_chunks']}  tokens equal "
              f"{run['tokens_equal_single']}  bytes equal {run['bytes_equal_single']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
