"""Disaggregated prefill with all prompts in flight at once (offline, no
HTTP): a sharded TP=2 prefill instance (cp_kv, ``kv_producer``) hands its KV
to an unsharded TP=1 decode instance (``kv_consumer``) over NIXL and over
Mooncake (opt-in: ``VLLM_CP_KV_RUN_PD_E2E=1``), real vLLM on CPU
(``vllm_cp_kv.tools.pd_offline``, about 3 minutes each on 2 cores;
docs/disaggregated.md, "Status").

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

The NIXL run also runs a second wave (each prompt plus a new 24-token
suffix) on the same instances once the decode finished wave 1: it must hit
the prefill instance's prefix cache (vLLM's counters) on blocks that went
through the connector's delayed free, the decode must still receive every
wave-2 prompt token, and the tokens must equal the single instance's.
Both runs also check that both caches end empty (every block free: the
delayed free leaks nothing, shared cached blocks included) and the
connector's transfer figures from vLLM's stats channel: one successful pull
per request, none failed, and exactly the bytes of the blocks moved (from the
model config: layers x block size x 576 values x 4 bytes per block).

Not here, and why: the negative control (dropping the logical positions must
change the result) is asserted on the transferred bytes, NIXL and Mooncake,
in tests/pd/test_transfer_dist.py (seconds, not minutes); a P/D run with
the positions dropped (then ``--drop-positions``, now the decode test hook of
scripts/gpu/onegpu/pd_hooks.py) is recorded in
benchmarks/results/cpu-2026-11-30-pd-offline.
"""

import json
import os
import subprocess
import sys

import pytest

from builders import free_port
from conftest import CPU_ENV, FORK_WORKERS, ROOT, needs_vllm

pytestmark = needs_vllm


WAVES = {"nixl": 2, "mooncake": 1}
# Mooncake through real vLLM is opt-in, like the HTTP Mooncake tests: the
# default suite must stay well under 30 minutes on 2 cores, and Mooncake's
# bytes are checked there by tests/pd/test_transfer_dist.py (same connector code
# path as NIXL from the manifest on; docs/disaggregated.md, "Status").
MOONCAKE = pytest.param("mooncake", marks=pytest.mark.skipif(
    os.environ.get("VLLM_CP_KV_RUN_PD_E2E") != "1",
    reason="opt-in (VLLM_CP_KV_RUN_PD_E2E=1): Mooncake offline P/D, about 3 more "
           "minutes on 2 cores"))


def page_bytes(model, block_size=16, dtype_bytes=4):
    """One block of every layer's MLA latent, from the model config."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    return (cfg["num_hidden_layers"] * block_size
            * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * dtype_bytes)


@pytest.mark.parametrize("transport", ["nixl", MOONCAKE])
def test_pd_identical_to_single_instance(tiny_dsv2, tmp_path, transport):
    work = str(tmp_path / "pd")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_cp_kv.tools.pd_offline", tiny_dsv2, work,
         "--transport", transport, "--decode-tp", "1", "--dtype", "float32",
         "--backend", "CPU_MLA", "--block-size", "16",
         "--transfer-timeout", "120", "--blocks-expiry", "300",
         "--waves", str(WAVES[transport]), *(["--floor"] if transport == "nixl" else []),
         "--port", str(free_port(consecutive=2)), "--timeout", "400"],
        env={**os.environ, **CPU_ENV, **FORK_WORKERS}, cwd=ROOT, capture_output=True, text=True,
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
    if transport == "nixl":  # --floor: the prefill's layout (TP=2) unsharded, no
        # connector, next to the reference: its first differences per prompt
        with open(os.path.join(work, "floor.json")) as f:
            floor = json.load(f)
        with open(os.path.join(work, "reference.json")) as f:
            ref = json.load(f)
        assert [len(t) for t in floor["tokens"]] == [32] * 8
        assert res["floor_rc"] == 0, res
        # the summary's first differences, against a count of our own
        want = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                for a, b in zip(ref["tokens"], floor["tokens"])]
        assert res["floor_first_diff"] == want, res
    assert res["identical"] == res["prompts"] == 8, res
    # both caches end empty: every block freed, shared cached blocks included
    assert res["prefill_cache_empty_after_s"] is not None, res
    assert res["decode_cache_empty_after_s"] is not None, res
    # vLLM's stats channel: one pull per request, the exact bytes of the blocks
    waves = res["wave_results"]
    lens = [n for w in waves for n in w["prompt_lens"]]
    assert res["decode_transfer_metrics"]["ok"] == len(lens) == 8 * WAVES[transport], res
    assert res["decode_transfer_metrics"]["failed"] == 0, res
    assert res["decode_transfer_metrics"]["bytes"] == \
        sum(-(-n // 16) for n in lens) * page_bytes(tiny_dsv2), res
    if WAVES[transport] > 1:
        # wave 2 hits the prefill's cache, yet the decode receives every prompt
        # token of it and decodes the single instance's tokens
        second = waves[1]
        # exactly the full scheduler blocks (16 tokens x 2 ranks) of every
        # wave-1 prompt: held for the decode, read, freed, still cached
        full = sum(n // 32 * 32 for n in waves[0]["prompt_lens"])
        assert second["prefill_prefix_cache_hits"] == full > 0, second
        assert second["received_tokens"] == sorted(second["prompt_lens"]), second
        assert second["identical"] == second["prompts"] == 8, second


def test_pd_with_mtp_on_the_decode(tiny_mtp, tmp_path):
    """A sharded prefill with MTP (TP=2) feeds an unsharded decode with MTP
    (TP=1) over NIXL: the decode receives every layer's owned blocks, the
    MTP layer's included (the bytes are three layers' worth), and gives the
    tokens of one instance with MTP, its drafts accepted as that instance's."""
    work = str(tmp_path / "pd-mtp")
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2,
                       "attention_backend": "CPU_MLA"})
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_cp_kv.tools.pd_offline", tiny_mtp, work,
         "--decode-tp", "1", "--dtype", "float32", "--backend", "CPU_MLA",
         "--block-size", "16", "--num-prompts", "4", "--max-tokens", "24",
         "--spec", spec, "--port", str(free_port(consecutive=2)), "--timeout", "400"],
        env={**os.environ, **CPU_ENV, **FORK_WORKERS}, cwd=ROOT, capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(work, "pd_result.json")) as f:
        res = json.load(f)
    assert res["rc"] == [0, 0, 0], res
    assert res["identical"] == res["prompts"] == 4, res
    assert all(res["checks"].values()), res["checks"]
    layers = json.load(open(os.path.join(tiny_mtp, "config.json")))["num_hidden_layers"] + 1
    assert res["page_bytes_all_layers"] == page_bytes(tiny_mtp) * layers // (layers - 1)
