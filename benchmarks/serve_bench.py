"""What a server gains: `vllm serve` unsharded and sharded at the same KV
memory per rank, and sharded at half of it, driven by vLLM's own client
(`vllm bench serve`), in one run.

Usage: python benchmarks/serve_bench.py OUT_DIR [--kv-mib 32] [--input-len 2000]
           [--output-len 128] [--num-prompts 32] [--concurrency 12] [--tp 2]
           [--model DIR] [--dtype float32] [--backend CPU_MLA] [--device cpu|cuda]
           [--onegpu [--onegpu-comm shm|gloo]] [--stream-interval N] [--configs ...]

Three servers, one after another, each with the same flags except the KV
memory and the plugin: ``unsharded`` (``--kv-mib`` per rank), ``sharded``
(the same memory: about twice the tokens) and ``sharded_half`` (half the
memory: about the unsharded capacity). Each gets the same random workload
(``--num-prompts`` requests of ``--input-len`` prompt and ``--output-len``
generated tokens, ignore-eos, at most ``--concurrency`` in flight), sized so
that the unsharded server cannot hold every request in flight: it must
queue or preempt. Reported per server (from ``vllm bench serve``'s JSON and
the server's ``/metrics``, sampled every 0.25 s): request throughput,
output tokens/s, TTFT and TPOT p50/p99, preemptions, the peak number of
running requests, the KV capacity, the CPU seconds each process used (by
role: workers, engine core, API server, client; what shares the host's
cores); and ``request_throughput_ratio``
(sharded / unsharded at equal memory), with the latency ratios of
``sharded_half`` against ``unsharded``. Writes ``serve_bench.json``,
``serve_bench.png`` and each server's log and client result.

CPU: vLLM 0.32 on CPU, ``VLLM_CPU_KVCACHE_SPACE`` unset (the KV memory is
``--kv-cache-memory-bytes``), PyTorch rope derived by the plugin for the
sharded servers and passed to the unsharded one, CPU_MLA (on CPUs with AMX
vLLM would choose AMX_MLA, whose prefill reads the whole view: docs/design.md).
GPU: ``--device cuda --backend FLASH_ATTN_MLA --dtype bfloat16`` (the demo
model is then built with GPU head sizes) on two GPUs; ``--onegpu`` runs the
two TP ranks on one GPU through the repo's one-GPU harness
(scripts/gpu/onegpu/: each rank 5% of the GPU's memory; collectives through
shared host memory, ``--onegpu-comm shm``, or gloo), with the client outside
the harness. ``--configs`` may name a subset; the
results of earlier calls into the same OUT_DIR are kept (one device call
per server fits the device's limit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from common import (ROOT, free_port, meta, pyplot, result_dir, save_figure, wait_health,
                    write_json)

CONFIGS = ("unsharded", "sharded", "sharded_half")
HARNESS = os.path.join(ROOT, "scripts", "gpu", "onegpu")
# vLLM's command line as a module: the GPU payload has no console scripts
VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def server_cmd(a, name: str, port: int) -> list[str]:
    kv = a.kv_mib * 2**20 // (2 if name == "sharded_half" else 1)
    cmd = [*VLLM, "serve", a.model,
           "--host", "127.0.0.1", "--port", str(port),
           "--tensor-parallel-size", str(a.tp), "--dtype", a.dtype,
           "--max-model-len", str(a.input_len + a.output_len + 16),
           "--kv-cache-memory-bytes", str(kv), "--enforce-eager", "--seed", "0"]
    if a.backend:
        cmd += ["--attention-backend", a.backend]
    if a.stream_interval > 1:  # vLLM's output batching: less frontend work per token
        cmd += ["--stream-interval", str(a.stream_interval)]
    if a.onegpu:  # two ranks share the one GPU (scripts/gpu/onegpu)
        cmd += ["--gpu-memory-utilization", "0.05", "--disable-custom-all-reduce"]
    if a.device == "cpu":
        cmd += ["--block-size", "16"]
    if name.startswith("sharded"):
        cmd += ["--additional-config", json.dumps({"cp_kv": {"enable": True}})]
    elif a.device == "cpu":  # the sharded servers get PyTorch's rope from the plugin
        cmd += ["--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]})]
    return cmd


def scrape(port: int) -> dict:
    """The server's /metrics: running requests, preemptions, KV capacity."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for key in ("vllm:num_requests_running", "vllm:num_preemptions_total",
                "vllm:num_requests_waiting"):
        vals = [float(m.group(1)) for m in re.finditer(
            rf"^{re.escape(key)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
        out[key] = sum(vals) if vals else None
    return out


def cpu_times(sessions: dict) -> dict:
    """CPU seconds (user + system) so far of every process in the sessions
    ``{sid: role}`` (the server's, with its children; the client's), by pid:
    ``{pid: (role, seconds)}``. A role of None names the process by vLLM's
    process title (``VLLM::EngineCore``, ``VLLM::Worker_TP0``, ...), the
    session leader "api_server", anything else "other"."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            sid = int(fields[3])  # field 6: the session id
            if sid not in sessions:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except (OSError, ValueError):
            continue
        name = sessions[sid] or (title.split()[0] if title.startswith("VLLM::") else
                                 "api_server" if int(pid) == sid else "other")
        out[int(pid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_by_role(snapshots: dict) -> dict:
    """The last CPU seconds seen of each pid, summed by role."""
    roles: dict = {}
    for role, sec in snapshots.values():
        roles[role] = roles.get(role, 0.0) + sec
    return {k: round(v, 2) for k, v in sorted(roles.items())}


def wait_ready(port: int, proc, timeout: float = 900) -> None:
    wait_health(f"http://127.0.0.1:{port}", proc, timeout)


def capacity_of(log: str) -> int | None:
    with open(log) as f:
        m = re.findall(r"(?:GPU|CPU) KV cache size: ([0-9,]+) tokens", f.read())
    return int(m[-1].replace(",", "")) if m else None


def run_config(a, name: str) -> dict:
    port = free_port()
    log = os.path.join(a.out_dir, f"{name}.server.log")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    server_env = dict(env)
    if a.onegpu:
        server_env.update(ONEGPU="1", ONEGPU_COMM=a.onegpu_comm, CUDA_VISIBLE_DEVICES="0",
                          PYTHONPATH=os.pathsep.join(
            p for p in (HARNESS, env.get("PYTHONPATH")) if p))
    with open(log, "w") as f:
        proc = subprocess.Popen(server_cmd(a, name, port), stdout=f, stderr=subprocess.STDOUT,
                                env=server_env, cwd=ROOT, start_new_session=True)
    peak, samples, stop = {"running": 0.0, "waiting": 0.0}, [], threading.Event()
    cpu_start, cpu_seen = {}, {}  # where the host's cores go, by process role
    sessions = {proc.pid: None}  # the client's joins once it starts
    try:
        wait_ready(port, proc)
        cpu_start = cpu_times(sessions)

        def sample():
            while not stop.is_set():
                try:
                    m = scrape(port)
                    samples.append((time.time(), m))
                    peak["running"] = max(peak["running"], m["vllm:num_requests_running"] or 0)
                    peak["waiting"] = max(peak["waiting"], m["vllm:num_requests_waiting"] or 0)
                except OSError:
                    pass
                cpu_seen.update(cpu_times(dict(sessions)))
                stop.wait(0.25)

        before = scrape(port)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        client = [*VLLM, "bench", "serve",
                  "--backend", "vllm", "--model", a.model, "--tokenizer", a.model,
                  "--host", "127.0.0.1", "--port", str(port),
                  "--dataset-name", "random", "--random-input-len", str(a.input_len),
                  "--random-output-len", str(a.output_len), "--random-range-ratio", "0",
                  "--num-prompts", str(a.num_prompts), "--max-concurrency",
                  str(a.concurrency), "--ignore-eos", "--seed", "0",
                  "--percentile-metrics", "ttft,tpot,itl,e2el",
                  "--metric-percentiles", "50,99", "--save-result",
                  "--result-dir", a.out_dir, "--result-filename", f"{name}.client.json"]
        with open(os.path.join(a.out_dir, f"{name}.client.log"), "w") as f:
            bench = subprocess.Popen(client, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=env, start_new_session=True)
            sessions[bench.pid] = "client"
            try:
                if bench.wait(a.timeout):
                    raise RuntimeError(f"vllm bench serve exited with {bench.returncode}")
            finally:
                if bench.poll() is None:
                    os.killpg(bench.pid, signal.SIGKILL)
        stop.set()
        sampler.join()
        after = scrape(port)
    finally:
        stop.set()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(os.path.join(a.out_dir, f"{name}.client.json")) as f:
        c = json.load(f)
    pre = "vllm:num_preemptions_total"
    return {
        "kv_bytes_per_rank": a.kv_mib * 2**20 // (2 if name == "sharded_half" else 1),
        "capacity_tokens": capacity_of(log),
        "completed": c.get("completed"), "duration_s": c.get("duration"),
        "request_throughput": c.get("request_throughput"),
        "output_throughput": c.get("output_throughput"),
        **{k: c.get(k) for k in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
                                 "p50_e2el_ms", "p99_e2el_ms", "mean_ttft_ms",
                                 "mean_tpot_ms")},
        "preemptions": (after[pre] or 0) - (before[pre] or 0),
        "peak_running": peak["running"], "peak_waiting": peak["waiting"],
        "metric_samples": len(samples),
        # CPU seconds during the run, by process (server's from readiness on)
        "cpu_seconds": cpu_by_role({pid: (role, sec - cpu_start.get(pid, (role, 0.0))[1])
                                    for pid, (role, sec) in cpu_seen.items()})}


def plot(res: dict, path: str) -> None:
    plt = pyplot(optional=True)
    if plt is None:
        return
    names = [n for n in CONFIGS if n in res["configs"]]
    keys = (("request_throughput", "requests/s"), ("peak_running", "peak running requests"),
            ("p50_ttft_ms", "TTFT p50 (ms)"), ("p50_tpot_ms", "TPOT p50 (ms)"),
            ("preemptions", "preemptions"))
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.6))
    for ax, (key, label) in zip(axes, keys):
        vals = [res["configs"][n][key] or 0 for n in names]
        ax.bar(names, vals, color=["gray", "tab:blue", "tab:orange"][: len(names)])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom")
    fig.suptitle(f"vllm serve TP={res['tp']}, {res['num_prompts']} requests of "
                 f"{res['input_len']} + {res['output_len']} tokens, concurrency "
                 f"{res['concurrency']}, {res['kv_mib']} MiB KV per rank "
                 f"(sharded_half: half) [{res['device']}]")
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--kv-mib", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="CPU_MLA")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--onegpu", action="store_true",
                    help="cuda: both TP ranks on one GPU (the one-GPU harness)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="vLLM's --stream-interval for every server (tokens per streamed chunk)")
    ap.add_argument("--onegpu-comm", default="shm", choices=["shm", "gloo"],
                    help="--onegpu: the harness's collectives (scripts/gpu/onegpu/shm_comm.py)")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--summarize", action="store_true",
                    help="only recompute the ratios and plot of OUT_DIR's results")
    a = ap.parse_args()
    if a.summarize:
        with open(os.path.join(a.out_dir, "serve_bench.json")) as f:
            summarize(json.load(f), a.out_dir)
        return 0
    if a.model is None:
        from vllm_cp_kv.tools.tiny_model import build_demo

        a.model = build_demo(os.path.join(ROOT, ".work", "models", "tiny-dsv2-12l"),
                             gpu_heads=a.device == "cuda")
    result_dir(a.out_dir)
    res = {k: getattr(a, k) for k in ("kv_mib", "input_len", "output_len", "num_prompts",
                                      "concurrency", "tp", "model", "dtype", "backend",
                                      "device", "stream_interval")}
    res.update(meta(), onegpu=a.onegpu, configs={})
    if a.onegpu:
        res["onegpu_comm"] = a.onegpu_comm
    path = os.path.join(a.out_dir, "serve_bench.json")
    if os.path.exists(path):  # an earlier call's servers (same flags)
        with open(path) as f:
            res["configs"] = json.load(f).get("configs", {})
    for name in a.configs.split(","):
        res["configs"][name] = run_config(a, name)
        print(name, json.dumps(res["configs"][name]), flush=True)
        write_json(path, res)
    summarize(res, a.out_dir)
    return 0


def summarize(res: dict, out_dir: str) -> None:
    """The ratios (and the capacities from the server logs), JSON and plot."""
    cfg = res["configs"]
    for name, run in cfg.items():
        run["capacity_tokens"] = capacity_of(os.path.join(out_dir, f"{name}.server.log"))
    if "unsharded" in cfg and "sharded" in cfg:
        u, s = cfg["unsharded"], cfg["sharded"]
        res["request_throughput_ratio"] = s["request_throughput"] / u["request_throughput"]
        res["output_throughput_ratio"] = s["output_throughput"] / u["output_throughput"]
        res["peak_running_ratio"] = s["peak_running"] / max(u["peak_running"], 1)
        res["capacity_ratio"] = (s["capacity_tokens"] or 0) / max(u["capacity_tokens"] or 1, 1)
    if "unsharded" in cfg and "sharded_half" in cfg:
        u, h = cfg["unsharded"], cfg["sharded_half"]
        res["half_memory_latency_ratios"] = {
            k: h[k] / u[k] for k in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")
            if h.get(k) and u.get(k)}
    write_json(os.path.join(out_dir, "serve_bench.json"), res)
    plot(res, os.path.join(out_dir, "serve_bench.png"))
    print(json.dumps({k: v for k, v in res.items() if k.endswith("ratio") or
                      k.endswith("ratios")}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
