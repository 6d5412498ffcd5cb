"""Every multi-rank GPU path of cp_kv in real vLLM 0.32 on ONE GPU, in
vLLM's default mode: CUDA graphs on (FULL_AND_PIECEWISE, default capture
sizes), every rank on GPU 0 with real NCCL (the one-GPU harness,
scripts/gpu/onegpu, ``ONEGPU_COMM=nccl``: a distinct ``NCCL_HOSTID`` per
rank), several runs at a time. Runs that are eager say why in their name:
``-debug`` (``VLLM_CP_KV_DEBUG=1`` checks on the host, which a replayed graph
skips; the plugin refuses it with graphs), ``-eager`` (a reference: graphs
against eager), ``-old`` (the plugin before the captured decode was fixed:
the negative control, in graphs mode).

Usage (on the GPU machine, after ``source scripts/gpu/setup_device.sh``):
    python benchmarks/gpu_onegpu.py OUT_DIR [--runs GROUP|NAME,...]
        [--budget-s 540] [--parallel 6] [--comm nccl|gloo|shm]
    python benchmarks/gpu_onegpu.py OUT_DIR --summarize   (here, afterwards)
    python benchmarks/gpu_onegpu.py OUT_DIR --against OLD_DIR  (a re-run of
        runs whose references are in OLD_DIR: same tokens, statistics, hits)
GROUPs: ``graphs`` (TP=2 on FLASH_ATTN_MLA, FLASHMLA and TRITON_MLA in
FULL_AND_PIECEWISE and FULL_DECODE_ONLY against TP=2 unsharded with graphs,
sharded eager with the debug checks, TP=1, prompts of 1 token to 40K; the
negative control), ``more`` (TP=4, PCP=2 dense, MoE and both sparse
backends, prefix hits, the chunked context with and without the prefetch,
MTP k=1..3, P/D, decode step times), ``accuracy`` (the trained model's
runs of benchmarks/gpu_recall.py: where they ran, the verdicts of TP=2,
TP=4, PCP=2, PCP=2 x TP=2, FP8, prefix hits and P/D are its accuracy
against unsharded, the token comparisons kept beside), ``all``.

Runs go through ``harness/run_vllm.py`` (and ``vllm_cp_kv.tools.pd_offline``)
as in benchmarks/gpu_vllm_checks.py, with a fixed KV budget per rank
(``--kv-bytes``: no memory profiling, so ranks that share the GPU do not
count each other's memory) and a small ``gpu_memory_utilization``, so that
up to ``--parallel`` runs share the GPU. Writes OUT_DIR/<run>.json|.log,
OUT_DIR/summary.json (runs, checks, wall seconds, capture seconds and graph
memory per rank from vLLM's logs), OUT_DIR/onegpu.png, and prints the checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import gpu_vllm_checks as checks  # model builders, run loading
from common import ROOT, RUN_VLLM, pyplot, result_dir, save_figure, write_json
from vllm_cp_kv.tools import tiny_model

HARNESS = os.path.join(ROOT, "scripts", "gpu", "onegpu")
# the plugin before the captured decode was fixed (a copy of the package,
# carried as .old/vllm_cp_kv): the negative control
OLD = os.path.join(ROOT, ".old")
KV = str(4 << 30)  # per rank: the scratch view is < 2%
BASE = ["--gpu-mem", "0.05", "--kv-bytes", KV]
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


def runs() -> dict:
    """name -> (model, args, harness on, env). ``model`` "pd" is a P/D run."""
    tp2, tp4, pcp2 = ["--tp", "2"], ["--tp", "4"], ["--tp", "1", "--pcp", "2"]
    fa = ["--backend", "FLASH_ATTN_MLA"]
    r = {"tp1-FA-plain": ("moe", ["--tp", "1", "--no-plugin"] + fa + GEN_LONG + GRAPHS,
                          False, {}),
         "tp2-FA-plain-eager": ("moe", tp2 + fa + GEN_LONG + ["--no-plugin"] + TIME,
                                True, {}),
         "tp2-FA-old": ("moe", tp2 + fa + GEN_LONG + GRAPHS + SHARD, True,
                        {"CPKV_PACKAGE": OLD})}
    for k, b in BACKENDS.items():
        be = tp2 + ["--backend", b] + GEN_LONG
        timed = TIME if k == "FA" else []
        r[f"tp2-{k}-plain"] = ("moe", be + GRAPHS + ["--no-plugin"] + timed, True, {})
        r[f"tp2-{k}-shard"] = ("moe", be + GRAPHS + SHARD + timed, True, {})
        r[f"tp2-{k}-fdo"] = ("moe", be + ["--graph-mode", "FULL_DECODE_ONLY"] + SHARD,
                             True, {})
        r[f"tp2-{k}-debug"] = ("moe", be + SHARD, True, DEBUG)
    r["tp2-FA-shard-eager"] = ("moe", tp2 + fa + GEN_LONG + SHARD + TIME, True, {})
    # the materializing decode: attention stays out of vLLM's graphs (PIECEWISE)
    r["tp2-FA-mat"] = ("moe", tp2 + fa + GEN_LONG + GRAPHS + ["--cp-kv", '{"decode": "materialize"}',
                                                         "--poison"], True, {})
    r["tp4-plain"] = ("dense8", tp4 + fa + GEN + GRAPHS + ["--no-plugin"], True, {})
    r["tp4-shard"] = ("dense8", tp4 + fa + GEN + GRAPHS + SHARD, True, {})
    r["tp4-plain-eager"] = ("dense8", tp4 + fa + GEN + ["--no-plugin"], True, {})  # the floor
    r["pcp2-dense-plain"] = ("dense", pcp2 + GEN + GRAPHS + ["--no-plugin"], True, {})
    r["pcp2-dense-shard"] = ("dense", pcp2 + GEN + GRAPHS + SHARD, True, {})
    r["pcp2-dense-debug"] = ("dense", pcp2 + GEN + SHARD, True, DEBUG)
    # plain vLLM 0.32 fails with PCP and MoE (docs/gpu-testing.md): vLLM's
    # replicated layout with the plugin's gathered mask, checked against TP=1
    r["pcp2-moe-base"] = ("moe", pcp2 + GEN + GRAPHS + ["--cp-kv", '{"kv_sharding": false}'],
                          True, {})
    r["pcp2-moe-shard"] = ("moe", pcp2 + GEN + GRAPHS + SHARD, True, {})
    r["tp1-moe-plain"] = ("moe", ["--tp", "1", "--no-plugin"] + GEN + GRAPHS, False, {})
    # eager: vLLM 0.32 refuses CUDA graphs with sparse MLA under PCP ("MRV2
    # sparse MLA PCP does not support CUDA graphs yet"), sharded or not
    for k, extra in SPARSE.items():
        r[f"pcp2-{k}-plain-eager"] = ("dsv32", pcp2 + extra + SPARSE_GEN + ["--no-plugin"],
                                      True, {})
        r[f"pcp2-{k}-shard-eager"] = ("dsv32", pcp2 + extra + SPARSE_GEN + SHARD, True, DEBUG)
    r["tp2-prefix-plain"] = ("moe", tp2 + fa + WAVES + GRAPHS + ["--no-plugin", "--waves", "2"],
                             True, {})
    r["tp2-prefix-shard"] = ("moe", tp2 + fa + WAVES + GRAPHS + [
        "--shard", "--waves", "3", "--poison", "--corrupt-between-waves", "--corrupt-index", "20",
        "--stats"], True, {})
    # the bounded scratch: wave 2's hits read through a 1,024-token
    # workspace, chunk by chunk; rank 1's 21st block corrupted before wave 3;
    # the same with the layer-ahead prefetch (tokens must not change)
    chunk = tp2 + fa + WAVES + GRAPHS + ["--shard", "--waves", "3", "--poison",
                                          "--corrupt-between-waves", "--corrupt-index", "20",
                                          "--stats"]
    r["tp2-FA-chunk"] = ("moe", chunk + ["--cp-kv", '{"workspace_tokens": 1024}'], True, {})
    r["tp2-FA-chunk-prefetch"] = ("moe", chunk + [
        "--cp-kv", '{"workspace_tokens": 1024, "prefetch": true}'], True, {})
    for n in (1, 2, 3):
        spec = ["--spec", json.dumps({"method": "mtp", "num_speculative_tokens": n})]
        r[f"tp2-FA-mtp{n}-plain"] = ("mtp", tp2 + fa + GEN + GRAPHS + spec + ["--no-plugin"],
                                     True, {})
        r[f"tp2-FA-mtp{n}-shard"] = ("mtp", tp2 + fa + GEN + GRAPHS + spec + SHARD, True, {})
    spec2 = ["--spec", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]
    r["tp2-FA-mtp2-debug"] = ("mtp", tp2 + fa + GEN + spec2 + SHARD, True, DEBUG)
    # FP8 KV on dense MLA (issue 39, a probe: the plugin refuses it until
    # shown right, CPKV_TEST_ALLOW_FP8 lifts the refusal in these runs only):
    # TP=1 and TP=2 unsharded FP8 (their floor), TP=2 sharded FP8, per backend
    fp8 = ["--kv-cache-dtype", "fp8"]
    for k in ("FM", "TR", "FA"):
        be = ["--backend", BACKENDS[k]] + GEN_LONG + fp8
        r[f"tp1-{k}-fp8-plain"] = ("moe", ["--tp", "1", "--no-plugin"] + be + GRAPHS, False, {})
        r[f"tp2-{k}-fp8-plain"] = ("moe", tp2 + be + GRAPHS + ["--no-plugin"], True, {})
        r[f"tp2-{k}-fp8-shard"] = ("moe", tp2 + be + GRAPHS + SHARD, True,
                                   {"CPKV_TEST_ALLOW_FP8": "1"})
        r[f"tp2-{k}-fp8-debug"] = ("moe", tp2 + be + SHARD, True,
                                   {"CPKV_TEST_ALLOW_FP8": "1", **DEBUG})
    # PCP=2 sharded FP8 on the dense model (vLLM's default backend), its
    # floor PCP=2 unsharded FP8 against TP=1 unsharded FP8
    allow = {"CPKV_TEST_ALLOW_FP8": "1"}
    r["tp1-dense-fp8-plain"] = ("dense", ["--tp", "1", "--no-plugin"] + GEN + GRAPHS + fp8,
                                False, {})
    r["tp2-dense-fp8-plain"] = ("dense", ["--tp", "2", "--no-plugin"] + GEN + GRAPHS + fp8,
                                True, {})
    r["pcp2-dense-fp8-plain"] = ("dense", pcp2 + GEN + GRAPHS + fp8 + ["--no-plugin"], True, {})
    r["pcp2-dense-fp8-shard"] = ("dense", pcp2 + GEN + GRAPHS + fp8 + SHARD, True, allow)
    r["pcp2-dense-fp8-debug"] = ("dense", pcp2 + GEN + fp8 + SHARD, True, {**allow, **DEBUG})
    # the same on TRITON_MLA, where vLLM's own PCP=2 runs with FP8 (on
    # FLASHMLA it dies in get_mla_metadata_dense_fp8, a floating-point
    # exception, eager and in graphs, with or without the plugin's layout)
    tr = ["--backend", "TRITON_MLA"] + fp8
    for x, lay in (("tp1", ["--tp", "1"]), ("tp2", ["--tp", "2"]), ("pcp2", pcp2)):
        r[f"{x}-dTR-fp8-plain"] = ("dense", lay + GEN + GRAPHS + tr + ["--no-plugin"],
                                   x != "tp1", {})
    r["pcp2-dTR-fp8-shard"] = ("dense", pcp2 + GEN + GRAPHS + tr + SHARD, True, allow)
    r["pcp2-dTR-fp8-debug"] = ("dense", pcp2 + GEN + tr + SHARD, True, {**allow, **DEBUG})
    # issue 40's baseline: vLLM's own PCP=2 x TP=2 (4 ranks on the GPU),
    # dense in graphs and eager, sparse eager (vLLM's DCP over TP x PCP)
    pcp2tp2 = ["--tp", "2", "--pcp", "2"]
    r["pcp2tp2-dense-plain"] = ("dense8", pcp2tp2 + GEN + GRAPHS + ["--no-plugin"], True, {})
    r["pcp2tp2-dense-plain-eager"] = ("dense8", pcp2tp2 + GEN + ["--no-plugin"], True, {})
    r["pcp2tp2-fms-plain-eager"] = ("dsv32", pcp2tp2 + SPARSE["fms"] + SPARSE_GEN + [
        "--no-plugin"], True, {})
    # issue 40: sharded over all PCP x TP ranks (vLLM 0.34), against vLLM's
    # own PCP=2 x TP=2 and TP=2 (the floor of two unsharded layouts), dense
    # in graphs and eager with the debug switch, sparse eager with it, P/D
    # from such a prefill to a TP=1 decode
    r["pcp2tp2-dense-shard"] = ("dense8", pcp2tp2 + GEN + GRAPHS + SHARD, True, {})
    r["pcp2tp2-dense-debug"] = ("dense8", pcp2tp2 + GEN + SHARD, True, DEBUG)
    r["tp2-dense8-plain"] = ("dense8", ["--tp", "2"] + GEN + GRAPHS + ["--no-plugin"], True, {})
    r["pcp2tp2-prefix-plain"] = ("dense8", pcp2tp2 + WAVES + GRAPHS + [
        "--no-plugin", "--waves", "2"], True, {})
    r["pcp2tp2-prefix-shard"] = ("dense8", pcp2tp2 + WAVES + GRAPHS + [
        "--shard", "--waves", "3", "--poison", "--corrupt-between-waves", "--corrupt-index",
        "20", "--stats"], True, {})
    r["pcp2tp2-fms-shard-eager"] = ("dsv32", pcp2tp2 + SPARSE["fms"] + SPARSE_GEN + SHARD,
                                    True, DEBUG)
    # what issue 40 left: MTP k=2 over PCP=2 x TP=2 in graphs against vLLM's
    # own (the floor: vLLM's own against TP=2) and eager with the debug
    # switch; MTP over PCP=2 (TP 1) in graphs; FP8 (TRITON_MLA) over PCP=2 x
    # TP=2 against vLLM's own, its floor against TP=2 FP8; P/D from a
    # PCP=2 x TP=2 prefill into a TP=2 sharded decode
    for x, lay in (("pcp2tp2", pcp2tp2), ("pcp2", pcp2)):
        g = lay + GEN + spec2
        r[f"{x}-mtp2-plain"] = ("mtp", g + GRAPHS + ["--no-plugin"], True, {})
        r[f"{x}-mtp2-shard"] = ("mtp", g + GRAPHS + SHARD, True, {})
        r[f"{x}-mtp2-debug"] = ("mtp", g + SHARD, True, DEBUG)
        r[f"{x}-mtp2-plain-eager"] = ("mtp", g + ["--no-plugin"], True, {})
        r[f"{x}-mtp2-shard-eager"] = ("mtp", g + SHARD, True, {})
        # TRITON_MLA in graphs (vLLM's own PCP with MTP on FLASH_ATTN_MLA fails
        # in its draft prefill: FlashAttention's scheduler metadata)
        trg = g + ["--backend", "TRITON_MLA"] + GRAPHS
        r[f"{x}-mtp2-TR-plain"] = ("mtp", trg + ["--no-plugin"], True, {})
        r[f"{x}-mtp2-TR-shard"] = ("mtp", trg + SHARD, True, {})
    r["tp2-mtp2-TR-plain"] = ("mtp", tp2 + GEN + spec2 + ["--backend", "TRITON_MLA"] + GRAPHS
                              + ["--no-plugin"], True, {})
    r["tp2-mtp2-plain"] = ("mtp", tp2 + GEN + spec2 + GRAPHS + ["--no-plugin"], True, {})
    r["pcp2tp2-dTR-fp8-plain"] = ("dense", pcp2tp2 + GEN + GRAPHS + tr + ["--no-plugin"],
                                  True, {})
    r["pcp2tp2-dTR-fp8-shard"] = ("dense", pcp2tp2 + GEN + GRAPHS + tr + SHARD, True, {})
    r["pcp2tp2-dTR-fp8-debug"] = ("dense", pcp2tp2 + GEN + tr + SHARD, True, DEBUG)
    # the chunked context under PCP and PCP x TP (a 1,024-token workspace:
    # wave 2's hits read chunk by chunk, the global requests' chunks), rank
    # 1's 21st block corrupted before wave 3; eager with the debug switch
    for x, lay in (("pcp2", pcp2), ("pcp2tp2", pcp2tp2)):
        ws = ["--cp-kv", '{"workspace_tokens": 1024}']
        r[f"{x}-chunk"] = ("dense8", lay + WAVES + GRAPHS + [
            "--shard", "--waves", "3", "--poison", "--corrupt-between-waves",
            "--corrupt-index", "20", "--stats"] + ws, True, {})
        r[f"{x}-chunk-debug"] = ("dense8", lay + WAVES + [
            "--shard", "--waves", "2", "--poison", "--stats"] + ws, True, DEBUG)
    r["pcp2-prefix-plain"] = ("dense8", pcp2 + WAVES + GRAPHS + [
        "--no-plugin", "--waves", "2"], True, {})
    # FP8 with the chunked context (a 1,024-token workspace) and prefix hits
    fm8 = tp2 + ["--backend", "FLASHMLA"] + fp8 + WAVES + GRAPHS
    r["tp2-FM-fp8-prefix-plain"] = ("moe", fm8 + ["--no-plugin", "--waves", "2"], True, {})
    r["tp2-FM-fp8-chunk"] = ("moe", fm8 + [
        "--shard", "--waves", "3", "--poison", "--corrupt-between-waves", "--corrupt-index",
        "20", "--stats", "--cp-kv", '{"workspace_tokens": 1024}'], True, {})
    # vLLM's own PCP=2 with FP8 eager (its graphs run lost a worker at
    # warmup: that run again with Python's fault handler on), the plugin's
    # replicated layout (kv_sharding false) in graphs, the sharded run eager
    fault = {"PYTHONFAULTHANDLER": "1"}
    r["pcp2-dense-fp8-plain-eager"] = ("dense", pcp2 + GEN + fp8 + ["--no-plugin"], True, fault)
    r["pcp2-dense-fp8-base"] = ("dense", pcp2 + GEN + GRAPHS + fp8 + [
        "--cp-kv", '{"kv_sharding": false}'], True, fault)
    r["pcp2-dense-fp8-shard-eager"] = ("dense", pcp2 + GEN + fp8 + SHARD, True, allow)
    r["pd-tp2-nixl-fp8"] = ("pd", ["--prefill-tp", "2", "--prefill-pcp", "1", "--cuda-graphs",
                                   "--floor", *fp8], True, {"CPKV_TEST_ALLOW_FP8": "1"})
    # the same P/D with an unsharded prefill (the plugin's connector, cp_kv
    # off): separates the sharding's part from the P/D path's with FP8
    r["pd-tp2-nixl-fp8-unsharded"] = ("pd", ["--prefill-tp", "2", "--prefill-pcp", "1",
                                             "--cuda-graphs", "--floor", "--prefill-plain",
                                             *fp8], True, {})
    r["pd-tp2-nixl"] = ("pd", ["--prefill-tp", "2", "--prefill-pcp", "1", "--cuda-graphs"],
                        True, {})
    # every sharded prefill layout into a TP=1 decode and a PCP=2 prefill
    # into a TP=2 sharded decode, over both transports (Mooncake's CUDA
    # build staged next to the payload: scripts/gpu/onegpu/pd_device.sh)
    layouts = {"tp2": ["--prefill-tp", "2", "--prefill-pcp", "1"],
               "pcp2": ["--prefill-tp", "1", "--prefill-pcp", "2"],
               "pcp2-shard2": ["--prefill-tp", "1", "--prefill-pcp", "2",
                               "--decode-tp", "2", "--decode-shard"]}
    r["pd-pcp2tp2-nixl"] = ("pd", ["--prefill-tp", "2", "--prefill-pcp", "2",
                                   "--cuda-graphs"], True, {})
    r["pd-pcp2tp2-shard2-nixl"] = ("pd", ["--prefill-tp", "2", "--prefill-pcp", "2",
                                          "--decode-tp", "2", "--decode-shard",
                                          "--cuda-graphs"], True, {})
    for lay, args in layouts.items():
        for tr in ("nixl", "mooncake"):
            r[f"pd-{lay}-{tr}"] = ("pd", args + ["--transport", tr, "--cuda-graphs"], True, {})
    # the negative control: the decode ignores the explicit logical positions
    r["pd-pcp2-shard2-nixl-dropped"] = ("pd", layouts["pcp2-shard2"] + ["--cuda-graphs"], True,
                                        {"CPKV_TEST_HOOKS": "1",
                                         "CPKV_TEST_IGNORE_POSITIONS": "1"})
    import gpu_recall  # the trained model's accuracy runs (it imports this module)

    r.update({ACC + name: run for name, run in gpu_recall.runs().items()})
    return r


# The trained recall model's accuracy (issue 50, benchmarks/gpu_recall.py):
# its runs join the matrix as "acc-<run>", and where they ran, the verdict of
# each mode below is its accuracy against unsharded plus the mode's
# structural facts (capacity, owned writes, hits, transfers), the token
# comparison with random weights kept beside as "tokens_ok".
ACC = "acc-"
ACCURACY = {"tp2-FLASHMLA-graphs": "tp2-shard", "tp4": "tp4-shard",
            "pcp2-dense": "pcp2-shard", "pcp2tp2-dense": "pcp2tp2-shard",
            "tp2-FLASHMLA-fp8": "tp2-fp8-shard", "prefix-tp2": "tp2-prefix-shard",
            "pd-tp2-nixl": "pd-tp2-into-tp1", "pd-pcp2-shard2-nixl": "pd-pcp2-into-tp2-shard"}


def accuracy_verdicts(out: dict, results: dict) -> None:
    import gpu_recall

    acc = gpu_recall.checks({k[len(ACC):]: v for k, v in results.items() if k.startswith(ACC)})
    for key, name in ACCURACY.items():
        c, a = out.get(key), acc[name]
        if a.get("why") == "missing run":  # not run in this lease: tokens decide
            continue
        if c is None:  # the mode's token runs not in this lease: accuracy alone
            c = out[key] = {"ok": True}
        # the mode's own facts without its token comparison
        facts = (c.get("ok_capacity_writes_debug", True) and c.get("same_rows_written_as_eager",
                                                                   True)
                 and c.get("transport_ok", True) and c.get("prefix_ok", True))
        c.update(tokens_ok=c["ok"], accuracy=a, ok=a["ok"] and facts)


GROUPS = {
    "graphs": ["tp2-FA-old"] + [f"tp2-{k}-{v}" for v in ("plain", "shard", "debug", "fdo")
                                for k in BACKENDS]
    + ["tp1-FA-plain", "tp2-FA-plain-eager", "tp2-FA-shard-eager"],
    "more": ["tp4-plain", "tp4-shard", "pcp2-dense-plain", "pcp2-dense-shard",
             "pcp2-dense-debug", "pcp2-moe-base", "pcp2-moe-shard", "tp1-moe-plain"]
    + [f"pcp2-{k}-{v}-eager" for k in SPARSE for v in ("plain", "shard")] + ["tp4-plain-eager"]
    + ["tp2-prefix-plain", "tp2-prefix-shard", "tp2-FA-chunk", "tp2-FA-chunk-prefetch",
       "tp2-FA-mat"]
    + [f"tp2-FA-mtp{n}-{v}" for n in (1, 2, 3) for v in ("plain", "shard")]
    + ["tp2-FA-mtp2-debug", "pd-tp2-nixl"],
}
GROUPS["accuracy"] = [ACC + n for n in ("tp1-plain", "tp2-plain", "tp2-shard", "tp4-plain",
                                         "tp4-shard", "pcp2-plain", "pcp2-shard",
                                         "pcp2tp2-plain", "pcp2tp2-shard", "tp2-fp8-plain",
                                         "tp2-fp8-shard", "tp2-prefix-plain", "tp2-prefix-shard",
                                         "pd-tp2-into-tp1", "pd-pcp2-into-tp2-shard")]
GROUPS["all"] = GROUPS["graphs"] + GROUPS["more"] + GROUPS["accuracy"]
# the second lease of 2026-12-03: P/D with time enough, PCP + MoE after the
# capture's padding-mask fix, the sparse pairs eager, the TP=4 floor
GROUPS["pd-shard"] = ["pd-pcp2-shard2-nixl"]
# P/D in vLLM's default mode over both transports (issues 37 and 41)
GROUPS["pd"] = [f"pd-{lay}-{tr}" for lay in ("tp2", "pcp2", "pcp2-shard2")
                for tr in ("nixl", "mooncake")] + ["pd-pcp2-shard2-nixl-dropped"]
# vLLM 0.34 (issue 38; the 0.34 payload): the
# three dense backends in graphs against TP=2 unsharded, the debug switch,
# PCP dense and sparse, MTP k=2, prefix hits, P/D over NIXL
GROUPS["v034"] = ["tp1-FA-plain"] + [f"tp2-{k}-{v}" for k in BACKENDS for v in ("plain", "shard")] + [
    "tp2-FA-debug", "tp2-FA-plain-eager", "pcp2-dense-plain", "pcp2-dense-shard",
    "pcp2-fms-plain-eager",
    "pcp2-fms-shard-eager", "tp2-FA-mtp2-plain", "tp2-FA-mtp2-shard", "tp2-prefix-plain",
    "tp2-prefix-shard", "pd-tp2-nixl"]
GROUPS["fp8"] = [f"tp{t}-{k}-fp8-{v}" for k in ("FM", "TR", "FA")
                 for t, v in ((1, "plain"), (2, "plain"), (2, "shard"), (2, "debug"))] + [
    "pd-tp2-nixl-fp8"]
GROUPS["fp8-pcp"] = [f"{x}-dense-fp8-{v}" for x, v in (
    ("tp1", "plain"), ("tp2", "plain"), ("pcp2", "plain"), ("pcp2", "shard"),
    ("pcp2", "debug"))]
# the third 0.34 lease: the FP8 debug runs after the reference's fix, the
# floor of PCP FP8, P/D FP8 with its floor measured in the run
GROUPS["fp8-again"] = ["tp2-FM-fp8-debug", "tp2-TR-fp8-debug", "pcp2-dense-fp8-debug",
                       "tp2-dense-fp8-plain", "pcp2-dense-fp8-plain", "pd-tp2-nixl-fp8"]
# 2026-12-05, 0.34: PCP=2 FP8 against unsharded PCP=2 FP8 (vLLM's own,
# eager and in graphs with the fault handler; the plugin's replicated
# layout), the floors, P/D FP8 with an unsharded prefill, the sparse PCP pair
# with the re-poisoning harness
GROUPS["fp8-pcp-ref"] = [
    "pcp2-dense-fp8-plain", "pcp2-dense-fp8-plain-eager", "pcp2-dense-fp8-base",
    "pcp2-dense-fp8-shard", "pcp2-dense-fp8-shard-eager", "tp1-dense-fp8-plain",
    "tp2-dense-fp8-plain", "pd-tp2-nixl-fp8-unsharded", "pd-tp2-nixl-fp8",
    "pcp2-fms-plain-eager", "pcp2-fms-shard-eager"]
# the second lease of 2026-12-05: PCP=2 FP8 on TRITON_MLA against vLLM's
# own, its floors; P/D FP8 from an unsharded TP=2 prefill after its replica
# rank's fix
GROUPS["fp8-pcp-tr"] = [f"{x}-dTR-fp8-plain" for x in ("tp1", "tp2", "pcp2")] + [
    "pcp2-dTR-fp8-shard", "pcp2-dTR-fp8-debug", "pd-tp2-nixl-fp8-unsharded",
    "pcp2-dense-fp8-debug", "pcp2tp2-dense-plain", "pcp2tp2-dense-plain-eager",
    "pcp2tp2-fms-plain-eager"]
# the third lease of 2026-12-05: PCP x TP (issue 40), FP8 with the chunked
# context (issue 39)
GROUPS["pcp-tp"] = ["pcp2tp2-dense-plain", "pcp2tp2-dense-shard", "pcp2tp2-dense-debug",
                    "tp2-dense8-plain", "pd-pcp2tp2-nixl", "pcp2tp2-fms-plain-eager",
                    "pcp2tp2-fms-shard-eager", "tp2-FM-fp8-prefix-plain", "tp2-FM-fp8-chunk"]
GROUPS["pcp-tp-prefix"] = ["pcp2tp2-prefix-plain", "pcp2tp2-prefix-shard"]
# 2026-12-04 (second session): what issue 40 left, MTP under PCP in graphs
GROUPS["pcp-tp-more"] = [
    "pd-pcp2tp2-shard2-nixl", "pcp2tp2-mtp2-plain-eager", "pcp2tp2-mtp2-plain",
    "pcp2tp2-mtp2-shard", "pcp2tp2-mtp2-debug", "tp2-mtp2-plain",
    "pcp2-mtp2-plain", "pcp2-mtp2-shard", "pcp2-mtp2-debug", "pcp2tp2-dTR-fp8-plain",
    "pcp2tp2-dTR-fp8-shard", "pcp2tp2-dTR-fp8-debug", "tp2-dTR-fp8-plain"]
# the chunked context under PCP and PCP x TP; the default (one chunk) again
GROUPS["pcp-chunk"] = [
    "pcp2tp2-chunk", "pcp2tp2-prefix-plain", "pcp2-chunk", "pcp2-prefix-plain",
    "pcp2tp2-chunk-debug", "pcp2-chunk-debug", "pcp2tp2-dense-shard", "pcp2tp2-dense-plain",
    "tp2-dense8-plain"]
# its second lease: MTP under PCP eager without the debug switch, vLLM's own
# PCP eager, both on TRITON_MLA in graphs; FP8's TP=1 floor
GROUPS["pcp-tp-more2"] = [
    "pcp2tp2-mtp2-TR-plain", "pcp2tp2-mtp2-TR-shard", "pcp2-mtp2-TR-plain",
    "pcp2-mtp2-TR-shard", "tp2-mtp2-TR-plain", "pcp2tp2-mtp2-shard-eager",
    "pcp2-mtp2-plain-eager", "pcp2-mtp2-shard-eager", "tp1-dTR-fp8-plain"]
# the second 0.34 lease: the debug runs after the dummy-run fix, the debug
# runs of FLASHMLA and TRITON_MLA, the sparse pair, the prefix control
GROUPS["v034-debug"] = ["tp2-FA-debug", "tp2-FM-debug", "tp2-TR-debug", "pcp2-dense-debug",
                        "pcp2-fms-shard-eager", "tp2-prefix-shard"]
GROUPS["again"] = ["pd-tp2-nixl", "pcp2-moe-base", "pcp2-moe-shard", "tp4-plain-eager"] + [
    f"pcp2-{k}-{v}-eager" for k in SPARSE for v in ("plain", "shard")]


def model_dir(kind: str) -> str:
    """``moe``, ``dense`` (6 heads) and ``dense8`` (8 heads, TP=4) with GPU
    head sizes and 16K positions (prompts up to 8K); ``dsv32`` as
    gpu_vllm_checks builds it."""
    if kind == "dsv32":
        return checks.model_dir(kind)
    if kind == "recall":  # the trained model (docs/accuracy.md), committed
        return os.path.join(ROOT, "models", "recall-dsv2")
    if kind in ("mtp", "mtp-moe"):
        return tiny_model.build_mtp(os.path.join(checks.MODELS, "onegpu-" + kind),
                                    gpu_heads=True, max_positions=16384, moe=kind == "mtp-moe")
    # 64K positions: the graphs group's prompts reach 40K tokens
    return tiny_model.build(os.path.join(checks.MODELS, "onegpu64k-" + kind), gpu_heads=True,
                            moe=kind == "moe", heads=8 if kind == "dense8" else 6,
                            max_positions=65536)


COMM = ["nccl"]  # --comm: the harness's collectives


def env_for(harness: bool, extra: dict) -> dict:
    extra = dict(extra)
    package = extra.pop("CPKV_PACKAGE", None)  # another copy of vllm_cp_kv first
    env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}
    paths = [p for p in env.get("PYTHONPATH", "").split(":") if p and p != HARNESS]
    if harness:
        env["ONEGPU"] = "1"
        env["ONEGPU_COMM"] = COMM[0]
        env["CUDA_VISIBLE_DEVICES"] = "0"
        paths.insert(0, HARNESS)
    if package:
        paths.insert(0, package)
    env["PYTHONPATH"] = ":".join(paths)
    return env


def run_one(name: str, spec, out: str, timeout: float) -> dict:
    kind, args, harness, extra = spec
    t0 = time.time()
    if kind.startswith("pd"):  # "pd" (the moe model) or "pd:MODEL"
        work = os.path.join(out, name)
        # P/D runs may run at the same time: each its own side-channel ports
        # (another table's P/D runs pass their own --port, which comes later)
        mine = sorted(n for n, r in runs().items() if r[0] == "pd")
        port = 5700 + 10 * mine.index(name) if name in mine else 0
        cmd = [sys.executable, "-m", "vllm_cp_kv.tools.pd_offline",
               model_dir(kind.partition(":")[2] or "moe"), work,
               "--device", "cuda", "--gpu-mem", "0.05", "--decode-gpu-mem", "0.05",
               "--kv-bytes", KV, "--port", str(port), "--timeout", str(int(timeout) - 20),
               *args]
    else:
        cmd = [sys.executable, RUN_VLLM, model_dir(kind),
               os.path.join(out, f"{name}.json"), *BASE, *args]
    rc = checks.run_logged(cmd, env_for(harness, extra), os.path.join(out, f"{name}.log"),
                           timeout, "CMD " + " ".join(cmd) + f"\nENV {extra} harness={harness}\n")
    if kind.startswith("pd"):
        path = os.path.join(out, name, "pd_result.json")
        res = {"name": name, "rc": rc}
        if os.path.exists(path):
            with open(path) as f:
                res.update(json.load(f))
            res["drop_positions"] = extra.get("CPKV_TEST_IGNORE_POSITIONS") == "1"
        res["wall_s"] = round(time.time() - t0, 1)
        return res
    return checks.load_run(out, name, rc, wall_s=round(time.time() - t0, 1),
                           graph_capture=capture_figures(os.path.join(out, f"{name}.log")))


CAPTURE = re.compile(r"Graph capturing finished in (\d+) secs, took ([-\d.]+) GiB")


def capture_figures(log: str) -> list:
    """vLLM's own line per rank: capture seconds and graph memory (GiB, the
    device's free memory before and after, so ranks and runs that share the
    GPU blur it)."""
    if not os.path.exists(log):
        return []
    with open(log, errors="replace") as f:
        return [{"seconds": int(m[1]), "gib": float(m[2])} for m in CAPTURE.finditer(f.read())]


# -- checks -------------------------------------------------------------------
def _ok(results, name):
    r = results.get(name)
    return r if r and r.get("rc") == 0 and "tokens" in r else None


def agreement(a_tokens, a_lps, b_tokens, b_lps) -> dict:
    """Identical prompts, first differing token per prompt, the largest
    logprob difference before it."""
    first = checks.first_diffs(a_tokens, b_tokens)
    lp = max((abs(p - q) for x, y, f in zip(a_lps, b_lps, first)
              for p, q in list(zip(x, y))[: len(x) if f is None else f]), default=0.0)
    # where the two runs part, on average (an identical prompt: its length)
    reach = [len(t) if f is None else f for t, f in zip(a_tokens, first)]
    return {"identical": sum(f is None for f in first), "of": len(first),
            "first_diffs": first, "mean_first_diff": round(sum(reach) / max(len(reach), 1), 2),
            "max_logprob_diff_before_first_diff": round(lp, 4)}


def pair(out, key, results, shard, base, ranks, min_ratio, waves=False):
    s, b = _ok(results, shard), _ok(results, base)
    if not s or not b:
        out[key] = {"ok": False, "why": "a run is missing or failed",
                    "rc": [(results.get(n) or {}).get("rc") for n in (shard, base)]}
        return None
    st, sl = (s["waves"][0]["tokens"], s["waves"][0]["logprobs"]) if waves else (
        s["tokens"], s["logprobs"])
    c = {"agreement": agreement(st, sl, b["tokens"], b["logprobs"]),
         "capacity_ratio": round(s["capacity_tokens"] / b["capacity_tokens"], 3),
         "debug_invariants_hold": s["debug_invariants_hold"], "backends": s.get("backends"),
         "prompt_lens": s["prompt_lens"]}
    c["same_tokens"] = c["agreement"]["identical"] == c["agreement"]["of"]
    stats = [x for x in (s.get("stats") or []) if x]
    if stats:  # debug: the merged decode and vLLM's kernel against float32
        c["decode_error_vs_float32"] = {
            "sharded": max(x.get("debug_decode_err_max", 0.0) for x in stats),
            "vllm_kernel_same_view": max((x.get("debug_unsharded_err_max") or 0.0)
                                         for x in stats),
            "checks_per_rank": [x.get("debug_decode_checks") for x in stats]}
    ok = c["capacity_ratio"] >= min_ratio and c["debug_invariants_hold"]
    if "written" in s:
        if any(w == checks.INDEXER_ROW for layers in s["written"] for w, _, _ in layers):
            c["owned_writes_ok"] = checks.sparse_writes(s, c, ranks)
        else:
            want = checks.owned_rows(s["prompt_lens"], len(s["tokens"][0]), s["block_size"],
                                     ranks)
            got = [sorted(set(layers)) for layers in s["written_rows"]]
            # vLLM hands a finished request's last, partly filled block
            # (uncached: the front of the free queue) to a later request, and
            # a reused row counts once: with more prompts than --max-num-seqs
            # the count falls short of the sum (10 prompts, 8 at a time, block
            # 64: the first 8 requests' last blocks, 415 and 86 rows, exactly),
            # by at most the rows of every request's last block on the rank.
            # The exact check per step is the debug run's (owned slots).
            slack = last_block_rows(s["prompt_lens"], len(s["tokens"][0]), s["block_size"],
                                    ranks)
            c["owned_writes_ok"] = all(len(g) == 1 and w - m <= g[0] <= w
                                       for g, w, m in zip(got, want, slack))
            c.update(written_rows=got, owned_rows_expected=want,
                     rows_reused=[w - g[-1] if g else None for g, w in zip(got, want)])
        ok = ok and c["owned_writes_ok"]
    c["ok_capacity_writes_debug"] = ok
    out[key] = c
    return c


def last_block_rows(prompt_lens, new_tokens, block_size, ranks) -> list[int]:
    """Per rank: the rows it holds of every request's last scheduler block
    (``block_size`` x ``ranks`` tokens, ``block_size`` on each rank in turn),
    the most that vLLM's reuse of such blocks can hide from the count."""
    out = [0] * ranks
    span = block_size * ranks
    for p in prompt_lens:
        n = p + new_tokens - 1  # the last token is never fed back
        start = (n - 1) // span * span
        for r in range(ranks):
            out[r] += min(max(n - start - r * block_size, 0), block_size)
    return out


def floor_of(*agreements) -> dict | None:
    """The noise floor: the lesser agreement of two unsharded layouts (bf16
    near-ties of random weights flip between any two reduction orders)."""
    got = [a for a in agreements if a]
    return min(got, key=lambda a: a["mean_first_diff"]) if got else None


FLOOR_SHARE = 0.7


def within_floor(a: dict, floor: dict | None) -> bool:
    """The pair parts on average no earlier than 70% of where the floor's
    two unsharded layouts part (or has as many identical prompts). The
    failure this guards against, a stale captured decode, parts at once:
    the code before the fix, on this matrix (h200x1-2026-12-03-graphs), at
    1.9 tokens of 24 on average against the floor's 6.7 (0.28 of it)."""
    if floor is None:
        return False
    return (a["mean_first_diff"] >= FLOOR_SHARE * floor["mean_first_diff"]
            or a["identical"] >= max(floor["identical"], 1))


def same_rows(results, x: str, y: str) -> bool:
    """Both runs wrote the same number of KV rows per rank and layer."""
    a, b = _ok(results, x), _ok(results, y)
    return bool(a and b and a.get("written_rows") and
                a.get("written_rows") == b.get("written_rows"))


def agree(results, x: str, y: str, waves: bool = False) -> dict | None:
    a, b = _ok(results, x), _ok(results, y)
    if not a or not b:
        return None
    if waves:
        a, b = a["waves"][0], b["waves"][0]
    return agreement(a["tokens"], a["logprobs"], b["tokens"], b["logprobs"])


def compare(results) -> dict:
    out = {}
    # the noise floor of two unsharded layouts: TP=2 vs TP=1, graphs vs eager
    floor_tp1 = agree(results, "tp2-FA-plain", "tp1-FA-plain")
    floor_eager = agree(results, "tp2-FA-plain", "tp2-FA-plain-eager")
    floor = floor_of(floor_tp1, floor_eager)
    out["noise-floor"] = {"ok": floor is not None, "tp2_vs_tp1_graphs": floor_tp1,
                          "tp2_graphs_vs_eager_unsharded": floor_eager}
    for k, b in BACKENDS.items():
        for mode, run in (("graphs", f"tp2-{k}-shard"), ("full-decode-only", f"tp2-{k}-fdo"),
                          ("eager-debug", f"tp2-{k}-debug")):
            base = "tp2-FA-plain-eager" if (k, mode) == ("FA", "eager-debug") \
                else f"tp2-{k}-plain"
            c = pair(out, f"tp2-{b}-{mode}", results, run, base, 2, 1.95)
            if not c:
                continue
            c["within_noise_floor"] = within_floor(c["agreement"], floor)
            if mode != "eager-debug":  # the captured decode against the eager one
                c["vs_sharded_eager"] = agree(results, run, f"tp2-{k}-debug")
                c["same_rows_written_as_eager"] = same_rows(results, run, f"tp2-{k}-debug")
            err = c.get("decode_error_vs_float32") or {}
            c["ok"] = c["capacity_ratio"] >= 1.95 and c["within_noise_floor"] and (
                c["debug_invariants_hold"] and 0 < err.get("sharded", 0)
                <= 2 * err.get("vllm_kernel_same_view", 0) if mode == "eager-debug"
                else c["same_rows_written_as_eager"])
    old = agree(results, "tp2-FA-old", "tp2-FA-plain")
    if old:  # the negative control: before the fix, graphs answer wrong at once
        run = _ok(results, "tp2-FA-old")
        # degenerate: from the fourth token on one token repeated to the end
        stuck = sum(len(set(t[3:])) == 1 for t in run["tokens"])
        early = sum(f is not None and f <= 4 for f in old["first_diffs"])
        out["negative-control-old-code-graphs"] = {
            "agreement": old, "prompts_wrong_by_token_4": early,
            "prompts_one_token_repeated": stuck,
            "ok": old["identical"] == 0 and early == len(old["first_diffs"])
            and not within_floor(old, floor)}
    c = pair(out, "tp4", results, "tp4-shard", "tp4-plain", 4, 3.9)
    if c:
        c["ok"] = c["ok_capacity_writes_debug"] or (c["capacity_ratio"] >= 3.9
                                                    and c.get("owned_writes_ok", True))
    for key, shard, base in (("pcp2-dense", "pcp2-dense-shard", "pcp2-dense-plain"),
                             ("pcp2-dense-eager-debug", "pcp2-dense-debug", "pcp2-dense-plain"),
                             ("pcp2-moe", "pcp2-moe-shard", "pcp2-moe-base"),
                             *((f"pcp2-sparse-{k}-eager", f"pcp2-{k}-shard-eager",
                                f"pcp2-{k}-plain-eager") for k in SPARSE)):
        # sparse models reserve the whole view (docs/sparse.md): 1.94x at most
        c = pair(out, key, results, shard, base, 2, 1.9 if "sparse" in key else 1.95)
        if c:
            c["ok"] = c["capacity_ratio"] >= (1.9 if "sparse" in key else 1.95) and \
                c.get("owned_writes_ok", True) and (
                    c["debug_invariants_hold"] or "debug" not in key and "sparse" not in key)
    c = out.get("tp4")
    if c and "agreement" in c:  # the floor of TP=4: graphs against eager, unsharded
        c["floor_tp4_graphs_vs_eager"] = agree(results, "tp4-plain", "tp4-plain-eager")
        c["within_noise_floor"] = within_floor(c["agreement"], c["floor_tp4_graphs_vs_eager"])
        c["ok"] = c["ok"] and c["within_noise_floor"]
    # the PCP MoE mask against an independent reference: the same model TP=1
    ref = agree(results, "pcp2-moe-base", "tp1-moe-plain")
    shard = agree(results, "pcp2-moe-shard", "tp1-moe-plain")
    if ref and shard:  # both PCP layouts against the same independent run
        out["pcp2-moe-mask-vs-tp1"] = {
            "base_vs_tp1": ref, "sharded_vs_tp1": shard,
            "ok": within_floor(ref, floor) and within_floor(shard, ref)}
        c = out.get("pcp2-moe")
        if c and "agreement" in c:
            c["within_noise_floor"] = within_floor(c["agreement"], ref)
            c["ok"] = c["ok"] and c["within_noise_floor"]
    prefix_check(out, results)
    chunk_check(out, results)
    c = pair(out, "tp2-FLASH_ATTN_MLA-materialize", results, "tp2-FA-mat", "tp2-FA-plain",
             2, 1.95)
    if c:  # the materializing decode reserves the whole view: below 1.95x
        c["within_noise_floor"] = within_floor(c["agreement"], floor)
        c["ok"] = c["capacity_ratio"] >= 1.8 and c["within_noise_floor"]
    mtp_check(out, results)
    fp8_check(out, results)
    pcp_tp_check(out, results)
    pd_checks(out, results)
    timing_check(out, results)
    accuracy_verdicts(out, results)
    return out


def pcp_tp_check(out, results) -> None:
    """PCP=2 x TP=2 (issue 40): sharded over all 4 ranks against vLLM's own
    PCP=2 x TP=2, within the floor of two unsharded layouts (PCP=2 x TP=2
    against TP=2), capacity >= 3.9x, owned writes; the eager debug run; the
    sparse pair (eager, debug); decode bytes per step from the statistics."""
    floor = agree(results, "pcp2tp2-dense-plain", "tp2-dense8-plain")
    c = pair(out, "pcp2tp2-dense", results, "pcp2tp2-dense-shard", "pcp2tp2-dense-plain",
             4, 3.9)
    if c:
        c["floor_pcp2tp2_vs_tp2"] = floor
        c["vs_tp2_unsharded"] = agree(results, "pcp2tp2-dense-shard", "tp2-dense8-plain")
        c["within_noise_floor"] = within_floor(c["agreement"], floor)
        stats = [x for x in (_ok(results, "pcp2tp2-dense-shard").get("stats") or []) if x]
        # per step (from the batch's shapes): rows x a per-row figure, the
        # same whatever the context (1 to 8,000 tokens here)
        steps = [x.get("decode_step_bytes") or [] for x in stats]
        c["decode_step_bytes_rank0"] = steps[0] if steps else None
        c["decode_step_bytes_distinct"] = sorted({b for x in steps for b in x})
        c["ok"] = (c["capacity_ratio"] >= 3.9 and c["within_noise_floor"]
                   and c.get("owned_writes_ok", False))
    d = pair(out, "pcp2tp2-dense-eager-debug", results, "pcp2tp2-dense-debug",
             "pcp2tp2-dense-plain", 4, 3.9)
    if d:
        d["ok"] = d["ok_capacity_writes_debug"]
    e = pair(out, "pcp2tp2-sparse-fms-eager", results, "pcp2tp2-fms-shard-eager",
             "pcp2tp2-fms-plain-eager", 4, 3.9)
    if e:
        e["floor_pcp2tp2_vs_pcp2"] = agree(results, "pcp2tp2-fms-plain-eager",
                                           "pcp2-fms-plain-eager")
        e["ok"] = e["ok_capacity_writes_debug"] and (
            e["same_tokens"] or within_floor(e["agreement"], e["floor_pcp2tp2_vs_pcp2"]))


def fp8_check(out, results) -> None:
    """FP8 KV (issue 39): TP=2 sharded FP8 against TP=2 unsharded FP8 on the
    same backend, within the floor of two unsharded FP8 layouts (TP=2 vs
    TP=1: FP8 flips near-ties against bf16, so FP8 is compared with FP8)."""
    for k, b in BACKENDS.items():
        fp8_pair(out, f"tp2-{b}-fp8", results, f"tp2-{k}-fp8", f"tp2-{k}-fp8-plain",
                 agree(results, f"tp2-{k}-fp8-plain", f"tp1-{k}-fp8-plain"))
    # PCP=2: vLLM 0.34's own PCP=2 with FP8 (pcp2-dense-fp8-plain) lost a
    # worker at its warmup on the H200, so the sharded run is held against
    # TP=1 unsharded FP8 (either holds one copy in a rank's KV memory), within
    # the floor of TP=2 against TP=1 (unsharded)
    base = "pcp2-dense-fp8-plain" if _ok(results, "pcp2-dense-fp8-plain") \
        else "tp1-dense-fp8-plain"
    c = fp8_pair(out, "pcp2-dense-fp8", results, "pcp2-dense-fp8", base,
                 agree(results, "tp2-dense-fp8-plain", "tp1-dense-fp8-plain"))
    if c:
        c["base"] = base
    # TRITON_MLA, where vLLM's own PCP=2 runs with FP8: sharded against it,
    # within the floor of TP=2 against TP=1 (both unsharded FP8); the floor
    # of PCP=2 against TP=1 (unsharded) shows what PCP's own prefill does
    c = fp8_pair(out, "pcp2-dense-TRITON_MLA-fp8", results, "pcp2-dTR-fp8",
                 "pcp2-dTR-fp8-plain", agree(results, "tp2-dTR-fp8-plain", "tp1-dTR-fp8-plain"))
    if c:
        c["floor_fp8_pcp2_vs_tp1"] = agree(results, "pcp2-dTR-fp8-plain", "tp1-dTR-fp8-plain")
    # PCP=2 x TP=2 (TRITON_MLA): against vLLM's own, within the floor of
    # TP=2 against TP=1 (both unsharded FP8; vLLM's own PCP x TP parts from
    # TP=2 early, as PCP's prefill reads through FP8)
    c = fp8_pair(out, "pcp2tp2-dense-TRITON_MLA-fp8", results, "pcp2tp2-dTR-fp8",
                 "pcp2tp2-dTR-fp8-plain",
                 agree(results, "tp2-dTR-fp8-plain", "tp1-dTR-fp8-plain"), ranks=4)
    if c:
        c["floor_fp8_pcp2tp2_vs_tp2"] = agree(results, "pcp2tp2-dTR-fp8-plain",
                                              "tp2-dTR-fp8-plain")
    # P/D with FP8: the decode recomputes the last prompt token over the FP8
    # cache (vLLM's P/D), where one instance's first token came from a prefill
    # attending unquantized; so P/D with an unsharded prefill is the floor the
    # sharded prefill's P/D is held to: as close to the one instance
    pds = [_ok_pd(results, n) for n in ("pd-tp2-nixl-fp8", "pd-tp2-nixl-fp8-unsharded")]
    if all(pds):
        same = sum(x == y for x, y in zip(pds[0]["decode_tokens"], pds[1]["decode_tokens"]))
        reach = [pd_reach(x) for x in pds]
        out["pd-tp2-nixl-fp8-vs-unsharded-prefill"] = {
            "ok": None not in reach and reach[0] >= FLOOR_SHARE * reach[1],
            "reach_sharded_prefill": reach[0], "reach_unsharded_prefill": reach[1],
            "first_diff_sharded_prefill": pds[0].get("first_diff"),
            "first_diff_unsharded_prefill": pds[1].get("first_diff"),
            "identical_decodes": same, "of": len(pds[0]["decode_tokens"])}


def _ok_pd(results, name):
    r = results.get(name)
    return r if r and r.get("decode_tokens") else None


def least_ratio(ranks: int) -> float:
    """The capacity a sharded run must reach over its unsharded one: 1.95x
    a pair of ranks (the scratch and rounding take the rest)."""
    return 1.95 * ranks / 2


def fp8_pair(out, key, results, run, base, floor, ranks=2) -> dict | None:
    """``run``-shard against ``base`` within ``floor``, and ``run``-debug's
    verdict (invariants held, capacity, owned writes)."""
    least = least_ratio(ranks)
    c = pair(out, key, results, f"{run}-shard", base, ranks, least)
    if c:
        c["floor_fp8_tp2_vs_tp1"] = floor
        c["within_noise_floor"] = within_floor(c["agreement"], floor)
        c["ok"] = c["capacity_ratio"] >= least and c["within_noise_floor"] and \
            c.get("owned_writes_ok", True)
    d = pair(out, f"{key}-eager-debug", results, f"{run}-debug", base, ranks, least)
    if d:
        d["ok"] = d["ok_capacity_writes_debug"]
    return c


def prefix_check(out, results) -> None:
    """Prefix hits (wave 2), the corrupted owned block changing wave 3: TP=2
    and PCP=2 x TP=2 (issue 40)."""
    for lay in ("tp2", "pcp2tp2"):
        s, b = _ok(results, f"{lay}-prefix-shard"), _ok(results, f"{lay}-prefix-plain")
        if not (s and b):
            continue
        same = [agreement(x["tokens"], x["logprobs"], y["tokens"], y["logprobs"])
                for x, y in zip(s["waves"][:2], b["waves"][:2])]
        hits = [w.get("prefix_cache_hits") for w in s["waves"]]
        facts = hits[0] == 0 and hits[1] > 0 and s["waves"][2]["tokens"] != s["waves"][1]["tokens"]
        out[f"prefix-{lay}"] = {
            "ok": facts, "prefix_ok": facts,
            "agreement_per_wave": same, "hits_sharded": hits,
            "hits_unsharded": [w.get("prefix_cache_hits") for w in b["waves"]],
            "corruption_changed_wave3": s["waves"][2]["tokens"] != s["waves"][1]["tokens"],
            "capacity_ratio": round(s["capacity_tokens"] / b["capacity_tokens"], 3)}


def chunk_check(out, results) -> None:
    """The chunked context: wave 2 read in several chunks on both ranks,
    hits, the corrupted block changed wave 3; the prefetch gives the same
    tokens as without it."""
    chunked = _ok(results, "tp2-FA-chunk")
    for name, base in (("tp2-FA-chunk", "tp2-prefix-plain"),
                       ("tp2-FA-chunk-prefetch", "tp2-prefix-plain"),
                       ("tp2-FM-fp8-chunk", "tp2-FM-fp8-prefix-plain"),  # FP8 (issue 39)
                       ("pcp2-chunk", "pcp2-prefix-plain"),  # PCP and PCP x TP
                       ("pcp2tp2-chunk", "pcp2tp2-prefix-plain"),
                       ("pcp2-chunk-debug", "pcp2-prefix-plain"),
                       ("pcp2tp2-chunk-debug", "pcp2tp2-prefix-plain")):
        run, plain = _ok(results, name), _ok(results, base)
        if not run:
            continue
        stats = [x for x in run["waves"][1]["stats"] if x]
        hits = [w.get("prefix_cache_hits") for w in run["waves"]]
        ranks = 4 if name.startswith("pcp2tp2") else 2
        debug = name.endswith("-debug")  # two waves, no corruption: the invariants
        c = out[f"chunk-{name}"] = {
            "chunks_wave2": [x["max_context_chunks"] for x in stats],
            "chunked_steps_wave2": [x["chunked_context_steps"] for x in stats],
            "hits": hits,
            "corruption_changed_wave3": None if debug else
            run["waves"][2]["tokens"] != run["waves"][1]["tokens"]}
        if plain:
            c["agreement_vs_unsharded"] = [
                agreement(x["tokens"], x["logprobs"], y["tokens"], y["logprobs"])
                for x, y in zip(run["waves"][:2], plain["waves"][:2])]
        c["ok"] = (len(stats) == ranks and min(c["chunks_wave2"]) > 1 and hits[1] > 0
                   and (c["corruption_changed_wave3"] or debug))
        if debug:
            c["debug_invariants_hold"] = run.get("debug_invariants_hold")
            c["ok"] = c["ok"] and bool(run.get("debug_invariants_hold"))
        if "prefetch" in name and chunked:  # the same gathers, ahead: the same tokens
            c["same_tokens_as_without_prefetch"] = [
                x["tokens"] == y["tokens"] for x, y in zip(run["waves"], chunked["waves"])]
            c["ok"] = c["ok"] and all(c["same_tokens_as_without_prefetch"])


def mtp_check(out, results) -> None:
    """MTP on the V2 runner with graphs: sharded vs unsharded with the same
    draft count, verification rows through the shard-aware decode; tokens
    and vLLM's spec-decode counters side by side (bf16); the eager debug run."""
    for n in (1, 2, 3):
        s, p = _ok(results, f"tp2-FA-mtp{n}-shard"), _ok(results, f"tp2-FA-mtp{n}-plain")
        if not s:
            continue
        stats = [x for x in s.get("stats") or [] if x]
        sd, pd = s.get("spec_decode") or {}, (p or {}).get("spec_decode") or {}
        c = out[f"mtp{n}-tp2-FLASH_ATTN_MLA"] = {
            "spec_decode_sharded": sd, "spec_decode_unsharded": pd,
            "multi_query_decode_steps": [x.get("multi_query_decode_steps") for x in stats],
            "capacity_ratio": round(s["capacity_tokens"] / p["capacity_tokens"], 3)
            if p else None}
        if p:
            c["agreement"] = agreement(s["tokens"], s["logprobs"], p["tokens"], p["logprobs"])
            c["accepted_difference"] = abs(sd.get("spec_decode_num_accepted_tokens", 0)
                                           - pd.get("spec_decode_num_accepted_tokens", 0))
        c["ok"] = bool(stats and all((m or 0) > 0 for m in c["multi_query_decode_steps"])
                       and p and sd.get("spec_decode_num_drafts", 0) > 0
                       and c["capacity_ratio"] >= 1.9)
    # under PCP=2 x TP=2 and PCP=2 (TP 1), k=2: sharded against vLLM's own
    # layout, within the floor of vLLM's own against TP=2 (both unsharded):
    # in graphs (FLASH_ATTN_MLA, the default, and TRITON_MLA) and eager;
    # the eager debug run's invariants
    for lay, ranks in (("pcp2tp2", 4), ("pcp2", 2)):
        mtp_pair(out, f"mtp2-{lay}-eager", results, f"{lay}-mtp2-shard-eager",
                 f"{lay}-mtp2-plain-eager", "tp2-mtp2-plain", ranks)
        # in graphs vLLM's own fails (why the plugin refuses it, row
        # spec-pcp-graphs): the check holds while it does
        for be, run in (("FLASH_ATTN_MLA", "mtp2"), ("TRITON_MLA", "mtp2-TR")):
            names = [f"{lay}-{run}-{v}" for v in ("plain", "shard")]
            if not all(n in results for n in names):
                continue
            own = results[names[0]]
            errors = worker_errors(names[0])
            drafts = (own.get("spec_decode") or {})
            out[f"mtp2-{lay}-graphs-{be}-vllm-own-fails"] = {
                "ok": own.get("rc") != 0 or bool(errors),
                "rc_vllm_own": own.get("rc"), "rc_sharded": results[names[1]].get("rc"),
                "vllm_own_worker_errors": errors, "vllm_own_spec_decode": drafts or None}
        d = pair(out, f"mtp2-{lay}-eager-debug", results, f"{lay}-mtp2-debug",
                 f"{lay}-mtp2-plain-eager", ranks, least_ratio(ranks))
        if d:
            run = _ok(results, f"{lay}-mtp2-debug")
            d["owned_writes_ok"] = mtp_rows_ok(d, run)
            d["ok"] = (d["capacity_ratio"] >= least_ratio(ranks) and d["debug_invariants_hold"]
                       and d["owned_writes_ok"])
            d["spec_decode"] = run.get("spec_decode")
    d = _ok(results, "tp2-FA-mtp2-debug")
    if d:
        out["mtp2-tp2-eager-debug"] = {"ok": d["debug_invariants_hold"],
                                       "spec_decode": d.get("spec_decode"),
                                       "vs_graphs": agree(results, "tp2-FA-mtp2-debug",
                                                          "tp2-FA-mtp2-shard")}


def worker_errors(name: str) -> list[str]:
    """The distinct error lines of a run's workers (its log)."""
    path = os.path.join(checks.OUT_DIR[0] or "", f"{name}.log")
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        lines = {re.sub(r"^\(.*?\) ERROR \S+ \S+ \[.*?\] ", "", x).strip() for x in f
                 if re.search(r"(Error|error):", x) and "ERROR" in x}
    return sorted(x for x in lines if x and not x.startswith(("File ", "Traceback")))[:4]


def mtp_rows_ok(c, run, k: int = 2) -> bool:
    """Rows written per rank with MTP (k drafts): the owned rows of every
    prompt and generated token, and at most k more a request (its last
    step's drafts, written past the tokens kept; the exact check per step
    is the debug run's). ``pair``'s exact count does not hold with drafts."""
    got, want = c.get("written_rows"), c.get("owned_rows_expected")
    if not got or not want:
        return False
    extra = [g[0] - w if len(g) == 1 else -1 for g, w in zip(got, want)]
    c["rows_past_the_kept_tokens"] = extra
    return all(0 <= e <= k * len(run["prompt_lens"]) for e in extra)


def mtp_pair(out, key, results, shard, base, tp2, ranks) -> None:
    """MTP: ``shard`` against vLLM's own ``base`` within the floor of
    ``base`` against ``tp2``; verification rows through the shard-aware
    decode, drafts made, vLLM's spec-decode counters side by side."""
    c = pair(out, key, results, shard, base, ranks, least_ratio(ranks))
    if not c:
        return
    s, p = _ok(results, shard), _ok(results, base)
    stats = [x for x in s.get("stats") or [] if x]
    floor = agree(results, base, tp2)
    c.update(floor_vs_tp2=floor, within_noise_floor=within_floor(c["agreement"], floor),
             spec_decode_sharded=s.get("spec_decode"), spec_decode_unsharded=p.get("spec_decode"),
             multi_query_decode_steps=[x.get("multi_query_decode_steps") for x in stats])
    c["owned_writes_ok"] = mtp_rows_ok(c, s)
    c["ok"] = (c["capacity_ratio"] >= least_ratio(ranks) and c["owned_writes_ok"]
               and c["within_noise_floor"] and bool(stats)
               and all((m or 0) > 0 for m in c["multi_query_decode_steps"])
               and (s.get("spec_decode") or {}).get("spec_decode_num_drafts", 0) > 0)


def timing_check(out, results) -> None:
    """Decode step time (8 requests at 2,000 tokens): graphs against eager,
    sharded against unsharded. On this harness every collective crosses
    NCCL's socket transport between processes that share one GPU (about
    5 ms each), which dominates a step and hides what graphs save in
    launches."""
    t = {n: (_ok(results, n) or {}).get("decode_step") for n in (
        "tp2-FA-plain", "tp2-FA-plain-eager", "tp2-FA-shard", "tp2-FA-shard-eager")}
    if not all(t.values()):
        return
    ms = {n: round(1000 * v["seconds_per_step"], 2) for n, v in t.items()}
    out["decode-step-time"] = {
        "ok": True, "ms_per_step": ms,
        "graphs_over_eager_unsharded": round(ms["tp2-FA-plain"] / ms["tp2-FA-plain-eager"], 3),
        "graphs_over_eager_sharded": round(ms["tp2-FA-shard"] / ms["tp2-FA-shard-eager"], 3),
        "sharded_over_unsharded_graphs": round(ms["tp2-FA-shard"] / ms["tp2-FA-plain"], 3),
        "capture": {n: (results.get(n) or {}).get("graph_capture") for n in t}}


# The noise floor of two unsharded bf16 layouts, from the matrix of
# 2026-12-03 (h200x1-2026-12-03-graphs, check noise-floor: TP=2 graphs
# against TP=2 eager, unsharded, 24 tokens): where the two part on average,
# as a share of the tokens generated. A P/D run compares a TP=2 or PCP=2
# prefill with one instance: bf16 near-ties flip there as between any two
# layouts, so its tokens are held to this floor, not to identity.
PD_FLOOR_SHARE = 6.7 / 24


def pd_reach(pd, key="first_diff") -> float | None:
    """Where the P/D tokens part from the one instance, on average, as a
    share of the tokens generated (an identical prompt counts in full);
    ``key="floor_first_diff"``: where the prefill's layout, unsharded, parts
    from it (``pd_offline --floor``)."""
    from vllm_cp_kv.tools.pd_offline import MAX_TOKENS  # runs before it was recorded

    diffs, n = pd.get(key), pd.get("max_tokens") or MAX_TOKENS
    if not diffs or not n:
        return None
    return round(sum(n if f is None else f for f in diffs) / (len(diffs) * n), 3)


def pd_checks(out, results):
    """Per run: the transport facts exact (every prompt token received, bytes
    as the manifests say, caches empty after) and the tokens within the
    floor of the one instance. Per layout: NIXL and Mooncake give the same
    tokens (the same bytes arrived). The dropped-positions control parts from
    its layout's real run, and earlier."""
    for name, pd in results.items():
        if not name.startswith("pd-") or not pd or name.endswith("-dropped"):
            continue
        facts = {k: v for k, v in (pd.get("checks") or {}).items() if k != "identical_tokens"}
        reach = pd_reach(pd)
        # the floor measured in the run (--floor: two unsharded layouts on
        # these prompts), else the bf16 one measured once
        measured = pd_reach(pd, "floor_first_diff")
        floor_reach = FLOOR_SHARE * (PD_FLOOR_SHARE if measured is None else measured)
        asked = "floor_rc" in pd  # --floor: no floor measured is a failure
        out[name] = {
            "transport_ok": bool(facts) and all(facts.values()),
            "ok": bool(facts) and all(facts.values()) and reach is not None and (
                not asked or measured is not None) and (
                pd.get("identical") == pd.get("prompts") or reach >= floor_reach),
            "floor_rc": pd.get("floor_rc"),
            "rc": pd.get("rc"), "checks": pd.get("checks"), "identical": pd.get("identical"),
            "prompts": pd.get("prompts"), "prompt_lens": pd.get("prompt_lens"),
            "first_diff": pd.get("first_diff"), "reach": reach,
            "floor_first_diff": pd.get("floor_first_diff"), "floor_measured_reach": measured,
            "floor_reach": round(floor_reach, 3),
            "prefill_first_token_same": pd.get("prefill_first_token_same"),
            "transfer": pd.get("decode_transfer_metrics"),
            "expected_transfer_bytes": pd.get("expected_transfer_bytes")}
    for lay in ("tp2", "pcp2", "pcp2-shard2"):
        a, b = results.get(f"pd-{lay}-nixl") or {}, results.get(f"pd-{lay}-mooncake") or {}
        if a.get("decode_tokens") and b.get("decode_tokens"):
            out[f"pd-{lay}-nixl-vs-mooncake"] = {
                "ok": a["decode_tokens"] == b["decode_tokens"],
                "same_tokens": a["decode_tokens"] == b["decode_tokens"]}
    real, control = (results.get(n) or {} for n in ("pd-pcp2-shard2-nixl",
                                                    "pd-pcp2-shard2-nixl-dropped"))
    if real.get("decode_tokens") and control.get("decode_tokens"):
        changed = sum(x != y for x, y in zip(real["decode_tokens"], control["decode_tokens"]))
        out["pd-negative-control-positions-dropped"] = {
            "ok": changed > 0 and pd_reach(control) < pd_reach(real),
            "prompts_changed": changed, "of": len(real["decode_tokens"]),
            "reach": pd_reach(control), "reach_of_the_real_run": pd_reach(real),
            "first_diff": control.get("first_diff"), "prompt_lens": control.get("prompt_lens")}


def report(out_dir, results):
    # the checks of this lease's runs only (none of a pair ran: left out)
    cks = {k: c for k, c in compare(results).items() if c.get("rc") != [None, None]
           and (k != "noise-floor" or c["ok"])}
    write_json(os.path.join(out_dir, "summary.json"), {"runs": results, "checks": cks})
    plot(out_dir, cks)
    print("\ncheck | ok | figures")
    for key, c in cks.items():
        figs = {k: c[k] for k in ("capacity_ratio", "same_tokens", "rc", "why",
                                  "multi_query_decode_steps") if k in c}
        if "agreement" in c:
            figs["identical"] = f"{c['agreement']['identical']}/{c['agreement']['of']}"
        if "unsharded_tp2_vs_tp1" in c:
            u = c["unsharded_tp2_vs_tp1"]
            figs["tp2_vs_tp1_unsharded"] = f"{u['identical']}/{u['of']}"
        print(f"{key} | {c.get('ok')} | {json.dumps(figs)}")
    print("wall_s per run:", {n: r.get("wall_s") for n, r in results.items()})


def plot(out_dir, cks):
    plt = pyplot(optional=True)
    if plt is None:
        return
    items = {k: c for k, c in cks.items() if "capacity_ratio" in c}
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(range(len(items)), [c["capacity_ratio"] for c in items.values()],
           color=["tab:green" if c.get("ok") else "tab:red" for c in items.values()])
    ax.set_xticks(range(len(items)), list(items), rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("KV capacity, sharded / unsharded")
    ax.set_title("one H200, ranks on NCCL, CUDA graphs (green: every check holds)", fontsize=9)
    save_figure(fig, os.path.join(out_dir, "onegpu.png"), dpi=120)


def against(out: str, old: str) -> dict:
    """Each run of ``out`` against the same run in ``old`` (a re-run after a
    change that must not change behaviour): tokens of every wave, the shard
    statistics' step counts and bytes, prefix-cache hits, P/D identity.
    Writes OUT_DIR/against.json."""
    keys = ("prefill_steps", "decode_steps", "prefill_bytes", "decode_bytes", "")

    def load(folder, name):
        path = os.path.join(folder, name + ".json")
        if not os.path.exists(path):  # P/D runs keep their result in a folder
            path = os.path.join(folder, name, "pd_result.json")
        with open(path) as f:
            return json.load(f)

    def facts(r):
        waves = r["waves"] if isinstance(r.get("waves"), list) else [r]
        per_wave = [w["stats"] for w in waves if w.get("stats")]
        # runs with per-wave statistics: their sums are the run's totals
        totals = [{k: sum(wave[i][k] for wave in per_wave) for k in keys[:-1]}
                  for i in range(len(per_wave[0]))] if len(per_wave) == len(waves) > 1 \
            else [{k: s.get(k) for k in keys[:-1]} for s in r.get("stats") or []]
        return {"tokens": [w.get("tokens") for w in waves],
                "hits": [w.get("prefix_cache_hits") for w in waves],
                "stats": totals, "identical": r.get("identical")}

    with open(os.path.join(out, "summary.json")) as f:
        names = sorted(json.load(f)["runs"])
    report = {}
    for name in names:
        new, ref = facts(load(out, name)), facts(load(old, name))
        stats_known = bool(ref["stats"])  # older runs of some kinds kept none
        report[name] = {"same_tokens": new["tokens"] == ref["tokens"],
                        "same_hits": new["hits"] == ref["hits"],
                        "same_stats": new["stats"] == ref["stats"] if stats_known else None,
                        "same_identity": new["identical"] == ref["identical"],
                        "stats": new["stats"][:1]}
        print(name, {k: v for k, v in report[name].items() if k != "stats"})
    write_json(os.path.join(out, "against.json"), {"old": old, "runs": report})
    return report


def matrix_arguments(timeout: float) -> argparse.ArgumentParser:
    """The arguments of a matrix of runs (this one and gpu_sparse.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--runs", default="all")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--parallel", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=timeout)
    ap.add_argument("--summarize", action="store_true")
    return ap


def main() -> None:
    ap = matrix_arguments(timeout=240)
    ap.add_argument("--comm", default="nccl", choices=["nccl", "gloo", "shm"],
                    help="the harness's collectives (gloo and shm: eager runs only)")
    ap.add_argument("--against", help="compare with the same runs in this folder")
    a = ap.parse_args()
    if a.against:
        return against(a.out, a.against)
    COMM[0] = a.comm
    checks.OUT_DIR[0] = a.out
    result_dir(a.out)
    path = os.path.join(a.out, "summary.json")
    results = {}
    if os.path.exists(path):  # earlier calls of the lease
        with open(path) as f:
            results = json.load(f)["runs"]
    if a.summarize:  # P/D runs: their folder's pd_result.json, which a run cut
        for name in results:  # short after every role finished gets from pd_offline
            path = os.path.join(a.out, name, "pd_result.json")  # --summarize
            if name.startswith("pd-") and os.path.exists(path):
                with open(path) as f:
                    results[name] = {**results[name], **json.load(f), "name": name}
        return report(a.out, results)
    table = runs()
    names = [n for part in a.runs.split(",") for n in GROUPS.get(part, [part])]
    for kind in {table[n][0] for n in names}:  # build the models before the clock runs
        model_dir(kind.partition(":")[2] or "moe" if kind.startswith("pd") else kind)
    run_table(table, names, a, results, path)
    report(a.out, results)


def run_table(table: dict, names: list, a, results: dict, path: str) -> None:
    """Run ``names`` of ``table``, ``a.parallel`` at a time, each stopped by
    ``a.timeout`` or the budget left of ``a.budget_s``; ``results`` (and
    ``path``) updated after each."""
    start = time.time()

    def go(name):
        left = a.budget_s - (time.time() - start)
        if left < 90:
            return name, {"name": name, "rc": "skipped (budget)"}
        res = run_one(name, table[name], a.out, min(a.timeout, left - 10))
        print(f"{name}: rc={res['rc']} {res['wall_s']} s", flush=True)
        return name, res

    with ThreadPoolExecutor(a.parallel) as pool:
        for name, res in pool.map(go, names):
            if res["rc"] == "skipped (budget)" and name in results:
                continue  # an earlier call's result stays
            results[name] = res
            write_json(path, {"runs": results})


if __name__ == "__main__":
    main()
