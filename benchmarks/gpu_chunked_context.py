"""One GPU: a prefill's cached context read in scratch-sized chunks
(gather, up-project, attend with LSE, merge) against one gather of the whole
view, per layer, in one run.

Usage: python benchmarks/gpu_chunked_context.py OUT_DIR [--ranks 8] [--heads 16]
           [--queries 2048] [--contexts 32768,131072] [--workspaces 8192,32768,65536]

DeepSeek-V3 shapes (latent 512 + rope 64, nope 128, v 128, bf16, block 64);
``--heads`` per rank (128 / TP). The ``--ranks`` owners' caches live on the
one GPU and each chunk's all-gather is their packs concatenated in the
scratch (what the collective delivers; its transport is not timed here:
one GPU cannot run NCCL between ranks). Per context and workspace: the time
of the chunked read against the single gather (ratio), the peak memory of
each, and the largest difference of the chunked output from the single
gather's (the LSE merge), with a negative control (one chunk dropped).
The plan is made once per batch and not timed (it runs once for all layers).
Writes ``gpu_chunked_context.json`` (and a plot where matplotlib exists).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from common import header, pyplot, result_dir, save_figure, time_ms, write_json
from vllm_cp_kv.core.decode import merge_two_by_lse
from vllm_cp_kv.core.materialize import pack
from vllm_cp_kv.core.ownership import CPShardSpec
from vllm_cp_kv.core.plan import plan_context_chunks

BS, LATENT, ROPE, NOPE, V = 64, 512, 64, 128, 128


def context_attention(q, scratch, table, length, w_kv, scale):
    """vLLM's context-chunk step on a materialized view: the request's
    tokens, up-projected, attended to without a mask, with the LSE."""
    heads = q.shape[1]
    tokens = scratch[table[: -(-length // BS)].long()].reshape(-1, LATENT + ROPE)[:length]
    kv = (tokens[:, :LATENT] @ w_kv).view(length, heads, NOPE + V)
    k = torch.cat([kv[..., :NOPE], tokens[:, None, LATENT:].expand(length, heads, ROPE)], -1)
    v = torch.nn.functional.pad(kv[..., NOPE:], (0, NOPE + ROPE - V))  # FA: equal dims
    flash = torch.ops.aten._scaled_dot_product_flash_attention if q.is_cuda else \
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # a smoke run
    out, lse = flash(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                     v.transpose(0, 1)[None], scale=scale)[:2]
    return out[0].transpose(0, 1)[..., :V], lse[0].transpose(0, 1)  # [Q, H, V], [Q, H]


def read(chunks, caches, q, w_kv, scale, scratch, skip=None):
    """Every chunk gathered into the one scratch and attended to, merged."""
    n = len(caches)
    out = lse = None
    for k, c in enumerate(chunks):
        if k == skip:
            continue
        p = c.plan.blocks_per_rank
        for r in range(n):  # the all-gather's result, rank-major
            pack(c.plan, r, caches[r], out=scratch[r * p:(r + 1) * p])
        o, l = context_attention(q, scratch, c.plan.full_block_table[0],
                                 int(c.num_tokens[0]), w_kv, scale)
        out, lse = (o, l) if out is None else merge_two_by_lse(out, lse, o, l)
    return out, lse


def run_case(n, heads, queries, context, workspace, dev):
    gen = torch.Generator(device=dev).manual_seed(context + workspace)
    spec = CPShardSpec(0, n, BS)
    nb = -(-context // BS)
    cols = -(-nb // n)
    caches = [torch.randn((cols + 1, BS, LATENT + ROPE), device=dev, dtype=torch.bfloat16,
                          generator=gen) for _ in range(n)]
    table = (torch.arange(cols, device=dev, dtype=torch.int32) + 1)[None]
    lens = torch.tensor([context])
    q = torch.randn((queries, heads, NOPE + ROPE), device=dev, dtype=torch.bfloat16,
                    generator=gen)
    w_kv = torch.randn((LATENT, heads * (NOPE + V)), device=dev, dtype=torch.bfloat16,
                       generator=gen) / LATENT ** 0.5
    scale = (NOPE + ROPE) ** -0.5
    single = plan_context_chunks(spec, table, lens, 1 << 40)
    capacity = -(-workspace // BS)
    capacity -= capacity % n
    chunked = plan_context_chunks(spec, table, lens, capacity)
    row = {"context": context, "workspace_tokens": workspace, "chunks": len(chunked)}
    for name, chunks in (("single", single), ("chunked", chunked)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        scratch = torch.empty((max(c.plan.num_scratch_blocks for c in chunks), BS,
                               LATENT + ROPE), device=dev, dtype=torch.bfloat16)
        out, _ = read(chunks, caches, q, w_kv, scale, scratch)
        row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row[f"{name}_scratch_mib"] = scratch.numel() * 2 / 2**20
        row[f"{name}_ms"] = time_ms(lambda: read(chunks, caches, q, w_kv, scale, scratch),
                                    iters=10, warmup=2, sync_group=False)
        row[f"{name}_out"] = out
        if name == "chunked" and len(chunks) > 1:  # negative control
            bad, _ = read(chunks, caches, q, w_kv, scale, scratch, skip=len(chunks) // 2)
            row["dropped_chunk_err"] = float((bad.float() - row["single_out"].float())
                                             .abs().max())
    row["max_err"] = float((row.pop("chunked_out").float() - row.pop("single_out").float())
                           .abs().max())
    row["ratio"] = row["chunked_ms"] / row["single_ms"]
    return row


def plot(res, path):
    plt = pyplot(optional=True)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ctx in sorted({r["context"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["context"] == ctx]
        ws = [r["workspace_tokens"] for r in rows]
        axes[0].plot(ws, [r["ratio"] for r in rows], "o-", label=f"context {ctx}")
        axes[1].plot(ws, [r["chunked_peak_mib"] / r["single_peak_mib"] for r in rows],
                     "o-", label=f"context {ctx}")
    for ax, title in zip(axes, ("time, chunked / single gather",
                                "peak memory, chunked / single gather")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workspace (tokens)")
        ax.set_title(title)
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.legend()
    fig.suptitle(f"{res['ranks']} owners, {res['heads']} heads, {res['queries']} "
                 f"new tokens ({res['gpu']})")
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--queries", type=int, default=2048)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--workspaces", default="8192,32768,65536")
    a = ap.parse_args()
    dev = torch.device("cuda")
    res = {**header(), "ranks": a.ranks, "heads": a.heads, "queries": a.queries, "rows": []}
    for ctx in (int(x) for x in a.contexts.split(",")):
        for ws in (int(x) for x in a.workspaces.split(",")):
            row = run_case(a.ranks, a.heads, a.queries, ctx, ws, dev)
            res["rows"].append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
                  flush=True)
    result_dir(a.out_dir)
    write_json(os.path.join(a.out_dir, "gpu_chunked_context.json"), res)
    plot(res, os.path.join(a.out_dir, "gpu_chunked_context.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
