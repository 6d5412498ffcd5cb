"""Plot benchmark JSON (materialize.json, last_token.json; pd_transfer.json)
to PNG.

Usage: python benchmarks/plot.py RESULTS_DIR
"""

import json
import os
import sys

from common import pyplot, save_figure

plt = pyplot()


def plot_pd_transfer(path: str) -> str:
    """pd_transfer.json: time per request (connector, raw) and descriptors."""
    res = json.load(open(path))
    rows = res["rows"]
    labels = [f"{r['transport']}\n{r['layout']}\n{r['decode_table']}" for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4.8))
    ax = axes[0]
    ax.bar([i - 0.2 for i in x], [r["connector_ms"] for r in rows], 0.4, label="connector")
    ax.bar([i + 0.2 for i in x], [r["raw_ms"] for r in rows], 0.4, label="raw engine")
    for i, r in enumerate(rows):
        ax.text(i, max(r["connector_ms"], r["raw_ms"]), f"{r['ratio']:.2f}",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="median ms per request",
           title=f"{rows[0]['blocks']}-block request from 2 owners (label: raw/connector)"
           if rows else "no transport ran")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar([i - 0.2 for i in x], [r["unmerged_descriptors"] for r in rows], 0.4,
           label="blocks x caches")
    ax.bar([i + 0.2 for i in x], [r["descriptors"] for r in rows], 0.4,
           label="descriptors issued (merged runs)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="read descriptors", yscale="log", title="descriptors per request")
    ax.legend(fontsize=8)
    fig.suptitle(f"{res['machine']}, {res['date'][:10]}", fontsize=9)
    return save_figure(fig, os.path.splitext(path)[0] + ".png")


def main(d: str) -> None:
    if os.path.exists(os.path.join(d, "pd_transfer.json")):
        print(plot_pd_transfer(os.path.join(d, "pd_transfer.json")))
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
    print(save_figure(fig, os.path.join(d, "gpu_benchmarks.png")))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
