"""The MLA architectures of docs/models.md on the one-GPU harness (issue
53), vLLM 0.34, TP=2 with real NCCL between the ranks: a result per family.

Usage (on the GPU machine, after staging: docs/gpu-testing.md):

    python3 benchmarks/gpu_models.py OUT --runs all [--budget-s S --parallel P]
    python3 benchmarks/gpu_models.py OUT --summarize      # here too: the checks

* Families that run (``glm4``: ``Glm4MoeLiteForCausalLM``, ``axk1``:
  ``AXK1ForCausalLM``, tiny random-weight models of
  ``tiny_model.build_dense_arch`` with GPU head sizes): ``tp2-K-shard``
  (graphs) against ``tp2-K-plain`` (unsharded TP=2, graphs) within the floor
  of ``tp2-K-plain`` against ``tp1-K-plain``; capacity; ``tp2-K-debug``
  (eager, the debug switch) holds.
* Refused families (tiny configs of transformers' classes, no weights: the
  check refuses first): ``refuse-K`` must exit at startup with the family's
  row naming the architecture.
"""

from __future__ import annotations

import json
import os

import gpu_onegpu as onegpu
import gpu_vllm_checks as checks
from common import write_json
from vllm_cp_kv.integration import models
from vllm_cp_kv.tools import tiny_model

RUNS_ARCHS = {"glm4": "Glm4MoeLiteForCausalLM", "axk1": "AXK1ForCausalLM"}
# refused at startup: two refused families and an unverified one
REFUSED_ARCHS = {"kimi-linear": "KimiLinearForCausalLM", "hy-v4": "HYV4ForCausalLM",
                 "longcat": "LongcatFlashForCausalLM"}
GEN = ["--token-prompts", "1,40,250,700,1990,3000,4000,8000", "--max-model-len", "8200",
       "--max-tokens", "24"]
TP1, TP2 = ["--tp", "1"], ["--tp", "2"]


def model_dir(kind: str) -> str:
    """``run:ARCH`` a tiny model that runs, ``cfg:ARCH`` a config only."""
    how, _, arch = kind.partition(":")
    path = os.path.join(checks.MODELS, f"{how}-{arch}")
    if how == "run":  # GPU head sizes, positions past GEN's 8,200
        return tiny_model.build_dense_arch(arch, path + "-gpu16k", gpu_heads=True,
                                           max_positions=16384)
    return tiny_model.build_arch_config(arch, path)


def runs() -> dict:
    """name -> (model, args, harness on, env), as ``gpu_onegpu.runs``."""
    r = {}
    for k, arch in RUNS_ARCHS.items():
        m = f"run:{arch}"
        r[f"tp1-{k}-plain"] = (m, TP1 + GEN + onegpu.GRAPHS + ["--no-plugin"], False, {})
        r[f"tp2-{k}-plain"] = (m, TP2 + GEN + onegpu.GRAPHS + ["--no-plugin"], True, {})
        r[f"tp2-{k}-shard"] = (m, TP2 + GEN + onegpu.GRAPHS + onegpu.SHARD, True, {})
        r[f"tp2-{k}-debug"] = (m, TP2 + GEN + onegpu.SHARD, True, onegpu.DEBUG)
    for k, arch in REFUSED_ARCHS.items():
        r[f"refuse-{k}"] = (f"cfg:{arch}", TP2 + GEN + ["--shard"], True, {})
    return r


def refusal_said(text: str, arch: str) -> bool:
    """``text`` holds cp_kv's refusal of ``arch``: its name and its family's
    reason (refused) or "has not run sharded" (unverified)."""
    fam = models.ARCHITECTURES[arch]
    reason = fam.why[:40] if fam.status == models.REFUSED else "has not run sharded"
    return f"cp_kv: architecture {arch}" in text and reason in text


def refusal_check(res: dict, arch: str) -> dict:
    """The run ended at startup with the family's message naming ``arch``."""
    fam = models.ARCHITECTURES[arch]
    said = refusal_said(res.get("log_tail") or "", arch)
    return {"ok": res.get("rc") not in (0, None) and said, "rc": res.get("rc"),
            "row": fam.row, "message_found": said}


def checks_of(results: dict) -> dict:
    out = {}
    for k in RUNS_ARCHS:
        floor = onegpu.agree(results, f"tp2-{k}-plain", f"tp1-{k}-plain")
        c = onegpu.pair(out, f"tp2-{k}", results, f"tp2-{k}-shard", f"tp2-{k}-plain", 2, 1.9)
        if c is not None:
            c["floor"] = floor
            c["within_floor"] = onegpu.within_floor(c["agreement"], floor)
            c["ok"] = bool(c["capacity_ok"] and c.get("owned_writes_ok", True)
                           and c["within_floor"])
        debug = results.get(f"tp2-{k}-debug") or {}
        out[f"tp2-{k}-debug"] = {"ok": debug.get("rc") == 0 and bool(
            debug.get("debug_invariants_hold")), "rc": debug.get("rc")}
    for k, arch in REFUSED_ARCHS.items():
        out[f"refuse-{k}"] = refusal_check(results.get(f"refuse-{k}") or {}, arch)
    return out


def main() -> None:
    a = onegpu.matrix_arguments(timeout=300).parse_args()
    results, path = onegpu.earlier_runs(a.out)
    if not a.summarize:
        table = runs()
        names = list(table) if a.runs == "all" else a.runs.split(",")
        for kind in {table[n][0] for n in names}:  # the models before the clock runs
            model_dir(kind)
        onegpu.model_dir = model_dir  # run_one builds its command from it
        onegpu.run_table(table, names, a, results, path)
    cks = checks_of(results)
    for res in results.values():
        res.pop("log", None)
    write_json(path, {"runs": results, "checks": cks})
    print(json.dumps({k: v["ok"] for k, v in cks.items()}, indent=1))


if __name__ == "__main__":
    main()
