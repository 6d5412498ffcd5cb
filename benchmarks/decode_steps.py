"""Decode step time, TP=2: unsharded vs sharded with the shard-aware (LSE)
decode vs sharded with the materializing decode (and on GPU vLLM's own
TP=2+DCP=2, with and without CUDA graphs), in one run.

Usage: python benchmarks/decode_steps.py OUT_DIR [--contexts 256,1024,3584]
           [--batch 8] [--steps 64] [--dtype bfloat16] [--model DIR]
           [--configs unsharded,sharded_lse,sharded_materialize] [--gpu-mem F]

Configurations: ``unsharded`` (TP=2), ``sharded_lse``, ``sharded_materialize``,
``vllm_dcp`` (vLLM's TP=2 + DCP=2, GPU); a ``_graphs`` suffix runs it with
CUDA graphs (vLLM's default mode) instead of eager.

Each configuration runs in its own process (vLLM's workers start fresh) and
goes through the context lengths in turn: ``--batch`` requests of that many
random prompt tokens are added, the engine is stepped until every request
has its first token (the prefills), then ``--steps`` pure decode steps are
timed one by one (wall time of ``LLMEngine.step``; every request still
running). Reports the median per configuration and context, the ratios to
the unsharded step, the extra time over unsharded, and the bytes the plugin
counted per decode step; writes ``decode_steps.json`` and
``decode_steps.png``. Ratios, not absolute times, are what this machine's
noise allows to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"unsharded": None, "sharded_lse": {"decode": "lse"},
           "sharded_materialize": {"decode": "materialize"}, "vllm_dcp": "dcp"}


def config_of(name: str):
    """(cp_kv options or None or "dcp", CUDA graphs?) of a configuration name."""
    graphs = name.endswith("_graphs")
    return CONFIGS[name[: -len("_graphs")] if graphs else name], graphs


def run_config(a, name: str, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_cp_kv.tools.tiny_model import token_prompts

    import torch

    contexts = [int(x) for x in a.contexts.split(",")]
    options, graphs = config_of(name)
    kw = dict(model=a.model, tensor_parallel_size=2, dtype=a.dtype,
              max_model_len=max(contexts) + a.steps + 64, max_num_seqs=a.batch,
              enforce_eager=not graphs, seed=0, enable_prefix_caching=False)
    if torch.cuda.is_available():
        kw.update(gpu_memory_utilization=a.gpu_mem, disable_custom_all_reduce=True)
    else:
        kw["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    if a.backend:
        kw["attention_config"] = {"backend": a.backend}
    if options == "dcp":
        kw["decode_context_parallel_size"] = 2
    elif options is not None:
        kw["additional_config"] = {"cp_kv": {"enable": True, **options}}
    sharded = isinstance(options, dict)
    llm = LLM(**kw)
    engine = llm.llm_engine
    vocab = engine.vllm_config.model_config.get_vocab_size()
    # long enough that every request still runs during the timed steps
    sp = SamplingParams(temperature=0.0, max_tokens=a.steps + 32, ignore_eos=True)
    rows = []
    for k, ctx in enumerate(contexts):
        for i, ids in enumerate(token_prompts([ctx] * a.batch, vocab, seed=k)):
            engine.add_request(f"{k}-{i}", TokensPrompt(prompt_token_ids=ids), sp)
        started: set = set()
        tokens = {}

        def step():
            outs = engine.step()
            tokens.update({o.request_id: list(o.outputs[0].token_ids)
                           for o in outs if o.finished})
            return outs

        while len(started) < a.batch:  # prefills (and the steps mixing them)
            started |= {o.request_id for o in step() if o.outputs[0].token_ids}
        if sharded:
            llm.collective_rpc("cp_kv_stats", kwargs={"reset": True})
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        stats = llm.collective_rpc("cp_kv_stats")[0] if sharded else None
        while engine.has_unfinished_requests():
            step()
        rows.append({"context": ctx, "median_ms": 1e3 * statistics.median(times),
                     "times_ms": [1e3 * t for t in times],
                     "bytes_per_step": (statistics.median(stats["decode_step_bytes"])
                                        if stats and stats["decode_step_bytes"] else 0),
                     "tokens": [tokens[f"{k}-{i}"] for i in range(a.batch)]})
    with open(out, "w") as f:
        json.dump({"config": name, "rows": rows}, f)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, (name, rows) in enumerate(res["configs"].items()):
        ctx = [r["context"] for r in rows]
        style = dict(marker="o", label=name, color=f"C{k}")  # one color per config
        axes[0].plot(ctx, [r["median_ms"] for r in rows], **style)
        if name != "unsharded":
            axes[1].plot(ctx, [r["bytes_per_step"] / 2**10 for r in rows], **style)
    axes[0].set(xlabel="context (tokens)", ylabel="decode step (ms, median)",
                title=f"decode step, batch {res['batch']}, TP=2, {res['dtype']}")
    axes[1].set(xlabel="context (tokens)", ylabel="KiB received per decode step (rank 0)",
                title="bytes across ranks per decode step", yscale="log")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--contexts", default="256,1024,3584")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", default="unsharded,sharded_lse,sharded_materialize")
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--run", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.model is None:
        from vllm_cp_kv.tools.tiny_model import build_held_out

        a.model = build_held_out(os.path.join(ROOT, ".work", "models", "held-out-dsv2"))
    configs = a.configs.split(",")
    if a.run:
        run_config(a, *a.run)
        return 0
    os.makedirs(a.out_dir, exist_ok=True)
    res = {"batch": a.batch, "steps": a.steps, "dtype": a.dtype, "model": a.model,
           "machine": os.uname().nodename, "configs": {}}
    for name in configs:
        out = os.path.join(a.out_dir, f"{name}.json")
        args = [sys.executable, os.path.abspath(__file__), a.out_dir, "--run", name, out,
                "--contexts", a.contexts, "--batch", str(a.batch), "--steps",
                str(a.steps), "--dtype", a.dtype, "--model", a.model,
                "--gpu-mem", str(a.gpu_mem)]
        if a.backend:
            args += ["--backend", a.backend]
        with open(out + ".log", "w") as log:
            proc = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        if proc.returncode != 0:  # recorded; the other configurations go on
            with open(out + ".log") as f:
                res.setdefault("failed", {})[name] = f.read()[-3000:]
            continue
        with open(out) as f:
            res["configs"][name] = json.load(f)["rows"]
    base = {r["context"]: r["median_ms"] for r in res["configs"].get(configs[0], [])}
    res["baseline"] = configs[0]
    print(f"{'config':<22}{'context':>8}{'step ms':>10}{'ratio':>8}{'extra ms':>10}"
          f"{'KiB/step':>10}")
    for name, rows in res["configs"].items():
        for r in rows:
            r["ratio"] = r["median_ms"] / base[r["context"]] if base else None
            r["extra_ms"] = r["median_ms"] - base[r["context"]] if base else None
            if not base:
                continue
            print(f"{name:<22}{r['context']:>8}{r['median_ms']:>10.2f}{r['ratio']:>8.2f}"
                  f"{r['extra_ms']:>10.2f}{r['bytes_per_step'] / 2**10:>10.1f}")
    # CUDA graphs must not change the tokens
    for name in res["configs"]:
        eager = name[: -len("_graphs")]
        if name.endswith("_graphs") and eager in res["configs"]:
            res.setdefault("graphs_same_tokens", {})[name] = all(
                g["tokens"] == e["tokens"] for g, e in zip(res["configs"][name],
                                                          res["configs"][eager]))
    print("failed:", sorted(res.get("failed", {})), "graphs same tokens:",
          res.get("graphs_same_tokens"))
    with open(os.path.join(a.out_dir, "decode_steps.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out_dir, "decode_steps.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
