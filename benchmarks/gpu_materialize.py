"""Materialization on GPU: correctness, bandwidth and overlap (2 GPUs, NCCL).

Usage (on the lent 2xH200 machine): python benchmarks/gpu_materialize.py OUT_DIR

1. Correctness, bit-exact, for the three paged layouts (bf16 MLA latent, fp8
   latent with scales, sparse indexer), with ragged batches, shared blocks, a
   rank that owns nothing and a one-token request: the full view gathered
   with ``core.materialize.gather`` (``pack`` = ``index_select`` into the
   own slice, then the in-place all-gather) against every token read from
   where vLLM's slot-mapping kernel stored it (harness/reference.py), and the
   plan made on the GPU against the plan made on the CPU.
2. Bandwidth: HBM device-to-device copy (the ceiling for the pack); the pack
   alone; plain NCCL all_gather_into_tensor against the materialization
   gather (pack into the own slice + in-place all-gather) at the same byte
   count.
3. Overlap: L layers of "gather the next layer on a side stream + MLA-prefill
   attention on this layer" (``LayerPrefetcher``) against the same loop
   without gathers.
Writes OUT_DIR/materialize.json; prints a short table last.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import graph_time, header, result_dir, spawn, time_ms, write_json
from harness.reference import full_view, tokens_of  # the independent reference
from vllm_cp_kv.core.materialize import LayerPrefetcher, all_gather_into_fn, gather, pack
from vllm_cp_kv.core.ownership import CPShardSpec
from vllm_cp_kv.core.plan import plan_materialization

LOW_CTAS = 2  # NCCL CTAs of the prefetch communicator in the overlap test
BS = 64  # GPU MLA block size (FlashMLA / sparse backends)
LAYOUTS = {  # name: (per-block shape [tokens, bytes or values per token], dtype)
    "bf16_latent": ((BS, 576), torch.bfloat16),
    "fp8_latent": ((BS, 656), torch.uint8),
    # keys then scales per block; viewed as [BS, 132] like
    # tests/distributed/test_materialize_dist.py
    "indexer": ((BS, 132), torch.uint8),
}
SCENARIOS = {
    "ragged": ([1, 70, 1000, 333, 4097], None),
    "shared_blocks": ([2048, 2048, 640], (0, 1, 8)),
    "rank_owns_nothing": ([64, 5], None),
    "one_token": ([1], None),
}


def random_cache(shape, dtype, num_blocks, gen):
    if dtype == torch.bfloat16:
        return torch.randn((num_blocks, *shape), generator=gen).to(dtype)
    return torch.randint(0, 256, (num_blocks, *shape), generator=gen, dtype=torch.uint8)


def batch(n, lens, shared, seed, num_blocks):
    gen = torch.Generator().manual_seed(seed)
    cols = max(1, max(-(-(-(-s // BS)) // n) for s in lens))
    ids = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * cols] + 1
    table = ids.view(len(lens), cols).to(torch.int32)
    if shared:
        src, dst, c = shared
        table[dst, :c] = table[src, :c]
    return table, torch.tensor(lens), gen


def check_correctness(rank, n, fn, results):
    dev = torch.device("cuda", rank)
    for lname, (shape, dtype) in LAYOUTS.items():
        for sname, (lens, shared) in SCENARIOS.items():
            num_blocks = 400
            table, lens_t, gen = batch(n, lens, shared, 7, num_blocks)
            caches = [random_cache(shape, dtype, num_blocks, gen) for _ in range(n)]
            spec = CPShardSpec(rank, n, BS)
            plan = plan_materialization(spec, table.to(dev), lens_t)
            scratch = torch.empty((plan.num_scratch_blocks, *shape), dtype=dtype, device=dev)
            scratch.view(torch.uint8).fill_(0xFF)  # poison
            full = gather(plan, rank, caches[rank].to(dev), fn, scratch=scratch)
            ref = full_view(table, lens_t, caches, BS, n)
            cpu = plan_materialization(spec, table, lens_t)
            ok = torch.equal(plan.full_block_table.cpu(), cpu.full_block_table)
            for i in range(len(lens)):
                nb = int(cpu.num_logical_blocks[i])
                got = tokens_of(full[plan.full_block_table[i, :nb].long()].cpu(), lens[i])
                ok &= torch.equal(got.view(torch.uint8), ref[i].view(torch.uint8))
            results.setdefault("correctness", {})[f"{lname}/{sname}"] = bool(ok)


def bandwidth(rank, n, fn, results):
    dev = torch.device("cuda", rank)
    gib = 1 << 30
    src = torch.randn(gib // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), sync_group=False)
    hbm = 2 * gib / t / 1e6  # GB/s, read + write
    results["hbm_copy_GBps"] = hbm
    # pack (index_select) 1 GiB worth of bf16 latent blocks from a 4 GiB
    # cache: one request's blocks at random places, as a plan lists them
    block_bytes = BS * 576 * 2
    nblk = (4 * gib) // block_bytes
    cache = torch.randn((nblk, BS, 576), device=dev, dtype=torch.bfloat16)
    cols = gib // block_bytes
    table = (torch.randperm(nblk - 1, device=dev)[:cols] + 1).view(1, cols).to(torch.int32)
    plan = plan_materialization(CPShardSpec(rank, n, BS), table, torch.tensor([cols * n * BS]))
    out = torch.empty((plan.blocks_per_rank, BS, 576), device=dev, dtype=torch.bfloat16)
    t = time_ms(lambda: pack(plan, rank, cache, out=out), sync_group=False)
    results["pack_index_select_GBps"] = 2 * plan.blocks_per_rank * block_bytes / t / 1e6
    del cache, out, src, dst
    torch.cuda.empty_cache()
    # gather vs plain all_gather_into_tensor at the same bytes per rank
    rows_out = []
    results["gather"] = rows_out
    if n < 2:
        return  # needs a second GPU
    for mib in (8, 64, 256, 1024):
        per_rank_blocks = (mib << 20) // block_bytes
        num_blocks = per_rank_blocks * 2 + 8
        cache = torch.randn((num_blocks, BS, 576), device=dev, dtype=torch.bfloat16)
        # a batch whose blocks are spread over the cache: 16 requests
        seq = per_rank_blocks * n * BS // 16
        table = torch.randperm(num_blocks - 1, device=dev)[: 16 * -(-seq // (BS * n))] + 1
        table = table.view(16, -1).to(torch.int32)
        plan = plan_materialization(CPShardSpec(rank, n, BS), table,
                                    torch.full((16,), seq))
        scratch = torch.empty((plan.num_scratch_blocks, BS, 576), device=dev, dtype=torch.bfloat16)
        nbytes = plan.blocks_per_rank * block_bytes
        flat_in = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
        flat_out = torch.empty(nbytes // 2 * n, device=dev, dtype=torch.bfloat16)
        t_plain = time_ms(lambda: dist.all_gather_into_tensor(flat_out, flat_in))
        t_mat = time_ms(lambda: gather(plan, rank, cache, fn, scratch=scratch))
        own = scratch[rank * plan.blocks_per_rank:(rank + 1) * plan.blocks_per_rank]
        t_coll = time_ms(lambda: fn(scratch, own))
        # the same two, captured in CUDA graphs (no host launch gaps)
        t_plain_g = graph_time(lambda: dist.all_gather_into_tensor(flat_out, flat_in))
        t_mat_g = graph_time(lambda: gather(plan, rank, cache, fn, scratch=scratch))
        bus = lambda t: (n - 1) / n * n * nbytes / t / 1e6 if t else None  # noqa: E731
        rows_out.append({"MiB_per_rank": nbytes / 2**20, "plain_busbw_GBps": bus(t_plain),
                         "materialize_busbw_GBps": bus(t_mat),
                         "collective_only_busbw_GBps": bus(t_coll),
                         "plain_graph_busbw_GBps": bus(t_plain_g),
                         "materialize_graph_busbw_GBps": bus(t_mat_g),
                         "ratio_materialize_vs_plain": t_plain / t_mat,
                         "ratio_collective_vs_plain": t_plain / t_coll,
                         "ratio_graph": (t_plain_g / t_mat_g) if t_mat_g and t_plain_g else None})
        del cache, scratch, flat_in, flat_out
        torch.cuda.empty_cache()


def overlap(rank, n, fn, results, layers=4):
    """MLA-prefill-sized attention per layer (DeepSeek-V3: 128 heads, qk 192,
    v 128 padded to 192 as vLLM does for FA), 8K-token chunk on C context."""
    dev = torch.device("cuda", rank)
    heads, dqk, chunk = 128, 192, 8192
    # a communicator for the prefetch that uses few SMs (CTAs): an all-gather
    # waiting for its peer spins on its SMs, which attention then lacks
    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = LOW_CTAS
        low_cta_fn = all_gather_into_fn(dist.new_group(list(range(n)), pg_options=opts))
        results["low_ctas"] = LOW_CTAS
    except Exception as e:  # older torch without NCCL config options
        print("low-CTA group unavailable:", e)
        low_cta_fn, results["low_ctas"] = fn, None
    out_rows = []
    for ctx in (8192, 32768, 131072):
        q = torch.randn((1, heads, chunk, dqk), device=dev, dtype=torch.bfloat16)
        k = torch.randn((1, heads, ctx, dqk), device=dev, dtype=torch.bfloat16)
        v = torch.randn((1, heads, ctx, dqk), device=dev, dtype=torch.bfloat16)
        # latent caches of `layers` layers; each rank owns half of the context
        nb = -(-ctx // BS)
        caches = [torch.randn((nb // n + 8, BS, 576), device=dev, dtype=torch.bfloat16)
                  for _ in range(layers)]
        table = (torch.arange(-(-nb // n), device=dev, dtype=torch.int32) + 1)[None]
        plan = plan_materialization(CPShardSpec(rank, n, BS), table,
                                    torch.tensor([ctx]))
        bufs = [torch.empty((plan.num_scratch_blocks, BS, 576), device=dev,
                            dtype=torch.bfloat16) for _ in range(2)]
        pf = LayerPrefetcher(rank, fn, bufs)
        pf_low = LayerPrefetcher(rank, low_cta_fn, bufs)
        # Earlier versions wrote this step's `chunk` new rows into each view
        # (write_new, since removed). A prefetched view holds only what the
        # cache held when its gather started, the cached context, which is
        # what the vLLM path plans for prefills (their new tokens come from
        # the projections), so nothing is written into it here. The plan
        # still covers all `ctx` tokens, the bytes per layer of the earlier
        # runs; a vLLM prefill of `chunk` new tokens would plan only the
        # `ctx - chunk` cached ones.

        def attention():
            return F.scaled_dot_product_attention(q, k, v)

        def baseline():
            for _ in range(layers):
                attention()

        def prefetched(p=pf):
            p.start(0, plan, caches[0])
            for layer in range(layers):
                if layer + 1 < layers:
                    p.start(layer + 1, plan, caches[layer + 1])
                p.wait(layer)
                attention()
                p.release(layer)

        def serial():
            for layer in range(layers):
                gather(plan, rank, caches[layer], fn, scratch=bufs[0])
                attention()

        iters = 5 if ctx > 32768 else 10
        t_base = time_ms(baseline, iters=iters, warmup=2)
        t_pref = time_ms(prefetched, iters=iters, warmup=2)
        t_pref_low = time_ms(lambda: prefetched(pf_low), iters=iters, warmup=2)
        t_ser = time_ms(serial, iters=iters, warmup=2)
        t_base2 = time_ms(baseline, iters=iters, warmup=1)  # noise estimate
        out_rows.append({"context": ctx, "chunk": chunk, "layers": layers,
                         "baseline_ms": t_base, "baseline_repeat_ms": t_base2,
                         "prefetched_ms": t_pref, "serial_ms": t_ser,
                         "prefetched_low_cta_ms": t_pref_low,
                         "ratio_prefetched": t_pref / min(t_base, t_base2),
                         "ratio_prefetched_low_cta": t_pref_low / min(t_base, t_base2),
                         "ratio_serial": t_ser / min(t_base, t_base2),
                         "gather_MiB_per_rank_per_layer":
                             plan.blocks_per_rank * BS * 1152 / 2**20})
        del q, k, v, caches, bufs
        torch.cuda.empty_cache()
    results["overlap"] = out_rows


def run(rank, n, out_dir):
    fn = all_gather_into_fn()
    results = header()
    results["world_size"] = n
    check_correctness(rank, n, fn, results)
    bandwidth(rank, n, fn, results)
    overlap(rank, n, fn, results)
    if rank == 0:
        write_json(os.path.join(out_dir, "materialize.json"), results)
        print_table(results)


def print_table(r):
    print(f"== materialization on {r['gpu']} x{r['world_size']} ({r['date']})")
    bad = [k for k, v in r["correctness"].items() if not v]
    print(f"correctness: {sum(r['correctness'].values())}/{len(r['correctness'])} bit-exact"
          + (f"  FAILED: {bad}" if bad else ""))
    hbm, pk = r["hbm_copy_GBps"], r["pack_index_select_GBps"]
    print(f"HBM copy {hbm:.0f} GB/s | pack (index_select) {pk:.0f} GB/s ({pk / hbm:.0%})")
    if r["world_size"] < 2:
        print("gather bandwidth: not measured (one GPU; the gather is a local copy)")
    print("MiB/rank  plain  materialize  collective-only  plain(graph)  materialize(graph)  busbw GB/s")
    f = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
    for g in r["gather"]:
        print(f"{g['MiB_per_rank']:8.0f}  {f(g['plain_busbw_GBps']):>5}  {f(g['materialize_busbw_GBps']):>11}"
              f"  {f(g['collective_only_busbw_GBps']):>15}  {f(g['plain_graph_busbw_GBps']):>12}"
              f"  {f(g['materialize_graph_busbw_GBps']):>18}")
    print(f"context  baseline ms  prefetched ms  ratio  ratio({r.get('low_ctas')} CTAs)  serial ratio")
    for o in r["overlap"]:
        print(f"{o['context']:7d}  {o['baseline_ms']:11.2f}  {o['prefetched_ms']:13.2f}  "
              f"{o['ratio_prefetched']:.3f}  {o['ratio_prefetched_low_cta']:.3f}  {o['ratio_serial']:.3f}")


if __name__ == "__main__":
    out = result_dir(sys.argv[1] if len(sys.argv) > 1 else None)
    spawn(run, min(2, torch.cuda.device_count()), out)
