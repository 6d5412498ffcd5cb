"""Time to first token in real vLLM on GPU, one parallel layout per process.

Usage: python benchmarks/gpu_vllm_ttft.py MODEL OUT_JSON --pcp 2 [--shard]
           [--lens 8192,32768,65536] [--reps 5] [--profile DIR]
MODEL: ``python -m vllm_cp_kv.tools.tiny_model DIR --v3-attention`` (2 layers,
DeepSeek-V3 attention shapes). Random-token prompts, ``max_tokens=1``, one
warm-up, then the median of ``reps`` runs per length (a fresh prompt each
time, so nothing is cached). ``gpu_vllm_checks.py`` runs it for sharded and
replicated PCP in the same lease and reports ratios.

``--profile DIR``: after the timed runs, one more prompt of the longest
length under vLLM's torch profiler (every worker writes a trace to DIR); the
result JSON gets a per-rank summary of the traces (GPU time per kernel, GPU
busy time vs the traced span, host-side syncs), to compare two layouts.
"""

import argparse
import glob
import gzip
import json
import os
import random
import statistics
import time
from collections import defaultdict

from common import write_json  # (also puts the repo root on sys.path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--pcp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--shard", action="store_true")
    ap.add_argument("--lens", default="8192,32768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--profile", default=None, metavar="DIR")
    ap.add_argument("--cp-kv", default="{}", help='more cp_kv options, e.g. \'{"prefetch": true}\'')
    ap.add_argument("--dcp", type=int, default=1, help="vLLM's own DCP (no plugin)")
    a = ap.parse_args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_cp_kv.tools.offline import build_llm

    lens = [int(x) for x in a.lens.split(",")]
    kw = {}
    if a.profile:
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": a.profile,
                                 "torch_profiler_with_stack": False}
    llm = build_llm(a.model, tp=a.tp, pcp=a.pcp, dcp=a.dcp, dtype="bfloat16",
                    gpu_mem=a.gpu_mem, cp_kv=json.loads(a.cp_kv) if a.shard else None,
                    max_model_len=max(lens) + 64, max_num_seqs=4, **kw)
    vc = llm.llm_engine.vllm_config
    res = {"pcp": a.pcp, "tp": a.tp, "shard": a.shard, "dcp": a.dcp,
           "cp_kv": json.loads(a.cp_kv) if a.shard else None,
           "block_size": vc.cache_config.block_size,
           "capacity_tokens": vc.cache_config.num_gpu_blocks * vc.cache_config.block_size
           * vc.parallel_config.decode_context_parallel_size,
           "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens}
    rnd = random.Random(0)
    sp = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt(n):
        return TokensPrompt(prompt_token_ids=[rnd.randrange(3, 1000) for _ in range(n)])

    llm.generate([prompt(lens[0])], sp, use_tqdm=False)  # warm-up
    res["ttft_ms"] = {}
    for n in lens:
        times = []
        for _ in range(a.reps):
            p = prompt(n)
            t0 = time.perf_counter()
            llm.generate([p], sp, use_tqdm=False)
            times.append(1000 * (time.perf_counter() - t0))
        res["ttft_ms"][str(n)] = {"median": round(statistics.median(times), 2),
                                  "min": round(min(times), 2),
                                  "all": [round(t, 2) for t in times]}
    if a.profile:
        llm.start_profile()
        llm.generate([prompt(lens[-1])], sp, use_tqdm=False)
        llm.stop_profile()
        res["profile"] = summarize_traces(a.profile)
    write_json(a.out, res, indent=None)
    print("RESULT", json.dumps(res))


def summarize_traces(path, top=30):
    """Per trace file (one per worker): GPU microseconds per kernel name (the
    ``top`` largest), total kernel/memcpy time, the span from the first to
    the last GPU event, and host-side synchronizations."""
    out = {}
    for fn in sorted(glob.glob(f"{path}/**/*.json*", recursive=True)):
        opener = gzip.open if fn.endswith(".gz") else open
        with opener(fn, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        per, cpu = defaultdict(float), defaultdict(float)
        gpu, syncs = [], defaultdict(lambda: [0, 0.0])
        for e in events:
            cat, dur = e.get("cat", ""), float(e.get("dur", 0) or 0)
            if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
                per[e.get("name", "?")[:120]] += dur
                gpu.append((float(e["ts"]), float(e["ts"]) + dur))
            elif cat in ("cpu_op", "user_annotation", "python_function"):
                cpu[e.get("name", "?")[:120]] += dur
            elif cat == "cuda_runtime" and ("Synchronize" in e.get("name", "")
                                            or e.get("name") == "cudaMemcpyAsync"):
                syncs[e["name"]][0] += 1
                syncs[e["name"]][1] += dur
        busy = sum(b - a for a, b in gpu)
        span = (max(b for _, b in gpu) - min(a for a, _ in gpu)) if gpu else 0.0
        out[os.path.relpath(fn, path)] = {
            "gpu_busy_us": round(busy, 1), "gpu_span_us": round(span, 1),
            "kernels_us": {k: round(v, 1) for k, v in
                           sorted(per.items(), key=lambda kv: -kv[1])[:top]},
            "cpu_ops_us": {k: round(v, 1) for k, v in
                           sorted(cpu.items(), key=lambda kv: -kv[1])[:top]},
            "host_syncs": {k: [n, round(t, 1)] for k, (n, t) in syncs.items()}}
    return out


if __name__ == "__main__":
    main()
