"""Last-token gather vs vLLM's full hidden-state gather (2 GPUs, NCCL; no vLLM).

Usage: python benchmarks/gpu_last_token.py OUT_DIR

For a prefill of T tokens split over the PCP group (DualChunkSwap layout,
as vLLM's PCPManager builds it), hidden size 7168 (DeepSeek-V3) in bf16:
* full: ``all_gather(local)[restore_idx]`` (vLLM's restore_hidden_states),
* narrow: only the sampled rows (``vllm_cp_kv.core.last_token``),
checked equal on the sampled rows, timed with CUDA events (median).
Writes OUT_DIR/last_token.json; prints a table last.
"""

from __future__ import annotations

import os
import sys

import torch

from common import graph_time, header, result_dir, spawn, time_ms, write_json
from vllm_cp_kv.core.last_token import gather_sampled_rows, plan_sampled_rows
from vllm_cp_kv.core.materialize import all_gather_into_fn

HIDDEN = 7168


def dual_chunk_layout(lens: list[int], n: int):
    """restore_idx and per-rank token lists of vLLM's DualChunkSwap split."""
    per_rank: list[list[int]] = [[] for _ in range(n)]
    start = 0
    for length in lens:
        chunk = -(-length // (2 * n))
        for r in range(n):
            for c in (r, 2 * n - 1 - r):
                lo, hi = start + c * chunk, min(start + (c + 1) * chunk, start + length)
                per_rank[r].extend(range(lo, hi))
        start += length
    rows = max(len(p) for p in per_rank)
    restore = torch.empty(start, dtype=torch.long)
    for r, toks in enumerate(per_rank):
        restore[torch.tensor(toks, dtype=torch.long)] = r * rows + torch.arange(len(toks))
    return restore, per_rank, rows


def run(rank, n, out_dir):
    dev = torch.device("cuda", rank)
    fn = all_gather_into_fn()
    results = header()
    results["world_size"], results["hidden"], results["rows"] = n, HIDDEN, []
    for total in (8192, 32768, 131072):
        for batch in (1, 4, 16):
            lens = [total // batch] * batch
            restore, per_rank, rows = dual_chunk_layout(lens, n)
            gen = torch.Generator(device=dev).manual_seed(total + batch)
            global_h = torch.randn((total, HIDDEN), device=dev, dtype=torch.bfloat16,
                                   generator=gen)
            local = torch.zeros((rows, HIDDEN), device=dev, dtype=torch.bfloat16)
            mine = torch.tensor(per_rank[rank], device=dev)
            local[: mine.numel()] = global_h[mine]
            restore = restore.to(dev)
            logits = torch.cumsum(torch.tensor(lens, device=dev), 0) - 1
            gathered = torch.empty((n * rows, HIDDEN), device=dev, dtype=torch.bfloat16)

            def full():
                fn(gathered, local)
                return gathered[restore]

            plan = plan_sampled_rows(restore, logits, rows)

            def narrow():
                return gather_sampled_rows(plan, rank, n, local, fn)

            ok = torch.equal(full()[logits], narrow()) and torch.equal(narrow(), global_h[logits])
            t_full, t_narrow = time_ms(full), time_ms(narrow)
            t_full_g, t_narrow_g = graph_time(full), graph_time(narrow)
            results["rows"].append({
                "tokens": total, "batch": batch, "equal": bool(ok),
                "full_ms": t_full, "narrow_ms": t_narrow, "ratio": t_narrow / t_full,
                "full_graph_ms": t_full_g, "narrow_graph_ms": t_narrow_g,
                "ratio_graph": t_narrow_g / t_full_g if t_full_g and t_narrow_g else None,
                "full_MiB_per_rank": n * rows * HIDDEN * 2 / 2**20,
                "narrow_KiB_per_rank": n * batch * HIDDEN * 2 / 2**10})
            del global_h, local, gathered
    if rank == 0:
        write_json(os.path.join(out_dir, "last_token.json"), results)
        print(f"== last-token gather on {results['gpu']} x{n} ({results['date']})")
        print("tokens batch equal  full ms  narrow ms  ratio  | in CUDA graphs: full  narrow  ratio")
        g = lambda v: f"{v:.3f}" if v else "-"  # noqa: E731
        for r in results["rows"]:
            print(f"{r['tokens']:6d} {r['batch']:5d} {str(r['equal']):5s} {r['full_ms']:8.3f} "
                  f"{r['narrow_ms']:10.3f}  {r['ratio']:.3f}  | {g(r['full_graph_ms'])}  "
                  f"{g(r['narrow_graph_ms'])}  {g(r['ratio_graph'])}")


if __name__ == "__main__":
    out = result_dir(sys.argv[1] if len(sys.argv) > 1 else None)
    if torch.cuda.device_count() < 2:
        print("last-token gather: needs 2 GPUs, skipped")
        sys.exit(0)
    spawn(run, 2, out)
