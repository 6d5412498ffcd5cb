"""The checks of the one-GPU matrix (benchmarks/gpu_onegpu.py; its runs:
benchmarks/onegpu_runs.py): ``compare(results)`` -> check name -> verdict
(``ok``) and figures. Each sharded run is held against its unsharded layout
within the noise floor of two unsharded layouts (``within_floor``), with
its structural facts (capacity, rows written per rank, debug invariants,
prefix hits, transfers); where the trained model's runs ran, the accuracy
decides (``accuracy_verdicts``)."""

from __future__ import annotations

import os
import re

import gpu_vllm_checks as checks  # run loading, owned rows, first differences
from onegpu_runs import ACC, BACKENDS, SPARSE

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
    c["capacity_ok"] = c["capacity_ratio"] >= min_ratio
    ok = c["capacity_ok"] and c["debug_invariants_hold"]
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
    """Every check whose runs are in ``results``, in the matrix's order."""
    out = {}
    floor = graphs_check(out, results)
    tp4_check(out, results)
    pcp_check(out, results, floor)
    prefix_check(out, results)
    chunk_check(out, results)
    owned_check(out, results)
    materialize_check(out, results, floor)
    mtp_check(out, results)
    fp8_check(out, results)
    pcp_tp_check(out, results)
    pd_checks(out, results)
    timing_check(out, results)
    accuracy_verdicts(out, results)
    return out


def graphs_check(out, results) -> dict | None:
    """The captured decode: TP=2 sharded per backend in FULL_AND_PIECEWISE,
    FULL_DECODE_ONLY and eager with the debug switch, within the noise floor
    (returned); the plugin before the fix answers wrong at once."""
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
    return floor


def tp4_check(out, results) -> None:
    """TP=4 sharded against TP=4 unsharded, within the floor of TP=4 graphs
    against eager (unsharded)."""
    c = pair(out, "tp4", results, "tp4-shard", "tp4-plain", 4, 3.9)
    if not c:
        return
    c["ok"] = c["ok_capacity_writes_debug"] or (c["capacity_ratio"] >= 3.9
                                                and c.get("owned_writes_ok", True))
    c["floor_tp4_graphs_vs_eager"] = agree(results, "tp4-plain", "tp4-plain-eager")
    c["within_noise_floor"] = within_floor(c["agreement"], c["floor_tp4_graphs_vs_eager"])
    c["ok"] = c["ok"] and c["within_noise_floor"]


def pcp_check(out, results, floor) -> None:
    """PCP=2 dense (graphs, eager debug), MoE, sparse (eager) against vLLM's
    own layout; the MoE mask: both PCP layouts against TP=1."""
    for key, shard, base in (("pcp2-dense", "pcp2-dense-shard", "pcp2-dense-plain"),
                             ("pcp2-dense-eager-debug", "pcp2-dense-debug", "pcp2-dense-plain"),
                             ("pcp2-moe", "pcp2-moe-shard", "pcp2-moe-base"),
                             *((f"pcp2-sparse-{k}-eager", f"pcp2-{k}-shard-eager",
                                f"pcp2-{k}-plain-eager") for k in SPARSE)):
        # sparse models on the materializing path reserve the whole view
        # (docs/sparse.md): 1.94x at most; the shard-aware path none
        c = pair(out, key, results, shard, base, 2, 1.9 if "sparse" in key else 1.95)
        if c:
            c["ok"] = c["capacity_ratio"] >= (1.9 if "sparse" in key else 1.95) and \
                c.get("owned_writes_ok", True) and (
                    c["debug_invariants_hold"] or "debug" not in key and "sparse" not in key)
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


def materialize_check(out, results, floor) -> None:
    c = pair(out, "tp2-FLASH_ATTN_MLA-materialize", results, "tp2-FA-mat", "tp2-FA-plain",
             2, 1.95)
    if c:  # the materializing decode reserves the whole view: below 1.95x
        c["within_noise_floor"] = within_floor(c["agreement"], floor)
        c["ok"] = c["capacity_ratio"] >= 1.8 and c["within_noise_floor"]


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
    for k in SPARSE:  # fms: the shard-aware path on vLLM 0.34; fas: materializing
        e = pair(out, f"pcp2tp2-sparse-{k}-eager", results, f"pcp2tp2-{k}-shard-eager",
                 f"pcp2tp2-{k}-plain-eager", 4, 3.9)
        if e:
            e["floor_pcp2tp2_vs_pcp2"] = agree(results, f"pcp2tp2-{k}-plain-eager",
                                               f"pcp2-{k}-plain-eager")
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


def owned_check(out, results) -> None:
    """The owned context under PCP and PCP x TP (issue 51): wave 2's rows
    read owned on every rank (none in the gathered run), prefix hits, the
    corrupted block changed wave 3; waves 1-2 against vLLM's own layout
    within the floor of its two unsharded layouts (PCP=2 against PCP=2 x
    TP=2); the eager debug run's invariants and owned rows."""
    plain = {x: _ok(results, f"{x}-FM-prefix-plain") for x in ("pcp2", "pcp2tp2")}
    floors = [agreement(a["tokens"], a["logprobs"], b["tokens"], b["logprobs"])
              for a, b in zip(*(p["waves"][:2] for p in plain.values()))] \
        if all(plain.values()) else None
    for x, ranks in (("pcp2", 2), ("pcp2tp2", 4)):
        for kind in ("owned", "gathered", "owned-debug"):
            run = _ok(results, f"{x}-{kind}")
            if not run:
                continue
            stats = [s for s in run["waves"][1]["stats"] if s]
            rows = [s["owned_context_rows"] for s in stats]
            hits = [w.get("prefix_cache_hits") for w in run["waves"]]
            debug = kind.endswith("debug")
            c = out[f"owned-{x}-{kind}"] = {
                "owned_rows_wave2": rows, "hits": hits,
                "chunks_wave2": [s["max_context_chunks"] for s in stats],
                "corruption_changed_wave3": None if debug else
                run["waves"][2]["tokens"] != run["waves"][1]["tokens"]}
            reads_owned = (min(rows) > 0) if kind != "gathered" else (max(rows) == 0)
            c["ok"] = (len(stats) == ranks and reads_owned and hits[1] > 0
                       and (debug or c["corruption_changed_wave3"]))
            if debug:
                c["debug_invariants_hold"] = run.get("debug_invariants_hold")
                c["ok"] = c["ok"] and bool(run.get("debug_invariants_hold"))
                graphs = _ok(results, f"{x}-owned")
                if graphs:
                    c["graphs_vs_eager_debug"] = [
                        agreement(a["tokens"], a["logprobs"], b["tokens"], b["logprobs"])
                        for a, b in zip(graphs["waves"][:2], run["waves"][:2])]
                continue
            if plain[x]:
                same = [agreement(a["tokens"], a["logprobs"], b["tokens"], b["logprobs"])
                        for a, b in zip(run["waves"][:2], plain[x]["waves"][:2])]
                c["agreement_vs_vllm"] = same
                c["capacity_ratio"] = round(run["capacity_tokens"]
                                            / plain[x]["capacity_tokens"], 3)
                if floors:
                    c["floor_pcp2_vs_pcp2tp2"] = floors
                    c["within_noise_floor"] = all(within_floor(a, f)
                                                  for a, f in zip(same, floors))
                    c["ok"] = c["ok"] and c["within_noise_floor"]
        both = _ok(results, f"{x}-owned"), _ok(results, f"{x}-gathered")
        if all(both) and f"owned-{x}-owned" in out:
            out[f"owned-{x}-owned"]["agreement_vs_gathered"] = [
                agreement(a["tokens"], a["logprobs"], b["tokens"], b["logprobs"])
                for a, b in zip(both[0]["waves"][:2], both[1]["waves"][:2])]


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


# The trained recall model's accuracy (issue 50, benchmarks/gpu_recall.py):
# its runs join the matrix as "acc-<run>", and where they ran, the verdict of
# each mode below is its accuracy against unsharded plus the mode's
# structural facts (capacity, owned writes, hits, transfers), the token
# comparison with random weights kept beside as "tokens_ok".
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
        tokens = c["ok"] if c is not None and "why" not in c else None
        if tokens is None:  # the mode's token runs not in this lease (or
            # failed): accuracy alone, and says so
            c = out[key] = {"token_runs": (c or {}).get("why", "not run")}
        # the mode's own facts without its token comparison
        # (these are runs without the debug switch: its invariants are the
        # debug runs' own checks)
        facts = all(c.get(k, True) for k in ("capacity_ok", "owned_writes_ok",
                                             "same_rows_written_as_eager", "transport_ok",
                                             "prefix_ok"))
        c.update(tokens_ok=tokens, accuracy=a, ok=a["ok"] and facts)

