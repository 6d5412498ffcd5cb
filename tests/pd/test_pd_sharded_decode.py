"""Disaggregated prefill into a sharded decode instance (issue 41): each
decode rank pulls only the logical blocks it owns (block j on decode rank
j mod N_d), from the prefill rank that holds it (j mod N_p), into its own
virtual table's column j // N_d. Real vLLM on CPU, fp32, CPU_MLA, PyTorch's
rope (``vllm_cp_kv.tools.pd_offline``, a few minutes a run on 2 cores).

Against one unsharded instance running the same prompts as one batch:
identical greedy tokens; every prompt token arrived (summed over the decode
ranks); each decode rank received exactly the blocks it owns of every
prompt, counted from the descriptors its transport read (bytes and blocks,
per rank); both caches end empty; the decode instance holds 1.95x the KV of
an unsharded one at the same memory (N_d = 2).

Default suite: a TP=2 sharded prefill into a TP=2 sharded decode over NIXL.
Opt-in (``VLLM_CP_KV_RUN_PD_E2E=1``, minutes each): a TP=2 prefill into a
TP=4 sharded decode (4 ranks on 2 cores, unbound), an unsharded TP=1
prefill into a TP=2 sharded decode, the same over Mooncake, and the
negative control: each decode rank takes its neighbour's blocks
(``CPKV_TEST_WRONG_DECODE_RANK``, scripts/gpu/onegpu/pd_hooks.py) and the
answer changes. The placement arithmetic itself is checked against brute
force, with its negative control, in tests/unit/test_manifest.py.
"""

import json
import os
import subprocess
import sys

import pytest

from builders import free_port
from conftest import CPU_ENV, FORK_WORKERS, ROOT, harness_env, needs_vllm

pytestmark = needs_vllm
OPT_IN = pytest.mark.skipif(os.environ.get("VLLM_CP_KV_RUN_PD_E2E") != "1",
                            reason="opt-in (VLLM_CP_KV_RUN_PD_E2E=1): more P/D runs, "
                                   "minutes each on 2 cores")
KV_GIB = 1  # VLLM_CPU_KVCACHE_SPACE of every instance (CPU_ENV)


def page_bytes(model, block_size=16, dtype_bytes=4):
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    return (cfg["num_hidden_layers"] * block_size
            * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * dtype_bytes)


def run_pd(model, work, *args, env=None, num_prompts=6):
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_cp_kv.tools.pd_offline", model, work,
         "--decode-shard", "--dtype", "float32", "--backend", "CPU_MLA",
         "--block-size", "16", "--num-prompts", str(num_prompts), "--max-tokens", "24",
         "--transfer-timeout", "120", "--blocks-expiry", "300",
         "--port", str(free_port(consecutive=2)), "--timeout", "420", *args],
        env={**os.environ, **CPU_ENV, **FORK_WORKERS, **(env or {})}, cwd=ROOT, capture_output=True,
        text=True, timeout=1000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(work, "pd_result.json")) as f:
        res = json.load(f)
    logs = {r: open(os.path.join(work, f"{r}.log")).read()[-3000:] for r in ("prefill", "decode")}
    assert res["rc"] == [0, 0, 0], (res, logs)
    return res


def check_sharded_decode(res, model, decode_tp):
    assert res["decode_tp"] == decode_tp
    checks = res["checks"]
    assert checks["identical_tokens"] and res["identical"] == res["prompts"], res
    for key in ("every_prompt_token_received", "blocks_per_decode_rank_exact",
                "prefill_cache_empty", "decode_cache_empty", "transfers_counted",
                "transfer_bytes_exact"):
        assert checks[key], (key, res)
    # the bytes: every block once over all decode ranks, not once a rank
    lens = res["prompt_lens"]
    assert res["decode_transfer_metrics"]["bytes"] == \
        sum(-(-n // 16) for n in lens) * page_bytes(model)
    # capacity: N_d times the blocks an unsharded instance holds at this memory,
    # less the decode's scratch
    unsharded = KV_GIB * 2**30 // page_bytes(model) * 16
    assert res["decode_capacity_tokens"] >= 0.975 * decode_tp * unsharded, res
    return res["decode_capacity_tokens"] / unsharded


def test_sharded_prefill_into_a_sharded_decode(held_out, tmp_path):
    res = run_pd(held_out, str(tmp_path / "pd"), "--prefill-tp", "2", "--decode-tp", "2")
    ratio = check_sharded_decode(res, held_out, 2)
    assert ratio >= 1.95


@OPT_IN
@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_a_tp2_prefill_into_a_tp4_sharded_decode(held_out, tmp_path, transport):
    res = run_pd(held_out, str(tmp_path / "pd"), "--prefill-tp", "2", "--decode-tp", "4",
                 "--transport", transport)
    assert check_sharded_decode(res, held_out, 4) >= 3.9


@OPT_IN
@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_an_unsharded_prefill_into_a_sharded_decode(held_out, tmp_path, transport):
    res = run_pd(held_out, str(tmp_path / "pd"), "--prefill-tp", "1", "--prefill-plain",
                 "--decode-tp", "2", "--transport", transport)
    check_sharded_decode(res, held_out, 2)


@OPT_IN
def test_blocks_taken_by_the_wrong_decode_rank_change_the_answer(held_out, tmp_path):
    """Negative control: each decode rank reads its neighbour's blocks into
    its own slots (the bytes still add up), and the tokens change."""
    res = run_pd(held_out, str(tmp_path / "pd"), "--prefill-tp", "2", "--decode-tp", "2",
                 env=harness_env(CPKV_TEST_HOOKS="1", CPKV_TEST_WRONG_DECODE_RANK="1"))
    assert res["checks"]["transfer_bytes_exact"], res
    assert not res["checks"]["identical_tokens"], res
    assert sum(f == 0 or f == 1 for f in res["first_diff"] if f is not None) >= 1, res
