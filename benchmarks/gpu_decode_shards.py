"""Shard-aware decode with vLLM's own MLA decode kernels, on one GPU.

Usage (GPU machine, after ``source scripts/gpu/setup_device.sh``):
    python3 benchmarks/gpu_decode_shards.py OUT_DIR [--batch 16] [--context 32768]
        [--heads 128] [--shards 2,4] [--backends FLASHMLA,FLASH_ATTN_MLA,TRITON_MLA]
        [--queries 1]

One batch's cache (bf16, block 64, DeepSeek's 576-wide latent; random keys
plus one needle token per request that every head attends to, in a block
the last shard owns) is split into
N owner shards inside one process, the way the plugin lays it out (logical
block j on shard j mod N; each shard's view is the shared block table's
columns and its owned-token count). Per backend, vLLM's decode kernel runs
on every shard with the LSE returned, the partial outputs are merged with
vLLM's DCP merge kernel (``correct_attn_out``, what ``cp_lse_ag_out_rs``
runs on each rank before its reduce-scatter) and summed, and the result is
compared with the same kernel on the whole cache (max abs error, bf16;
negative control: the last shard reads shard 0's blocks instead of its own).
Times (CUDA events, median of 20): the whole-cache kernel, one shard's
kernel (what each rank runs), the merge; the cross-rank traffic per rank is
counted, not timed (one process). Writes ``decode_shards.json``.

``--queries Q`` (speculative verification: 1 + k query tokens per request):
each shard runs the kernel on one row per query token with its own causal
limit over the owned tokens (``core.decode.query_token_lens``, what the
plugin does), and the reference is the kernel's own multi-query causal
path on the whole cache (FLASHMLA, FLASH_ATTN_MLA; TRITON_MLA has none and
flattens its rows itself, so there one row per query token on the whole
cache). Writes ``decode_shards_q{Q}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

from common import header, pyplot, save_figure, time_ms, write_json
from vllm_cp_kv.core.decode import query_token_lens
from vllm_cp_kv.core.ownership import CPShardSpec

LATENT, ROPE, BS = 512, 64, 64
SCALE = (128 + 64) ** -0.5


def make_batch(batch, context, heads, seed=0, queries=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nblk = -(-context // BS)
    lens = torch.tensor([context - 37 * i for i in range(batch)], dtype=torch.int32,
                        device="cuda")
    table = torch.randperm(batch * nblk, generator=gen, device="cuda").view(
        batch, nblk).to(torch.int32)
    cache = (torch.randn(batch * nblk, BS, LATENT + ROPE, generator=gen, device="cuda")
             * 0.5).to(torch.bfloat16)
    q = (torch.randn(batch * queries, heads, LATENT + ROPE, generator=gen, device="cuda")
         * 0.5).to(torch.bfloat16)
    # one "needle" token per request that every head attends to strongly, in
    # a block the last shard owns (logical block j = 3 mod 4): random keys
    # alone average out, so a shard reading the wrong blocks would change
    # the output only slightly; with the needle it changes it completely
    needle = (3 * q.view(batch, queries, heads, -1)[:, 0].float().sum(dim=1)
              / heads ** 0.5).to(torch.bfloat16)
    for i in range(batch):
        j = (int(lens[i]) - 1) // BS - 4  # a full block, not the last one
        j -= (j - 3) % 4  # owned by the last shard for N = 2 and 4 (j = 3 mod 4)
        cache[int(table[i, j]), 5] = needle[i]
    return q, cache, table, lens


def shard_view(table, lens, n, r, queries=1):
    """Shard r's block table (columns r, r+N, ...) and owned-token counts,
    one row per query token (``queries`` new tokens per request)."""
    local_table = table[:, r::n].contiguous()
    rows, local = query_token_lens(lens.long().cpu(), [queries] * lens.numel(),
                                   CPShardSpec(r, n, BS))
    if rows is not None:
        local_table = local_table.index_select(0, rows.cuda())
    return local_table, local.to(torch.int32).cuda()


def whole_multi_query(name, q, cache, table, lens, queries):
    """The whole cache with ``queries`` query tokens per request, through the
    kernel's own causal multi-query path (``q``: ``[B * Q, H, D]``)."""
    b, h = table.shape[0], q.shape[1]
    if name == "FLASHMLA":
        from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

        sched, _ = get_mla_metadata(lens, queries * h, 1, is_fp8_kvcache=False)
        o, _ = flash_mla_with_kvcache(
            q=q.view(b, queries, h, -1), k_cache=cache.unsqueeze(-2), block_table=table,
            cache_seqlens=lens, head_dim_v=LATENT, tile_scheduler_metadata=sched,
            softmax_scale=SCALE, causal=True, is_fp8_kvcache=False)
        return o.reshape(b * queries, h, LATENT)
    if name == "FLASH_ATTN_MLA":
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

        cu = torch.arange(b + 1, dtype=torch.int32, device="cuda") * queries
        return flash_attn_varlen_func(
            q=q[..., LATENT:], k=cache[..., LATENT:].unsqueeze(-2),
            v=cache[..., :LATENT].unsqueeze(-2), q_v=q[..., :LATENT],
            max_seqlen_q=queries, cu_seqlens_q=cu, max_seqlen_k=int(lens.max()),
            seqused_k=lens, block_table=table, softmax_scale=SCALE, causal=True,
            fa_version=3)
    # TRITON_MLA: one row per query token, each its causal length
    rows = torch.arange(b, device="cuda").repeat_interleave(queries)
    per_query = (lens.long().repeat_interleave(queries) - queries + 1
                 + torch.arange(queries, device="cuda").repeat(b)).to(torch.int32)
    return KERNELS[name](q, cache, table.index_select(0, rows), per_query)[0]


# -- vLLM's decode kernels, called as its MLA impls call them ---------------
def flashmla(q, cache, table, lens):
    from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

    sched, _ = get_mla_metadata(lens, q.shape[1], 1, is_fp8_kvcache=False)
    o, lse = flash_mla_with_kvcache(
        q=q.unsqueeze(1), k_cache=cache.unsqueeze(-2), block_table=table,
        cache_seqlens=lens, head_dim_v=LATENT, tile_scheduler_metadata=sched,
        softmax_scale=SCALE, causal=True, is_fp8_kvcache=False)
    return o.squeeze(1), lse.reshape(q.shape[0], q.shape[1])


def flash_attn_mla(q, cache, table, lens):
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    b = q.shape[0]
    cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    o, lse = flash_attn_varlen_func(
        q=q[..., LATENT:], k=cache[..., LATENT:].unsqueeze(-2),
        v=cache[..., :LATENT].unsqueeze(-2), q_v=q[..., :LATENT], max_seqlen_q=1,
        cu_seqlens_q=cu, max_seqlen_k=int(lens.max()), seqused_k=lens,
        block_table=table, softmax_scale=SCALE, causal=True, return_softmax_lse=True,
        fa_version=3)
    return o, lse.transpose(0, 1)


def triton_mla(q, cache, table, lens):
    from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    b, h, _ = q.shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = _compute_num_kv_splits(int(lens.max()), sms)
    o = torch.zeros(b, h, LATENT, dtype=q.dtype, device="cuda")
    lse = torch.zeros(b, h, dtype=q.dtype, device="cuda")
    logits = torch.empty(b, h, splits, LATENT + 1, dtype=torch.float32, device="cuda")
    kv = cache.unsqueeze(2)
    decode_attention_fwd(q, kv, kv[..., :LATENT], o, lse, table, lens, logits, splits,
                         SCALE, BS, is_mla=True)
    return o, lse


KERNELS = {"FLASHMLA": flashmla, "FLASH_ATTN_MLA": flash_attn_mla,
           "TRITON_MLA": triton_mla}


MERGE = {"used": None}


def merge(outs, lses):
    """vLLM's DCP merge: each rank corrects its output with all LSEs, then
    the ranks' outputs are summed (the reduce-scatter). If vLLM's Triton
    kernel cannot launch outside an engine, vLLM's torch reference of the
    same merge (``_lse_weighted_combine``) is used and recorded."""
    from vllm.v1.attention.ops import dcp

    stacked = torch.stack([lse.float() for lse in lses])
    if MERGE["used"] != "torch_reference":
        try:
            ctx = dcp.CPTritonContext()
            total = None
            for r, out in enumerate(outs):
                corrected, _ = dcp.correct_attn_out(out.clone(), stacked, r, ctx,
                                                    is_lse_base_on_e=True)
                total = corrected.float() if total is None else total + corrected.float()
            MERGE["used"] = "correct_attn_out (Triton)"
            return total.to(outs[0].dtype)
        except Exception as e:  # recorded in the JSON
            MERGE["used"] = "torch_reference"
            MERGE["triton_error"] = f"{type(e).__name__}: {e}"[:500]
    return dcp._lse_weighted_combine(torch.stack(outs), stacked).to(outs[0].dtype)


def run_backend(name, a, q, cache, table, lens) -> dict:
    kernel, queries = KERNELS[name], a.queries
    if queries == 1:
        whole, _ = kernel(q, cache, table, lens)
        row = {"backend": name, "whole_ms": time_ms(lambda: kernel(q, cache, table, lens))}
    else:
        whole = whole_multi_query(name, q, cache, table, lens, queries)
        row = {"backend": name, "queries": queries, "whole_ms": time_ms(
            lambda: whole_multi_query(name, q, cache, table, lens, queries))}
    for n in (int(x) for x in a.shards.split(",")):
        views = [shard_view(table, lens, n, r, queries) for r in range(n)]
        parts = [kernel(q, cache, t, l) for t, l in views]
        merged = merge([o for o, _ in parts], [lse for _, lse in parts])
        err = (merged.float() - whole.float()).abs().max().item()
        t0, l0 = views[0]
        shard_ms = time_ms(lambda: kernel(q, cache, t0, l0))
        outs, lses = [o for o, _ in parts], [lse for _, lse in parts]
        merge_ms = time_ms(lambda: merge(outs, lses)) / n  # one rank's correction
        b, h = q.shape[:2]
        row[f"n{n}"] = {
            "max_abs_err": err, "shard_ms": shard_ms, "merge_ms": merge_ms,
            "ratio": (shard_ms + merge_ms) / row["whole_ms"],
            # per rank and step: all-gather of the queries (TP heads), the
            # LSEs, and a reduce-scatter of the outputs over heads
            "bytes_across_ranks": (n - 1) * b * (h // n) * (
                (LATENT + ROPE) * 2 + 4 + LATENT * 2),
        }
        # negative control: the last shard reads shard 0's blocks instead of
        # its own (misses the needle, counts shard 0's keys twice)
        bad = [kernel(q, cache, views[0][0] if r == n - 1 else t, l)
               for r, (t, l) in enumerate(views)]
        row[f"n{n}"]["control_err"] = (merge([o for o, _ in bad], [x for _, x in bad])
                                       .float() - whole.float()).abs().max().item()
    return row


def plot(path: str) -> str:
    """decode_shards.json -> decode_shards.png (here: matplotlib is not in
    the GPU payload)."""
    res = json.load(open(path))
    rows = [r for r in res["rows"] if "whole_ms" in r]
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    ax = axes[0]
    ax.bar([i - 0.3 for i in x], [r["whole_ms"] for r in rows], 0.2, label="whole cache")
    for k, (n, off) in enumerate((("n2", -0.1), ("n4", 0.1))):
        ax.bar([i + off for i in x], [r[n]["shard_ms"] for r in rows], 0.2,
               label=f"one of {n[1]} shards")
        ax.bar([i + off for i in x], [r[n]["merge_ms"] for r in rows], 0.2,
               bottom=[r[n]["shard_ms"] for r in rows], color="gray",
               label="merge" if k == 0 else None)
    ax.set_xticks(list(x), [r["backend"] for r in rows])
    ax.set_ylabel("ms (median of 20)")
    ax.set_title(f"decode, batch {res['batch']}, {res['context'] // 1024}K context, "
                 f"{res['heads']} heads, {res.get('queries', 1)} query tokens per "
                 f"request, {res['gpu']}", fontsize=8)
    ax.legend(fontsize=8)
    ax = axes[1]
    for n, off in (("n2", -0.2), ("n4", 0.2)):
        ax.bar([i + off for i in x], [r[n]["max_abs_err"] for r in rows], 0.2,
               label=f"merged, {n[1]} shards")
        ax.bar([i + off + 0.2 for i in x], [r[n]["control_err"] for r in rows], 0.2,
               label=f"control, {n[1]} shards", alpha=0.5)
    ax.set_yscale("log")
    ax.set_xticks(list(x), [r["backend"] for r in rows])
    ax.set_ylabel("max abs error vs whole-cache kernel (bf16)")
    ax.legend(fontsize=7)
    return save_figure(fig, path[:-5] + ".png")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--plot", action="store_true",
                    help="only draw OUT_DIR/decode_shards.png from its JSON")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--shards", default="2,4")
    ap.add_argument("--backends", default=",".join(KERNELS))
    ap.add_argument("--queries", type=int, default=1,
                    help="query tokens per request (1 + speculative draft tokens)")
    a = ap.parse_args()
    name = "decode_shards.json" if a.queries == 1 else f"decode_shards_q{a.queries}.json"
    if a.plot:
        print(plot(os.path.join(a.out_dir, name)))
        return 0
    q, cache, table, lens = make_batch(a.batch, a.context, a.heads, queries=a.queries)
    res = {**header(), "batch": a.batch, "context": a.context, "heads": a.heads,
           "queries": a.queries, "block_size": BS, "dtype": "bfloat16", "rows": []}
    for name in a.backends.split(","):
        try:
            row = run_backend(name, a, q, cache, table, lens)
        except Exception as e:  # recorded; the other backends go on
            row = {"backend": name, "error": f"{type(e).__name__}: {e}",
                   "trace": traceback.format_exc()[-2000:]}
        res["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}))
    res["merge"] = MERGE
    write_json(os.path.join(a.out_dir, name), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
