"""The one-GPU harness (scripts/gpu/onegpu) gives the answers of vLLM's own
communicator: the GPU checks run real vLLM ranks on one H200 through its
``OneGPUComm`` (torch.distributed on gloo), so here, on CPU, the same
communicator replaces vLLM's CPU communicator (the harness's
``ONEGPU_CPU_COMM=1``) in a sharded TP=2 run (the TP all-reduces, the
plugin's gathers, the LSE merge), and the result must equal the run with
vLLM's own communicator: float32, CPU_MLA, greedy tokens and logprobs
identical.
"""

from conftest import harness_env, needs_vllm, run_generate

pytestmark = needs_vllm
ARGS = ("--dtype", "float32", "--backend", "CPU_MLA", "--max-model-len", "1024",
        "--token-prompts", "30,200,500,700", "--max-tokens", "16", "--shard", "--stats")


def test_harness_communicator_matches_vllms(held_out, tmp_path):
    d = str(tmp_path)
    own = run_generate(held_out, d, "own", *ARGS)
    harness = run_generate(held_out, d, "harness", *ARGS,
                           env=harness_env(ONEGPU_CPU_COMM="1"))
    # the harness's communicator served the TP and shard groups of both ranks
    lines = [ln for ln in harness["log"].splitlines() if "ONEGPU" in ln and " comm " in ln]
    assert any(" tp:" in ln for ln in lines) and any(" dcp:" in ln for ln in lines), lines
    assert not any("ONEGPU" in ln for ln in own["log"].splitlines())
    assert own["tokens"] == harness["tokens"]
    assert own["logprobs"] == harness["logprobs"]
    # the plugin's collectives moved the same bytes through either communicator
    assert [s["decode_bytes"] for s in own["stats"]] == \
        [s["decode_bytes"] for s in harness["stats"]]
