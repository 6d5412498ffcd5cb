"""Latency of requests at low load through the example P/D pair, against one
instance of the same model: what the pair adds, and how much of it is the
transfer.

Starts the example servers as examples/disaggregated/README.md does (a TP=2 sharded prefill,
a TP=1 decode, the proxy) and, separately, one plain instance (TP=1), all
with ``vllm serve`` on this machine (CPU_MLA, block 16, PyTorch's rope);
sends sequential requests (one at a
time, a gap after each answer) of ~``--prompt-len`` random tokens and
``--max-tokens`` new ones, through the proxy and to the single instance, at
each gap of ``--gaps``; then drives each with ``vllm bench serve``
(``--load-requests`` random requests of ``--prompt-len`` tokens and
``--load-output-len`` new ones, ``--load-concurrency`` in flight, streamed:
TTFT p50/p90/p99). The decode's log gives each request's transfer time
(``received ... in X s``). Where the pair's added time goes
(``breakdown``, at the middle gap's p50s): the pair's two legs are also
timed from the client without the proxy (``parts``), against one instance's
first-token request and a request whose prompt it has cached (what the
decode leg does once the KV arrived). ``--code old`` runs the P/D servers
with another copy of the plugin (``.old/vllm_cp_kv``, e.g. the commit
before a change) for a before/after comparison in one run. ``--no-spin``
repeats the single instance and the new pair with vLLM's message-queue
readers spinning 50 ms instead of 1 s after each message
(``benchmarks/nospin``, a diagnostic, not part of the plugin): on a machine
with fewer cores than the pair has processes, those spinners take the
cores the other instance computes on.

``--device cuda`` (one GPU, scripts/gpu/onegpu/pd_device.sh): vLLM's
default mode (CUDA graphs), the tiny model with GPU head sizes, each server
a fixed KV budget (no memory profiling: they share the GPU), block 64, and a
TP=1 prefill (unsharded, cp_kv off): two ranks on one GPU would go through
the one-GPU harness, whose collectives cost milliseconds each and would
hide what this measures, the engine loop and the transfer.

Usage: python benchmarks/pd_latency.py OUT_DIR [--device cpu|cuda] [--code new,old] [--no-spin]
           [--gaps 0.1,0.3,1.0]
Writes OUT_DIR/pd_latency.json, pd_latency.png and the servers' logs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from common import (ROOT, free_port, meta, pyplot, result_dir, save_figure, wait_health,
                    write_json)

EXAMPLES = os.path.join(ROOT, "examples", "disaggregated")
OLD = os.path.join(ROOT, ".old")
NOSPIN = os.path.join(ROOT, "benchmarks", "nospin")
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
ROPE = '{"custom_ops":["all","-rotary_embedding"]}'  # vLLM 0.32's CPU rotary kernel is wrong for MLA
GPU_ENV = {"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}
# each GPU server: 2 GiB of KV, no profiling (the servers share the one GPU)
GPU_ARGS = ["--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(2 << 30)]
DEVICE = ["cpu"]  # --device


def post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode()[:500]}


class Servers:
    """Processes started in sessions of their own (killed whole), each with a log."""

    def __init__(self, out: str):
        self.out, self.procs = out, {}

    def start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        log = open(os.path.join(self.out, f"{name}.log"), "w")
        self.procs[name] = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return self.procs[name]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.procs = {}


def vllm_bin() -> str:
    """A folder with a ``vllm`` command first on PATH: the example scripts
    call ``vllm serve``; where vLLM is on PYTHONPATH only (the GPU payload)
    there is none, so a shim runs its CLI module with this Python."""
    bin_dir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bin_dir, "vllm")):
        return bin_dir
    shim = os.path.join(ROOT, ".work", "vllm-bin")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "vllm"), "w") as f:
        f.write(f'#!/bin/sh\nexec {sys.executable} -m vllm.entrypoints.cli.main "$@"\n')
    os.chmod(os.path.join(shim, "vllm"), 0o755)
    return shim


def base_env(package: str | None, nospin: bool = False) -> dict:
    path = f"{vllm_bin()}:{os.environ['PATH']}"
    if DEVICE[0] == "cuda":  # vLLM's default mode: no EAGER
        env = {**os.environ, **GPU_ENV, "PATH": path, "BLOCK_SIZE": "64", "TP": "1",
               "EXTRA_ARGS": " ".join(GPU_ARGS)}
    else:
        env = {**os.environ, **CPU_ENV, "PATH": path, "BLOCK_SIZE": "16", "EAGER": "1",
               "EXTRA_ARGS": f"--attention-backend CPU_MLA --compilation-config {ROPE}"}
    # another copy of the plugin first on the path; the spin diagnostic
    first = [d for d, on in ((package, bool(package)), (NOSPIN, nospin)) if on]
    if first:
        env["PYTHONPATH"] = ":".join([*first, *filter(None, [env.get("PYTHONPATH")])])
    return env


def start_pair(servers: Servers, model: str, transport: str, package: str | None,
               nospin: bool = False) -> tuple[str, str, str]:
    """Start the example pair; returns the proxy's, prefill's and decode's URLs."""
    env = base_env(package, nospin)
    pp, dp, xp, side = free_port(), free_port(), free_port(), free_port()
    prefill = servers.start("prefill", ["bash", f"{EXAMPLES}/start_prefill.sh", model,
                                        str(pp), transport, str(side)],
                            {**env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    decode = servers.start("decode", ["bash", f"{EXAMPLES}/start_decode.sh", model, str(dp),
                                      transport],
                           {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                            "ALLOWED_PREFILL_HOSTS": json.dumps([f"127.0.0.1:{side}"])})
    proxy = servers.start("proxy", [sys.executable, f"{EXAMPLES}/proxy.py", "--prefill",
                                    f"http://127.0.0.1:{pp}", "--decode",
                                    f"http://127.0.0.1:{dp}", "--port", str(xp)], env)
    for url, proc in ((f"http://127.0.0.1:{pp}", prefill), (f"http://127.0.0.1:{dp}", decode),
                      (f"http://127.0.0.1:{xp}", proxy)):
        wait_health(url, proc)
    return f"http://127.0.0.1:{xp}", f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"


def start_single(servers: Servers, model: str, nospin: bool = False) -> str:
    port = free_port()
    env = {**base_env(None, nospin), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    mode = ["--block-size", "64", *GPU_ARGS] if DEVICE[0] == "cuda" else [
        "--block-size", "16", "--enforce-eager", "--attention-backend", "CPU_MLA",
        "--compilation-config", ROPE]
    proc = servers.start("single", [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                                    model, "--port", str(port), "--host", "127.0.0.1",
                                    "--max-model-len", "1024", "--max-num-seqs", "8", *mode],
                         env)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, proc)
    return url


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    from vllm_cp_kv.tools.tiny_model import token_prompts

    return token_prompts([length] * n, vocab, seed=seed)


def one(url: str, model: str, prompt: list[int], max_tokens: int, **extra) -> float:
    return timed(url, model, prompt, max_tokens, **extra)[0]


def timed(url: str, model: str, prompt: list[int], max_tokens: int, **extra
          ) -> tuple[float, dict]:
    t0 = time.perf_counter()
    status, out = post(f"{url}/v1/completions", {"model": model, "prompt": prompt,
                                                 "max_tokens": max_tokens, "temperature": 0,
                                                 **extra})
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}: {out}")
    return time.perf_counter() - t0, out


def sequential(url: str, model: str, reqs, max_tokens: int, gap: float) -> list[float]:
    out = []
    for p in reqs:
        out.append(one(url, model, p, max_tokens))
        time.sleep(gap)
    return out


def bench_serve(url: str, model: str, a, out: str) -> dict:
    """``vllm bench serve`` against ``url`` (streamed completions): TTFT,
    TPOT and end-to-end percentiles from its JSON."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--backend", "vllm", "--model", model, "--tokenizer", model,
           "--host", host, "--port", port, "--dataset-name", "random",
           "--random-input-len", str(a.prompt_len), "--random-output-len",
           str(a.load_output_len), "--random-range-ratio", "0",
           "--num-prompts", str(a.load_requests), "--max-concurrency", str(a.load_concurrency),
           "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", out,
           "--result-filename", "bench_serve.json"]
    with open(os.path.join(out, "bench_serve.log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=base_env(None), stdout=log, stderr=subprocess.STDOUT,
                       check=True, timeout=1800)
    with open(os.path.join(out, "bench_serve.json")) as f:
        c = json.load(f)
    keys = [f"{p}_{m}_ms" for m in ("ttft", "tpot", "e2el") for p in ("p50", "p90", "p99")]
    return {"completed": c["completed"], **{k: round(c[k], 1) for k in keys}}


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {"n": len(xs), "p50_ms": round(1000 * statistics.median(xs), 1),
            "p90_ms": round(1000 * q(0.9), 1), "mean_ms": round(1000 * statistics.mean(xs), 1)}


def transfer_seconds(log: str) -> list[float]:
    with open(log) as f:
        return [float(s) for s in re.findall(r"prefill ranks in ([0-9.]+) s", f.read())]


def measure(url: str, model: str, a, vocab: int, seed: int, out: str,
            legs: tuple[str, str] | None = None) -> dict:
    """Sequential requests at each gap, the breakdown (``parts``), then the
    load. ``legs``: the pair's prefill and decode URLs, else a single
    instance."""
    one(url, model, prompts(1, a.prompt_len, vocab, seed + 99)[0], a.max_tokens)  # warm-up
    res = {"gaps": {}}
    for k, gap in enumerate(a.gaps):
        reqs = prompts(a.requests, a.prompt_len, vocab, seed + k)
        res["gaps"][str(gap)] = stats(sequential(url, model, reqs, a.max_tokens, gap))
    reqs = prompts(a.requests, a.prompt_len, vocab, seed + 50)
    if legs:  # the pulls of these requests only (the decode logs each as it ends)
        log = os.path.join(out, "decode.log")
        before = len(transfer_seconds(log))
        res["parts"] = pair_legs(*legs, model, reqs, a.max_tokens)
        res["parts"]["transfer"] = stats(transfer_seconds(log)[before:])
    else:
        res["parts"] = single_parts(url, model, reqs, a.max_tokens)
    res["load"] = bench_serve(url, model, a, out)
    return res


def single_parts(url: str, model: str, reqs, max_tokens: int, gap: float = 0.3) -> dict:
    """What a request's parts cost on one instance: its first token alone
    (what the pair's prefill leg does) and the same request again with its
    prompt cached (what the decode leg does after the transfer: the last
    prompt token recomputed, then the rest)."""
    first, cached = [], []
    for p in reqs:
        first.append(one(url, model, p, 1))
        time.sleep(gap)
        cached.append(one(url, model, p, max_tokens))
        time.sleep(gap)
    return {"first_token": stats(first), "cached_prompt": stats(cached)}


def pair_legs(prefill: str, decode: str, model: str, reqs, max_tokens: int,
              gap: float = 0.3) -> dict:
    """The pair's two legs timed from the client, without the proxy: the
    prefill (``max_tokens=1``, ``do_remote_decode``) and the decode (with the
    prefill's ``kv_transfer_params``: the transfer, then the request)."""
    pre, dec = [], []
    for p in reqs:
        t, out = timed(prefill, model, p, 1, kv_transfer_params={"do_remote_decode": True})
        pre.append(t)
        dec.append(one(decode, model, p, max_tokens, kv_transfer_params=out["kv_transfer_params"]))
        time.sleep(gap)
    return {"prefill_leg": stats(pre), "decode_leg": stats(dec)}


def breakdown(pair: dict, single: dict, gap: str) -> dict:
    """Where the pair's added latency (``added``: the pair's p50 minus one
    instance's at ``gap``, ms) goes; the parts sum to it:

    * ``transfer``: the pulls of the legs' requests (p50);
    * ``second_request``: two requests instead of one on one instance (a
      first-token request plus the same request with its prompt cached,
      minus the whole request): the fixed cost of the decode's own request;
    * ``proxy``: the pair through the proxy minus its two legs timed directly;
    * ``prefill_extra``, ``decode_extra``: each leg beyond its one-instance
      counterpart (the decode's also beyond the transfer): the engine loops.
    """
    p, s = pair["parts"], single["parts"]
    transfer = p["transfer"]["p50_ms"]
    first, cached = s["first_token"]["p50_ms"], s["cached_prompt"]["p50_ms"]
    whole, through = single["gaps"][gap]["p50_ms"], pair["gaps"][gap]["p50_ms"]
    out = {"added": through - whole, "transfer": transfer,
           "second_request": first + cached - whole,
           "proxy": through - p["prefill_leg"]["p50_ms"] - p["decode_leg"]["p50_ms"],
           "prefill_extra": p["prefill_leg"]["p50_ms"] - first,
           "decode_extra": p["decode_leg"]["p50_ms"] - cached - transfer}
    return {k: round(v, 1) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default=None, help="default: the held-out tiny model "
                    "(GPU: a tiny model with GPU head sizes)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--code", default="new", help="new, old or new,old (the P/D servers' plugin)")
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--no-spin", action="store_true",
                    help="also run single and pd-new with vLLM's reader spin cut to 50 ms")
    ap.add_argument("--gaps", default="0.1,0.3,1.0")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--load-requests", type=int, default=32)
    ap.add_argument("--load-output-len", type=int, default=16)
    ap.add_argument("--load-concurrency", type=int, default=4)
    a = ap.parse_args()
    a.gaps = [float(g) for g in a.gaps.split(",")]
    out = result_dir(a.out)
    from vllm_cp_kv.tools import tiny_model

    DEVICE[0] = a.device
    if a.model:
        model = a.model
    elif a.device == "cuda":  # FLASH_ATTN_MLA's head sizes (kv_lora_rank 512, rope 64)
        model = tiny_model.build(os.path.join(ROOT, ".work", "models", "pd-latency-gpu"),
                                 gpu_heads=True, moe=False, heads=8)
    else:
        model = tiny_model.build_held_out(os.path.join(ROOT, ".work", "models", "held-out"))
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    res = {**meta(), "args": {k: v for k, v in vars(a).items() if k != "out"},
           "model": model, "configs": {}}
    servers = Servers(out)
    runs = [("", False, a.code.split(","))] + ([("-nospin", True, ["new"])] if a.no_spin else [])
    try:
        for suffix, nospin, codes in runs:
            sub = result_dir(os.path.join(out, f"single{suffix}"))
            servers = Servers(sub)
            url = start_single(servers, model, nospin)
            res["configs"][f"single{suffix}"] = measure(url, model, a, vocab, 1, sub)
            servers.stop()
            for code in codes:
                name = f"pd-{code}{suffix}"
                sub = result_dir(os.path.join(out, name))
                servers = Servers(sub)
                url, *legs = start_pair(servers, model, a.transport,
                                        OLD if code == "old" else None, nospin)
                res["configs"][name] = measure(url, model, a, vocab, 1, sub, tuple(legs))
                servers.stop()
                moves = transfer_seconds(os.path.join(sub, "decode.log"))
                res["configs"][name]["transfer"] = stats(moves) if moves else None
                single = res["configs"][f"single{suffix}"]
                res["configs"][name]["added_p50_ms"] = {
                    g: round(v["p50_ms"] - single["gaps"][g]["p50_ms"], 1)
                    for g, v in res["configs"][name]["gaps"].items()}
                res["configs"][name]["breakdown"] = breakdown(
                    res["configs"][name], single, str(a.gaps[len(a.gaps) // 2]))
                write_json(os.path.join(out, "pd_latency.json"), res)
    finally:
        servers.stop()
    write_json(os.path.join(out, "pd_latency.json"), res)
    plot(res, os.path.join(out, "pd_latency.png"))
    print(json.dumps({k: {g: v["gaps"][g]["p50_ms"] for g in v["gaps"]}
                      for k, v in res["configs"].items()}))
    return 0


def plot(res: dict, path: str) -> None:
    plt = pyplot(optional=True)
    if plt is None:
        return
    configs = res["configs"]
    gaps = list(next(iter(configs.values()))["gaps"])
    pairs = {n: c["breakdown"] for n, c in configs.items() if c.get("breakdown")}
    fig, axes = plt.subplots(1, 3 if pairs else 2, figsize=(15 if pairs else 11, 3.8),
                             gridspec_kw={"width_ratios": [3, 2, 2][:3 if pairs else 2]})
    ax, bx = axes[0], axes[1]
    width = 0.8 / len(configs)
    for i, (name, c) in enumerate(configs.items()):
        xs = [j + i * width for j in range(len(gaps))]
        ax.bar(xs, [c["gaps"][g]["p50_ms"] for g in gaps], width, label=name)
        bx.bar([k + i * width for k in range(2)],
               [c["load"]["p50_ttft_ms"], c["load"]["p90_ttft_ms"]], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(gaps))],
                  [f"gap {g} s" for g in gaps])
    ax.set_yscale("log")
    ax.set_ylabel("request latency p50 (ms)")
    ax.set_title("sequential requests: P/D pair vs one instance", fontsize=9)
    ax.legend(fontsize=7)
    bx.set_xticks([k + 0.4 - width / 2 for k in range(2)], ["TTFT p50", "TTFT p90"])
    bx.set_yscale("log")
    bx.set_ylabel("ms")
    bx.set_title(f"vllm bench serve, {res['args']['load_concurrency']} in flight", fontsize=9)
    if pairs:  # where the added latency goes (stacked p50 parts)
        cx = axes[2]
        parts = [("transfer", "transfer"), ("second_request", "decode's own request"),
                 ("proxy", "proxy hops"), (None, "rest (engine loops)")]
        for i, (name, b) in enumerate(pairs.items()):
            bottom = 0.0
            for key, label in parts:
                v = b[key] if key else b["prefill_extra"] + b["decode_extra"]
                cx.bar(i, v, 0.6, bottom=bottom if v >= 0 else 0,
                       label=label if i == 0 else None,
                       color=f"C{parts.index((key, label)) + 3}")
                bottom += max(v, 0)
            cx.plot([i - 0.35, i + 0.35], [b["added"]] * 2, "k-", lw=2,
                    label="added (pair - single)" if i == 0 else None)
        cx.set_xticks(range(len(pairs)), list(pairs), fontsize=7)
        cx.set_ylabel("ms (p50)")
        cx.set_title("what the pair adds, by part", fontsize=9)
        cx.legend(fontsize=6)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
