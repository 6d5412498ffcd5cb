"""``vllm-cp-kv``: the package's command line.

    vllm-cp-kv capacity --model PATH --tp 2 [--kv-memory-gib 1] [--block-size 16]
        [--dtype auto] [--max-model-len N] [--max-num-seqs 256]
    vllm-cp-kv compat [--json]

``capacity`` reads the model's config (no engine start, no weights) and
prints the KV tokens a memory budget per rank holds with every rank keeping
a full copy and with the cache sharded over the shard group, with the
arithmetic vLLM's engine and the plugin use (whole blocks of every layer;
the sharded budget minus the scratch full view). ``compat`` resolves every
private vLLM name the plugin touches against the installed vLLM
(``tools/compat.py``), and lists each with what is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..core.capacity import is_dense_fp8, logical_capacity_tokens
from ..integration.geometry import shard_group_size
from ..integration.options import sparse_reads_owned_blocks

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": None}
FP8_DS_MLA_BYTES = 656  # per token: 512 fp8 + 4 fp32 scales + 64 bf16 rope
INDEXER_BYTES = 132  # DeepSeek-V3.2 indexer: 128 fp8 keys + one fp32 scale


def model_kv_layout(model_dir: str, dtype: str, kv_cache_dtype: str) -> dict:
    """Bytes per token per layer of an MLA model's persistent caches."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    if not cfg.get("kv_lora_rank"):
        raise SystemExit(f"{model_dir}: not an MLA model (no kv_lora_rank); "
                         "cp_kv shards the MLA latent cache.")
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    if kv_cache_dtype == "fp8_ds_mla":
        latent = FP8_DS_MLA_BYTES
    elif kv_cache_dtype.startswith("fp8"):  # fp8, fp8_e4m3, fp8_e5m2: one byte a value
        latent = width  # (vLLM keeps the scale per layer, outside the cache)
    else:
        size = DTYPE_BYTES.get(dtype) or {"bfloat16": 2, "float16": 2, "float32": 4}.get(
            str(cfg.get("torch_dtype", "bfloat16")), 2)
        latent = width * size
    indexer = INDEXER_BYTES if cfg.get("index_topk") else 0
    return {"layers": cfg["num_hidden_layers"], "latent": latent, "indexer": indexer,
            "max_position": cfg.get("max_position_embeddings", 4096)}


def chunked_context(layout: dict, a) -> bool:
    """Whether the worker would reserve the chunked context's workspace
    (``core.capacity.scratch_blocks_bound``) rather than the whole view:
    dense models, the shard-aware decode, a backend that merges context
    chunks (not AMX_MLA, which needs block size 32 or more on CPU); under
    PCP too."""
    return not (layout["indexer"] or a.decode == "materialize" or a.backend == "AMX_MLA")


def shard_aware_sparse(layout: dict, a) -> bool:
    """A sparse model on the shard-aware path (vLLM 0.34, the default decode,
    TP or PCP with fp8_ds_mla: ``checks.sparse_shard_aware``): no scratch
    view at all."""
    return bool(layout["indexer"]) and sparse_reads_owned_blocks(a.decode, a.pcp,
                                                                 a.kv_cache_dtype)


def scratch_kind(layout: dict, a) -> str:
    if shard_aware_sparse(layout, a):
        return "none: the shard-aware sparse path"
    return "the chunked context" if chunked_context(layout, a) else "the whole view"


def capacity(a) -> int:
    layout = model_kv_layout(a.model, a.dtype, a.kv_cache_dtype)
    n = shard_group_size(a.tp, a.pcp)
    page = a.block_size * (layout["latent"] + layout["indexer"])
    budget = int(a.kv_memory_gib * 2**30)
    max_len = a.max_model_len or layout["max_position"]
    got = logical_capacity_tokens(
        budget_bytes=budget, page_bytes=page, num_layers=layout["layers"],
        block_size=a.block_size, shard_size=n, max_num_seqs=a.max_num_seqs,
        max_model_len=max_len, cap_blocks=a.max_scratch_blocks,
        chunked=chunked_context(layout, a), workspace_tokens=a.workspace_tokens,
        scratch=not shard_aware_sparse(layout, a))
    if a.json:
        print(json.dumps({**got, "shard_size": n, "pcp": a.pcp, "tp": a.tp,
                          # PCP x TP and a dense FP8 cache need vLLM 0.34
                          # and the shard-aware sparse path
                          "min_vllm": "0.34" if (a.pcp > 1 and a.tp > 1) or is_dense_fp8(
                              a.kv_cache_dtype, bool(layout["indexer"]))
                          or shard_aware_sparse(layout, a) else "0.32",
                          "budget_bytes": budget,
                          "bytes_per_token": layout["layers"] * (layout["latent"]
                                                                 + layout["indexer"])}))
        return 0
    print(f"model           {a.model}: {layout['layers']} layers, "
          f"{layout['latent'] + layout['indexer']} bytes per token and layer")
    print(f"KV memory       {a.kv_memory_gib:g} GiB per rank, block size {a.block_size}, "
          f"max_model_len {max_len}, max_num_seqs {a.max_num_seqs}")
    print(f"every rank a full copy:   {got['unsharded']:>14,} tokens")
    print(f"sharded over {n} ranks:     {got['sharded']:>14,} tokens "
          f"({got['ratio']:.2f}x; scratch {got['scratch_blocks']} blocks of one layer, "
          f"{scratch_kind(layout, a)})")
    if a.pcp > 1 and a.tp > 1:
        print(f"note            PCP {a.pcp} x TP {a.tp}: one shard group of {n} ranks; "
              "needs vLLM 0.34 (docs/startup-checks.md, pcp-and-tp)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vllm-cp-kv", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("capacity", help="KV tokens per memory budget, off vs on")
    c.add_argument("--model", required=True, help="model directory (config.json)")
    c.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    c.add_argument("--pcp", type=int, default=1, help="prefill context parallel size")
    c.add_argument("--kv-memory-gib", type=float, default=1.0,
                   help="KV memory per rank (vLLM CPU: VLLM_CPU_KVCACHE_SPACE)")
    c.add_argument("--block-size", type=int, default=16,
                   help="16 with CPU_MLA, 32+ with AMX_MLA, 64 with FLASHMLA")
    c.add_argument("--dtype", default="auto", choices=sorted(DTYPE_BYTES))
    c.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype), fp8 / fp8_e4m3 / fp8_e5m2 (one byte a "
                        "value), fp8_ds_mla (DeepSeek-V3.2's packed latent)")
    c.add_argument("--max-model-len", type=int, default=None)
    c.add_argument("--max-num-seqs", type=int, default=256)
    c.add_argument("--max-scratch-blocks", type=int, default=0)
    c.add_argument("--workspace-tokens", type=int, default=0,
                   help="cp_kv.workspace_tokens (0: 1%% of the KV budget)")
    c.add_argument("--decode", default="lse", choices=["lse", "materialize"],
                   help="cp_kv.decode")
    c.add_argument("--backend", default="",
                   help="attention backend, if not a GPU one or CPU_MLA (AMX_MLA)")
    c.add_argument("--json", action="store_true")
    k = sub.add_parser("compat", help="check every private vLLM name the plugin touches still resolves")
    k.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.command == "compat":
        from .compat import main as compat

        return compat(a.json)
    return capacity(a)


if __name__ == "__main__":
    sys.exit(main())
