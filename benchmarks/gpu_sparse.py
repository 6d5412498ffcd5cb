"""The shard-aware sparse path (issue 49) on the one-GPU harness, vLLM 0.34:
its runs as a table, the checks apart, JSON and a plot.

Usage (on the GPU machine, after staging: docs/gpu-testing.md):

    python3 benchmarks/gpu_sparse.py OUT --runs GROUP [--budget-s S --parallel P]
    python3 benchmarks/gpu_sparse.py OUT --summarize      # here too: checks + plot

Runs (a tiny DeepSeek-V3.2, 64 heads, ``index_topk`` 512, prompts up to
about 1,700 tokens so the sparse selection matters; TP=2 on one H200 with
real NCCL between the ranks), each backend (``fas`` FLASH_ATTN_MLA_SPARSE
bf16, ``fms`` FLASHMLA_SPARSE with ``fp8_ds_mla``):

* ``tp2-K-shard`` (sharded, vLLM's default CUDA graphs) against
  ``tp2-K-plain`` (unsharded TP=2, graphs), within the floor of two
  unsharded layouts (``tp2-K-plain`` against ``tp1-K-plain``); capacity;
  each rank's owned writes (poisoned caches);
* ``tp2-K-debug``: eager with the debug switch (the ranks' merged top-k
  identical, positions distinct);
* ``tp2-K-dump-{plain,shard}``: eager, the top-k rows of the first decode
  steps of every layer, as sets: the merged global top-k against vLLM's
  unsharded one;
* ``tp2-fas-time-{plain,shard}``: decode step (8 requests) at 2K, 16K and 64K
  tokens of context, graphs: the sharded over unsharded ratio must stay flat
  (the harness's collectives cost the same at every context);
* ``tp2-glm5-{plain,shard}``: the same model declared as GLM-5
  (``GlmMoeDsaForCausalLM``);
* ``sa-vllm``: vLLM's own DCP=2 sparse decode (``tp2-fms-vllmdcp``: no
  plugin, FLASHMLA_SPARSE fp8_ds_mla, its CuteDSL top-k merge: stage the
  add-on of ``scripts/gpu/build_cutedsl.sh``) beside cp_kv and unsharded,
  and with MTP k=2 in vLLM's default full decode graphs;
  ``sa-vllm-time``: the decode step of the three at 2K / 16K / 64K (each
  alone: ``--parallel 1``);
* ``sa-bytes``: eager runs counting the bytes each rank takes in per decode
  step at the CUDA communicator (``--count-collectives``), at 2K / 16K / 64K;
* ``sa-pcp``: sharding over PCP=2 and PCP=2 x TP=2 (FLASHMLA_SPARSE
  fp8_ds_mla: vLLM 0.34's PCP + DCP sparse layers), graphs, against vLLM's
  own PCP layout unsharded, the eager debug runs, MTP k=2 (eager: the row
  spec-pcp-graphs); ``sa-mtp-final``: MTP k=2 with both drafters in graphs,
  and sparse P/D with MTP; ``sa-mtp-time``, ``sa-pcp-time``: the decode
  step with MTP, and under PCP=2 (each alone: ``--parallel 1``). Runs of
  four ranks take about 10 GiB of an 80 GiB GPU each: at most five runs at
  once (six ran out of memory on an H100).
"""

from __future__ import annotations

import json
import os
import sys

import gpu_onegpu as onegpu
import onegpu_checks
import onegpu_runs
import gpu_vllm_checks as checks
from common import pyplot, result_dir, save_figure, write_json
from vllm_cp_kv.tools import tiny_model

TP1, TP2 = ["--tp", "1"], ["--tp", "2"]
BACKENDS = {"fas": ["--backend", "FLASH_ATTN_MLA_SPARSE"],
            "fms": ["--backend", "FLASHMLA_SPARSE", "--kv-cache-dtype", "fp8_ds_mla"],
            "fmb": ["--backend", "FLASHMLA_SPARSE"]}
# vLLM 0.34's FLASHMLA_SPARSE runs DCP with an fp8_ds_mla cache only below 32
# heads a rank and 64 gathered (its own check): that backend's runs use a
# 32-head model (16 a rank under TP=2); its unsharded TP=2 baseline without
# vLLM's ShardQ, whose symmetric memory needs one GPU a rank (the harness
# puts both on one)
MODEL = {"fas": "dsv32", "fms": "dsv32-h32", "fmb": "dsv32"}
NO_SHARDQ = {"fms": ["--attention-config", '{"sparse_mla_shard_q": false}']}
PREFIX = ["--suffix-len", "24"]
GEN = ["--prompt-repeat", "3", "--max-model-len", "4096"]
PLAIN, SHARD = ["--no-plugin"], onegpu.SHARD
MTP2 = onegpu_runs.mtp(2)  # DeepSeek-V3.2 ships an MTP layer: verification rows of 3
GRAPHS, DEBUG = onegpu.GRAPHS, onegpu.DEBUG
CONTEXTS = (2000, 16000, 64000)
TIMED = ["--max-model-len", "66000", "--num-prompts", "1", "--max-tokens", "4",
         "--time-decode", "48", "--time-contexts", ",".join(map(str, CONTEXTS))]


def runs() -> dict:
    """name -> (model, args, harness on, env), as ``gpu_onegpu.runs``."""
    r = {}
    for k, be in BACKENDS.items():
        m = MODEL[k]
        r[f"tp1-{k}-plain"] = (m, TP1 + be + GEN + GRAPHS + PLAIN, False, {})
        plain = PLAIN + NO_SHARDQ.get(k, [])
        r[f"tp2-{k}-plain"] = (m, TP2 + be + GEN + GRAPHS + plain, True, {})
        r[f"tp2-{k}-shard"] = (m, TP2 + be + GEN + GRAPHS + SHARD, True, {})
        r[f"tp2-{k}-debug"] = (m, TP2 + be + GEN + SHARD, True, DEBUG)
        for v, extra in (("plain", plain), ("shard", ["--shard"])):
            r[f"tp2-{k}-dump-{v}"] = (m, TP2 + be + GEN + extra + [
                "--num-prompts", "4", "--max-tokens", "4", "--dump-topk", f"DUMP/tp2-{k}-{v}"],
                True, {})
    for v, extra in (("plain", PLAIN), ("shard", SHARD)):  # 4 ranks, 16 heads each
        r[f"tp4-fas-{v}"] = ("dsv32", ["--tp", "4"] + BACKENDS["fas"] + GEN + GRAPHS + extra,
                             True, {})
    # MTP k=2 (DeepSeek-V3.2 ships an MTP layer): verification rows of 3 tokens
    mtp = TP2 + BACKENDS["fas"] + GEN + MTP2
    r["tp2-fas-mtp-plain"] = ("dsv32-mtp", mtp + GRAPHS + PLAIN, True, {})
    # the MTP model's own floor: unsharded MTP at TP=1 against TP=2 (both
    # backends; the floor of the model without its MTP layer is not its)
    for k in ("fas", "fms"):
        r[f"tp1-{k}-mtp-plain"] = (MODEL[k] + "-mtp", TP1 + BACKENDS[k] + GEN + MTP2 + GRAPHS
                                   + PLAIN, False, {})
    r["tp2-fas-mtp-shard"] = ("dsv32-mtp", mtp + GRAPHS + SHARD, True, {})
    r["tp2-fas-mtp-debug"] = ("dsv32-mtp", mtp + SHARD, True, DEBUG)
    # the target's other graph modes. Until sparse_dcp.SpecRowsAsDecode the
    # full modes gave wrong tokens (the row spec-sparse-graphs refused them)
    # and the drafter's full graphs an illegal memory access (it ran eager);
    # the earlier runs: benchmarks/results/h100x1-2026-12-05-sparse-mtp,
    # h100x1-2026-12-06-sparse-mtp, the fix's: h100x1-2026-12-06-sparse-mtp-graphs
    for mode, tag in (("PIECEWISE", "pw"), ("FULL_DECODE_ONLY", "fdo")):
        r[f"tp2-fas-mtp-shard-{tag}"] = ("dsv32-mtp", mtp + ["--graph-mode", mode] + SHARD,
                                         True, {})
    # vLLM's own DCP sparse path (no plugin): its top-k merge needs CuteDSL
    # (the add-on of scripts/gpu/build_cutedsl.sh); without vLLM's ShardQ,
    # as the unsharded baseline
    vdcp = TP2 + ["--dcp", "2"] + BACKENDS["fms"] + PLAIN + NO_SHARDQ["fms"]
    r["tp2-fms-vllmdcp"] = ("dsv32-h32", vdcp + GEN + GRAPHS, True, {})
    # decode step at 2K / 16K / 64K, FLASHMLA_SPARSE fp8_ds_mla: unsharded,
    # vLLM's DCP, cp_kv (each alone on the GPU: --parallel 1)
    fms_time = TP2 + BACKENDS["fms"] + TIMED + GRAPHS
    r["tp2-fms-time-plain"] = ("dsv32-h32-64k", fms_time + PLAIN + NO_SHARDQ["fms"], True, {})
    r["tp2-fms-time-shard"] = ("dsv32-h32-64k", fms_time + SHARD, True, {})
    r["tp2-fms-time-vllmdcp"] = ("dsv32-h32-64k", vdcp + TIMED + GRAPHS, True, {})
    # the bytes each rank takes in per decode step, counted at the CUDA
    # communicator's collectives (eager: a graph's replay runs no Python)
    counted = TP2 + BACKENDS["fas"] + TIMED + ["--count-collectives", "--time-decode", "8"]
    for v, extra in (("plain", PLAIN), ("shard", ["--shard"])):
        r[f"tp2-fas-bytes-{v}"] = ("dsv32-64k", counted + extra, True, {})
    # MTP k=2 with vLLM's own DCP (its default full decode graphs) against
    # unsharded MTP: whether verification rows in full graphs hold there
    r["tp2-fms-mtp-plain"] = ("dsv32-h32-mtp", TP2 + BACKENDS["fms"] + GEN + MTP2 + GRAPHS
                              + PLAIN + NO_SHARDQ["fms"], True, {})
    r["tp2-fms-mtp-vllmdcp"] = ("dsv32-h32-mtp", vdcp + GEN + MTP2 + GRAPHS, True, {})
    # cp_kv with FLASHMLA_SPARSE and MTP in vLLM's default mode (until
    # SpecRowsAsDecode: tp2-fms-mtp-shard-full, the row spec-sparse-graphs
    # lifted, wrong; benchmarks/results/h100x1-2026-12-06-sparse-vllm-dcp)
    r["tp2-fms-mtp-shard"] = ("dsv32-h32-mtp", TP2 + BACKENDS["fms"] + GEN + MTP2 + SHARD
                              + GRAPHS, True, {})
    r["tp2-fms-mtp-debug"] = ("dsv32-h32-mtp", TP2 + BACKENDS["fms"] + GEN + MTP2 + SHARD,
                              True, DEBUG)
    # P/D with the sparse model on vLLM 0.34 (NIXL over loopback): a TP=2
    # prefill sends its owned latent and indexer blocks into an unsharded
    # TP=1 decode and into a sharded TP=2 decode, against the unsharded
    # single instance and its floor (pd_offline --floor)
    pd = onegpu_runs.PREFILL_TP2 + BACKENDS["fas"] + GRAPHS + ["--floor"]
    r["pd-sa-tp2-nixl"] = ("pd:dsv32", pd + ["--port", "5900"], True, {})
    r["pd-sa-tp2-shard2-nixl"] = ("pd:dsv32", pd + onegpu_runs.INTO_TP2_SHARD
                                  + ["--port", "5920"], True, {})
    # sparse P/D with MTP k=2 on both sides: the prefill's drafter and the
    # sharded decode's (the indexer pages travel with the latent)
    r["pd-sa-tp2-shard2-mtp-nixl"] = ("pd:dsv32-mtp", pd + onegpu_runs.INTO_TP2_SHARD + MTP2
                                      + ["--port", "5940"], True, {})
    # sharding over PCP=2 and PCP=2 x TP=2 on the shard-aware path (vLLM
    # 0.34's PCP + DCP sparse layers: FLASHMLA_SPARSE with fp8_ds_mla),
    # graphs, against vLLM's own PCP layout unsharded (and the TP floor);
    # the eager debug runs; MTP k=2 eager (the row spec-pcp-graphs: vLLM
    # 0.34's own PCP fails with MTP in graphs, so graphs have no reference)
    fms = BACKENDS["fms"]
    for x, lay in (("pcp2", onegpu_runs.PCP2), ("pcp2tp2", onegpu_runs.PCP2TP2)):
        r[f"{x}-fms-plain"] = ("dsv32-h32", lay + fms + GEN + GRAPHS + PLAIN + NO_SHARDQ["fms"],
                               True, {})
        r[f"{x}-fms-shard"] = ("dsv32-h32", lay + fms + GEN + GRAPHS + SHARD, True, {})
        r[f"{x}-fms-debug"] = ("dsv32-h32", lay + fms + GEN + SHARD, True, DEBUG)
        r[f"{x}-fms-mtp-eager"] = ("dsv32-h32-mtp", lay + fms + GEN + MTP2 + SHARD, True, {})
    # the decode step with MTP k=2 (graphs, each alone: --parallel 1), and
    # under PCP=2
    for v, extra in (("plain", PLAIN), ("shard", SHARD)):
        r[f"tp2-fas-mtp-time-{v}"] = ("dsv32-mtp-64k", TP2 + BACKENDS["fas"] + TIMED + MTP2
                                      + GRAPHS + extra, True, {})
        r[f"pcp2-fms-time-{v}"] = ("dsv32-h32-64k", onegpu_runs.PCP2 + fms + TIMED + GRAPHS
                                   + extra + (NO_SHARDQ["fms"] if v == "plain" else []), True, {})
    fas = TP2 + BACKENDS["fas"] + GEN + PREFIX + GRAPHS
    r["tp2-fas-prefix-plain"] = ("dsv32", fas + PLAIN + ["--waves", "2"], True, {})
    r["tp2-fas-prefix-shard"] = ("dsv32", fas + [
        "--shard", "--waves", "3", "--poison", "--corrupt-between-waves", "--corrupt-index",
        "20", "--stats"], True, {})
    for v, extra in (("plain", PLAIN), ("shard", SHARD)):
        r[f"tp2-fas-time-{v}"] = ("dsv32-64k", TP2 + BACKENDS["fas"] + TIMED + GRAPHS + extra,
                                  True, {})
        r[f"tp2-glm5-{v}"] = ("glm5", TP2 + BACKENDS["fas"] + GEN + GRAPHS + extra, True, {})
    return r


GROUPS = {
    "sa": [f"tp{t}-{k}-{v}" for k in BACKENDS for t, v in ((1, "plain"), (2, "plain"),
                                                             (2, "shard"), (2, "debug"))],
    "sa-dump": [f"tp2-{k}-dump-{v}" for k in BACKENDS for v in ("plain", "shard")],
    "sa-time": ["tp2-fas-time-plain", "tp2-fas-time-shard"],
    "sa-glm5": ["tp2-glm5-plain", "tp2-glm5-shard"],
    "sa-prefix": ["tp2-fas-prefix-plain", "tp2-fas-prefix-shard"],
    "sa-tp4": ["tp4-fas-plain", "tp4-fas-shard"],
    "sa-vllm": ["tp1-fms-plain", "tp2-fms-plain", "tp2-fms-shard", "tp2-fms-vllmdcp",
                "tp2-fms-mtp-plain", "tp2-fms-mtp-vllmdcp"],
    "sa-vllm-time": ["tp2-fms-time-plain", "tp2-fms-time-shard", "tp2-fms-time-vllmdcp"],
    "sa-bytes": ["tp2-fas-bytes-plain", "tp2-fas-bytes-shard"],
    "sa-mtp": ["tp2-fas-mtp-plain", "tp2-fas-mtp-shard", "tp2-fas-mtp-debug"],
    "sa-mtp-modes": ["tp2-fas-mtp-shard-pw", "tp2-fas-mtp-shard-fdo"],
    # MTP k=2 in vLLM's default mode on both backends, with their floors
    "sa-mtp-graphs": ["tp1-fas-plain", "tp2-fas-plain", "tp2-fas-mtp-plain",
                      "tp2-fas-mtp-shard", "tp2-fas-mtp-debug", "tp2-fas-mtp-shard-fdo",
                      "tp1-fms-plain", "tp2-fms-plain", "tp2-fms-mtp-plain",
                      "tp2-fms-mtp-shard", "tp2-fms-mtp-debug", "tp1-fas-mtp-plain",
                      "tp1-fms-mtp-plain"],
    "sa-pd": ["pd-sa-tp2-nixl", "pd-sa-tp2-shard2-nixl"],
    "sa-mtp-floor": ["tp1-fas-mtp-plain", "tp1-fms-mtp-plain"],
    # PCP and PCP x TP on the shard-aware path, with their floors
    "sa-pcp": ["tp1-fms-plain", "tp2-fms-plain", "pcp2-fms-plain", "pcp2-fms-shard",
               "pcp2-fms-debug", "pcp2tp2-fms-plain", "pcp2tp2-fms-shard", "pcp2tp2-fms-debug",
               "tp1-fms-mtp-plain", "tp2-fms-mtp-plain", "pcp2-fms-mtp-eager",
               "pcp2tp2-fms-mtp-eager"],
    # MTP k=2 with the final code (both drafters in graphs) and sparse P/D with MTP
    "sa-mtp-final": ["tp2-fms-mtp-shard", "tp2-fms-mtp-debug", "tp1-fas-mtp-plain",
                     "tp2-fas-mtp-plain", "tp2-fas-mtp-shard", "pd-sa-tp2-shard2-mtp-nixl"],
    "sa-mtp-time": ["tp2-fas-mtp-time-plain", "tp2-fas-mtp-time-shard"],
    "sa-pcp-time": ["pcp2-fms-time-plain", "pcp2-fms-time-shard"],
}
GROUPS["all"] = [n for g in ("sa", "sa-dump", "sa-time", "sa-glm5", "sa-prefix", "sa-tp4")
                 for n in GROUPS[g]]


def model_dir(kind: str) -> str:
    """``dsv32`` as the other GPU checks build it; ``dsv32-64k`` with 70K
    positions (decode steps at 64K); ``glm5`` the same model as GLM-5."""
    if kind == "dsv32-64k":
        return tiny_model.build_dsv32(os.path.join(checks.MODELS, kind), max_positions=70000)
    if kind == "glm5":
        return tiny_model.build_dsv32(os.path.join(checks.MODELS, kind), glm5=True)
    if kind == "dsv32-mtp-64k":
        return tiny_model.build_dsv32(os.path.join(checks.MODELS, kind), mtp=True,
                                      max_positions=70000)
    if kind == "dsv32-mtp":
        return tiny_model.build_dsv32(os.path.join(checks.MODELS, kind), mtp=True)
    if kind == "dsv32-h32":
        return tiny_model.build_dsv32(os.path.join(checks.MODELS, kind), heads=32)
    if kind == "dsv32-h32-64k":
        return tiny_model.build_dsv32(os.path.join(checks.MODELS, kind), heads=32,
                                      max_positions=70000)
    if kind == "dsv32-h32-mtp":
        return tiny_model.build_dsv32(os.path.join(checks.MODELS, kind), heads=32, mtp=True)
    return checks.model_dir(kind)


# -- checks -------------------------------------------------------------------
def topk_sets(out: str, dump: str) -> list | None:
    """The top-k records rank 0 dumped under ``dumps/DUMP`` (every rank
    holds the same merged rows)."""
    import torch

    path = os.path.join(out, "dumps", f"{dump}.rank0.pt")
    return torch.load(path) if os.path.exists(path) else None


def dump_check(out_dir: str, k: str) -> dict:
    """Per record (layer, decode step): rows whose sets equal the unsharded
    run's, and the mean overlap of the rest."""
    a, b = (topk_sets(out_dir, f"tp2-{k}-{v}") for v in ("shard", "plain"))
    if not a or not b:
        return {"ok": False, "why": "a dump is missing"}
    same = rows = 0
    overlap = []
    per_layer = {}
    for x, y in zip(a, b):
        n = min(x["rows"].shape[0], y["rows"].shape[0])
        for i in range(n):
            sx = set(x["rows"][i].tolist()) - {-1}
            sy = set(y["rows"][i].tolist()) - {-1}
            eq = sx == sy
            same += eq
            rows += 1
            overlap.append(len(sx & sy) / max(len(sx | sy), 1))
            layer = per_layer.setdefault(x["layer"], [0, 0])
            layer[0] += eq
            layer[1] += 1
    first = per_layer[a[0]["layer"]] if a else [0, 0]
    return {"ok": rows > 0 and first[0] == first[1], "records": min(len(a), len(b)),
            "rows_identical": same, "rows": rows,
            "mean_jaccard": round(sum(overlap) / max(len(overlap), 1), 4),
            "per_layer_identical": per_layer}


def prefix_check(results) -> dict:
    """Prefix hits (wave 2 reads a cached context), and one owned block
    corrupted before wave 3 changes its tokens (wave 3 repeats wave 2)."""
    s, b = (onegpu._ok(results, f"tp2-fas-prefix-{v}") for v in ("shard", "plain"))
    if not (s and b):
        return {"ok": False, "why": "a prefix run is missing or failed"}
    same = [onegpu.agreement(x["tokens"], x["logprobs"], y["tokens"], y["logprobs"])
            for x, y in zip(s["waves"][:2], b["waves"][:2])]
    hits = [w.get("prefix_cache_hits") for w in s["waves"]]
    changed = s["waves"][2]["tokens"] != s["waves"][1]["tokens"]
    return {"ok": hits[0] == 0 and bool(hits[1]) and changed, "agreement_per_wave": same,
            "hits_sharded": hits, "corruption_changed_wave3": changed,
            "hits_unsharded": [w.get("prefix_cache_hits") for w in b["waves"]]}


def time_check(results, prefix: str = "tp2-fas-time") -> dict:
    """Sharded over unsharded decode step at each context (runs
    ``PREFIX-plain`` and ``PREFIX-shard``); flat means the step moves no
    context: 16K and 64K no more over unsharded than 2K (10% for the
    harness's noise)."""
    t = {v: (onegpu._ok(results, f"{prefix}-{v}") or {}).get("decode_steps")
         for v in ("plain", "shard")}
    if not all(t.values()):
        return {"ok": False, "why": "a timing run is missing"}
    ms = {v: ms_per_step(t[v]) for v in t}
    ratio = {c: round(ms["shard"][c] / ms["plain"][c], 3) for c in ms["plain"]}
    base = ratio[str(CONTEXTS[0])]
    return {"ok": all(r <= 1.10 * base for r in ratio.values()), "ms_per_step": ms,
            "sharded_over_unsharded": ratio, "bytes_per_step": step_bytes()}


def ms_per_step(decode_steps: list) -> dict:
    """A timing run's ``decode_steps``: milliseconds per step by context."""
    return {str(x["context"]): round(1000 * x["seconds_per_step"], 2) for x in decode_steps}


def vllm_dcp_checks(results, floor: dict | None, mtp_floor: dict | None) -> dict:
    """vLLM's own DCP sparse decode (FLASHMLA_SPARSE, fp8_ds_mla, its
    CuteDSL top-k merge) and cp_kv's against unsharded TP=2: tokens within
    the floor, capacity; with MTP k=2 in vLLM's default full decode graphs,
    vLLM's DCP and cp_kv against unsharded MTP."""
    out = {}
    for key, run, base in (("vllm-own-dcp-fms", "tp2-fms-vllmdcp", "tp2-fms-plain"),
                           ("vllm-own-dcp-fms-mtp2", "tp2-fms-mtp-vllmdcp",
                            "tp2-fms-mtp-plain"),
                           ("cp-kv-fms-mtp2-full-graphs", "tp2-fms-mtp-shard-full",
                            "tp2-fms-mtp-plain"),  # the 2026-12-06 try, before the fix
                           ("cp-kv-fms-mtp2-graphs", "tp2-fms-mtp-shard",
                            "tp2-fms-mtp-plain"),
                           ("cp-kv-fms-mtp2-eager-debug", "tp2-fms-mtp-debug",
                            "tp2-fms-mtp-plain")):
        if run not in results:
            continue
        c = onegpu.pair(out, key, results, run, base, 2, 1.95)
        if c is None:
            out[key]["error"] = _error(results.get(run) or {})
            continue
        if "mtp" not in run:
            c["floor_tp2_vs_tp1_unsharded"] = floor
            verdict(c, floor)
        elif "vllmdcp" in run:
            c["floor_tp2_vs_tp1_unsharded"] = mtp_floor
            verdict(c, mtp_floor)
            c["spec_counters"] = {v: (results.get(v) or {}).get("spec_decode")
                                  for v in (base, run)}
        else:
            mtp_verdict(c, results, run, base, mtp_floor, "tp2-fms-mtp-debug")
    s, v = (onegpu._ok(results, n) for n in ("tp2-fms-shard", "tp2-fms-vllmdcp"))
    if s and v:
        out["cp-kv-vs-vllm-dcp-fms"] = {
            "ok": None, "agreement": onegpu.agreement(s["tokens"], s["logprobs"], v["tokens"],
                                                      v["logprobs"]),
            "capacity_tokens": {"cp_kv": s["capacity_tokens"],
                                "vllm_dcp": v["capacity_tokens"]}}
    return out


def time_side_by_side(results) -> dict:
    """Decode step (8 requests) at each context, FLASHMLA_SPARSE fp8_ds_mla:
    unsharded TP=2, vLLM's DCP=2 and cp_kv, each run alone; the ratios to
    unsharded and cp_kv over vLLM's DCP."""
    runs = {v: (onegpu._ok(results, f"tp2-fms-time-{v}") or {}).get("decode_steps")
            for v in ("plain", "vllmdcp", "shard")}
    ms = {v: ms_per_step(t) for v, t in runs.items() if t}
    out = {"ok": None, "ms_per_step": ms,
           "rc": {v: (results.get(f"tp2-fms-time-{v}") or {}).get("rc") for v in runs}}
    if "plain" in ms:
        out["over_unsharded"] = {v: {c: round(ms[v][c] / ms["plain"][c], 3) for c in ms[v]}
                                 for v in ms if v != "plain"}
    if "shard" in ms and "vllmdcp" in ms:
        out["cp_kv_over_vllm_dcp"] = {c: round(ms["shard"][c] / ms["vllmdcp"][c], 3)
                                      for c in ms["shard"]}
    return out


def bytes_check(results) -> dict:
    """Bytes each rank took in per pure decode step of the timed batch,
    counted at the CUDA communicator (eager runs), per context: the sharded
    run's must not depend on the context (within 5% of the 2K figure)."""
    out = {"by_shapes": step_bytes()}
    for v in ("plain", "shard"):
        r = onegpu._ok(results, f"tp2-fas-bytes-{v}")
        if not r:
            return {"ok": False, "why": f"tp2-fas-bytes-{v} is missing or failed", **out}
        out[v] = {str(x["context"]): x.get("bytes_per_decode_step") for x in r["decode_steps"]}
    per_ctx = {c: max(b for rank in ranks for b in rank)
               for c, ranks in out["shard"].items() if all(ranks)}
    base = per_ctx.get(str(CONTEXTS[0]))
    out["shard_max_per_context"] = per_ctx
    out["ok"] = bool(base) and len(per_ctx) == len(CONTEXTS) and all(
        abs(b - base) <= 0.05 * base for b in per_ctx.values())
    return out


def step_bytes(rows: int = 8, layers: int = 2, heads: int = 64, k: int = 512,
               n: int = 2) -> dict:
    """What one sharded decode step receives per rank, from the shapes (a
    replayed graph runs no Python to count): per layer and row the other
    ranks' top-k keys (8 bytes a candidate), the query heads of the other
    ranks (576 bf16 values a head), their LSEs (fp32) and the
    reduce-scattered partial outputs (512 bf16 values a head). None of it
    depends on the context."""
    per_row = (n - 1) * (k * 8 + heads // n * 576 * 2 + heads * 4 + heads // n * 512 * 2)
    return {"per_step": rows * layers * per_row, "depends_on_context": False,
            "rows": rows, "layers": layers}


def compare(results, out_dir: str) -> dict:
    out = {}
    floors = {k: onegpu.agree(results, f"tp2-{k}-plain", f"tp1-{k}-plain") for k in BACKENDS}
    # MTP runs against the MTP model's own floor where it ran (before
    # 2026-12-06's fifth lease: the floor of the model without its MTP layer)
    mtp_floors = {k: onegpu.agree(results, f"tp2-{k}-mtp-plain", f"tp1-{k}-mtp-plain")
                  or floors[k] for k in ("fas", "fms")}
    for k, floor in floors.items():
        c = onegpu.pair(out, f"tp2-{k}-shard-graphs", results, f"tp2-{k}-shard",
                        f"tp2-{k}-plain", 2, 1.95)
        if c:
            c["floor_tp2_vs_tp1_unsharded"] = floor
            verdict(c, floor)
        d = onegpu._ok(results, f"tp2-{k}-debug")
        out[f"tp2-{k}-debug"] = {"ok": bool(d and d["debug_invariants_hold"]),
                                 "rc": (results.get(f"tp2-{k}-debug") or {}).get("rc")}
        if any(n.startswith(f"tp2-{k}-dump") for n in results):
            out[f"tp2-{k}-topk-sets"] = dump_check(out_dir, k)
    if "tp4-fas-shard" in results:
        c = onegpu.pair(out, "tp4-fas-shard-graphs", results, "tp4-fas-shard",
                        "tp4-fas-plain", 4, 3.9)
        if c:
            c["floor_tp4_vs_tp1_unsharded"] = onegpu.agree(results, "tp4-fas-plain",
                                                           "tp1-fas-plain")
            verdict(c, c["floor_tp4_vs_tp1_unsharded"], 3.9)
    if "tp2-fas-prefix-shard" in results:
        out["prefix-tp2-fas"] = prefix_check(results)
    if "tp2-fas-time-plain" in results:
        out["decode-step-vs-context"] = time_check(results)
    for prefix in ("tp2-fas-mtp-time", "pcp2-fms-time"):  # with MTP k=2; under PCP=2
        if f"{prefix}-plain" in results:
            out[f"decode-step-vs-context-{prefix}"] = time_check(results, prefix)
    for x, ranks, cap in (("pcp2", 2, 1.95), ("pcp2tp2", 4, 3.9)):
        if {f"{x}-fms-shard", f"{x}-fms-debug", f"{x}-fms-mtp-eager"} & set(results):
            pcp_checks(out, results, x, ranks, cap, floors["fms"], mtp_floors["fms"])
    if {"tp2-fms-vllmdcp", "tp2-fms-mtp-vllmdcp", "tp2-fms-mtp-shard-full",
            "tp2-fms-mtp-shard"} & set(results):
        # vLLM's own DCP (CuteDSL) beside cp_kv
        out.update(vllm_dcp_checks(results, floors["fms"], mtp_floors["fms"]))
    if "tp2-fms-time-plain" in results:
        out["decode-step-vs-vllm-dcp"] = time_side_by_side(results)
    if "tp2-fas-bytes-shard" in results:
        out["bytes-per-decode-step"] = bytes_check(results)
    if "tp2-fas-mtp-shard" in results:
        for mode, run in (("graphs", "tp2-fas-mtp-shard"), ("eager-debug", "tp2-fas-mtp-debug"),
                          ("graphs-piecewise", "tp2-fas-mtp-shard-pw"),
                          ("graphs-full-decode-only", "tp2-fas-mtp-shard-fdo"),
                          # lease 1 of the fix (the drafter's eager switch off)
                          ("graphs-drafter-in-graphs", "tp2-fas-mtp-shard-gdraft")):
            if run not in results:
                continue
            c = onegpu.pair(out, f"tp2-fas-mtp2-{mode}", results, run, "tp2-fas-mtp-plain",
                            2, 1.95)
            if c:
                mtp_verdict(c, results, run, "tp2-fas-mtp-plain", mtp_floors["fas"],
                            "tp2-fas-mtp-debug")
            else:  # failed (before the fix a FULL mode was refused at startup)
                out[f"tp2-fas-mtp2-{mode}"]["error"] = _error(results.get(run) or {})
    if any(n.startswith("pd-sa-") for n in results):  # sparse P/D, as the dense model's
        onegpu_checks.pd_checks(out, {n: r for n, r in results.items() if n.startswith("pd-sa-")})
    if "tp2-glm5-shard" in results:
        c = onegpu.pair(out, "tp2-glm5-shard-graphs", results, "tp2-glm5-shard",
                        "tp2-glm5-plain", 2, 1.95)
        if c:  # the floor of the same model declared as DeepSeek-V3.2
            verdict(c, floors["fas"])
    return out


def pcp_checks(out: dict, results, x: str, ranks: int, cap: float, floor: dict | None,
               mtp_floor: dict | None) -> None:
    """Sharding over PCP layout ``x`` (FLASHMLA_SPARSE fp8_ds_mla, the
    shard-aware path): graphs against vLLM's own ``x`` unsharded (where it
    did not run: vLLM's PCP=2, named in ``base``), within the floor of two
    unsharded layouts (TP=2 against TP=1), capacity, owned writes, and beside
    TP=1 unsharded; the eager debug run's invariants and the graphs run beside
    it; MTP k=2 (eager: the row spec-pcp-graphs) against unsharded MTP (TP=2,
    else TP=1) within the MTP model's floor."""
    base = next((b for b in (f"{x}-fms-plain", "pcp2-fms-plain") if onegpu._ok(results, b)),
                f"{x}-fms-plain")
    for key, run in ((f"{x}-fms-shard-graphs", f"{x}-fms-shard"),
                     (f"{x}-fms-eager-debug", f"{x}-fms-debug")):
        c = onegpu.pair(out, key, results, run, base, ranks, cap)
        if not c:
            continue
        c["base"] = base
        c["floor_tp2_vs_tp1_unsharded"] = floor
        c["vs_tp1_unsharded"] = onegpu.agree(results, run, "tp1-fms-plain")
        c["base_vs_tp1"] = onegpu.agree(results, base, "tp1-fms-plain")
        verdict(c, floor, cap)
        if run.endswith("debug"):
            c["ok"] = c["ok"] and c["debug_invariants_hold"]
        else:
            c["vs_eager_debug"] = onegpu.agree(results, run, f"{x}-fms-debug")
    run = f"{x}-fms-mtp-eager"
    mtp_base = next((b for b in ("tp2-fms-mtp-plain", "tp1-fms-mtp-plain")
                     if onegpu._ok(results, b)), "tp2-fms-mtp-plain")
    if run in results:
        # capacity beside unsharded MTP (one rank's KV either way)
        m = onegpu.pair(out, f"{x}-fms-mtp2-eager", results, run, mtp_base, ranks, cap)
        if m:
            m["base"] = mtp_base
            m["floor_is_the_mtp_models"] = mtp_floor is not floor
            mtp_verdict(m, results, run, mtp_base, mtp_floor, None, cap)


def indexer_blocks_ok(c: dict) -> bool:
    """Each rank wrote exactly its owned indexer blocks (``pair``'s counts;
    with MTP the latent rows apart, :func:`mtp_rows`)."""
    want = c.get("owned_blocks_expected")
    got = [[x for w, x in layers if w == checks.INDEXER_ROW] for layers in c.get("written") or []]
    return bool(want) and len(got) == len(want) and all(g == [w] for g, w in zip(got, want))


def mtp_rows(c: dict, run: dict) -> None:
    """With MTP the exact count ``pair`` checks does not hold (drafts are
    written past the tokens kept): the latent rows each rank wrote, checked
    as for the dense model (``gpu_onegpu.mtp_rows_ok``), and the indexer
    blocks exactly (:func:`indexer_blocks_ok`)."""
    c["written_rows"] = [[n for width, n in layers if width != checks.INDEXER_ROW]
                         for layers in c.get("written") or []]
    c["indexer_blocks_ok"] = indexer_blocks_ok(c)
    c["owned_writes_ok"] = onegpu.mtp_rows_ok(c, run) and c["indexer_blocks_ok"]


def mtp_verdict(c: dict, results, run: str, base: str, floor: dict | None,
                eager: str | None, capacity: float = 1.95) -> None:
    """A sharded MTP run ``run`` against unsharded MTP ``base``: its writes
    (:func:`mtp_rows`), tokens within the MTP model's ``floor``, capacity,
    the draft counters; the eager debug run ``eager`` must hold its checks,
    and every other run is set beside it (a stale captured plan shows as
    graphs parting from eager). ``eager`` None: no debug run to set it
    beside (MTP under PCP runs eager itself)."""
    mtp_rows(c, results[run])
    c["floor_tp2_vs_tp1_unsharded"] = floor
    verdict(c, floor, capacity)
    if run == eager:
        c["ok"] = c["ok"] and c["debug_invariants_hold"]
    elif eager is not None:
        c["vs_eager_debug"] = onegpu.agree(results, run, eager)
    c["spec_counters"] = {v: (results.get(v) or {}).get("spec_decode") for v in (base, run)}


def _error(run: dict) -> list:
    """The last error line of a failed run's log tail."""
    return [line.strip()[:300] for line in (run.get("log_tail") or "").splitlines()
            if "Error" in line][-1:]


def verdict(c: dict, floor: dict | None, capacity: float = 1.95) -> None:
    """A sharded graphs run: capacity at least 1.95x, each rank wrote its
    owned rows only (where the poisoned caches were read), tokens within
    the floor of two unsharded layouts."""
    c["within_noise_floor"] = onegpu.within_floor(c["agreement"], floor)
    c["ok"] = (c["capacity_ratio"] >= capacity and c.get("owned_writes_ok", True)
               and c["within_noise_floor"])


def plot_vllm_dcp(plt, out_dir: str, t: dict) -> None:
    """cp_kv beside vLLM's own DCP and unsharded: decode step per context."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    labels = {"plain": "unsharded TP=2", "vllmdcp": "vLLM DCP=2 (CuteDSL merge)",
              "shard": "cp_kv TP=2"}
    for v, ms in t["ms_per_step"].items():
        ctx = [int(c) for c in ms]
        ax.plot(ctx, list(ms.values()), "o-", label=labels[v])
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode step (ms)", ylim=(0, None),
           title="FLASHMLA_SPARSE fp8_ds_mla, 8 requests, graphs")
    ax.set_xticks(ctx, [f"{c // 1000}K" for c in ctx])
    ax.minorticks_off()
    ax.legend()
    save_figure(fig, os.path.join(out_dir, "sparse_vllm_dcp.png"))


def plot_agreement(plt, out_dir: str, cks: dict) -> None:
    """Each sharded check that ran: where its tokens first part from its
    unsharded base (mean over the prompts) beside the floor's, and its
    capacity ratio."""
    rows = [(k, c) for k, c in cks.items() if "agreement" in c and c.get("floor_tp2_vs_tp1_unsharded")]
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 1.8))
    y = range(len(rows))
    ax[0].barh([i + 0.2 for i in y], [c["agreement"]["mean_first_diff"] for _, c in rows],
               height=0.4, label="sharded against its unsharded base")
    ax[0].barh([i - 0.2 for i in y],
               [c["floor_tp2_vs_tp1_unsharded"]["mean_first_diff"] for _, c in rows],
               height=0.4, label="floor: unsharded TP=2 against TP=1")
    ax[0].set(xlabel="mean first differing token (of 32)", title="tokens (higher: later)")
    ax[0].set_yticks(list(y), [k for k, _ in rows])
    ax[0].legend(fontsize=7)
    ax[1].barh(list(y), [c["capacity_ratio"] for _, c in rows])
    ax[1].set(xlabel="KV capacity over unsharded", title="capacity")
    ax[1].set_yticks(list(y), ["" for _ in rows])
    save_figure(fig, os.path.join(out_dir, "agreement.png"))


def plot(out_dir: str, cks: dict) -> None:
    plt = pyplot(optional=True)
    if plt is not None and "ms_per_step" in (cks.get("decode-step-vs-vllm-dcp") or {}):
        plot_vllm_dcp(plt, out_dir, cks["decode-step-vs-vllm-dcp"])
    if plt is not None:
        plot_agreement(plt, out_dir, cks)
    t = cks.get("decode-step-vs-context") or {}
    if plt is None or "ms_per_step" not in t:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ctx = [int(c) for c in t["ms_per_step"]["plain"]]
    for v in ("plain", "shard"):
        ax[0].plot(ctx, list(t["ms_per_step"][v].values()), "o-",
                   label={"plain": "unsharded TP=2", "shard": "sharded TP=2"}[v])
    ax[0].set(xscale="log", xlabel="context (tokens)", ylabel="decode step (ms)",
              title="8 requests, graphs, one H200 (NCCL harness)", ylim=(0, None))
    ax[0].legend()
    ax[1].plot(ctx, list(t["sharded_over_unsharded"].values()), "o-")
    ax[1].set(xscale="log", xlabel="context (tokens)", ylabel="sharded / unsharded",
              title="shard-aware sparse decode: flat = no context moved", ylim=(0, None))
    for a in ax:
        a.set_xticks(ctx, [f"{c // 1000}K" for c in ctx])
        a.minorticks_off()
    save_figure(fig, os.path.join(out_dir, "sparse.png"))


def report(out_dir: str, results: dict) -> None:
    cks = compare(results, out_dir)
    write_json(os.path.join(out_dir, "summary.json"), {"runs": results, "checks": cks})
    write_json(os.path.join(out_dir, "checks.json"), cks)
    plot(out_dir, cks)
    print("\ncheck | ok | figures")
    for key, c in cks.items():
        figs = {x: c[x] for x in ("capacity_ratio", "within_noise_floor", "rows_identical",
                                  "rows", "sharded_over_unsharded", "why", "rc") if x in c}
        if "agreement" in c:
            figs["identical"] = f"{c['agreement']['identical']}/{c['agreement']['of']}"
            figs["mean_first_diff"] = c["agreement"]["mean_first_diff"]
        for x in ("identical", "prompts", "reach", "floor_reach", "transport_ok"):
            if x in c and "agreement" not in c:  # the P/D runs
                figs[x] = c[x]
        if c.get("floor_tp2_vs_tp1_unsharded"):
            f = c["floor_tp2_vs_tp1_unsharded"]
            figs["floor"] = f"{f['identical']}/{f['of']} {f['mean_first_diff']}"
        print(f"{key} | {c.get('ok')} | {json.dumps(figs)}")
    print("wall_s per run:", {n: r.get("wall_s") for n, r in results.items()})


def main() -> None:
    a = onegpu.matrix_arguments(timeout=300).parse_args()
    checks.OUT_DIR[0] = a.out
    result_dir(a.out)
    os.makedirs(os.path.join(a.out, "dumps"), exist_ok=True)
    path = os.path.join(a.out, "summary.json")
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)["runs"]
    if a.summarize:
        return report(a.out, results)
    onegpu.model_dir = model_dir  # run_one builds the models through it
    table = {name: (kind, [x.replace("DUMP", os.path.join(a.out, "dumps")) for x in args],
                    harness, env) for name, (kind, args, harness, env) in runs().items()}
    names = [n for part in a.runs.split(",") for n in GROUPS.get(part, [part])]
    for kind in {table[n][0] for n in names}:
        model_dir(onegpu.model_of(kind))
    onegpu.run_table(table, names, a, results, path)
    report(a.out, results)


if __name__ == "__main__":
    sys.exit(main())
