"""Multi-turn prefix reuse at the same KV memory per rank: unsharded vs
sharded, in one run.

Usage: python benchmarks/prefix_caching.py OUT_DIR [--conversations 12] [--turns 4]
           [--user-tokens 450] [--new-tokens 16] [--working-set-fraction 0.55]
           [--max-num-seqs 4] [--tp 2] [--pcp 1] [--model DIR] [--dtype D] [--backend B]

Each conversation sends, turn after turn, its whole history (every earlier
prompt and answer) plus a new user message of ``--user-tokens`` random
tokens; turns go round-robin over the conversations (all first turns, then
all second turns, ...), so between two turns of a conversation every other
conversation runs once. The KV memory per rank is the same for both
layouts and sized so that the unsharded cache holds ``--working-set-fraction``
of the final working set (every conversation's last context). The model is
the demo's 12-layer tiny DeepSeek-V2: the sharded layout spends a scratch of
one layer's full view out of the same memory (bounded by ``--max-num-seqs``
requests of the longest context), which on a 2-layer model would be a large
share of a small cache. vLLM's own
prefix-cache counters give the hit rate and the prompt tokens recomputed;
the wall time of all turns is measured. Writes ``prefix_caching.json`` and
``prefix_caching.png``.

A third configuration, ``sharded_half``, runs the sharded layout with half
the memory per rank: the same logical capacity as the unsharded cache, so
it shows what the capacity alone is worth. It stands in for the unsharded
baseline where that one cannot cache: on CPUs without AMX vLLM 0.32 turns
prefix caching off for MLA (CPU_MLA), so there the unsharded run recomputes
everything, while the sharded runs keep it (the plugin reads a cached
context through its full view). On GPU and on AMX CPUs vLLM keeps prefix
caching on for both layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import ROOT, meta, pyplot, result_dir, save_figure, write_json


def workload(a, vocab: int):
    from vllm_cp_kv.tools.tiny_model import token_prompts

    users = [token_prompts([a.user_tokens] * a.turns, vocab, seed=1000 + c)
             for c in range(a.conversations)]
    return users


def bytes_per_token(model: str, dtype: str) -> int:
    from vllm_cp_kv.tools.cli import model_kv_layout

    layout = model_kv_layout(model, dtype, "auto")
    return layout["layers"] * (layout["latent"] + layout["indexer"])


def run_config(a, name: str, out: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_cp_kv.tools.offline import build_llm, prefix_cache_counters

    final_ctx = a.turns * (a.user_tokens + a.new_tokens)
    working_set = a.conversations * final_ctx
    n = a.pcp if a.pcp > 1 else a.tp
    kv_bytes = int(a.working_set_fraction * working_set * bytes_per_token(a.model, a.dtype))
    if name == "sharded_half":
        kv_bytes //= 2
    cpu = a.device == "cpu"
    # GPU: vLLM's custom all-reduce stays on (no gpu_mem option)
    gpu = {} if cpu else {"gpu_memory_utilization": a.gpu_mem}
    llm = build_llm(a.model, tp=a.tp, pcp=a.pcp, dtype=a.dtype, backend=a.backend,
                    kv_bytes=kv_bytes, rope="torch" if cpu else None,
                    shard=name.startswith("sharded"), max_model_len=final_ctx + 64,
                    max_num_seqs=a.max_num_seqs, enable_prefix_caching=True,
                    disable_log_stats=False, **gpu)
    cfg = llm.llm_engine.vllm_config
    sp = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    users = workload(a, cfg.model_config.get_vocab_size())
    history = [[] for _ in range(a.conversations)]
    turns, prompt_tokens, t0 = [], 0, time.perf_counter()
    for turn in range(a.turns):
        prompts = []
        for c in range(a.conversations):
            history[c] = history[c] + users[c][turn]
            prompts.append(TokensPrompt(prompt_token_ids=list(history[c])))
            prompt_tokens += len(history[c])
        before = prefix_cache_counters(llm)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t
        after = prefix_cache_counters(llm)
        for c, o in enumerate(outs):
            history[c] = history[c] + list(o.outputs[0].token_ids)
        turns.append({"turn": turn, "seconds": elapsed,
                      **{k: after[k] - before[k] for k in after}})
    total = time.perf_counter() - t0
    queries = sum(t.get("prefix_cache_queries", 0) for t in turns)
    hits = sum(t.get("prefix_cache_hits", 0) for t in turns)
    write_json(out, {"config": name, "kv_bytes_per_rank": kv_bytes, "shard_size": n,
                     "capacity_tokens": cfg.cache_config.kv_cache_size_tokens,
                     "prefix_caching": cfg.cache_config.enable_prefix_caching,
                     "working_set_tokens": working_set, "turns": turns,
                     "prompt_tokens": prompt_tokens, "queries": queries, "hits": hits,
                     # of all prompt tokens (queries is 0 where caching is off)
                     "hit_rate": hits / prompt_tokens,
                     "recomputed_tokens": prompt_tokens - hits, "total_seconds": total},
               indent=None)


def plot(res: dict, path: str) -> None:
    names = list(res["configs"])
    fig, axes = pyplot().subplots(1, 3, figsize=(12, 3.8))
    for ax, key, label in zip(axes, ("hit_rate", "recomputed_tokens", "total_seconds"),
                              ("prefix-cache hit rate", "prompt tokens recomputed",
                               "total time (s)")):
        ax.bar(names, [res["configs"][k][key] for k in names],
               color=["gray", "tab:blue", "tab:orange"][: len(names)])
        ax.set_title(label)
        for i, k in enumerate(names):
            v = res["configs"][k][key]
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom")
    fig.suptitle(f"{res['conversations']} conversations x {res['turns']} turns, same KV "
                 f"memory per rank (sharded_half: half) ({res['device']}, TP={res['tp']} PCP={res['pcp']})")
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=450)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--working-set-fraction", type=float, default=0.55)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pcp", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--run", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    import torch

    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.model is None:
        from vllm_cp_kv.tools.tiny_model import build_demo

        models = os.path.join(ROOT, ".work", "models") if a.device == "cpu" else "/root/models"
        a.model = build_demo(os.path.join(models, "tiny-dsv2-12l"),
                             gpu_heads=a.device != "cpu")
    if a.run:
        run_config(a, *a.run)
        return 0
    result_dir(a.out_dir)
    res = {k: getattr(a, k) for k in ("conversations", "turns", "user_tokens", "new_tokens",
                                      "working_set_fraction", "tp", "pcp", "model", "dtype",
                                      "device")}
    res.update(meta(), configs={})
    for name in ("unsharded", "sharded", "sharded_half"):
        out = os.path.join(a.out_dir, f"{name}.json")
        cmd = [sys.executable, os.path.abspath(__file__), a.out_dir, "--run", name, out]
        for key in ("conversations", "turns", "user_tokens", "new_tokens",
                    "working_set_fraction", "max_num_seqs", "tp", "pcp", "model", "dtype",
                    "gpu_mem"):
            cmd += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
        if a.backend:
            cmd += ["--backend", a.backend]
        with open(out + ".log", "w") as log:
            env = {k: v for k, v in os.environ.items()
                   if k != "VLLM_CPU_KVCACHE_SPACE"}  # else it overrides the budget
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT,
                           env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        with open(out) as f:
            res["configs"][name] = json.load(f)
    u, s = res["configs"]["unsharded"], res["configs"]["sharded"]
    res["hit_rate_ratio"] = s["hit_rate"] / u["hit_rate"] if u["hit_rate"] else None
    res["recomputed_ratio"] = s["recomputed_tokens"] / max(u["recomputed_tokens"], 1)
    res["time_ratio"] = s["total_seconds"] / u["total_seconds"]
    h = res["configs"]["sharded_half"]
    res["hit_rate_ratio_vs_half"] = s["hit_rate"] / h["hit_rate"] if h["hit_rate"] else None
    res["recomputed_ratio_vs_half"] = s["recomputed_tokens"] / max(h["recomputed_tokens"], 1)
    res["time_ratio_vs_half"] = s["total_seconds"] / h["total_seconds"]
    for name, r in res["configs"].items():
        print(f"{name:<10} capacity {r['capacity_tokens']:>8} tokens  hit rate "
              f"{r['hit_rate']:.3f}  recomputed {r['recomputed_tokens']:>8}  "
              f"time {r['total_seconds']:.1f} s")
    print(f"sharded/unsharded: hit rate x{res['hit_rate_ratio']}, recomputed "
          f"x{res['recomputed_ratio']:.2f}, time x{res['time_ratio']:.2f}")
    print(f"sharded/sharded_half: hit rate x{res['hit_rate_ratio_vs_half']}, recomputed "
          f"x{res['recomputed_ratio_vs_half']:.2f}, time x{res['time_ratio_vs_half']:.2f}")
    write_json(os.path.join(a.out_dir, "prefix_caching.json"), res)
    plot(res, os.path.join(a.out_dir, "prefix_caching.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
