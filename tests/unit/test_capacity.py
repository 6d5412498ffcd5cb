"""The scratch bound against the plans it must hold: the planner (another
implementation) sizes the worst batch the scheduler can send, and the bound
must hold it exactly; under a memory limit the bound must leave the
persistent cache what the formula promises, and no more scratch fits."""

import pytest
import torch

from builders import spec
from vllm_cp_kv.core.capacity import scratch_blocks_bound
from vllm_cp_kv.core.plan import plan_materialization

BS = 16


def worst_batch_plan(n, max_num_seqs, max_model_len):
    """Every request at max_model_len, no block shared: the largest gather."""
    cols = -(-(-(-max_model_len // BS)) // n)
    ids = torch.arange(1, max_num_seqs * cols + 1, dtype=torch.int32)
    table = ids.view(max_num_seqs, cols)
    lens = torch.full((max_num_seqs,), max_model_len, dtype=torch.int64)
    return plan_materialization(spec(n), table, lens)


@pytest.mark.parametrize("n,seqs,model_len", [(2, 8, 1024), (4, 3, 1000), (8, 5, 77),
                                              (2, 1, 16), (4, 16, 4096)])
def test_bound_holds_exactly_the_worst_batch(n, seqs, model_len):
    bound = scratch_blocks_bound(available_bytes=1 << 40, page_bytes=BS * 1152,
                                 num_layers=3, shard_size=n, block_size=BS,
                                 max_num_seqs=seqs, max_model_len=model_len)
    plan = worst_batch_plan(n, seqs, model_len)
    assert plan.num_scratch_blocks == bound
    # negative control: one more token per request no longer fits
    assert worst_batch_plan(n, seqs, model_len + BS * n).num_scratch_blocks > bound


@pytest.mark.parametrize("available", [2**20, 5 * 2**20 + 12345, 2**24])
def test_memory_limited_bound_leaves_the_persistent_cache(available):
    n, layers, page = 2, 3, BS * 1152
    bound = scratch_blocks_bound(available_bytes=available, page_bytes=page,
                                 num_layers=layers, shard_size=n, block_size=BS,
                                 max_num_seqs=10**6, max_model_len=10**6)
    assert bound > 0 and bound % n == 0

    def fits(scratch):  # no more than every rank's blocks of one layer
        return scratch * layers * page <= n * (available - scratch * page)

    assert fits(bound)
    assert not fits(bound + n)  # the bound is tight


def test_user_cap():
    kw = dict(available_bytes=1 << 40, page_bytes=BS * 1152, num_layers=3,
              shard_size=2, block_size=BS, max_num_seqs=16, max_model_len=512)
    assert scratch_blocks_bound(cap_blocks=10, **kw) == 10
    assert scratch_blocks_bound(cap_blocks=11, **kw) == 10  # a multiple of N


# DeepSeek-V3 shapes: 61 layers, bf16 latent of 576, block 64, 64 GiB per rank
DSV3 = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16",
        "max_position_embeddings": 163840}


DSV32 = {**DSV3, "architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048}


def capacity_json(tmp_path, *args, config=DSV3):
    import json

    from vllm_cp_kv.tools import cli

    (tmp_path / "config.json").write_text(json.dumps(config))
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["capacity", "--model", str(tmp_path), "--kv-memory-gib", "64",
                         "--block-size", "64", "--dtype", "bfloat16", "--max-model-len",
                         "131072", "--max-num-seqs", "256", "--json", *args]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("n,goal", [(2, 1.97), (4, 3.92), (8, 7.80)])
def test_chunked_workspace_capacity_at_deepseek_v3_shapes(tmp_path, n, goal):
    """The bounded scratch: the arithmetic by hand (1% of the budget, a
    multiple of N), and the ratio at least vLLM DCP's public figures."""
    got = capacity_json(tmp_path, "--tp", str(n))
    page, budget, layers = 64 * 576 * 2, 64 * 2**30, 61
    scratch = budget // (100 * page)
    scratch -= scratch % n
    assert got["scratch_blocks"] == scratch
    assert got["unsharded"] == budget // (layers * page) * 64
    assert got["sharded"] == (budget - scratch * page) // (layers * page) * 64 * n
    assert got["ratio"] >= goal, got
    # negative control: the whole view (what the worker reserved before) falls short
    whole = capacity_json(tmp_path, "--tp", str(n), "--decode", "materialize")
    assert whole["ratio"] < goal and whole["scratch_blocks"] > 3 * scratch


def test_workspace_option_and_floor():
    from vllm_cp_kv.core.capacity import workspace_blocks

    kw = dict(available_bytes=24 * 2**20, page_bytes=16 * 576 * 4, block_size=16)
    assert workspace_blocks(shard_size=2, workspace_tokens=100, **kw) == 7
    assert workspace_blocks(shard_size=8, workspace_tokens=16, **kw) == 8  # one block a rank
    # 1% of 24 MiB is 6 blocks: with a max_model_len of 64 tokens (4
    # blocks) the floor of 4 blocks per rank wins
    assert workspace_blocks(shard_size=2, max_model_len=64, **kw) == 8
    bound = scratch_blocks_bound(num_layers=2, shard_size=2, max_num_seqs=12,
                                 max_model_len=64, chunked=True, **kw)
    assert bound == 8
    # toward vLLM's own context chunk (64K tokens, or max_model_len): up to
    # 2% of the budget (13 blocks here), never past max_model_len (10 blocks)
    assert workspace_blocks(shard_size=2, max_model_len=4096, **kw) == 13
    assert workspace_blocks(shard_size=2, max_model_len=160, **kw) == 10
    big = dict(kw, available_bytes=8 * 2**30)  # 1%: 2,330 blocks; 2%: 4,660; DCP: 4,096
    assert workspace_blocks(shard_size=2, max_model_len=131072, **big) == 65536 // 16
    huge = dict(kw, available_bytes=2**40)  # 1% is already past 64K tokens: kept
    assert workspace_blocks(shard_size=2, max_model_len=131072, **huge) == 2**40 // (100 * 16 * 576 * 4)


@pytest.mark.parametrize("n,goal", [(2, 1.97), (4, 3.92), (8, 7.80)])
def test_fp8_capacity_at_deepseek_v3_shapes(tmp_path, n, goal):
    """``--kv-cache-dtype fp8`` (and its spellings): one byte a latent value,
    so the sharded FP8 cache holds >= goal x the unsharded FP8 cache and
    about 2 x that of the bf16 one; by hand, as above."""
    bf16 = capacity_json(tmp_path, "--tp", str(n))
    for spelling in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        got = capacity_json(tmp_path, "--tp", str(n), "--kv-cache-dtype", spelling)
        page, budget, layers = 64 * 576, 64 * 2**30, 61
        scratch = budget // (100 * page)
        scratch -= scratch % n
        assert got["scratch_blocks"] == scratch
        assert got["unsharded"] == budget // (layers * page) * 64
        assert abs(got["unsharded"] - 2 * bf16["unsharded"]) <= 64  # one block of rounding
        assert got["sharded"] == (budget - scratch * page) // (layers * page) * 64 * n
        assert got["ratio"] >= goal, got
        assert got["sharded"] / bf16["unsharded"] >= 2 * goal - 0.01


def test_pcp_by_tp_shards_over_all_ranks(tmp_path):
    """``--pcp P --tp T``: one shard group of P x T ranks (issue 40), with the
    chunked context's workspace as its scratch (as TP = P x T has; a
    materializing decode reads the whole view); it needs vLLM 0.34 (row
    pcp-and-tp)."""
    both = capacity_json(tmp_path, "--pcp", "2", "--tp", "2")
    tp4 = capacity_json(tmp_path, "--tp", "4")
    whole4 = capacity_json(tmp_path, "--tp", "4", "--decode", "materialize")
    assert both["shard_size"] == 4 and both["min_vllm"] == "0.34"
    assert {k: both[k] for k in ("sharded", "unsharded", "scratch_blocks")} == \
        {k: tp4[k] for k in ("sharded", "unsharded", "scratch_blocks")}
    assert both["scratch_blocks"] < whole4["scratch_blocks"]
    alone = capacity_json(tmp_path, "--pcp", "2", "--tp", "1")
    assert alone["shard_size"] == 2 and alone["min_vllm"] == "0.32"
    # a dense FP8 cache is sharded on vLLM 0.34 only (row fp8-pcp)
    assert capacity_json(tmp_path, "--tp", "2", "--kv-cache-dtype", "fp8")["min_vllm"] == "0.34"
    assert capacity_json(tmp_path, "--pcp", "2", "--tp", "4")["shard_size"] == 8


@pytest.mark.parametrize("n,goal", [(2, 1.97), (4, 3.93), (8, 7.85)])
def test_sparse_capacity_at_deepseek_v32_shapes(tmp_path, n, goal):
    """DeepSeek-V3.2 (fp8_ds_mla latent 656 B + indexer 132 B a token, 61
    layers, block 64, 64 GiB, 131,072 tokens, 256 sequences): on the
    shard-aware sparse path (vLLM 0.34, TP) the plugin reserves no scratch,
    so N ranks hold N times the tokens, by hand, over TP and over PCP (with
    fp8_ds_mla: vLLM 0.34's PCP + DCP sparse layers); the materializing
    path's whole view (vLLM 0.32, PCP with a bf16 cache, decode
    "materialize") falls short of the goal: the negative control."""
    got = capacity_json(tmp_path, "--tp", str(n), "--kv-cache-dtype", "fp8_ds_mla",
                        config=DSV32)
    page, budget, layers = 64 * (656 + 132), 64 * 2**30, 61
    assert got["scratch_blocks"] == 0 and got["min_vllm"] == "0.34"
    assert got["unsharded"] == budget // (layers * page) * 64
    assert got["sharded"] == got["unsharded"] * n
    assert got["ratio"] >= goal, got
    whole = capacity_json(tmp_path, "--tp", str(n), "--kv-cache-dtype", "fp8_ds_mla",
                          "--decode", "materialize", config=DSV32)
    assert whole["ratio"] < goal and whole["scratch_blocks"] > 0
    pcp = capacity_json(tmp_path, "--pcp", str(n), "--tp", "1", "--kv-cache-dtype", "fp8_ds_mla",
                        config=DSV32)
    assert pcp["scratch_blocks"] == 0 and pcp["sharded"] == got["sharded"]
    bf16 = capacity_json(tmp_path, "--pcp", str(n), "--tp", "1", config=DSV32)
    assert bf16["scratch_blocks"] > 0 and bf16["ratio"] < goal  # PCP, bf16: materializing
