"""Demo: a prompt that does not fit in one rank's KV memory runs once the
cache is sharded, with the same answer as a server given twice the memory.

Run through ``bash scripts/demo.sh`` (sets up the environment first), or
directly: ``python examples/demo_offline.py [--workdir DIR]``.

A tiny DeepSeek-V2 (MLA, 12 layers, random weights, built offline), vLLM's
offline ``LLM`` API on CPU with tensor parallelism 2, and the same long
prompt (3,000 token ids) three times, each run in its own process:

1. plain vLLM, 80 MiB of KV memory per rank: vLLM refuses to start for a
   3,200-token request (its own message is shown);
2. the same with ``additional_config={"cp_kv": {"enable": True}}``: every
   KV block lives on one rank only, so the two ranks hold twice the tokens,
   and the request runs;
3. plain vLLM with twice the memory (160 MiB per rank): the reference.

Float32 with the CPU_MLA backend, so that "the same answer" is exact; all
runs use PyTorch's rope (cp_kv derives it on CPU; vLLM 0.32's CPU rotary
kernel is wrong for MLA, docs/design.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20
KV_PER_RANK = 80 * MIB
PROMPT_TOKENS, NEW_TOKENS, MAX_MODEL_LEN = 3000, 32, 3200


def run_one(model: str, out: str, shard: bool, kv_bytes: int) -> None:
    """One configuration (in a fresh process: vLLM's workers start fresh)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_cp_kv.tools.offline import build_llm
    from vllm_cp_kv.tools.tiny_model import token_prompts

    result: dict = {"shard": shard, "kv_bytes": kv_bytes}
    try:
        llm = build_llm(model, tp=2, dtype="float32", backend="CPU_MLA", rope="torch",
                        kv_bytes=kv_bytes, shard=shard, max_model_len=MAX_MODEL_LEN,
                        max_num_seqs=1)
    except Exception as e:  # vLLM's own refusal
        result["refused"] = str(e).strip().splitlines()[0]
        with open(out, "w") as f:
            json.dump(result, f)
        return
    cfg = llm.llm_engine.vllm_config
    ids = token_prompts([PROMPT_TOKENS], cfg.model_config.get_vocab_size())[0]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp)
    result.update(tokens=list(outs[0].outputs[0].token_ids),
                  capacity_tokens=cfg.cache_config.kv_cache_size_tokens,
                  shard_size=cfg.parallel_config.decode_context_parallel_size,
                  block_size=cfg.cache_config.block_size)
    with open(out, "w") as f:
        json.dump(result, f)


def launch(model: str, workdir: str, name: str, shard: bool, kv_bytes: int) -> dict:
    out = os.path.join(workdir, f"{name}.json")
    env = {k: v for k, v in os.environ.items()
           if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override kv_cache_memory_bytes
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [sys.executable, os.path.abspath(__file__), "--run", model, out,
           str(int(shard)), str(kv_bytes)]
    with open(out + ".log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT,
                       cwd=ROOT, env=env)
    with open(out) as f:
        return json.load(f)


def capacity(run: dict) -> int | None:
    """The engine's KV capacity in tokens; for a refused run, the maximum
    length vLLM computed from the same memory (its message says it)."""
    if "capacity_tokens" in run:
        return run["capacity_tokens"]
    m = re.search(r"estimated maximum model length is (\d+)", run.get("refused", ""))
    return int(m.group(1)) if m else None


def row(label: str, run: dict) -> str:
    cap = capacity(run)
    outcome = (f"refused: a {MAX_MODEL_LEN:,}-token request does not fit" if "refused" in run
               else f"served, {len(run['tokens'])} new tokens")
    return (f"  {label:<33}{run['kv_bytes'] // MIB:>6} MiB"
            f"{(f'{cap:,}' if cap else '-'):>13}   {outcome}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(ROOT, ".work", "demo"))
    ap.add_argument("--run", nargs=4, metavar=("MODEL", "OUT", "SHARD", "KV_BYTES"),
                    help=argparse.SUPPRESS)  # internal: one configuration
    a = ap.parse_args()
    if a.run:
        model, out, shard, kv_bytes = a.run
        run_one(model, out, shard == "1", int(kv_bytes))
        return 0
    os.makedirs(a.workdir, exist_ok=True)
    from vllm_cp_kv.tools.tiny_model import build_demo

    model = build_demo(os.path.join(a.workdir, "tiny-dsv2-12l"))
    print(f"model:   {model}\n         tiny DeepSeek-V2 (MLA), 12 layers, random weights, "
          "built offline")
    print(f"request: {PROMPT_TOKENS:,} prompt tokens + {NEW_TOKENS} greedy tokens "
          f"(max_model_len {MAX_MODEL_LEN:,}); vLLM on CPU, tensor parallel 2, float32\n")
    plain = launch(model, a.workdir, "plain", False, KV_PER_RANK)
    sharded = launch(model, a.workdir, "sharded", True, KV_PER_RANK)
    double = launch(model, a.workdir, "plain_2x", False, 2 * KV_PER_RANK)
    print(f"  {'run':<33}{'KV memory':>10}{'KV capacity':>13}   outcome")
    print(f"  {'':<33}{'per rank':>10}{'(tokens)':>13}")
    print(row("1. plain vLLM", plain))
    print(row("2. vLLM + cp_kv (KV sharded)", sharded))
    print(row("3. plain vLLM, twice the memory", double))
    print()
    if "refused" in plain:
        print("vLLM's own message for run 1:")
        print("  " + plain["refused"].split(". Try ")[0] + ".")
        print()
    same = "tokens" in sharded and sharded["tokens"] == double.get("tokens")
    n = sharded.get("shard_size", 0)
    print("KV capacity: the tokens of KV the engine can hold at that memory (vLLM's own")
    print("figure; for run 1 the maximum length vLLM computed before refusing).")
    if capacity(plain) and capacity(sharded):
        print(f"cp_kv:       {n} ranks, each logical block of {sharded['block_size']} tokens "
              f"on one rank only: {capacity(sharded) / capacity(plain):.2f}x the")
        print("             capacity at the same memory (2x, less the workspace a prefill "
              "reads its")
        print("             cached context through: 1-2% of the KV memory).")
    print(f"answer:      greedy tokens of runs 2 and 3 "
          f"{'identical' if same else 'DIFFERENT'} "
          f"({sum(x == y for x, y in zip(sharded.get('tokens', []), double.get('tokens', [])))}"
          f" of {NEW_TOKENS}): the sharded run answers as a server with twice the memory.")
    ok = "refused" in plain and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
