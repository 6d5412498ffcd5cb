"""The runs of the one-GPU matrix (benchmarks/gpu_onegpu.py runs them,
benchmarks/onegpu_checks.py checks them), as data: name -> (model, args,
harness on, env), in sections by what they check. Each section is a
``--runs`` group of its own; ``groups`` adds the timing runs, the trained
model's accuracy runs (benchmarks/gpu_recall.py, as ``acc-<run>``) and the
names of earlier leases' groups (their results folders' commands).

Models: ``moe`` (MoE tiny DeepSeek-V2), ``dense`` (6 heads), ``dense8`` (8
heads: TP=4 and PCP=2 x TP=2), ``mtp`` (with a DeepSeek MTP layer),
``dsv32`` (sparse), ``pd`` / ``pd:MODEL`` (a P/D run of
``vllm_cp_kv.tools.pd_offline``), ``recall`` (the trained model).
"""

from __future__ import annotations

import json
import os

from common import ROOT

# the plugin before the captured decode was fixed (a copy of the package,
# carried as .old/vllm_cp_kv): the negative control
OLD = os.path.join(ROOT, ".old")
PROMPTS = "1,40,250,700,1990,3000,4000,8000"  # 1 token to 8K
# ... and two of 32K and more: 10 requests, 8 at a time, so decode batches
# of 1 to 8 rows (capture sizes 1, 2, 4, 8 and padding in between)
LONG = PROMPTS + ",32768,40000"
GEN = ["--token-prompts", PROMPTS, "--max-model-len", "8200", "--max-tokens", "24"]
GEN_LONG = ["--token-prompts", LONG, "--max-model-len", "40200", "--max-tokens", "24"]
WAVES = GEN + ["--suffix-len", "24"]
GRAPHS = ["--cuda-graphs"]  # vLLM's default: FULL_AND_PIECEWISE, default sizes
DEBUG = {"VLLM_CP_KV_DEBUG": "1"}
BACKENDS = {"FA": "FLASH_ATTN_MLA", "FM": "FLASHMLA", "TR": "TRITON_MLA"}
SPARSE = {"fas": ["--backend", "FLASH_ATTN_MLA_SPARSE"],
          "fms": ["--backend", "FLASHMLA_SPARSE", "--kv-cache-dtype", "fp8_ds_mla"]}
SPARSE_GEN = ["--prompt-repeat", "3", "--max-model-len", "4096", "--sorted-topk"]
SHARD = ["--shard", "--poison", "--stats"]
TIME = ["--time-decode", "32"]
TP1, TP2, TP4 = ["--tp", "1"], ["--tp", "2"], ["--tp", "4"]
PCP2, PCP2TP2 = ["--tp", "1", "--pcp", "2"], ["--tp", "2", "--pcp", "2"]
PLAIN = ["--no-plugin"]
FA, TR = ["--backend", "FLASH_ATTN_MLA"], ["--backend", "TRITON_MLA"]
FP8 = ["--kv-cache-dtype", "fp8"]
# FP8 KV is refused by the plugin until shown right (issue 39): this lifts
# the refusal in these runs only
ALLOW_FP8 = {"CPKV_TEST_ALLOW_FP8": "1"}
FAULT = {"PYTHONFAULTHANDLER": "1"}  # a dying worker's stack in the log
REPLICATED = ["--cp-kv", '{"kv_sharding": false}']  # the plugin's layout, unsharded
# prefix caching: wave 2 hits wave 1's blocks; sharded, a third wave after
# rank 1's 21st written block was corrupted (the negative control)
PLAIN_WAVES = PLAIN + ["--waves", "2"]
SHARD_WAVES = ["--shard", "--waves", "3", "--poison", "--corrupt-between-waves",
               "--corrupt-index", "20", "--stats"]
WORKSPACE = ["--cp-kv", '{"workspace_tokens": 1024}']  # the context read in chunks
PREFILL_TP2 = ["--prefill-tp", "2", "--prefill-pcp", "1"]
PREFILL_PCP2 = ["--prefill-tp", "1", "--prefill-pcp", "2"]
PREFILL_PCP2TP2 = ["--prefill-tp", "2", "--prefill-pcp", "2"]
INTO_TP2_SHARD = ["--decode-tp", "2", "--decode-shard"]
ACC = "acc-"  # the trained model's runs (benchmarks/gpu_recall.py) in this table


def run(model: str, *parts: list, harness: bool = True, env: dict | None = None) -> tuple:
    """One run: its argument lists joined in order."""
    return (model, [a for p in parts for a in p], harness, dict(env or {}))


def mtp(n: int) -> list:
    return ["--spec", json.dumps({"method": "mtp", "num_speculative_tokens": n})]


def tp2_backend(mode: str, k: str) -> tuple:
    """TP=2 on backend ``k``: ``plain`` (vLLM's own, graphs), ``shard``
    (graphs), ``fdo`` (FULL_DECODE_ONLY), ``debug`` (eager, the debug
    switch); FLASH_ATTN_MLA's graphs runs also time the decode step."""
    be = TP2 + ["--backend", BACKENDS[k]] + GEN_LONG
    timed = TIME if k == "FA" else []
    return {"plain": run("moe", be, GRAPHS, PLAIN, timed),
            "shard": run("moe", be, GRAPHS, SHARD, timed),
            "fdo": run("moe", be, ["--graph-mode", "FULL_DECODE_ONLY"], SHARD),
            "debug": run("moe", be, SHARD, env=DEBUG)}[mode]


# The captured decode (issue 35): TP=2 sharded on three backends in
# FULL_AND_PIECEWISE and FULL_DECODE_ONLY against TP=2 unsharded in graphs,
# within the noise floor of two unsharded layouts (TP=2 against TP=1 and
# against eager); the eager debug runs; the plugin before the fix (the
# negative control); sharded eager (graphs against eager, timed)
GRAPH_RUNS = {
    "tp2-FA-old": run("moe", TP2, FA, GEN_LONG, GRAPHS, SHARD, env={"CPKV_PACKAGE": OLD}),
    **{f"tp2-{k}-{v}": tp2_backend(v, k) for v in ("plain", "shard", "debug", "fdo")
       for k in BACKENDS},
    "tp1-FA-plain": run("moe", TP1, PLAIN, FA, GEN_LONG, GRAPHS, harness=False),
    "tp2-FA-plain-eager": run("moe", TP2, FA, GEN_LONG, PLAIN, TIME),
    "tp2-FA-shard-eager": run("moe", TP2, FA, GEN_LONG, SHARD, TIME),
}
# decode step time: graphs against eager, sharded against unsharded
TIMING = ["tp2-FA-plain", "tp2-FA-plain-eager", "tp2-FA-shard", "tp2-FA-shard-eager"]

# TP=4 sharded against TP=4 unsharded, within its floor (graphs against eager)
TP4_RUNS = {
    "tp4-plain": run("dense8", TP4, FA, GEN, GRAPHS, PLAIN),
    "tp4-shard": run("dense8", TP4, FA, GEN, GRAPHS, SHARD),
    "tp4-plain-eager": run("dense8", TP4, FA, GEN, PLAIN),
}

# the materializing decode: attention stays out of vLLM's graphs (PIECEWISE)
MATERIALIZE_RUNS = {
    "tp2-FA-mat": run("moe", TP2, FA, GEN_LONG, GRAPHS,
                      ["--cp-kv", '{"decode": "materialize"}', "--poison"]),
}

# PCP=2 (dense, MoE) against vLLM's own PCP=2, the MoE mask against TP=1
# (plain vLLM 0.32 fails with PCP and MoE, docs/gpu-testing.md: vLLM's
# replicated layout with the plugin's gathered mask is the reference);
# PCP=2 x TP=2 (issue 40) sharded over all 4 ranks against vLLM's own,
# within the floor of vLLM's own against TP=2, eager with the debug switch;
# P/D from a PCP=2 x TP=2 prefill into a TP=1 and a sharded TP=2 decode
PCP_RUNS = {
    "pcp2-dense-plain": run("dense", PCP2, GEN, GRAPHS, PLAIN),
    "pcp2-dense-shard": run("dense", PCP2, GEN, GRAPHS, SHARD),
    "pcp2-dense-debug": run("dense", PCP2, GEN, SHARD, env=DEBUG),
    "pcp2-moe-base": run("moe", PCP2, GEN, GRAPHS, REPLICATED),
    "pcp2-moe-shard": run("moe", PCP2, GEN, GRAPHS, SHARD),
    "tp1-moe-plain": run("moe", TP1, PLAIN, GEN, GRAPHS, harness=False),
    "pcp2tp2-dense-plain": run("dense8", PCP2TP2, GEN, GRAPHS, PLAIN),
    "pcp2tp2-dense-plain-eager": run("dense8", PCP2TP2, GEN, PLAIN),
    "pcp2tp2-dense-shard": run("dense8", PCP2TP2, GEN, GRAPHS, SHARD),
    "pcp2tp2-dense-debug": run("dense8", PCP2TP2, GEN, SHARD, env=DEBUG),
    "tp2-dense8-plain": run("dense8", TP2, GEN, GRAPHS, PLAIN),
    "pd-pcp2tp2-nixl": run("pd", PREFILL_PCP2TP2, GRAPHS),
    "pd-pcp2tp2-shard2-nixl": run("pd", PREFILL_PCP2TP2, INTO_TP2_SHARD, GRAPHS),
}


def sparse_pair(x: str, lay: list, k: str) -> dict:
    return {f"{x}-{k}-plain-eager": run("dsv32", lay, SPARSE[k], SPARSE_GEN, PLAIN),
            f"{x}-{k}-shard-eager": run("dsv32", lay, SPARSE[k], SPARSE_GEN, SHARD, env=DEBUG)}


# sparse MLA (both backends) under PCP=2 and PCP=2 x TP=2 against vLLM's
# own, with the debug switch; eager: vLLM 0.32 refuses CUDA graphs with
# sparse MLA under PCP ("MRV2 sparse MLA PCP does not support CUDA graphs
# yet"), sharded or not. On vLLM 0.34 the fms pairs (fp8_ds_mla) take the
# shard-aware path (benchmarks/gpu_sparse.py's sa-pcp has its graphs runs)
# and the fas pairs (bf16) the materializing one; pcp2tp2-fas (not yet run)
# is the materializing path under PCP x TP
SPARSE_RUNS = {**sparse_pair("pcp2", PCP2, "fas"), **sparse_pair("pcp2", PCP2, "fms"),
               **sparse_pair("pcp2tp2", PCP2TP2, "fms"), **sparse_pair("pcp2tp2", PCP2TP2, "fas")}


def chunked(x: str, lay: list) -> dict:
    """The context read in chunks under ``lay``; eager with the debug
    switch in two waves (no corruption: the invariants)."""
    return {f"{x}-chunk": run("dense8", lay, WAVES, GRAPHS, SHARD_WAVES, WORKSPACE),
            f"{x}-chunk-debug": run("dense8", lay, WAVES, ["--shard", "--waves", "2", "--poison",
                                                           "--stats"], WORKSPACE, env=DEBUG)}


# prefix caching in three waves, TP=2 and PCP=2 x TP=2: hits in wave 2, the
# corrupted block changes wave 3; the chunked context (a 1,024-token
# workspace: wave 2's hits read chunk by chunk) under TP=2, with the
# layer-ahead prefetch too (the same tokens), under PCP=2 and PCP=2 x TP=2
PREFIX_RUNS = {
    "tp2-prefix-plain": run("moe", TP2, FA, WAVES, GRAPHS, PLAIN_WAVES),
    "tp2-prefix-shard": run("moe", TP2, FA, WAVES, GRAPHS, SHARD_WAVES),
    "tp2-FA-chunk": run("moe", TP2, FA, WAVES, GRAPHS, SHARD_WAVES, WORKSPACE),
    "tp2-FA-chunk-prefetch": run("moe", TP2, FA, WAVES, GRAPHS, SHARD_WAVES, [
        "--cp-kv", '{"workspace_tokens": 1024, "prefetch": true}']),
    "pcp2tp2-prefix-plain": run("dense8", PCP2TP2, WAVES, GRAPHS, PLAIN_WAVES),
    "pcp2tp2-prefix-shard": run("dense8", PCP2TP2, WAVES, GRAPHS, SHARD_WAVES),
    "pcp2-prefix-plain": run("dense8", PCP2, WAVES, GRAPHS, PLAIN_WAVES),
    **chunked("pcp2", PCP2), **chunked("pcp2tp2", PCP2TP2),
}


def pcp_mtp(x: str, lay: list) -> dict:
    """MTP k=2 under ``lay``: in graphs, eager, eager with the debug switch;
    on TRITON_MLA in graphs (vLLM's own PCP with MTP on FLASH_ATTN_MLA fails
    in its draft prefill: FlashAttention's scheduler metadata)."""
    g = lay + GEN + mtp(2)
    return {f"{x}-mtp2-plain": run("mtp", g, GRAPHS, PLAIN),
            f"{x}-mtp2-shard": run("mtp", g, GRAPHS, SHARD),
            f"{x}-mtp2-debug": run("mtp", g, SHARD, env=DEBUG),
            f"{x}-mtp2-plain-eager": run("mtp", g, PLAIN),
            f"{x}-mtp2-shard-eager": run("mtp", g, SHARD),
            f"{x}-mtp2-TR-plain": run("mtp", g, TR, GRAPHS, PLAIN),
            f"{x}-mtp2-TR-shard": run("mtp", g, TR, GRAPHS, SHARD)}


# MTP (the V2 runner, graphs): TP=2 sharded against unsharded with k = 1..3
# drafts, verification rows through the shard-aware decode, the eager debug
# run; k=2 under PCP=2 x TP=2 and PCP=2 against vLLM's own, within the floor
# of vLLM's own against TP=2
MTP_RUNS = {
    **{f"tp2-FA-mtp{n}-{v}": run("mtp", TP2, FA, GEN, GRAPHS, mtp(n), x)
       for n in (1, 2, 3) for v, x in (("plain", PLAIN), ("shard", SHARD))},
    "tp2-FA-mtp2-debug": run("mtp", TP2, FA, GEN, mtp(2), SHARD, env=DEBUG),
    **pcp_mtp("pcp2tp2", PCP2TP2), **pcp_mtp("pcp2", PCP2),
    "tp2-mtp2-TR-plain": run("mtp", TP2, GEN, mtp(2), TR, GRAPHS, PLAIN),
    "tp2-mtp2-plain": run("mtp", TP2, GEN, mtp(2), GRAPHS, PLAIN),
}


def tp2_fp8(k: str) -> dict:
    be = ["--backend", BACKENDS[k]] + GEN_LONG + FP8
    return {f"tp1-{k}-fp8-plain": run("moe", TP1, PLAIN, be, GRAPHS, harness=False),
            f"tp2-{k}-fp8-plain": run("moe", TP2, be, GRAPHS, PLAIN),
            f"tp2-{k}-fp8-shard": run("moe", TP2, be, GRAPHS, SHARD, env=ALLOW_FP8),
            f"tp2-{k}-fp8-debug": run("moe", TP2, be, SHARD, env={**ALLOW_FP8, **DEBUG})}


# FP8 KV on dense MLA (issue 39): TP=2 sharded FP8 against TP=2 unsharded
# FP8 per backend, within the floor of TP=2 against TP=1 (unsharded FP8);
# the debug runs; P/D from a sharded TP=2 FP8 prefill (its floor measured
# in the run)
FP8_RUNS = {**tp2_fp8("FM"), **tp2_fp8("TR"), **tp2_fp8("FA"),
            "pd-tp2-nixl-fp8": run("pd", PREFILL_TP2, GRAPHS, ["--floor"], FP8, env=ALLOW_FP8)}

# PCP=2 sharded FP8 on the dense model (vLLM's default backend, FLASHMLA)
# against vLLM's own PCP=2 FP8, or TP=1 where that fails; the floor of
# TP=2 against TP=1 (unsharded FP8)
FP8_PCP_RUNS = {
    "tp1-dense-fp8-plain": run("dense", TP1, PLAIN, GEN, GRAPHS, FP8, harness=False),
    "tp2-dense-fp8-plain": run("dense", TP2, PLAIN, GEN, GRAPHS, FP8),
    "pcp2-dense-fp8-plain": run("dense", PCP2, GEN, GRAPHS, FP8, PLAIN),
    "pcp2-dense-fp8-shard": run("dense", PCP2, GEN, GRAPHS, FP8, SHARD, env=ALLOW_FP8),
    "pcp2-dense-fp8-debug": run("dense", PCP2, GEN, FP8, SHARD, env={**ALLOW_FP8, **DEBUG}),
}

# the references of PCP=2 FP8 on FLASHMLA where vLLM's own dies (a worker
# lost at warm-up in graphs: Python's fault handler on): vLLM's own eager,
# the plugin's replicated layout in graphs, the sharded run eager; P/D FP8
# from an unsharded prefill (the plugin's connector, cp_kv off), which
# separates the sharding's part from the P/D path's with FP8
FP8_REF_RUNS = {
    "pcp2-dense-fp8-plain-eager": run("dense", PCP2, GEN, FP8, PLAIN, env=FAULT),
    "pcp2-dense-fp8-base": run("dense", PCP2, GEN, GRAPHS, FP8, REPLICATED, env=FAULT),
    "pcp2-dense-fp8-shard-eager": run("dense", PCP2, GEN, FP8, SHARD, env=ALLOW_FP8),
    "pd-tp2-nixl-fp8-unsharded": run("pd", PREFILL_TP2, GRAPHS, ["--floor", "--prefill-plain"],
                                     FP8),
}

# FP8 on TRITON_MLA, where vLLM's own PCP=2 runs with FP8 (on FLASHMLA it
# dies in get_mla_metadata_dense_fp8, a floating-point exception): PCP=2 and
# PCP=2 x TP=2 sharded against vLLM's own, their floors against TP=1 and
# TP=2 (PCP x TP on TRITON_MLA is admitted without ALLOW_FP8: docs/fp8.md)
FP8_TRITON_RUNS = {
    **{f"{x}-dTR-fp8-plain": run("dense", lay, GEN, GRAPHS, TR, FP8, PLAIN, harness=x != "tp1")
       for x, lay in (("tp1", TP1), ("tp2", TP2), ("pcp2", PCP2), ("pcp2tp2", PCP2TP2))},
    "pcp2-dTR-fp8-shard": run("dense", PCP2, GEN, GRAPHS, TR, FP8, SHARD, env=ALLOW_FP8),
    "pcp2-dTR-fp8-debug": run("dense", PCP2, GEN, TR, FP8, SHARD, env={**ALLOW_FP8, **DEBUG}),
    "pcp2tp2-dTR-fp8-shard": run("dense", PCP2TP2, GEN, GRAPHS, TR, FP8, SHARD),
    "pcp2tp2-dTR-fp8-debug": run("dense", PCP2TP2, GEN, TR, FP8, SHARD, env=DEBUG),
}

# FP8 with the chunked context (a 1,024-token workspace) and prefix hits
FM8 = TP2 + ["--backend", "FLASHMLA"] + FP8 + WAVES + GRAPHS
FP8_CHUNK_RUNS = {"tp2-FM-fp8-prefix-plain": run("moe", FM8, PLAIN_WAVES),
                  "tp2-FM-fp8-chunk": run("moe", FM8, SHARD_WAVES, WORKSPACE)}

# P/D in vLLM's default mode (issues 37 and 41): every sharded prefill
# layout into a TP=1 decode and a PCP=2 prefill into a TP=2 sharded decode,
# over both transports (Mooncake's CUDA build staged next to the payload:
# scripts/gpu/onegpu/pd_device.sh); the negative control: the decode
# ignores the explicit logical positions
PD_LAYOUTS = {"tp2": PREFILL_TP2, "pcp2": PREFILL_PCP2,
              "pcp2-shard2": PREFILL_PCP2 + INTO_TP2_SHARD}
PD_RUNS = {
    **{f"pd-{lay}-{tr}": run("pd", args, ["--transport", tr], GRAPHS)
       for lay, args in PD_LAYOUTS.items() for tr in ("nixl", "mooncake")},
    "pd-pcp2-shard2-nixl-dropped": run("pd", PD_LAYOUTS["pcp2-shard2"], GRAPHS, env={
        "CPKV_TEST_HOOKS": "1", "CPKV_TEST_IGNORE_POSITIONS": "1"}),
}

# the owned context under PCP and PCP x TP (issue 51): wave 2's prefix hits
# (24 new tokens over up to 8K cached) read their context owned, split over
# the PCP ranks (FLASHMLA, graphs); the same sharded layout reading it
# gathered; vLLM's own PCP=2 and PCP=2 x TP=2 (the two unsharded layouts:
# the floor); eager with the debug switch in two waves
FM = ["--backend", "FLASHMLA"]
OWNED = ["--cp-kv", '{"context_path": "owned"}']
GATHERED = ["--cp-kv", '{"context_path": "gathered"}']
OWNED_RUNS = {
    **{f"{x}-{name}": run("dense8", lay, FM, WAVES, *parts)
       for x, lay in (("pcp2", PCP2), ("pcp2tp2", PCP2TP2))
       for name, parts in (("owned", (GRAPHS, SHARD_WAVES, OWNED)),
                           ("gathered", (GRAPHS, SHARD_WAVES, GATHERED)),
                           ("FM-prefix-plain", (GRAPHS, PLAIN_WAVES)))},
    **{f"{x}-owned-debug": run("dense8", lay, FM, WAVES, [
        "--shard", "--waves", "2", "--poison", "--stats"], OWNED, env=DEBUG)
       for x, lay in (("pcp2", PCP2), ("pcp2tp2", PCP2TP2))},
}

SECTIONS = {"graphs": GRAPH_RUNS, "tp4": TP4_RUNS, "materialize": MATERIALIZE_RUNS,
            "pcp": PCP_RUNS, "sparse": SPARSE_RUNS, "prefix": PREFIX_RUNS, "mtp": MTP_RUNS,
            "fp8": FP8_RUNS, "fp8-pcp": FP8_PCP_RUNS, "fp8-refs": FP8_REF_RUNS,
            "fp8-triton": FP8_TRITON_RUNS, "fp8-chunk": FP8_CHUNK_RUNS, "pd": PD_RUNS,
            "owned": OWNED_RUNS}

# The groups of earlier leases, by name, for the commands in their results
# folders' README.md (which say what each lease ran and why)
ALIASES = {
    # h200x1-2026-12-03-graphs
    "more": ["tp4-plain", "tp4-shard", "pcp2-dense-plain", "pcp2-dense-shard",
        "pcp2-dense-debug", "pcp2-moe-base", "pcp2-moe-shard", "tp1-moe-plain",
        "pcp2-fas-plain-eager", "pcp2-fas-shard-eager", "pcp2-fms-plain-eager",
        "pcp2-fms-shard-eager", "tp4-plain-eager", "tp2-prefix-plain", "tp2-prefix-shard",
        "tp2-FA-chunk", "tp2-FA-chunk-prefetch", "tp2-FA-mat", "tp2-FA-mtp1-plain",
        "tp2-FA-mtp1-shard", "tp2-FA-mtp2-plain", "tp2-FA-mtp2-shard", "tp2-FA-mtp3-plain",
        "tp2-FA-mtp3-shard", "tp2-FA-mtp2-debug", "pd-tp2-nixl"],
    "again": ["pd-tp2-nixl", "pcp2-moe-base", "pcp2-moe-shard", "tp4-plain-eager",
        "pcp2-fas-plain-eager", "pcp2-fas-shard-eager", "pcp2-fms-plain-eager",
        "pcp2-fms-shard-eager"],
    # h200x1-2026-12-03-vllm-0.34, h200x1-2026-12-04-vllm-0.34
    "v034": ["tp1-FA-plain", "tp2-FA-plain", "tp2-FA-shard", "tp2-FM-plain", "tp2-FM-shard",
        "tp2-TR-plain", "tp2-TR-shard", "tp2-FA-debug", "tp2-FA-plain-eager",
        "pcp2-dense-plain", "pcp2-dense-shard", "pcp2-fms-plain-eager", "pcp2-fms-shard-eager",
        "tp2-FA-mtp2-plain", "tp2-FA-mtp2-shard", "tp2-prefix-plain", "tp2-prefix-shard",
        "pd-tp2-nixl"],
    "v034-debug": ["tp2-FA-debug", "tp2-FM-debug", "tp2-TR-debug", "pcp2-dense-debug",
        "pcp2-fms-shard-eager", "tp2-prefix-shard"],
    "fp8-again": ["tp2-FM-fp8-debug", "tp2-TR-fp8-debug", "pcp2-dense-fp8-debug",
        "tp2-dense-fp8-plain", "pcp2-dense-fp8-plain", "pd-tp2-nixl-fp8"],
    # h200x1-2026-12-04-fp8-pcp
    "fp8-pcp-ref": ["pcp2-dense-fp8-plain", "pcp2-dense-fp8-plain-eager",
        "pcp2-dense-fp8-base", "pcp2-dense-fp8-shard", "pcp2-dense-fp8-shard-eager",
        "tp1-dense-fp8-plain", "tp2-dense-fp8-plain", "pd-tp2-nixl-fp8-unsharded",
        "pd-tp2-nixl-fp8", "pcp2-fms-plain-eager", "pcp2-fms-shard-eager"],
    "fp8-pcp-tr": ["tp1-dTR-fp8-plain", "tp2-dTR-fp8-plain", "pcp2-dTR-fp8-plain",
        "pcp2-dTR-fp8-shard", "pcp2-dTR-fp8-debug", "pd-tp2-nixl-fp8-unsharded",
        "pcp2-dense-fp8-debug", "pcp2tp2-dense-plain", "pcp2tp2-dense-plain-eager",
        "pcp2tp2-fms-plain-eager"],
    # h200x1-2026-12-04-pcp-tp
    "pcp-tp": ["pcp2tp2-dense-plain", "pcp2tp2-dense-shard", "pcp2tp2-dense-debug",
        "tp2-dense8-plain", "pd-pcp2tp2-nixl", "pcp2tp2-fms-plain-eager",
        "pcp2tp2-fms-shard-eager", "tp2-FM-fp8-prefix-plain", "tp2-FM-fp8-chunk"],
    "pcp-tp-prefix": ["pcp2tp2-prefix-plain", "pcp2tp2-prefix-shard"],
    # h200x1-2026-12-04-pcp-tp-more
    "pcp-tp-more": ["pd-pcp2tp2-shard2-nixl", "pcp2tp2-mtp2-plain-eager", "pcp2tp2-mtp2-plain",
        "pcp2tp2-mtp2-shard", "pcp2tp2-mtp2-debug", "tp2-mtp2-plain", "pcp2-mtp2-plain",
        "pcp2-mtp2-shard", "pcp2-mtp2-debug", "pcp2tp2-dTR-fp8-plain", "pcp2tp2-dTR-fp8-shard",
        "pcp2tp2-dTR-fp8-debug", "tp2-dTR-fp8-plain"],
    "pcp-tp-more2": ["pcp2tp2-mtp2-TR-plain", "pcp2tp2-mtp2-TR-shard", "pcp2-mtp2-TR-plain",
        "pcp2-mtp2-TR-shard", "tp2-mtp2-TR-plain", "pcp2tp2-mtp2-shard-eager",
        "pcp2-mtp2-plain-eager", "pcp2-mtp2-shard-eager", "tp1-dTR-fp8-plain"],
    # h200x1-2026-12-04-pcp-chunk
    "pcp-chunk": ["pcp2tp2-chunk", "pcp2tp2-prefix-plain", "pcp2-chunk", "pcp2-prefix-plain",
        "pcp2tp2-chunk-debug", "pcp2-chunk-debug", "pcp2tp2-dense-shard",
        "pcp2tp2-dense-plain", "tp2-dense8-plain"],
}


def groups(table: dict) -> dict:
    """``--runs`` names -> run names: each section, ``timing``, ``accuracy``
    (the ``acc-`` runs of ``table``), the earlier leases' groups and ``all``
    (the matrix of docs/gpu-testing.md: ``graphs``, ``more``, ``accuracy``)."""
    g = {name: list(section) for name, section in SECTIONS.items()}
    g["timing"] = TIMING
    g["accuracy"] = [n for n in table if n.startswith(ACC)]
    g.update(ALIASES)
    g["all"] = g["graphs"] + g["more"] + g["accuracy"]
    return g


def runs() -> dict:
    """name -> (model, args, harness on, env), every section's runs and the
    trained model's (benchmarks/gpu_recall.py) as ``acc-<run>``."""
    import gpu_recall  # it imports gpu_onegpu, which imports this module

    table = {n: (model, list(args), harness, dict(env)) for section in SECTIONS.values()
             for n, (model, args, harness, env) in section.items()}
    assert len(table) == sum(map(len, SECTIONS.values())), "a run named in two sections"
    table.update({ACC + name: r for name, r in gpu_recall.runs().items()})
    return table
