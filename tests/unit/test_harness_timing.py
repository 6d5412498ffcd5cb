"""The first-token diagnosis tools (issue 51's cold prompt):
``harness/run_vllm.py --step-times`` records each engine step of a wave, and
``benchmarks/trace_steps.py`` sums a profiler trace. Both checked against
brute force on made-up input (the GPU runs are in benchmarks/results)."""

import gzip
import importlib.util
import json
import os
import random
from types import SimpleNamespace

from harness import run_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location(
    "trace_steps", os.path.join(ROOT, "benchmarks", "trace_steps.py"))
trace_steps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_steps)


def test_step_times_records_each_step_with_tokens_and_resets():
    calls = []
    worker = SimpleNamespace(execute_model=lambda out: calls.append(out) or "ran",
                             sample_tokens=lambda: calls.append("sample") or "sampled")
    assert run_vllm._time_steps(worker) and run_vllm._time_steps(worker)  # wraps once
    for n in ({"a": 5, "b": 3}, {}, {"a": 1}):  # an empty step is not recorded
        assert worker.execute_model(SimpleNamespace(num_scheduled_tokens=n)) == "ran"
    assert worker.sample_tokens() == "sampled"  # timed into the last step's row
    assert len(calls) == 4  # each call ran once: nothing wrapped twice
    rows = run_vllm._step_times(worker)
    assert [r[0] for r in rows] == [8, 1] and rows[0][1] == 0.0
    assert all(r[2] >= 0 for r in rows) and rows[0][5] == 0.0 and rows[1][5] >= 0
    assert abs(rows[1][6] - rows[0][6] - rows[1][1]) < 1e-5
    assert rows[0][7] is None and rows[1][7] >= rows[1][6] + rows[1][2] / 1e3 - 1e-6
    assert rows[0][8] is None and rows[1][8] is None  # no GPU here
    assert run_vllm._step_times(worker) == []  # reset
    worker.execute_model(SimpleNamespace(num_scheduled_tokens={"a": 2}))
    worker.sample_tokens()
    worker.execute_model(SimpleNamespace(num_scheduled_tokens={}))  # no row
    end = worker.cp_kv_step_times[-1][5]
    worker.sample_tokens()  # an empty step's sampling: not timed into the row before
    assert worker.cp_kv_step_times[-1][5] == end and len(run_vllm._step_times(worker)) == 1


def _brute_busy(spans):
    """Busy ms by marking every microsecond."""
    on = set()
    for s, e in spans:
        on.update(range(s, e))
    return len(on) / 1e3


def test_trace_summary_matches_brute_force(tmp_path):
    rng = random.Random(3)
    events, spans = [], []
    for i in range(200):
        s = rng.randrange(0, 50_000)
        d = rng.randrange(1, 900)
        name = rng.choice(["ncclDevKernel_AllGather", "flash_fwd_mla", "sm90_xmma_gemm", "elementwise"])
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": s, "dur": d})
        spans.append((s, s + d))
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 5, "dur": 2000})
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 9})
    path = tmp_path / "r0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = trace_steps.summarize(str(path))
    busy = _brute_busy(spans)
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3
    assert abs(got["gpu_busy_ms"] - busy) < 1e-6
    assert abs(got["gpu_idle_ms"] - (span - busy)) < 1e-3
    assert got["nccl_kernels"] == sum(e["name"].startswith("nccl") for e in events)
    assert got["host_waits"] == {"cudaStreamSynchronize": {"n": 1, "ms": 2.0}}
    kinds = got["kernel_ms_by_kind"]
    assert abs(sum(kinds.values()) - sum(e - s for s, e in spans) / 1e3) < 1e-2
    # a gap over half a millisecond is listed, a shorter one is not
    two = tmp_path / "gap.pt.trace.json"
    two.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 410, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 1420, "dur": 10}]}))
    g = trace_steps.summarize(str(two))
    assert g["idle_gaps_over_half_ms"] == [1.0] and g["gpu_busy_ms"] == 0.03


def test_spans_splits_a_wave_into_gpu_span_and_host_time_before_and_after():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_context

    # two steps: the first enters 5 ms after the wave's start, the second's
    # GPU work ends 30 ms after the first entry, its sampling's 4 ms later;
    # the last sample_tokens returns 40 ms in, the wave ends at 50 ms
    clock = 100.0
    rows = [[8, 0.0, 2.0, 10.0, 0.0, 0.5, clock + 0.005, clock + 0.008, 10.5],
            [8, 0.01, 2.0, 20.0, 10.0, 1.0, clock + 0.015, clock + 0.040, 34.0]]
    got = gpu_context.spans([{"seconds": 0.050, "clock": clock, "step_times": rows}])
    assert got["gpu_span_ms"] == [30.0] and got["outside_ms"] == [20.0]
    assert got["before_ms"] == [5.0] and got["after_ms"] == [10.0]
    assert got["sample_gpu_ms"] == [4.0] and got["last_step_host_ms"] == [2.0]
    # rows of an older harness (no clock columns): only the span and the rest
    old = gpu_context.spans([{"seconds": 0.050, "step_times": [r[:5] for r in rows]}])
    assert "before_ms" not in old and old["outside_ms"] == [20.0]


def test_stacks_gives_each_wait_its_frames_and_each_function_its_own_time():
    def ev(name, ts, dur, cat="python_function", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [ev("A", 0, 1000), ev("B", 100, 500), ev("C", 700, 200),
              ev("cudaStreamSynchronize", 200, 300, cat="cuda_runtime"),
              ev("cudaLaunchKernel", 750, 10, cat="cuda_runtime"),  # not a wait
              ev("D", 0, 400, tid=2)]  # another thread: not around the wait
    got = trace_steps.stacks(events, min_wait_ms=0.1)
    assert got["waits"] == [{"call": "cudaStreamSynchronize", "ms": 0.3, "frames": ["A", "B"]}]
    assert got["own_ms"] == {"B": 0.5, "D": 0.4, "A": 0.3, "C": 0.2}
    assert trace_steps.stacks(events, min_wait_ms=0.5)["waits"] == []
