"""The one-GPU harness (scripts/gpu/onegpu) gives the answers of vLLM's own
communicator: the GPU checks run real vLLM ranks on one H200 through its
``OneGPUComm`` (torch.distributed on gloo, or with ``ONEGPU_COMM=shm`` its
collectives through shared host memory: the GPU serving benchmark's), so
here, on CPU, the same
communicator replaces vLLM's CPU communicator (the harness's
``ONEGPU_CPU_COMM=1``) in a sharded TP=2 run (the TP all-reduces, the
plugin's gathers, the LSE merge), and the result must equal the run with
vLLM's own communicator: float32, CPU_MLA, greedy tokens and logprobs
identical.
"""

import os
import subprocess
import sys

import pytest
from conftest import HARNESS, harness_env, needs_vllm, run_generate
ARGS = ("--dtype", "float32", "--backend", "CPU_MLA", "--max-model-len", "1024",
        "--token-prompts", "30,200,500,700", "--max-tokens", "16", "--shard", "--stats")


@pytest.fixture(scope="module")
def own(held_out, tmp_path_factory):
    """The run with vLLM's own CPU communicator (one for both transports)."""
    return run_generate(held_out, str(tmp_path_factory.mktemp("own")), "own", *ARGS)


@needs_vllm
@pytest.mark.parametrize("comm", ["gloo", "shm"])
def test_harness_communicator_matches_vllms(held_out, own, tmp_path, comm):
    d = str(tmp_path)
    harness = run_generate(held_out, d, "harness", *ARGS,
                           env=harness_env(ONEGPU_CPU_COMM="1", ONEGPU_COMM=comm))
    # the harness's communicator served the TP and shard groups of both ranks
    lines = [ln for ln in harness["log"].splitlines() if "ONEGPU" in ln and " comm " in ln]
    assert any(" tp:" in ln for ln in lines) and any(" dcp:" in ln for ln in lines), lines
    tp = [ln for ln in lines if " tp:" in ln]
    assert all(("collectives=shm" in ln) == (comm == "shm") for ln in tp), tp
    assert not any("ONEGPU" in ln for ln in own["log"].splitlines())
    assert own["tokens"] == harness["tokens"]
    assert own["logprobs"] == harness["logprobs"]
    # the plugin's collectives moved the same bytes through either communicator
    assert [s["decode_bytes"] for s in own["stats"]] == \
        [s["decode_bytes"] for s in harness["stats"]]


def test_shm_collectives_match_torch():
    """scripts/gpu/onegpu/shm_check.py (the GPU run's first step) on CPU:
    all-reduce, all-gather, reduce-scatter of 2 and 3 ranks equal torch's,
    a tensor over a slot is refused, no shared file is left."""
    proc = subprocess.run([sys.executable, os.path.join(HARNESS, "shm_check.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("collectives equal torch's") == 5, proc.stdout
