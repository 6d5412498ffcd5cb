"""The materialization plan on one GPU: same plan as on the CPU, host waits
counted, time per plan.

Usage (GPU machine): python benchmarks/gpu_plan_check.py OUT_DIR

For a prefill-like batch (one 32K-token request), a decode-like batch (64
requests of 2K-8K tokens, 16 of them sharing a 1K-token prefix) and a PCP
split batch, with block 64 and shard sizes 2 and 8:

* the plan made on the GPU from the device block table equals the plan made
  on the CPU (send lists, per-rank counts, full-view table);
* host waits for the GPU while planning, counted with
  ``torch.cuda.set_sync_debug_mode`` after warm-up (expected: 1 per batch,
  none with ``host_size``, the context chunks' plans);
* median plan time with an idle GPU, and the host time of a plan queued
  behind 20 ms of GPU work (a plan that waited once shows it here).
Writes OUT_DIR/plan_check.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings

import torch

from common import write_json  # (also puts the repo root on sys.path)
from vllm_cp_kv.core.ownership import CPShardSpec
from vllm_cp_kv.core.plan import plan_materialization, plan_split_requests

BS = 64


def batch(n, lens, shared=0, seed=0):
    """Block table ``[R, C]`` (distinct random ids, the first ``shared``
    requests sharing their first 1024 tokens' blocks) and host lengths."""
    gen = torch.Generator().manual_seed(seed)
    cols = -(-max(lens) // (BS * n))
    ids = torch.randperm(len(lens) * cols + 1, generator=gen)[: len(lens) * cols] + 1
    table = ids.view(len(lens), cols).to(torch.int32)
    c = 1024 // (BS * n)
    for i in range(1, shared):
        table[i, :c] = table[0, :c]
    return table, torch.tensor(lens)


def syncs_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing" in str(w.message) for w in caught)


def main(out):
    dev = torch.device("cuda", 0)
    rnd = torch.Generator().manual_seed(1)
    cases = {"prefill-32k": [32768],
             "decode-64": (torch.randint(2048, 8192, (64,), generator=rnd)).tolist()}
    res = {}
    busy_a = torch.randn(8192, 8192, device=dev)
    for n in (2, 8):
        spec = CPShardSpec(0, n, BS)
        for name, lens in cases.items():
            table, lens_t = batch(n, lens, shared=16 if name.startswith("decode") else 0)
            gpu_table = table.to(dev)
            ref = plan_materialization(spec, table, lens_t)
            plan = plan_materialization(spec, gpu_table, lens_t)
            same = (torch.equal(plan.send_block_ids.cpu(), ref.send_block_ids)
                    and torch.equal(plan.num_send_blocks.cpu(), ref.num_send_blocks)
                    and torch.equal(plan.full_block_table.cpu(), ref.full_block_table))
            for _ in range(10):  # first uses allocate the pinned staging ring
                plan_materialization(spec, gpu_table, lens_t)
            n_sync = syncs_of(lambda: plan_materialization(spec, gpu_table, lens_t))
            times = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                plan_materialization(spec, gpu_table, lens_t)
                times.append(1e6 * (time.perf_counter() - t0))
            # queued behind ~20 ms of GPU work: the one wait shows here
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                busy_a @ busy_a
            t_enqueue = time.perf_counter() - t0
            t0 = time.perf_counter()
            plan_materialization(spec, gpu_table, lens_t)
            t_behind = time.perf_counter() - t0
            torch.cuda.synchronize()
            # sized on the host (the context chunks): no wait at all
            host = plan_materialization(spec, gpu_table, lens_t, host_size=True)
            same &= torch.equal(host.full_block_table.cpu(), plan_materialization(
                spec, table, lens_t, host_size=True).full_block_table)
            res[f"N{n}/{name}"] = {
                "same_as_cpu": bool(same), "host_syncs": n_sync,
                "host_sized_syncs": syncs_of(lambda: plan_materialization(
                    spec, gpu_table, lens_t, host_size=True)),
                "blocks_per_rank": plan.blocks_per_rank,
                "plan_us_median": round(statistics.median(times), 1),
                "plan_host_ms_behind_busy_gpu": round(1e3 * t_behind, 2),
                "busy_enqueue_ms": round(1e3 * t_enqueue, 2)}
        # PCP: two local rows per request, planned from the global batch
        table, lens_t = batch(n, [16384, 8192, 4096])
        gpu_table = table.to(dev)[[0, 0, 1, 1, 2, 2]]
        args = (spec, gpu_table, [0, 0, 1, 1, 2, 2], [0, 1, 2], lens_t)
        plan, local, _ = plan_split_requests(*args)
        ref, ref_local, _ = plan_split_requests(spec, table[[0, 0, 1, 1, 2, 2]],
                                                *args[2:])
        res[f"N{n}/pcp-split"] = {
            "same_as_cpu": bool(torch.equal(plan.full_block_table.cpu(), ref.full_block_table)
                                and torch.equal(local.cpu(), ref_local)
                                and torch.equal(plan.send_block_ids.cpu(), ref.send_block_ids)),
            "host_syncs": syncs_of(lambda: plan_split_requests(*args))}
    write_json(os.path.join(out, "plan_check.json"), res)
    for k, v in res.items():
        print(k, json.dumps(v))
    ok = all(v["same_as_cpu"] and v["host_syncs"] <= 1 and v.get("host_sized_syncs", 0) == 0
             for v in res.values())
    print("PLAN_CHECK", "ok" if ok else "FAILED")


if __name__ == "__main__":
    main(sys.argv[1])
