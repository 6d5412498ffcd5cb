"""Materialization on GPU: correctness, bandwidth and overlap (2 GPUs, NCCL).

Usage (on the lent 2xH200 machine): python benchmarks/gpu_materialize.py OUT_DIR

1. Correctness, bit-exact against the torch/CPU reference, for the three
   paged layouts (bf16 MLA latent, fp8 latent with scales, sparse indexer),
   with ragged batches, shared blocks, a rank that owns nothing and a
   one-token request; Triton pack/scatter against torch on fresh random data.
2. Bandwidth: HBM device-to-device copy (the ceiling for pack and scatter);
   plain NCCL all_gather_into_tensor against the materialization gather
   (pack into the own slice + in-place all-gather) at the same byte count.
3. Overlap: L layers of "gather the next layer on a side stream + MLA-prefill
   attention on this layer" against the same loop without gathers.
Writes OUT_DIR/materialize.json; prints a short table last.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import graph_time, header, spawn, time_ms, write_json  # noqa: E402

from vllm_cp_kv.core.kernels import indexer_views, pack_blocks, scatter_rows  # noqa: E402
from vllm_cp_kv.core.materialize import (LayerPrefetcher, all_gather_into_fn,  # noqa: E402
                                         gather, write_new)
from vllm_cp_kv.core.ownership import CPShardSpec  # noqa: E402
from vllm_cp_kv.core.plan import brute_force_full_view, plan_materialization  # noqa: E402

LOW_CTAS = 2  # NCCL CTAs of the prefetch communicator in the overlap test
BS = 64  # GPU MLA block size (FlashMLA / sparse backends)
LAYOUTS = {  # name: (per-block shape, dtype)
    "bf16_latent": ((BS, 576), torch.bfloat16),
    "fp8_latent": ((BS, 656), torch.uint8),
    "indexer": ((BS * 132,), torch.uint8),
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
            ref = brute_force_full_view(spec, table, lens_t, caches)
            cpu = plan_materialization(spec, table, lens_t)
            ok = torch.equal(plan.full_block_table.cpu(), cpu.full_block_table)
            for i in range(len(lens)):
                nb = int(cpu.num_logical_blocks[i])
                got = full[plan.full_block_table[i, :nb].long()].cpu()
                ok &= torch.equal(got.view(torch.uint8), ref[i].view(torch.uint8))
            results.setdefault("correctness", {})[f"{lname}/{sname}"] = bool(ok)
    # Triton pack/scatter against torch, fresh random data, each layout
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    for lname, (shape, dtype) in LAYOUTS.items():
        cache = (torch.randn((300, *shape), device=dev, generator=gen).to(dtype)
                 if dtype == torch.bfloat16 else
                 torch.randint(0, 256, (300, *shape), device=dev, generator=gen, dtype=dtype))
        ids = torch.randperm(300, device=dev, generator=gen)[:123]
        a = pack_blocks(cache, ids, use_triton=True)  # Triton against torch
        b = pack_blocks(cache, ids, use_triton=False)
        ok = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        slots = torch.randperm(300 * BS, device=dev, generator=gen)[:777]
        slots[::5] = -1  # tokens other ranks own
        c1, c2 = cache.clone(), cache.clone()
        views1 = [(c1, shape[-1])] if lname != "indexer" else list(zip(indexer_views(c1, BS), (128, 4)))
        views2 = [(c2, shape[-1])] if lname != "indexer" else list(zip(indexer_views(c2, BS), (128, 4)))
        for (v1, d), (v2, _) in zip(views1, views2):
            rows = torch.randint(0, 256, (777, d * (2 if dtype == torch.bfloat16 else 1)),
                                 device=dev, generator=gen, dtype=torch.uint8).view(v1.dtype)
            scatter_rows(v1, slots, rows, use_triton=True)
            scatter_rows(v2, slots, rows, use_triton=False)
        ok &= torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
        ok &= not torch.equal(c1.view(torch.uint8), cache.view(torch.uint8))
        results.setdefault("correctness", {})[f"{lname}/triton_vs_torch"] = bool(ok)


def bandwidth(rank, n, fn, results):
    dev = torch.device("cuda", rank)
    gib = 1 << 30
    src = torch.randn(gib // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), sync_group=False)
    hbm = 2 * gib / t / 1e6  # GB/s, read + write
    results["hbm_copy_GBps"] = hbm
    # pack 1 GiB worth of bf16 latent blocks from a 4 GiB cache
    block_bytes = BS * 576 * 2
    nblk = (4 * gib) // block_bytes
    cache = torch.randn((nblk, BS, 576), device=dev, dtype=torch.bfloat16)
    ids = torch.randperm(nblk, device=dev)[: gib // block_bytes]
    out = torch.empty((ids.numel(), BS, 576), device=dev, dtype=torch.bfloat16)
    for name, tri in (("pack_triton", True), ("pack_index_select", False)):
        t = time_ms(lambda: pack_blocks(cache, ids, out=out, use_triton=tri), sync_group=False)
        results[f"{name}_GBps"] = 2 * ids.numel() * block_bytes / t / 1e6
    # scatter 1 GiB of new rows (576 bf16 each): into whole blocks in random
    # block order (a prefill chunk's tokens fill consecutive slots of their
    # blocks), and into fully random slots (worst case)
    rows_n = gib // 1152
    rows = torch.randn((rows_n, 576), device=dev, dtype=torch.bfloat16)
    blocks = torch.randperm(nblk, device=dev)[: rows_n // BS]
    patterns = {"blocks": (blocks[:, None] * BS + torch.arange(BS, device=dev)).flatten(),
                "random": torch.randperm(nblk * BS, device=dev)[:rows_n]}
    sweep = []
    for pname, slots in patterns.items():
        n_rows = slots.numel()
        t = time_ms(lambda: scatter_rows(cache, slots, rows[:n_rows], use_triton=False),
                    sync_group=False)
        results[f"scatter_torch_{pname}_GBps"] = 2 * n_rows * 1152 / t / 1e6
        for rpp, chunk in ((1, 256), (2, 256), (4, 256), (8, 128), (16, 64)):
            t = time_ms(lambda: scatter_rows(cache, slots, rows[:n_rows], use_triton=True,
                                             rows_per_program=rpp, chunk=chunk), sync_group=False)
            sweep.append({"pattern": pname, "rows_per_program": rpp, "chunk": chunk,
                          "GBps": 2 * n_rows * 1152 / t / 1e6})
        t = time_ms(lambda: scatter_rows(cache, slots, rows[:n_rows], use_triton=True),
                    sync_group=False)
        results[f"scatter_triton_{pname}_GBps"] = 2 * n_rows * 1152 / t / 1e6
    results["scatter_sweep"] = sweep
    results["scatter_triton_GBps"] = results["scatter_triton_blocks_GBps"]
    results["scatter_torch_GBps"] = results["scatter_torch_blocks_GBps"]
    del cache, out, rows, src, dst
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
        pf = LayerPrefetcher(plan, rank, fn, bufs)
        pf_low = LayerPrefetcher(plan, rank, low_cta_fn, bufs)
        new_slots = plan.scratch_slot_mapping(torch.zeros(chunk, dtype=torch.long, device=dev),
                                              torch.arange(ctx - chunk, ctx, device=dev))
        new_rows = torch.randn((chunk, 576), device=dev, dtype=torch.bfloat16)

        def attention():
            return F.scaled_dot_product_attention(q, k, v)

        def baseline():
            for _ in range(layers):
                attention()

        def prefetched(p=pf):
            p.start(0, caches[0])
            for layer in range(layers):
                if layer + 1 < layers:
                    p.start(layer + 1, caches[layer + 1])
                view = p.wait(layer)
                write_new(view, BS, new_slots, new_rows)
                attention()
                p.release(layer)

        def serial():
            for layer in range(layers):
                view = gather(plan, rank, caches[layer], fn, scratch=bufs[0])
                write_new(view, BS, new_slots, new_rows)
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
    print(f"HBM copy {r['hbm_copy_GBps']:.0f} GB/s | pack triton {r['pack_triton_GBps']:.0f} "
          f"index_select {r['pack_index_select_GBps']:.0f} | scatter triton blocks "
          f"{r['scatter_triton_blocks_GBps']:.0f} random {r['scatter_triton_random_GBps']:.0f}"
          f" torch blocks {r['scatter_torch_blocks_GBps']:.0f} GB/s")
    best = max(r["scatter_sweep"], key=lambda x: x["GBps"] if x["pattern"] == "blocks" else 0)
    print("scatter sweep:", " ".join(f"{x['pattern'][0]}{x['rows_per_program']}x{x['chunk']}="
                                     f"{x['GBps']:.0f}" for x in r["scatter_sweep"]), "best", best)
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
    out = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"
    spawn(run, min(2, torch.cuda.device_count()), out)
