"""Disaggregated prefill with all prompts in flight at once (offline, no
HTTP): a sharded TP=2 prefill instance (cp_kv, ``kv_producer``) hands its KV
to an unsharded TP=1 decode instance (``kv_consumer``) over NIXL and over
Mooncake, real vLLM on CPU (``vllm_cp_kv.tools.pd_offline``, about 2.5
minutes each).

Asserted against one unsharded TP=1 instance running the same 8 prompts as
one batch: identical greedy tokens (32 per prompt) for every prompt, the
prefill instance's own first token equal to the reference's, every request's
KV received (the decode reports each prompt's token count) and every request
complete.

The settings that make identity exact (docs/disaggregated.md, "Status"):
fp32 with the CPU_MLA backend (AMX_MLA is bf16 only), and the PyTorch rope
instead of vLLM 0.32's CPU rotary kernel, which is wrong for MLA and makes
the outputs depend on the batch layout (the tool's default). The transfer
timeout and block expiry are raised only so that a loaded 2-core machine
does not fail requests; they do not change what is compared.

Also a regression test for bugs that only concurrent receives show: UCX
calls from several receive threads crashed the decode worker (segfault in
``uct_cma_ep_tx``), the side channel's listen backlog of 1 stalled
connections until the prefill side expired the requests, per-conversation
progress loops starved the machine, and concurrent Mooncake reads failed
(``-1``) until they were serialized.

Not here, and why: the negative control (dropping the logical positions must
change the result) is asserted on the transferred bytes, NIXL and Mooncake,
in tests/test_transfer_dist.py (seconds, not minutes); a P/D run with
``--drop-positions`` is recorded in benchmarks/results/cpu-2026-11-30-pd-offline.
"""

import json
import os
import subprocess
import sys

import pytest

from builders import free_port
from conftest import CPU_ENV, ROOT, needs_vllm

pytestmark = needs_vllm


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_pd_identical_to_single_instance(tiny_dsv2, tmp_path, transport):
    work = str(tmp_path / "pd")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_cp_kv.tools.pd_offline", tiny_dsv2, work,
         "--transport", transport, "--decode-tp", "1", "--dtype", "float32",
         "--backend", "CPU_MLA", "--block-size", "16",
         "--transfer-timeout", "120", "--blocks-expiry", "300",
         "--port", str(free_port(consecutive=2)), "--timeout", "400"],
        env={**os.environ, **CPU_ENV}, cwd=ROOT, capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(work, "pd_result.json")) as f:
        res = json.load(f)
    logs = {r: open(os.path.join(work, f"{r}.log")).read()[-3000:]
            for r in ("prefill", "decode")}
    assert res["rc"] == [0, 0, 0], (res, logs)
    # every request's KV arrived
    assert res["received_tokens"] == sorted(res["prompt_lens"]), res
    with open(os.path.join(work, "decode.json")) as f:
        decode = json.load(f)
    assert [len(t) for t in decode["tokens"]] == [32] * 8
    # the tokens equal the single instance's, from the first one on
    assert res["prefill_first_token_same"] == [True] * 8, res
    assert res["identical"] == res["prompts"] == 8, res
