"""Plot GPU benchmark JSON (materialize.json, last_token.json) to PNG.

Usage: python benchmarks/plot.py RESULTS_DIR
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(d: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    lt_path, mat_path = os.path.join(d, "last_token.json"), os.path.join(d, "materialize.json")
    if os.path.exists(lt_path):
        lt = json.load(open(lt_path))
        ax = axes[0]
        for batch in sorted({r["batch"] for r in lt["rows"]}):
            rows = [r for r in lt["rows"] if r["batch"] == batch]
            ax.plot([r["tokens"] for r in rows], [r["narrow_ms"] for r in rows], "o-",
                    label=f"narrow, batch {batch}")
        rows = [r for r in lt["rows"] if r["batch"] == 1]
        ax.plot([r["tokens"] for r in rows], [r["full_ms"] for r in rows], "k^--",
                label="full gather (vLLM)")
        ax.set(xscale="log", yscale="log", xlabel="prefill tokens (PCP=2)", ylabel="ms",
               title=f"last-token gather, hidden {lt['hidden']}, {lt['gpu']} x{lt['world_size']}")
        ax.legend(fontsize=8)
    if os.path.exists(mat_path):
        m = json.load(open(mat_path))
        ax = axes[1]
        g = m["gather"]
        x = range(len(g))
        w = 0.2
        for k, (key, label) in enumerate([("plain_busbw_GBps", "NCCL all_gather"),
                                          ("materialize_busbw_GBps", "materialize (eager)"),
                                          ("plain_graph_busbw_GBps", "NCCL all_gather (graph)"),
                                          ("materialize_graph_busbw_GBps", "materialize (graph)")]):
            ax.bar([i + (k - 1.5) * w for i in x], [r.get(key) or 0 for r in g], w, label=label)
        ax.set_xticks(list(x), [f"{r['MiB_per_rank']:.0f} MiB" for r in g])
        ax.set(ylabel="bus bandwidth GB/s", title="gather bandwidth per rank")
        ax.legend(fontsize=8)
        ax = axes[2]
        o = m["overlap"]
        ctx = [f"{r['context'] // 1024}K" for r in o]
        ax.plot(ctx, [r["ratio_prefetched"] for r in o], "o-", label="prefetched")
        ax.plot(ctx, [r["ratio_prefetched_low_cta"] for r in o], "s-",
                label=f"prefetched, {m.get('low_ctas')} NCCL CTAs")
        ax.plot(ctx, [r["ratio_serial"] for r in o], "x--", label="gather then attention")
        ax.axhline(1.05, color="r", lw=0.8, label="goal 1.05")
        ax.set(xlabel="context (8K-token chunk)", ylabel="time / replicated baseline",
               title="MLA-prefill layer loop with gathers")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.join(d, "gpu_benchmarks.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
