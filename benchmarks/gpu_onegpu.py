"""Every multi-rank GPU path of cp_kv in real vLLM 0.32 on ONE GPU: the
one-GPU harness (scripts/gpu/onegpu: gloo collectives, every rank on GPU 0,
eager only), several runs at a time.

Usage (on the GPU machine, after ``source scripts/gpu/setup_device.sh``):
    python benchmarks/gpu_onegpu.py OUT_DIR [--runs GROUP|NAME,...]
        [--budget-s 540] [--parallel 4]
    python benchmarks/gpu_onegpu.py OUT_DIR --summarize   (here, afterwards)
    python benchmarks/gpu_onegpu.py OUT_DIR --against OLD_DIR  (a re-run of
        runs whose references are in OLD_DIR: same tokens, statistics, hits)
GROUPs: ``tp`` (TP=2 with FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA, their
multi-token decode rows, prefix caching, TP=4), ``pcp`` (PCP=2 dense, MoE,
both sparse backends), ``pd`` (a TP=2 sharded prefill feeding a TP=1 decode
over NIXL), ``all``.

Runs go through ``harness/run_vllm.py`` (and ``vllm_cp_kv.tools.pd_offline``)
as in benchmarks/gpu_vllm_checks.py, with a fixed KV budget per rank
(``--kv-bytes``: no memory profiling, so ranks that share the GPU do not
count each other's memory) and a small ``gpu_memory_utilization``, so that
up to ``--parallel`` runs share the GPU. Sharded correctness runs have
``VLLM_CP_KV_DEBUG=1``. Writes OUT_DIR/<run>.json|.log, OUT_DIR/summary.json
(runs, checks, wall seconds), OUT_DIR/onegpu.png, and prints the checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import gpu_vllm_checks as checks  # model builders, run loading
from common import ROOT, RUN_VLLM, pyplot, result_dir, save_figure, write_json
from vllm_cp_kv.tools import tiny_model

HARNESS = os.path.join(ROOT, "scripts", "gpu", "onegpu")
KV = str(4 << 30)  # per rank: the scratch view (8 x 8,200 tokens, one layer) is < 2%
BASE = ["--gpu-mem", "0.05", "--kv-bytes", KV]
PROMPTS = "1,40,250,700,1990,3000,4000,8000"  # 1 token to 8K
GEN = ["--token-prompts", PROMPTS, "--max-model-len", "8200", "--max-tokens", "24"]
# two phases of 4 requests, contexts about 10x apart: bytes per decode step
PHASES = ["--token-prompts", "40,250,300,700;3000,4000,6000,8000", "--max-model-len",
          "8200", "--max-tokens", "24"]
WAVES = GEN + ["--suffix-len", "24"]
DEBUG = {"VLLM_CP_KV_DEBUG": "1"}
SHIM = {"CPKV_SHIM_DECODE_THRESHOLD": "64"}  # patches.py no. 8
# patches.py no. 9 (pd_hooks.py): the decode writes every pull's blocks
# without their logical positions
DROP = {"CPKV_TEST_HOOKS": "1", "CPKV_TEST_IGNORE_POSITIONS": "1"}
BACKENDS = {"FA": "FLASH_ATTN_MLA", "FM": "FLASHMLA", "TR": "TRITON_MLA"}
SPARSE = {"fas": ["--backend", "FLASH_ATTN_MLA_SPARSE"],
          "fms": ["--backend", "FLASHMLA_SPARSE", "--kv-cache-dtype", "fp8_ds_mla"]}
SPARSE_GEN = ["--prompt-repeat", "3", "--max-model-len", "4096", "--sorted-topk"]


def runs() -> dict:
    """name -> (model, args, harness on, env). ``model`` "pd" is a P/D run."""
    tp2, tp4, pcp2 = ["--tp", "2"], ["--tp", "4"], ["--tp", "1", "--pcp", "2"]
    r = {"tp1-FA-plain": ("moe", ["--tp", "1", "--no-plugin", "--backend",
                                  "FLASH_ATTN_MLA"] + GEN, False, {})}
    for k, b in BACKENDS.items():
        be = ["--backend", b]
        r[f"tp2-{k}-plain"] = ("moe", tp2 + be + GEN + ["--no-plugin"], True, {})
        r[f"tp2-{k}-shard"] = ("moe", tp2 + be + GEN + ["--shard", "--poison", "--stats"], True, DEBUG)
        # each backend's own routing kept (FLASH_ATTN_MLA: prefills <= 512
        # tokens, FLASHMLA <= 128, TRITON_MLA <= 64 by the shim): short
        # prompts and wave 2's short extensions of a cached context reach the
        # shard-aware decode as rows with several query tokens
        r[f"tp2-{k}-multi"] = ("moe", tp2 + be + WAVES + ["--shard", "--waves", "2",
                                                       "--stats"], True, {**DEBUG, **SHIM})
    # the materializing decode: the inner kernel on the full view, so the
    # same kernels per request as unsharded (bit-identical expected)
    r["tp2-FA-mat"] = ("moe", tp2 + ["--backend", "FLASH_ATTN_MLA"] + GEN + [
        "--cp-kv", '{"decode": "materialize"}'], True, DEBUG)
    r["tp2-FA-bytes"] = ("moe", tp2 + ["--backend", "FLASH_ATTN_MLA"] + PHASES
                         + ["--shard", "--stats"], True, {})
    fa = ["--backend", "FLASH_ATTN_MLA"]
    r["tp2-prefix-plain"] = ("moe", tp2 + fa + WAVES + ["--no-plugin", "--waves", "2"],
                             True, {})
    r["tp2-prefix-shard"] = ("moe", tp2 + fa + WAVES + [
        "--shard", "--waves", "3", "--poison", "--corrupt-between-waves"], True, DEBUG)
    # the bounded scratch: wave 2's hits (up to 8K tokens) read through a
    # 1,024-token workspace, chunk by chunk; rank 1's 21st block (the
    # 1,990-token prompt's tokens from 21 x 64) corrupted before wave 3
    for k, b in BACKENDS.items():
        r[f"tp2-{k}-chunk"] = ("moe", tp2 + ["--backend", b] + WAVES + [
            "--shard", "--waves", "3", "--poison", "--corrupt-between-waves",
            "--corrupt-index", "20", "--stats", "--cp-kv", '{"workspace_tokens": 1024}'],
            True, DEBUG)
    # the layer-ahead prefetch over (layer, chunk) items
    r["tp2-FA-chunk-prefetch"] = ("moe", tp2 + fa + WAVES + [
        "--shard", "--waves", "3", "--poison", "--corrupt-between-waves",
        "--corrupt-index", "20", "--stats", "--cp-kv",
        '{"workspace_tokens": 1024, "prefetch": true}'], True, DEBUG)
    r["tp2-FA-chunk-single"] = ("moe", tp2 + fa + WAVES + [
        "--shard", "--waves", "2", "--stats"], True, DEBUG)
    # DeepSeek MTP through the V2 runner's speculator (plugin.py item 15):
    # k = 2 and 3 draft tokens (a draft prefill on the target's metadata,
    # then one or two chained draft decode steps, each planned anew), and
    # k = 1 with FLASH_ATTN_MLA
    for k, b in BACKENDS.items():
        for n in (1, 2, 3) if k == "FA" else (2, 3):
            spec = ["--spec", json.dumps({"method": "mtp", "num_speculative_tokens": n})]
            r[f"tp2-{k}-mtp{n}-plain"] = ("mtp", tp2 + ["--backend", b] + GEN + spec
                                         + ["--no-plugin"], True, {})
            r[f"tp2-{k}-mtp{n}-shard"] = ("mtp", tp2 + ["--backend", b] + GEN + spec
                                         + ["--shard", "--poison", "--stats"], True, DEBUG)
    # MTP under PCP=2 (the draft prefill on the target's split, chained
    # draft steps on the whole batch on every rank), the platform's backend;
    # and k = 2 with an MoE MTP layer (DeepSeek-V3's; plain vLLM fails with
    # PCP and MoE: the plugin's fix with the replicated layout is the base)
    for n in (1, 2, 3):
        spec = ["--spec", json.dumps({"method": "mtp", "num_speculative_tokens": n})]
        r[f"pcp2-mtp{n}-plain"] = ("mtp", pcp2 + GEN + spec + ["--no-plugin"], True, {})
        r[f"pcp2-mtp{n}-shard"] = ("mtp", pcp2 + GEN + spec
                                   + ["--shard", "--poison", "--stats"], True, DEBUG)
    spec = ["--spec", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]
    r["pcp2-mtp2moe-plain"] = ("mtp-moe", pcp2 + GEN + spec
                               + ["--cp-kv", '{"kv_sharding": false}'], True, {})
    r["pcp2-mtp2moe-shard"] = ("mtp-moe", pcp2 + GEN + spec
                               + ["--shard", "--poison", "--stats"], True, DEBUG)
    # vLLM's DCP query replication (the decode skips its query all-gather):
    # the same runs as tp2-*-shard with VLLM_DCP_Q_REPLICATE=1
    for k, b in BACKENDS.items():
        r[f"tp2-{k}-qrep"] = ("moe", tp2 + ["--backend", b] + GEN + [
            "--shard", "--poison", "--stats"], True, {**DEBUG, "VLLM_DCP_Q_REPLICATE": "1"})
    r["tp4-plain"] = ("dense8", tp4 + fa + GEN + ["--no-plugin"], True, {})
    r["tp4-shard"] = ("dense8", tp4 + fa + GEN + ["--shard", "--poison", "--stats"], True, DEBUG)
    r["pcp2-dense-plain"] = ("dense", pcp2 + GEN + ["--no-plugin"], True, {})
    r["pcp2-dense-shard"] = ("dense", pcp2 + GEN + ["--shard", "--poison", "--stats"], True, DEBUG)
    # plain vLLM 0.32 fails with PCP and MoE (docs/gpu-testing.md): the
    # plugin's fix with vLLM's replicated layout is the baseline
    r["pcp2-moe-base"] = ("moe", pcp2 + GEN + ["--cp-kv", '{"kv_sharding": false}'], True, {})
    r["pcp2-moe-shard"] = ("moe", pcp2 + GEN + ["--shard", "--poison", "--stats"], True, DEBUG)
    for k, extra in SPARSE.items():
        r[f"pcp2-{k}-plain"] = ("dsv32", pcp2 + extra + SPARSE_GEN + ["--no-plugin"], True, {})
        r[f"pcp2-{k}-shard"] = ("dsv32", pcp2 + extra + SPARSE_GEN + ["--shard", "--poison", "--stats"],
                                True, DEBUG)
    r["pd-tp2-nixl"] = ("pd", ["--prefill-tp", "2", "--prefill-pcp", "1"], True, {})
    r["pd-pcp2-nixl"] = ("pd", ["--prefill-tp", "1", "--prefill-pcp", "2"], True, {})
    # negative control: the decode writes the blocks without their logical
    # positions (what a layout error looks like in the tokens)
    r["pd-pcp2-nixl-dropped"] = ("pd", ["--prefill-tp", "1", "--prefill-pcp", "2"], True,
                                 DROP)
    # float16 (8x finer rounding than bf16): fewer near-tie flips between layouts
    half = ["--dtype", "float16"]
    r["tp1-FA-plain-fp16"] = ("moe", ["--tp", "1", "--no-plugin", "--backend",
                                      "FLASH_ATTN_MLA"] + GEN + half, False, {})
    r["tp2-FA-plain-fp16"] = ("moe", tp2 + fa + GEN + half + ["--no-plugin"], True, {})
    r["tp2-FA-shard-fp16"] = ("moe", tp2 + fa + GEN + half + ["--shard", "--stats"], True, DEBUG)
    r["pd-pcp2-nixl-fp16"] = ("pd", ["--prefill-tp", "1", "--prefill-pcp", "2"] + half, True, {})
    return r


GROUPS = {
    "tp": [f"tp2-{k}-{v}" for k in BACKENDS for v in ("shard", "plain")]
    + ["tp1-FA-plain"] + [f"tp2-{k}-multi" for k in BACKENDS]
    + ["tp2-FA-bytes", "tp4-plain", "tp4-shard", "tp2-prefix-plain", "tp2-prefix-shard"],
    "pcp": ["pcp2-dense-plain", "pcp2-dense-shard", "pcp2-moe-base", "pcp2-moe-shard"]
    + [f"pcp2-{k}-{v}" for k in SPARSE for v in ("plain", "shard")],
    "pd": ["pd-tp2-nixl", "pd-pcp2-nixl"],
    # the runs whose code changed after the first lease (Triton's float32
    # LSE, the debug check against vLLM's kernel), and the materializing decode
    "again": ["pd-pcp2-nixl", "tp2-TR-shard", "tp2-FA-shard", "tp2-FM-shard", "tp2-FA-mat",
              "tp2-TR-multi", "tp2-FA-multi", "tp2-FM-multi", "tp4-shard",
              "pcp2-dense-shard", "pcp2-moe-shard"],
    "fp16": ["pd-pcp2-nixl-fp16", "pd-pcp2-nixl-dropped", "tp1-FA-plain-fp16",
             "tp2-FA-plain-fp16", "tp2-FA-shard-fp16"],
}
GROUPS["chunk"] = [f"tp2-{k}-chunk" for k in BACKENDS] + ["tp2-FA-chunk-single",
                                                            "tp2-prefix-plain",
                                                            "tp2-FA-chunk-prefetch"]
GROUPS["mtp"] = [f"tp2-{k}-mtp{n}-{v}" for k in BACKENDS for n in ((1, 2, 3) if k == "FA"
                                                                    else (2, 3))
                 for v in ("shard", "plain")]
GROUPS["pcp-mtp"] = [f"pcp2-mtp{n}{m}-{v}" for n, m in ((1, ""), (2, ""), (3, ""), (2, "moe"))
                     for v in ("shard", "plain")]
GROUPS["qrep"] = [f"tp2-{k}-{v}" for k in BACKENDS for v in ("qrep", "shard")]
GROUPS["all"] = GROUPS["tp"] + GROUPS["pd"] + GROUPS["pcp"] + GROUPS["chunk"] + GROUPS["mtp"]


def model_dir(kind: str) -> str:
    """``moe``, ``dense`` (6 heads) and ``dense8`` (8 heads, TP=4) with GPU
    head sizes and 16K positions (prompts up to 8K); ``dsv32`` as
    gpu_vllm_checks builds it."""
    if kind == "dsv32":
        return checks.model_dir(kind)
    if kind in ("mtp", "mtp-moe"):
        return tiny_model.build_mtp(os.path.join(checks.MODELS, "onegpu-" + kind),
                                    gpu_heads=True, max_positions=16384, moe=kind == "mtp-moe")
    return tiny_model.build(os.path.join(checks.MODELS, "onegpu-" + kind), gpu_heads=True,
                            moe=kind == "moe", heads=8 if kind == "dense8" else 6,
                            max_positions=16384)


def env_for(harness: bool, extra: dict) -> dict:
    env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1"}
    paths = [p for p in env.get("PYTHONPATH", "").split(":") if p and p != HARNESS]
    if harness:
        env["ONEGPU"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = "0"
        paths.insert(0, HARNESS)
    env["PYTHONPATH"] = ":".join(paths)
    return env


def run_one(name: str, spec, out: str, timeout: float) -> dict:
    kind, args, harness, extra = spec
    t0 = time.time()
    if kind == "pd":
        work = os.path.join(out, name)
        # P/D runs may run at the same time: each its own side-channel ports
        port = 5700 + 10 * sorted(n for n, r in runs().items() if r[0] == "pd").index(name)
        cmd = [sys.executable, "-m", "vllm_cp_kv.tools.pd_offline", model_dir("moe"), work,
               "--device", "cuda", "--gpu-mem", "0.05", "--decode-gpu-mem", "0.05",
               "--kv-bytes", KV, "--port", str(port), "--timeout", str(int(timeout) - 20),
               *args]
    else:
        cmd = [sys.executable, RUN_VLLM, model_dir(kind),
               os.path.join(out, f"{name}.json"), *BASE, *args]
    rc = checks.run_logged(cmd, env_for(harness, extra), os.path.join(out, f"{name}.log"),
                           timeout, "CMD " + " ".join(cmd) + f"\nENV {extra} harness={harness}\n")
    if kind == "pd":
        path = os.path.join(out, name, "pd_result.json")
        res = {"name": name, "rc": rc}
        if os.path.exists(path):
            with open(path) as f:
                res.update(json.load(f))
            res["drop_positions"] = extra.get("CPKV_TEST_IGNORE_POSITIONS") == "1"
        res["wall_s"] = round(time.time() - t0, 1)
        return res
    return checks.load_run(out, name, rc, wall_s=round(time.time() - t0, 1))


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
    return {"identical": sum(f is None for f in first), "of": len(first),
            "first_diffs": first, "max_logprob_diff_before_first_diff": round(lp, 4)}


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
            c["owned_writes_ok"] = all(g == [w] for g, w in zip(got, want))
            c.update(written_rows=got, owned_rows_expected=want)
        ok = ok and c["owned_writes_ok"]
    c["ok_capacity_writes_debug"] = ok
    out[key] = c
    return c


def close_enough(c, unsharded) -> bool:
    """bf16 near-ties: the sharded run agrees with the same layout unsharded
    at least as often as two unsharded layouts (TP=2 vs TP=1) agree, or its
    merged decode is as accurate as vLLM's own kernel on the same full view
    (both against float32 attention, from the debug check)."""
    a, e = c["agreement"], c.get("decode_error_vs_float32") or {}
    c["agreement_as_close_as_tp2_vs_tp1"] = c["same_tokens"] or bool(
        unsharded and a["identical"] >= unsharded["identical"])
    c["decode_as_accurate_as_vllm_kernel"] = bool(e.get("vllm_kernel_same_view")) and \
        e["sharded"] <= 2 * e["vllm_kernel_same_view"]
    return c["agreement_as_close_as_tp2_vs_tp1"] or c["decode_as_accurate_as_vllm_kernel"]


def compare(results) -> dict:
    out = {}
    ref1 = _ok(results, "tp1-FA-plain")
    for k, b in BACKENDS.items():
        c = pair(out, f"tp2-{b}", results, f"tp2-{k}-shard", f"tp2-{k}-plain", 2, 1.95)
        plain = _ok(results, f"tp2-{k}-plain")
        if c and plain and ref1:
            # how close two unsharded layouts agree (bf16 near-ties)
            c["unsharded_tp2_vs_tp1"] = agreement(plain["tokens"], plain["logprobs"],
                                                  ref1["tokens"], ref1["logprobs"])
        if c:
            c["ok"] = c["ok_capacity_writes_debug"] and close_enough(c, c.get(
                "unsharded_tp2_vs_tp1"))
        m = pair(out, f"tp2-{b}-multi-token-rows", results, f"tp2-{k}-multi",
                 f"tp2-{k}-plain", 2, 1.95, waves=True)
        if m:
            run = results[f"tp2-{k}-multi"]
            per_wave = [w["stats"] for w in run["waves"] if w.get("stats")]
            stats = [x for x in (run.get("stats") or []) if x]
            m["multi_query_decode_steps"] = (
                [sum(w[r]["multi_query_decode_steps"] for w in per_wave)
                 for r in range(len(per_wave[0]))] if per_wave  # run_vllm.py resets per wave
                else [x.get("multi_query_decode_steps") for x in stats])
            stats = stats or (per_wave[0] if per_wave else [])
            m["ok"] = m["ok_capacity_writes_debug"] and bool(stats) and all(
                (n or 0) > 0 for n in m["multi_query_decode_steps"]) and close_enough(
                m, (c or {}).get("unsharded_tp2_vs_tp1"))
    prefix = _ok(results, "tp2-prefix-plain")
    for k, b in BACKENDS.items():
        m, run = out.get(f"tp2-{b}-multi-token-rows"), _ok(results, f"tp2-{k}-multi")
        if m and run and prefix and b == "FLASH_ATTN_MLA":  # same prompts, waves, backend
            m["wave2_vs_unsharded"] = agreement(run["waves"][1]["tokens"],
                                                run["waves"][1]["logprobs"],
                                                prefix["waves"][1]["tokens"],
                                                prefix["waves"][1]["logprobs"])
    by = _ok(results, "tp2-FA-bytes")
    if by:
        stats = [x for x in (by.get("phases") or []) if x]
        per = [ph["stats"][0]["decode_step_bytes"][:8] for ph in by["phases"]]
        out["decode-bytes-per-step"] = {
            "ok": len(per) == 2 and per[0] == per[1] and len(per[0]) > 0,
            "phase_prompt_lens": [ph["prompt_lens"] for ph in by["phases"]],
            "rank0_bytes_first_steps": per, "phases": len(stats)}
    s, b = _ok(results, "tp2-prefix-shard"), _ok(results, "tp2-prefix-plain")
    if s and b:
        same = [agreement(x["tokens"], x["logprobs"], y["tokens"], y["logprobs"])
                for x, y in zip(s["waves"][:2], b["waves"][:2])]
        hits = [w.get("prefix_cache_hits") for w in s["waves"]]
        out["prefix-tp2"] = {
            "ok": hits[0] == 0 and hits[1] > 0 and s["debug_invariants_hold"]
            and s["waves"][2]["tokens"] != s["waves"][1]["tokens"],
            "agreement_per_wave": same, "hits_sharded": hits,
            "hits_unsharded": [w.get("prefix_cache_hits") for w in b["waves"]],
            "corruption_changed_wave3": s["waves"][2]["tokens"] != s["waves"][1]["tokens"],
            "capacity_ratio": round(s["capacity_tokens"] / b["capacity_tokens"], 3)}
    chunk_check(out, results)
    mtp_check(out, results)
    for k, b in BACKENDS.items():  # query replication against the same run without
        q, s = _ok(results, f"tp2-{k}-qrep"), _ok(results, f"tp2-{k}-shard")
        if q and s:
            stats = [x for x in q.get("stats") or [] if x]
            out[f"qrep-tp2-{b}"] = {
                "agreement_vs_gathered_queries": agreement(q["tokens"], q["logprobs"],
                                                           s["tokens"], s["logprobs"]),
                "debug_invariants_hold": q["debug_invariants_hold"],
                "decode_step_bytes": [x["decode_step_bytes"][:2] for x in stats],
                "decode_step_bytes_gathered": [x["decode_step_bytes"][:2] for x in
                                               s.get("stats") or [] if x],
                "ok": q["debug_invariants_hold"] and len(stats) == 2}
    c = pair(out, "tp4", results, "tp4-shard", "tp4-plain", 4, 3.9)
    if c:
        c["ok"] = c["ok_capacity_writes_debug"]
    for key, shard, base in (("pcp2-dense", "pcp2-dense-shard", "pcp2-dense-plain"),
                             ("pcp2-moe", "pcp2-moe-shard", "pcp2-moe-base"),
                             *((f"pcp2-sparse-{k}", f"pcp2-{k}-shard", f"pcp2-{k}-plain")
                               for k in SPARSE)):
        c = pair(out, key, results, shard, base, 2, 1.95)
        if c:
            c["ok"] = c["ok_capacity_writes_debug"]
    for name in ("pd-tp2-nixl", "pd-pcp2-nixl", "pd-pcp2-nixl-fp16", "pd-pcp2-nixl-dropped"):
        pd_check(out, name, results.get(name))
    good, bad = out.get("pd-pcp2-nixl"), out.get("pd-pcp2-nixl-dropped")
    if good and bad and good.get("first_diff") and bad.get("first_diff"):
        # negative control: without the positions more prompts go wrong at once
        bad["first_token_wrong"] = sum(f == 0 for f in bad["first_diff"])
        good["first_token_wrong"] = sum(f == 0 for f in good["first_diff"])
        bad["ok"] = bad["first_token_wrong"] > good["first_token_wrong"]
    c = pair(out, "tp2-FLASH_ATTN_MLA-fp16", results, "tp2-FA-shard-fp16", "tp2-FA-plain-fp16",
             2, 1.95)
    ref16, plain16 = _ok(results, "tp1-FA-plain-fp16"), _ok(results, "tp2-FA-plain-fp16")
    if c and ref16 and plain16:
        c["unsharded_tp2_vs_tp1"] = agreement(plain16["tokens"], plain16["logprobs"],
                                              ref16["tokens"], ref16["logprobs"])
        c["ok"] = c["ok_capacity_writes_debug"]
    c = pair(out, "tp2-FLASH_ATTN_MLA-materialize", results, "tp2-FA-mat", "tp2-FA-plain",
             2, 1.95)
    if c:
        c["ok"] = c["ok_capacity_writes_debug"] and c["same_tokens"]
    return out


def chunk_check(out, results) -> None:
    """The chunked context per backend: wave 2 read in several chunks on
    both ranks with the debug checks held, hits as the single gather's, the
    corrupted block changed wave 3; tokens against the unsharded waves and
    (FLASH_ATTN_MLA) the sharded single gather."""
    plain, single = _ok(results, "tp2-prefix-plain"), _ok(results, "tp2-FA-chunk-single")
    chunked = _ok(results, "tp2-FA-chunk")
    for k, b in [*BACKENDS.items(), ("FA", "FLASH_ATTN_MLA-prefetch")]:
        run = _ok(results, f"tp2-{k}-chunk" + ("-prefetch" if "prefetch" in b else ""))
        if not run:
            continue
        stats = [x for x in run["waves"][1]["stats"] if x]
        hits = [w.get("prefix_cache_hits") for w in run["waves"]]
        c = out[f"chunk-tp2-{b}"] = {
            "chunks_wave2": [x["max_context_chunks"] for x in stats],
            "chunked_steps_wave2": [x["chunked_context_steps"] for x in stats],
            "hits": hits, "debug_invariants_hold": run["debug_invariants_hold"],
            "corruption_changed_wave3": run["waves"][2]["tokens"] != run["waves"][1]["tokens"]}
        if plain:
            c["agreement_vs_unsharded"] = [
                agreement(x["tokens"], x["logprobs"], y["tokens"], y["logprobs"])
                for x, y in zip(run["waves"][:2], plain["waves"][:2])]
        if single and b == "FLASH_ATTN_MLA":
            c["agreement_vs_single_gather"] = [
                agreement(x["tokens"], x["logprobs"], y["tokens"], y["logprobs"])
                for x, y in zip(run["waves"][:2], single["waves"][:2])]
            c["hits_single_gather"] = [w.get("prefix_cache_hits") for w in single["waves"]]
        if "prefetch" in b and chunked:  # the same gathers, ahead: the same tokens
            c["same_tokens_as_without_prefetch"] = [
                x["tokens"] == y["tokens"] for x, y in zip(run["waves"], chunked["waves"])]
        c["ok"] = (len(stats) == 2 and min(c["chunks_wave2"]) > 1 and hits[1] > 0
                   and c["debug_invariants_hold"] and c["corruption_changed_wave3"])


def mtp_check(out, results) -> None:
    """MTP on the V2 runner: sharded vs unsharded TP=2 or PCP=2 with the same draft
    count, debug checks held, verification rows through the shard-aware
    decode; tokens and vLLM's spec-decode counters side by side (bf16)."""
    pairs = [(f"mtp{n}-tp2-{b}", f"tp2-{k}-mtp{n}") for k, b in BACKENDS.items()
             for n in (1, 2, 3)]
    pairs += [(f"mtp{n}{m}-pcp2", f"pcp2-mtp{n}{m}") for n, m in ((1, ""), (2, ""), (3, ""),
                                                                   (2, "moe"))]
    for key, run in pairs:
        s, p = _ok(results, f"{run}-shard"), _ok(results, f"{run}-plain")
        if not s:
            continue
        stats = [x for x in s.get("stats") or [] if x]
        c = out[key] = {
            "spec_decode_sharded": s.get("spec_decode"),
            "spec_decode_unsharded": (p or {}).get("spec_decode"),
            "debug_invariants_hold": s["debug_invariants_hold"],
            "multi_query_decode_steps": [x.get("multi_query_decode_steps") for x in stats],
            "capacity_ratio": round(s["capacity_tokens"] / p["capacity_tokens"], 3)
            if p else None}
        if p:
            c["agreement"] = agreement(s["tokens"], s["logprobs"], p["tokens"],
                                       p["logprobs"])
        c["ok"] = bool(c["debug_invariants_hold"] and stats and all(
            (m or 0) > 0 for m in c["multi_query_decode_steps"]) and p
            and (s.get("spec_decode") or {}).get("spec_decode_num_drafts", 0) > 0)


def pd_check(out, name, pd):
    if pd:
        out[name] = {"ok": bool(pd.get("checks")) and all(pd["checks"].values()),
                     "rc": pd.get("rc"), "checks": pd.get("checks"),
                     "identical": pd.get("identical"), "prompts": pd.get("prompts"),
                     "prompt_lens": pd.get("prompt_lens"), "first_diff": pd.get("first_diff"),
                     "prefill_first_token_same": pd.get("prefill_first_token_same")}


def report(out_dir, results):
    cks = compare(results)
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
    ax.set_title("one H200, ranks on gloo (green: every check of the pair holds)", fontsize=9)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--runs", default="all")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--summarize", action="store_true")
    ap.add_argument("--against", help="compare with the same runs in this folder")
    a = ap.parse_args()
    if a.against:
        return against(a.out, a.against)
    checks.OUT_DIR[0] = a.out
    result_dir(a.out)
    path = os.path.join(a.out, "summary.json")
    results = {}
    if os.path.exists(path):  # earlier calls of the lease
        with open(path) as f:
            results = json.load(f)["runs"]
    if a.summarize:
        return report(a.out, results)
    start = time.time()
    table = runs()
    names = [n for part in a.runs.split(",") for n in GROUPS.get(part, [part])]
    for kind in {table[n][0] for n in names}:  # build the models before the clock runs
        model_dir("moe" if kind == "pd" else kind)

    def go(name):
        left = a.budget_s - (time.time() - start)
        if left < 90:
            return name, {"name": name, "rc": "skipped (budget)"}
        res = run_one(name, table[name], a.out, min(a.timeout, left - 10))
        print(f"{name}: rc={res['rc']} {res['wall_s']} s", flush=True)
        return name, res

    with ThreadPoolExecutor(a.parallel) as pool:
        for name, res in pool.map(go, names):
            results[name] = res
            write_json(path, {"runs": results})
    report(a.out, results)


if __name__ == "__main__":
    main()
