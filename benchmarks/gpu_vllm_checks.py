"""Every GPU check of cp_kv in real vLLM, on the lent 2x H200 machine.

Usage (on the GPU machine, after ``source scripts/gpu/setup_device.sh``):
    python benchmarks/gpu_vllm_checks.py OUT_DIR [--runs NAME,...|GROUP]
        [--budget-s 560]
GROUPs: ``pcp`` (PCP=2, dense and MoE), ``tp`` (TP=2 with FLASH_ATTN_MLA,
FLASHMLA, TRITON_MLA), ``ttft`` (time to first token), ``all``.

Each configuration runs in its own process (``harness/run_vllm.py`` or
``benchmarks/gpu_vllm_ttft.py``) with a timeout; a run that fails is recorded
with the tail of its log, the others go on. Sharded correctness runs have
``VLLM_CP_KV_DEBUG=1`` (all invariant checks on), TTFT runs do not.
Writes OUT_DIR/<run>.json|.log, OUT_DIR/summary.json, and prints a table last.
docs/gpu-testing.md says how to stage the payload and run this.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

# common first: it puts the repo root on sys.path
from common import ROOT, RUN_VLLM, pyplot, result_dir, save_figure, write_json
from harness.reference import owned_counts
from vllm_cp_kv.tools import tiny_model

MODELS = os.environ.get("CPKV_GPU_MODELS", "/root/models")
BACKENDS = ("FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA")
TTFT_LENS = os.environ.get("CPKV_TTFT_LENS", "8192,32768,65536")
PCP = ["--tp", "1", "--pcp", "2", "--gpu-mem", "0.3"]
TP = ["--tp", "2", "--gpu-mem", "0.3"]
DEBUG = {"VLLM_CP_KV_DEBUG": "1"}
# the two sparse MLA backends, each with its KV cache dtype
SPARSE = {"fas": ["--backend", "FLASH_ATTN_MLA_SPARSE"],
          "fms": ["--backend", "FLASHMLA_SPARSE", "--kv-cache-dtype", "fp8_ds_mla"]}
SPARSE_TTFT_LENS = os.environ.get("CPKV_SPARSE_TTFT_LENS", "8192,32768")


def runs():
    """name -> (kind, model, args, env)."""
    r = {
        "pcp2-dense-shard": ("gen", "dense", PCP + ["--shard", "--poison"], DEBUG),
        "pcp2-dense-plain": ("gen", "dense", PCP + ["--no-plugin", "--poison"], {}),
        "pcp2-moe-shard": ("gen", "moe", PCP + ["--shard", "--poison"], DEBUG),
        # plain vLLM 0.32 fails here (MoE padding mask); the plugin's fix with
        # vLLM's replicated layout is the baseline
        "pcp2-moe-base": ("gen", "moe", PCP + ["--cp-kv", '{"kv_sharding": false}'], {}),
        "pcp2-moe-plain": ("gen", "moe", PCP + ["--no-plugin"], {}),
        "pcp2-dense-corrupt": ("gen", "dense", PCP + ["--shard", "--poison",
                                                      "--corrupt-after-prefill"], {}),
    }
    # TRITON_MLA's decode kernel does not change its split with the batch
    # size, which differs between the two PCP layouts (see docs)
    r["pcp2-dense-triton-shard"] = ("gen", "dense", PCP + ["--backend", "TRITON_MLA", "--shard"], DEBUG)
    r["pcp2-dense-triton-plain"] = ("gen", "dense", PCP + ["--backend", "TRITON_MLA", "--no-plugin"], {})
    for b in BACKENDS:
        r[f"tp2-{b}-shard"] = ("gen", "moe", TP + ["--backend", b, "--shard", "--poison"], DEBUG)
        r[f"tp2-{b}-plain"] = ("gen", "moe", TP + ["--backend", b, "--no-plugin"], {})
    # DeepSeek-V3.2 sparse attention (issue 7): prompts up to ~1700 tokens,
    # longer than index_topk=512, so attention is really sparse
    long = ["--prompt-repeat", "3", "--max-model-len", "4096"]
    for b, extra in SPARSE.items():
        for layout, base in (("tp2", TP), ("pcp2", PCP)):
            r[f"{layout}-{b}-shard"] = ("gen", "dsv32", base + extra + long + [
                "--shard", "--poison"], DEBUG)
            r[f"{layout}-{b}-plain"] = ("gen", "dsv32", base + extra + long + [
                "--no-plugin"], {})
    dump = ["--token-prompt-len", "1023", "--max-tokens", "2", "--num-prompts", "1",
            "--max-model-len", "4096"] + SPARSE["fas"]
    r["tp2-fas-dump-shard"] = ("gen", "dsv32", TP + dump + ["--shard", "--poison",
                               "--dump-indexer", "{out}/tp2-fas-dump-shard"], DEBUG)
    r["tp2-fas-dump-plain"] = ("gen", "dsv32", TP + dump + [
        "--cp-kv", '{"kv_sharding": false}', "--dump-indexer", "{out}/tp2-fas-dump-plain"], {})
    # the same pairs with each top-k row's order fixed in both runs (vLLM's
    # top-k order varies run to run): token identity for long prompts too
    for b, extra in SPARSE.items():
        for layout, base in (("tp2", TP), ("pcp2", PCP)):
            fixed = base + extra + long + ["--sorted-topk"]
            r[f"{layout}-{b}-sorted-shard"] = ("gen", "dsv32", fixed + ["--shard", "--poison"], DEBUG)
            r[f"{layout}-{b}-sorted-plain"] = ("gen", "dsv32", fixed + ["--no-plugin"], {})
    # determinism probes: the same runs again, and sharded without poison
    r["tp2-fas-plain-again"] = ("gen", "dsv32", TP + SPARSE["fas"] + long + ["--no-plugin"], {})
    r["tp2-fas-dump-plain-again"] = ("gen", "dsv32", TP + dump + [
        "--cp-kv", '{"kv_sharding": false}', "--dump-indexer", "{out}/tp2-fas-dump-plain-again"], {})
    r["tp2-fas-dump-shard-clean"] = ("gen", "dsv32", TP + dump + [
        "--shard", "--dump-indexer", "{out}/tp2-fas-dump-shard-clean"], {})
    # one GPU: is unsharded vLLM itself run-to-run deterministic here?
    tp1 = ["--tp", "1", "--gpu-mem", "0.3"]
    for k in ("a", "b"):
        r[f"tp1-fas-plain-{k}"] = ("gen", "dsv32", tp1 + SPARSE["fas"] + long + ["--no-plugin"], {})
        r[f"tp1-fas-dump-{k}"] = ("gen", "dsv32", tp1 + dump + [
            "--cp-kv", '{"kv_sharding": false}', "--dump-indexer", "{out}/tp1-fas-dump-" + k], {})
    r["tp2-fas-corrupt"] = ("gen", "dsv32", TP + SPARSE["fas"] + long + [
        "--shard", "--poison", "--corrupt-after-prefill"], {})
    for layout in ("pcp", "tp"):
        par = ["--pcp", "2"] if layout == "pcp" else ["--pcp", "1", "--tp", "2"]
        r[f"ttft-sparse-{layout}2-shard"] = ("ttft", "dsv32-v3", par + [
            "--shard", "--lens", SPARSE_TTFT_LENS], {})
        r[f"ttft-sparse-{layout}2-repl"] = ("ttft", "dsv32-v3", par + [
            "--lens", SPARSE_TTFT_LENS], {})
        # the same with 9 repetitions and one profiled prompt of the longest
        # length: where the time goes (GPU kernels vs host syncs)
        for k, flag in (("shard", ["--shard"]), ("repl", [])):
            name = f"ttft-sparse-{layout}2-{k}-prof"
            r[name] = ("ttft", "dsv32-v3", par + flag + [
                "--lens", SPARSE_TTFT_LENS, "--reps", "9", "--profile", "{out}/" + name], {})
    r["ttft-pcp2-shard"] = ("ttft", "v3attn", ["--pcp", "2", "--shard", "--lens", TTFT_LENS], {})
    r["ttft-pcp2-repl"] = ("ttft", "v3attn", ["--pcp", "2", "--lens", TTFT_LENS], {})
    # issue 18: the shard-aware decode under CUDA graphs, prefix caching on
    # the GPU path, layer-ahead prefetch, vLLM's TP=2+DCP=2 for reference
    long18 = ["--token-prompts", "300,700,1200,1800,2400,3000,3500,4000",
              "--max-model-len", "4400", "--max-tokens", "48"]
    for b in BACKENDS:
        base = TP + ["--backend", b] + long18
        r[f"tp2-{b}-lse-eager"] = ("gen", "moe", base + ["--shard", "--stats"], DEBUG)
        r[f"tp2-{b}-lse-graphs"] = ("gen", "moe", base + ["--shard", "--cuda-graphs"], {})
        r[f"tp2-{b}-mat"] = ("gen", "moe", base + ["--cp-kv", '{"decode": "materialize"}'], {})
        r[f"tp2-{b}-long-plain"] = ("gen", "moe", base + ["--no-plugin"], {})
    pcp_long = PCP + long18
    r["pcp2-lse-eager"] = ("gen", "dense", pcp_long + ["--shard", "--stats"], DEBUG)
    r["pcp2-lse-graphs"] = ("gen", "dense", pcp_long + ["--shard", "--cuda-graphs"], {})
    r["pcp2-long-plain"] = ("gen", "dense", pcp_long + ["--no-plugin"], {})
    waves = ["--token-prompts", "600,900,1200,1500,1800,2100,2400,2700",
             "--max-model-len", "4096", "--max-tokens", "24", "--suffix-len", "40"]
    for layout, base in (("pcp2", PCP), ("tp2", TP)):
        r[f"{layout}-prefix-shard"] = ("gen", "dense", base + waves + [
            "--shard", "--waves", "3", "--poison", "--corrupt-between-waves"], DEBUG)
        r[f"{layout}-prefix-plain"] = ("gen", "dense", base + waves + [
            "--no-plugin", "--waves", "2"], {})
    r["ttft-pcp2-shard-prefetch"] = ("ttft", "v3attn", [
        "--pcp", "2", "--shard", "--cp-kv", '{"prefetch": true}', "--lens", TTFT_LENS], {})
    r["ttft-tp2-dcp2"] = ("ttft", "v3attn", ["--pcp", "1", "--tp", "2", "--dcp", "2",
                                             "--lens", TTFT_LENS], {})
    return r


GROUPS = {
    "pcp": ["pcp2-dense-shard", "pcp2-dense-plain", "pcp2-moe-shard", "pcp2-moe-base",
            "pcp2-dense-corrupt"],
    "vllm-moe-bug": ["pcp2-moe-plain"],
    "pcp-triton": ["pcp2-dense-triton-shard", "pcp2-dense-triton-plain"],
    "tp": [f"tp2-{b}-{k}" for b in BACKENDS for k in ("shard", "plain")],
    "ttft": ["ttft-pcp2-shard", "ttft-pcp2-repl"],
    "sparse-smoke": ["tp2-fas-shard", "tp2-fas-plain", "pcp2-fas-shard", "pcp2-fas-plain"],
    "sparse-rest": ["tp2-fms-shard", "tp2-fms-plain", "pcp2-fms-shard", "pcp2-fms-plain",
                    "tp2-fas-dump-shard", "tp2-fas-dump-plain", "tp2-fas-corrupt"],
    "sparse-probe": ["tp2-fas-dump-shard", "tp2-fas-dump-plain", "tp2-fas-dump-plain-again",
                     "tp2-fas-dump-shard-clean", "tp2-fas-plain-again"],
    "sparse-determinism": ["tp1-fas-plain-a", "tp1-fas-plain-b", "tp1-fas-dump-a", "tp1-fas-dump-b"],
    "sparse-sorted": [f"{layout}-{b}-sorted-{k}" for b in SPARSE for layout in ("tp2", "pcp2")
                      for k in ("shard", "plain")],
    "sparse-ttft": ["ttft-sparse-pcp2-shard", "ttft-sparse-pcp2-repl",
                    "ttft-sparse-tp2-shard", "ttft-sparse-tp2-repl"],
    "sparse-prof": ["ttft-sparse-pcp2-shard-prof", "ttft-sparse-pcp2-repl-prof"],
    "lse": [f"tp2-{b}-{k}" for b in BACKENDS for k in ("lse-eager", "long-plain")]
    + ["pcp2-lse-eager", "pcp2-long-plain"],
    "graphs": [f"tp2-{b}-lse-graphs" for b in BACKENDS] + ["pcp2-lse-graphs"],
    "lse-mat": [f"tp2-{b}-mat" for b in BACKENDS],
    "prefix": ["pcp2-prefix-shard", "pcp2-prefix-plain", "tp2-prefix-shard", "tp2-prefix-plain"],
    "ttft18": ["ttft-pcp2-shard", "ttft-pcp2-shard-prefetch", "ttft-pcp2-repl", "ttft-tp2-dcp2"],
}
GROUPS["sparse"] = GROUPS["sparse-smoke"] + GROUPS["sparse-rest"] + GROUPS["sparse-ttft"]
GROUPS["all"] = GROUPS["pcp"] + GROUPS["pcp-triton"] + GROUPS["vllm-moe-bug"] + GROUPS["tp"] + GROUPS["ttft"]


def model_dir(kind):
    path = os.path.join(MODELS, kind)
    if kind == "v3attn":
        return tiny_model.build_v3_attention(path)
    if kind.startswith("dsv32"):
        return tiny_model.build_dsv32(path, v3_shapes=kind == "dsv32-v3")
    return tiny_model.build(path, gpu_heads=True, moe=kind == "moe")


def run_one(name, spec, out, timeout):
    kind, model, args, env = spec
    path = model_dir(model)
    js = os.path.join(out, f"{name}.json")
    args = [x.replace("{out}", out) for x in args]
    if kind == "gen":
        cmd = [sys.executable, RUN_VLLM, path, js, *args]
    else:
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_vllm_ttft.py"),
               path, js, *args]
    t0 = time.time()
    rc = run_logged(cmd, {**os.environ, **env}, os.path.join(out, f"{name}.log"), timeout)
    return load_run(out, name, rc, wall_s=round(time.time() - t0, 1))


def run_logged(cmd, env, log_path, timeout, header=""):
    """Run ``cmd`` in its own process group with its output in ``log_path``;
    the exit code, or "timeout". The group is killed afterwards: vLLM's
    engine and workers hold GPU memory."""
    with open(log_path, "w") as log:
        log.write(header)
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def load_run(out, name, rc=0, **extra):
    """A run's JSON result plus what its log shows (debug checks, bytes)."""
    res = {"name": name, "rc": rc, **extra}
    js, log = os.path.join(out, f"{name}.json"), os.path.join(out, f"{name}.log")
    text = open(log).read() if os.path.exists(log) else ""
    if rc == 0 and os.path.exists(js):
        with open(js) as f:
            res.update(json.load(f))
    else:
        res["log_tail"] = text[-4000:]
    res["debug_invariants_hold"] = "debug invariants hold" in text
    res["last_token_log_lines"] = [l for l in text.splitlines()
                                   if "cp_kv last-token gather" in l][:4]
    return res


def owned_rows(prompt_lens, new_tokens, block_size, n):
    """Rows each of n ranks writes per layer (the last token is never fed back)."""
    return owned_counts([p + new_tokens - 1 for p in prompt_lens], block_size, n)


def compare(results):
    """Checks derived from pairs of runs; each entry has ok and figures."""
    out = {}

    def pair(key, shard, base, ranks=2):
        s, b = results.get(shard), results.get(base)
        if not s or not b or s.get("rc") != 0 or b.get("rc") != 0:
            out[key] = {"ok": False, "why": "a run is missing or failed"}
            return
        same = s["tokens"] == b["tokens"]
        ratio = s["capacity_tokens"] / b["capacity_tokens"]
        c = {"same_tokens": same, "prompts": len(s["tokens"]),
             "new_tokens": len(s["tokens"][0]), "prompt_lens": s["prompt_lens"],
             "capacity_shard": s["capacity_tokens"], "capacity_base": b["capacity_tokens"],
             "capacity_ratio": round(ratio, 3), "backends": s.get("backends"),
             "debug_invariants_hold": s["debug_invariants_hold"]}
        ok = same and ratio >= 1.95 and s["debug_invariants_hold"]
        if "written" in s and any(w == INDEXER_ROW for layers in s["written"]
                                  for w, _, _ in layers):
            c["owned_writes_ok"] = sparse_writes(s, c, ranks)
            ok = ok and c["owned_writes_ok"]
        elif "written_rows" in s:
            want = owned_rows(s["prompt_lens"], len(s["tokens"][0]), s["block_size"], ranks)
            got = [sorted(set(layers)) for layers in s["written_rows"]]
            c.update(written_rows=got, owned_rows_expected=want)
            ok = ok and all(g == [w] for g, w in zip(got, want))
        c["ok"] = ok
        out[key] = c

    for b in SPARSE:
        for layout in ("tp2", "pcp2"):
            pair(f"sparse-{layout}-{b}", f"{layout}-{b}-shard", f"{layout}-{b}-plain")
            sparse_identity(out.get(f"sparse-{layout}-{b}"), results.get(f"{layout}-{b}-shard"),
                            results.get(f"{layout}-{b}-plain"))
    for b in SPARSE:
        for layout in ("tp2", "pcp2"):
            pair(f"sparse-sorted-{layout}-{b}", f"{layout}-{b}-sorted-shard",
                 f"{layout}-{b}-sorted-plain")
    determinism(out, results)
    if "tp2-fas-dump-shard" in results and "tp2-fas-dump-plain" in results:
        out["sparse-indexer-view"] = indexer_view_check(results)
    bad, ref = results.get("tp2-fas-corrupt"), results.get("tp2-fas-shard")
    if bad and ref and bad.get("rc") == 0 and ref.get("rc") == 0:
        out["sparse-negative-control"] = {"ok": bad["tokens"] != ref["tokens"],
                                          "corrupted_block": bad.get("corrupted_block"),
                                          "cache_0": bad.get("cache_shapes", [None])[0]}
    for layout in ("pcp2", "tp2"):
        ttft_pair(out, f"sparse-ttft-{layout}", results.get(f"ttft-sparse-{layout}-shard"),
                  results.get(f"ttft-sparse-{layout}-repl"))
        ttft_pair(out, f"sparse-ttft-{layout}-9reps", results.get(f"ttft-sparse-{layout}-shard-prof"),
                  results.get(f"ttft-sparse-{layout}-repl-prof"))
    pair("pcp2-dense", "pcp2-dense-shard", "pcp2-dense-plain")
    pair("pcp2-moe", "pcp2-moe-shard", "pcp2-moe-base")
    pair("pcp2-dense-triton", "pcp2-dense-triton-shard", "pcp2-dense-triton-plain")
    for b in BACKENDS:
        pair(f"tp2-{b}", f"tp2-{b}-shard", f"tp2-{b}-plain")
    bad = results.get("pcp2-dense-corrupt")
    ref = results.get("pcp2-dense-shard")
    if bad and ref and bad.get("rc") == 0 and ref.get("rc") == 0:
        out["negative-control"] = {"ok": bad["tokens"] != ref["tokens"],
                                   "corrupted_block": bad.get("corrupted_block")}
    plain = results.get("pcp2-moe-plain")
    if plain:
        out["vllm-pcp-moe-without-fix"] = {
            "rc": plain.get("rc"),
            "error": next((l for l in plain.get("log_tail", "").splitlines()
                           if "is_padding" in l), None)}
    for run in ("pcp2-dense-shard", "pcp2-moe-shard"):
        r = results.get(run)
        if r and r.get("rc") == 0:
            stats = [s for s in (r.get("last_token") or []) if s]
            out[f"last-token-{run}"] = {"ok": bool(stats) and all(s["narrow_steps"] > 0 for s in stats),
                                        "stats_per_rank": stats,
                                        "log": r["last_token_log_lines"]}
    ttft_pair(out, "ttft", results.get("ttft-pcp2-shard"), results.get("ttft-pcp2-repl"))
    ttft_pair(out, "ttft-prefetch", results.get("ttft-pcp2-shard-prefetch"),
              results.get("ttft-pcp2-repl"))
    ttft_pair(out, "ttft-tp2-dcp2-vs-pcp2-repl", results.get("ttft-tp2-dcp2"),
              results.get("ttft-pcp2-repl"))
    lse_checks(out, results)
    return out


def lse_checks(out, results):
    """Issue 18: the shard-aware decode on GPU (tokens vs the same layout
    unsharded, debug checks held, decode bytes per step), the same tokens
    under CUDA graphs, prefix caching hits and identity."""
    def ok(name):
        r = results.get(name)
        return r if r and r.get("rc") == 0 else None

    for b in [*BACKENDS, None]:
        tag = f"tp2-{b}" if b else "pcp2"
        eager, plain = ok(f"{tag}-lse-eager"), ok(f"{tag}-long-plain")
        graphs, mat = ok(f"{tag}-lse-graphs"), ok(f"{tag}-mat")
        if eager and plain:
            stats = [st for st in (eager.get("stats") or []) if st]
            out[f"lse-{tag}"] = {
                "ok": eager["tokens"] == plain["tokens"] and eager["debug_invariants_hold"],
                "same_tokens": eager["tokens"] == plain["tokens"],
                "first_diffs": first_diffs(eager["tokens"], plain["tokens"]),
                "decode_step_bytes_rank0": (stats[0]["decode_step_bytes"][:3] if stats else None)}
        if graphs and eager:
            out[f"graphs-{tag}"] = {"ok": graphs["tokens"] == eager["tokens"],
                                    "same_tokens": graphs["tokens"] == eager["tokens"],
                                    "first_diffs": first_diffs(graphs["tokens"], eager["tokens"])}
        if mat and plain:
            out[f"mat-{tag}"] = {"ok": mat["tokens"] == plain["tokens"],
                                 "same_tokens": mat["tokens"] == plain["tokens"]}
    for layout in ("pcp2", "tp2"):
        s, b = ok(f"{layout}-prefix-shard"), ok(f"{layout}-prefix-plain")
        if s and b:
            same = [x["tokens"] == y["tokens"] for x, y in zip(s["waves"][:2], b["waves"][:2])]
            hits = [w.get("prefix_cache_hits") for w in s["waves"]]
            out[f"prefix-{layout}"] = {
                "ok": all(same) and hits[1] > 0 and s["waves"][2]["tokens"] != s["waves"][1]["tokens"],
                "same_tokens_per_wave": same, "hits_sharded": hits,
                "hits_unsharded": [w.get("prefix_cache_hits") for w in b["waves"]],
                "queries": [w.get("prefix_cache_queries") for w in s["waves"]],
                "corruption_changed_wave3": s["waves"][2]["tokens"] != s["waves"][1]["tokens"],
                "capacity_ratio": round(s["capacity_tokens"] / b["capacity_tokens"], 3)}


def ttft_pair(out, key, s, b):
    if s and b and s.get("rc") == 0 and b.get("rc") == 0:
        ratios = {n: round(s["ttft_ms"][n]["median"] / b["ttft_ms"][n]["median"], 3)
                  for n in s["ttft_ms"] if n in b["ttft_ms"]}
        out[key] = {"ok": all(v <= 1.05 for v in ratios.values()), "ratio": ratios,
                    "shard_ms": {n: v["median"] for n, v in s["ttft_ms"].items()},
                    "replicated_ms": {n: v["median"] for n, v in b["ttft_ms"].items()},
                    "capacity_ratio": round(s["capacity_tokens"] / b["capacity_tokens"], 3)}
        if "profile" in s and "profile" in b:  # one profiled prompt, per worker
            out[key]["profile_gpu_busy_span_us"] = {
                k: [[v["gpu_busy_us"], v["gpu_span_us"]] for v in r["profile"].values()]
                for k, r in (("shard", s), ("replicated", b))}


INDEXER_ROW = 132  # bytes per token of the DSA indexer cache (128 fp8 + fp32 scale)
INDEX_TOPK = 512  # of the tiny DeepSeek-V3.2 (tools/tiny_model.py build_dsv32)


def first_diffs(a, b):
    """Per prompt, the first position where two sequences differ (None: same)."""
    return [next((k for k, (x, y) in enumerate(zip(p, q)) if x != y), None)
            for p, q in zip(a, b)]


def sparse_identity(c, s, b):
    """Sparse pairs: vLLM's sparse path is not run-to-run deterministic once a
    sequence outgrows index_topk (see determinism()), so the strict check is
    on the prompts whose whole sequence stays within index_topk: logprobs
    bit-identical. Longer prompts: first differing token and logprob, for
    comparison with two unsharded runs."""
    if not c or "same_tokens" not in c:
        return
    new = len(s["tokens"][0])
    dense = [i for i, p in enumerate(s["prompt_lens"]) if p + new <= INDEX_TOPK]
    c.update(first_token_diff=first_diffs(s["tokens"], b["tokens"]),
             first_logprob_diff=first_diffs(s["logprobs"], b["logprobs"]),
             within_topk_prompts=dense,
             within_topk_logprobs_identical=all(
                 s["logprobs"][i] == b["logprobs"][i] for i in dense))
    c["ok_except_vllm_nondeterminism"] = bool(
        dense and c["within_topk_logprobs_identical"] and c["capacity_ratio"] >= 1.95
        and c["debug_invariants_hold"] and c.get("owned_writes_ok", True))


def determinism(out, results):
    """Two identical unsharded runs (one GPU): same tokens? For the one-prompt
    dumps: the same top-k sets, in the same order, and the same caches?"""
    a, b = results.get("tp1-fas-plain-a"), results.get("tp1-fas-plain-b")
    if a and b and a.get("rc") == 0 and b.get("rc") == 0:
        out["sparse-unsharded-run-to-run"] = {
            "same_tokens": a["tokens"] == b["tokens"], "prompt_lens": a["prompt_lens"],
            "first_token_diff": first_diffs(a["tokens"], b["tokens"]),
            "first_logprob_diff": first_diffs(a["logprobs"], b["logprobs"])}
    try:
        import torch

        load = lambda n: torch.load(os.path.join(OUT_DIR[0], n))
        ta, tb = (load(f"tp1-fas-dump-{k}.prefill_topk.rank0.pt") for k in "ab")
        da, db = (load(f"tp1-fas-dump-{k}.rank0.pt") for k in "ab")
    except (FileNotFoundError, ImportError):
        return
    out["sparse-unsharded-topk-order"] = {
        "rows": ta.shape[0], "same_order": torch.equal(ta, tb),
        "rows_with_other_sets": int((ta.sort(1).values != tb.sort(1).values).any(1).sum()),
        "indexer_cache_equal": torch.equal(da["blocks"], db["blocks"]),
        "latent_cache_equal": torch.equal(da["latent"].view(torch.int16),
                                          db["latent"].view(torch.int16))}


def sparse_writes(s, c, ranks):
    """Poisoned sparse run: per rank, latent rows written = owned rows and
    indexer blocks written = owned blocks (brute force from the lengths)."""
    bs, new = s["block_size"], len(s["tokens"][0])
    rows = owned_rows(s["prompt_lens"], new, bs, ranks)
    blocks = [sum(1 for p in s["prompt_lens"] for j in range(-(-(p + new - 1) // bs))
                  if j % ranks == r) for r in range(ranks)]
    got = [sorted({(w, x if w != INDEXER_ROW else b) for w, x, b in layers})
           for layers in s["written"]]
    c.update(written=got, owned_rows_expected=rows, owned_blocks_expected=blocks)
    return all(x == (blocks[r] if w == INDEXER_ROW else rows[r])
               for r, layers in enumerate(got) for w, x in layers)


def indexer_view_check(results):
    """The sharded run's materialized indexer view (both ranks) equals the
    unsharded run's indexer cache, byte for byte, for the same prompt."""
    import torch

    s, p = results["tp2-fas-dump-shard"], results["tp2-fas-dump-plain"]
    if s.get("rc") != 0 or p.get("rc") != 0:
        return {"ok": False, "why": "a dump run failed"}
    out_dir = OUT_DIR[0]
    load = lambda name, r: torch.load(os.path.join(out_dir, f"{name}.rank{r}.pt"))
    try:
        views = [load("tp2-fas-dump-shard", r) for r in (0, 1)]
        ref = load("tp2-fas-dump-plain", 0)
    except FileNotFoundError as e:
        return {"ok": False, "why": str(e)}
    same = [v["seq_len"] == ref["seq_len"] and torch.equal(v["blocks"], ref["blocks"])
            for v in views]
    return {"ok": all(same), "same_per_rank": same, "seq_len": ref["seq_len"],
            "blocks": list(ref["blocks"].shape), "bytes": ref["blocks"].numel(),
            "same_tokens": s["tokens"] == p["tokens"]}


OUT_DIR = ["."]  # where the runs of this invocation write (dump files)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--runs", default="all")
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--summarize", action="store_true",
                    help="no runs: rebuild summary.json, the table and the plot "
                         "from OUT's <run>.json/.log (e.g. runs from several calls)")
    a = ap.parse_args()
    OUT_DIR[0] = a.out
    if a.summarize:
        names = sorted(f[:-5] for f in os.listdir(a.out) if f.endswith(".json")
                       and f != "summary.json")
        results = {n: load_run(a.out, n) for n in names}
        return report(a.out, results)
    start = time.time()
    result_dir(a.out)
    table = runs()
    names = [n for part in a.runs.split(",") for n in GROUPS.get(part, [part])]
    summary_path = os.path.join(a.out, "summary.json")
    results = {}
    if os.path.exists(summary_path):  # results of earlier calls in the lease
        with open(summary_path) as f:
            results = json.load(f)["runs"]
    for name in names:
        left = a.budget_s - (time.time() - start)
        if left < 60:
            results[name] = {"name": name, "rc": "skipped (budget)"}
            continue
        cap = 330 if table[name][0] == "ttft" else 200
        results[name] = run_one(name, table[name], a.out, timeout=min(cap, left - 15))
        print(f"{name}: rc={results[name]['rc']} {results[name]['wall_s']} s", flush=True)
        write_json(summary_path, {"runs": results, "checks": compare(results)})
    report(a.out, results)


def report(out, results):
    checks = compare(results)
    write_json(os.path.join(out, "summary.json"), {"runs": results, "checks": checks})
    plot(out, checks)
    print("\ncheck | ok | figures")
    for key, c in checks.items():
        figs = {k: v for k, v in c.items() if k in ("capacity_ratio", "same_tokens", "ratio",
                                                     "rc", "error", "corrupted_block")}
        print(f"{key} | {c.get('ok', '-')} | {json.dumps(figs)}")


def plot(out, checks):
    """Capacity ratio per layout and TTFT per prompt length (PNG)."""
    plt = pyplot(optional=True)
    if plt is None:
        return
    pairs = {k: c for k, c in checks.items() if "capacity_ratio" in c and "same_tokens" in c}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(range(len(pairs)), [c["capacity_ratio"] for c in pairs.values()],
            color=["tab:green" if c["ok"] else "tab:red" for c in pairs.values()])
    ax1.axhline(1.95, ls="--", c="k", lw=1)
    ax1.set_xticks(range(len(pairs)), list(pairs), rotation=30, ha="right", fontsize=7)
    ax1.set_ylabel("KV capacity, sharded / unsharded")
    ax1.set_title("same tokens: " + ", ".join("yes" if c["same_tokens"] else "NO"
                                               for c in pairs.values()), fontsize=8)
    t = checks.get("ttft")
    if t:
        lens = list(t["shard_ms"])
        x = range(len(lens))
        ax2.bar([i - 0.2 for i in x], [t["replicated_ms"][n] for n in lens], 0.4,
                label="PCP=2 replicated")
        ax2.bar([i + 0.2 for i in x], [t["shard_ms"][n] for n in lens], 0.4,
                label="PCP=2 sharded (cp_kv)")
        for i, n in enumerate(lens):
            ax2.text(i, max(t["shard_ms"][n], t["replicated_ms"][n]), f"{t['ratio'][n]:.3f}",
                     ha="center", va="bottom", fontsize=8)
        ax2.set_xticks(list(x), [f"{int(n) // 1024}K" for n in lens])
        ax2.set_ylabel("TTFT ms (median of 5)")
        ax2.legend(fontsize=8)
    save_figure(fig, os.path.join(out, "gpu_vllm.png"), dpi=120)


if __name__ == "__main__":
    main()
