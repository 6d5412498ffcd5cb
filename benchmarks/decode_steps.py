"""Decode step time, TP=2: unsharded vs sharded with the shard-aware (LSE)
decode vs sharded with the materializing decode (and on GPU vLLM's own
TP=2+DCP=2, with and without CUDA graphs), in one run.

Usage: python benchmarks/decode_steps.py OUT_DIR [--contexts 256,1024,3584]
           [--batch 8] [--steps 64] [--dtype bfloat16] [--model DIR]
           [--configs unsharded,sharded_lse,sharded_materialize] [--gpu-mem F]
           [--spec-tokens 1,2,3]

Configurations: ``unsharded`` (TP=2), ``sharded_lse``, ``sharded_materialize``,
``vllm_dcp`` (vLLM's TP=2 + DCP=2, GPU); a ``_graphs`` suffix runs it with
CUDA graphs (vLLM's default mode) instead of eager. ``--spec-tokens 1,2,3``
runs every configuration with DeepSeek MTP at each number of draft tokens
(``<config>+mtp<k>``; the model must have an MTP layer, e.g.
``tools/tiny_model.py --mtp``) and reports, per context, the decode
throughput (new tokens per second over the timed steps: a step emits 1 +
the accepted drafts per request) and vLLM's acceptance rate.

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

from common import ROOT, meta, pyplot, result_dir, save_figure, write_json

CONFIGS = {"unsharded": None, "sharded_lse": {"decode": "lse"},
           "sharded_materialize": {"decode": "materialize"}, "vllm_dcp": "dcp"}


def config_of(name: str):
    """(cp_kv options or None or "dcp", CUDA graphs?, MTP draft tokens) of a
    configuration name."""
    name, _, mtp = name.partition("+mtp")
    graphs = name.endswith("_graphs")
    return CONFIGS[name[: -len("_graphs")] if graphs else name], graphs, int(mtp or 0)


def spec_kwargs(k: int, backend: str | None) -> dict:
    if not k:
        return {}
    config = {"method": "mtp", "num_speculative_tokens": k}
    if backend:  # vLLM picks the draft's attention backend separately
        config["attention_backend"] = backend
    return {"speculative_config": config, "disable_log_stats": False}


def run_config(a, name: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_cp_kv.tools.offline import build_llm, spec_decode_counters
    from vllm_cp_kv.tools.tiny_model import token_prompts

    import torch

    contexts = [int(x) for x in a.contexts.split(",")]
    options, graphs, mtp = config_of(name)
    gpu = torch.cuda.is_available()
    sharded = isinstance(options, dict)
    llm = build_llm(a.model, tp=2, dtype=a.dtype, backend=a.backend, eager=not graphs,
                    gpu_mem=a.gpu_mem if gpu else None, rope=None if gpu else "torch",
                    dcp=2 if options == "dcp" else 1, cp_kv=options if sharded else None,
                    max_model_len=max(contexts) + (1 + mtp) * a.steps + 64,
                    max_num_seqs=a.batch, enable_prefix_caching=False,
                    **spec_kwargs(mtp, a.backend))
    engine = llm.llm_engine
    vocab = engine.vllm_config.model_config.get_vocab_size()
    # long enough that every request still runs during the timed steps
    sp = SamplingParams(temperature=0.0, max_tokens=(1 + mtp) * a.steps + 32,
                        ignore_eos=True)
    rows = []
    for k, ctx in enumerate(contexts):
        for i, ids in enumerate(token_prompts([ctx] * a.batch, vocab, seed=k)):
            engine.add_request(f"{k}-{i}", TokensPrompt(prompt_token_ids=ids), sp)
        started: set = set()
        tokens, emitted = {}, {}

        def step():
            outs = engine.step()
            tokens.update({o.request_id: list(o.outputs[0].token_ids)
                           for o in outs if o.finished})
            emitted.update({o.request_id: len(o.outputs[0].token_ids) for o in outs})
            return outs

        while len(started) < a.batch:  # prefills (and the steps mixing them)
            started |= {o.request_id for o in step() if o.outputs[0].token_ids}
        if sharded:
            llm.collective_rpc("cp_kv_stats", kwargs={"reset": True})
        times, before = [], dict(emitted)
        drafts = spec_decode_counters(llm) if mtp else None
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        new_tokens = sum(emitted[r] - before.get(r, 0) for r in emitted)
        if mtp:
            after = spec_decode_counters(llm)
            drafts = {key: after[key] - drafts[key] for key in after}
        stats = llm.collective_rpc("cp_kv_stats")[0] if sharded else None
        while engine.has_unfinished_requests():
            step()
        accepted = (drafts["spec_decode_num_accepted_tokens"]
                    / max(drafts["spec_decode_num_draft_tokens"], 1)) if mtp else None
        rows.append({"context": ctx, "median_ms": 1e3 * statistics.median(times),
                     "times_ms": [1e3 * t for t in times],
                     "tokens_per_s": new_tokens / sum(times), "acceptance": accepted,
                     "spec_decode": drafts,
                     "bytes_per_step": (statistics.median(stats["decode_step_bytes"])
                                        if stats and stats["decode_step_bytes"] else 0),
                     "tokens": [tokens[f"{k}-{i}"] for i in range(a.batch)]})
    write_json(out, {"config": name, "rows": rows}, indent=None)


def report_spec(res: dict, configs: list[str], out_dir: str) -> int:
    """MTP runs: decode throughput of every configuration against the first
    (unsharded) one at the same number of draft tokens and context."""
    print(f"{'config':<26}{'context':>8}{'tokens/s':>10}{'vs base':>9}{'accepted':>10}")
    for name, rows in res["configs"].items():
        base = next((c for c in configs if c.endswith(name[name.index("+mtp"):])), None)
        base_rows = {r["context"]: r for r in res["configs"].get(base, [])}
        for r in rows:
            b = base_rows.get(r["context"])
            r["throughput_ratio"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
            r["same_tokens_as_base"] = b is not None and r["tokens"] == b["tokens"]
            print(f"{name:<26}{r['context']:>8}{r['tokens_per_s']:>10.1f}"
                  f"{r['throughput_ratio'] or 0:>9.2f}{r['acceptance']:>10.2f}")
    write_json(os.path.join(out_dir, "decode_steps_mtp.json"), res)
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    for k, (name, rows) in enumerate(res["configs"].items()):
        ax.plot([r["context"] for r in rows], [r["tokens_per_s"] for r in rows],
                marker="o", color=f"C{k}", linestyle="-" if name.startswith("sharded") else "--",
                label=f"{name} (accepted {rows[0]['acceptance']:.0%})")
    ax.set(xlabel="context (tokens)", ylabel="decode tokens/s (pure decode steps)",
           title=f"DeepSeek MTP, batch {res['batch']}, TP=2, {res['dtype']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save_figure(fig, os.path.join(out_dir, "decode_steps_mtp.png"))
    return 0


def plot(res: dict, path: str) -> None:
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4.2))
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
    save_figure(fig, path)


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
    ap.add_argument("--spec-tokens", default=None,
                    help="DeepSeek MTP with these numbers of draft tokens, e.g. 1,2,3")
    ap.add_argument("--run", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.model is None:
        from vllm_cp_kv.tools.tiny_model import build_held_out

        a.model = build_held_out(os.path.join(ROOT, ".work", "models", "held-out-dsv2"))
    configs = a.configs.split(",")
    if a.spec_tokens:
        configs = [f"{c}+mtp{k}" for k in a.spec_tokens.split(",") for c in configs]
    if a.run:
        run_config(a, *a.run)
        return 0
    result_dir(a.out_dir)
    res = {"batch": a.batch, "steps": a.steps, "dtype": a.dtype, "model": a.model,
           **meta(), "configs": {}}
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
    if a.spec_tokens:
        return report_spec(res, configs, a.out_dir)
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
    write_json(os.path.join(a.out_dir, "decode_steps.json"), res)
    plot(res, os.path.join(a.out_dir, "decode_steps.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
