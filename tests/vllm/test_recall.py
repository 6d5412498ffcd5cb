"""The trained recall model (models/recall-dsv2, docs/accuracy.md) through
vLLM on CPU: its task accuracy unsharded and sharded, with negative controls.

* unsharded TP=2 answers at least 95% of the prompts (2,048 tokens, 16
  prompts, two needles in each of the 8 position buckets), in float32 and in
  bfloat16; the sharded run (cp_kv, two ranks) is within the unsharded
  run's 95% interval, overall and per owning rank;
* one run, two controls (sharded, float32): every layer of the block that
  holds request 0's needle is overwritten on its owner after the prefill,
  and the decode's LSE merge drops the *other* rank's partial. Request 0
  is then wrong, the needles on the dropped rank fall toward chance and
  most needles on the kept rank (request 0 aside) stay right.

Also, without vLLM: the training script's model equals transformers'
DeepseekV2ForCausalLM (what vLLM implements), and the task generators.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import ROOT, needs_vllm, run_generate
from vllm_cp_kv.tools import recall

MODEL = os.path.join(ROOT, "models", "recall-dsv2")
LENGTH = 2048
ARGS = ("--backend", "CPU_MLA", "--max-model-len", "2100", "--torch-rope", "--block-size",
        "16", "--max-tokens", str(recall.VALUE_LEN), "--recall", str(LENGTH),
        "--recall-per-bucket", "2", "--max-num-batched-tokens", "4096")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


def _needle_ranks():
    return [(it["needle"] // 16) % 2 for it in recall.prompts(LENGTH, 2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("recall"))
    kept = _needle_ranks()[0]
    out = {}
    for dtype in ("float32", "bfloat16"):
        out["ref", dtype] = run_generate(MODEL, d, f"ref-{dtype}", *ARGS, "--dtype", dtype,
                                         env=ENV)
        out["on", dtype] = run_generate(MODEL, d, f"on-{dtype}", *ARGS, "--dtype", dtype,
                                        "--shard", env=ENV)
    out["control"] = run_generate(MODEL, d, "control", *ARGS, "--dtype", "float32", "--shard",
                                  "--poison", "--corrupt-after-prefill", "--corrupt-needle",
                                  "--drop-rank", str(1 - kept), env=ENV)
    return out


def _grade(res):
    return res["recall"][str(LENGTH)]


@needs_vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_accuracy_within_unsharded(runs, dtype):
    ref, on = _grade(runs["ref", dtype]), _grade(runs["on", dtype])
    assert ref["n"] == 16 and ref["accuracy"] >= 0.95, ref
    assert recall.within(on, ref), (on, ref)
    ranks = _needle_ranks()
    for rank in (0, 1):  # both ranks hold needles; each rank's within the reference's
        mine = [r for r, k in zip(ref["right_each"], ranks) if k == rank]
        assert mine and on["owners"][rank]["n"] == len(mine)
        lo, hi = recall.wilson(sum(mine), len(mine))
        assert lo <= on["owners"][rank]["accuracy"] <= hi, (rank, on["owners"])


@needs_vllm
def test_controls_break_the_needles_they_touch(runs):
    ranks = _needle_ranks()
    kept = ranks[0]
    res = runs["control"]
    assert res["corrupted_needle"]["rank"] == kept
    got = _grade(res)["right_each"]
    ref = _grade(runs["ref", "float32"])["right_each"]
    assert ref[0] and not got[0], "the corrupted needle block did not change request 0"
    dropped = [g for g, k in zip(got, ranks) if k != kept]
    assert dropped and sum(dropped) <= len(dropped) // 4, got
    # the kept rank's needles mostly survive (not all: a decode step also
    # reads the prompt's tail and its own tokens, some on the dropped rank)
    others = [g for i, (g, k) in enumerate(zip(got, ranks)) if k == kept and i > 0]
    assert others and sum(others) >= len(others) / 2 > sum(dropped), got


def test_training_model_is_vllms_architecture():
    """scripts/train_recall.py's forward equals transformers' DeepseekV2
    (the model vLLM implements) on the same random weights."""
    transformers = pytest.importorskip("transformers")
    import train_recall

    c = dict(train_recall.CONFIG, vocab_size=64, hidden_size=32, intermediate_size=48,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(0)
    ours = train_recall.DeepseekV2(c)
    train_recall.init_weights(ours, std=0.2)
    cfg = transformers.DeepseekV2Config(
        **c, first_k_dense_replace=c["num_hidden_layers"], n_routed_experts=4,
        head_dim=c["qk_rope_head_dim"], tie_word_embeddings=False, topk_method="greedy")
    theirs = transformers.DeepseekV2ForCausalLM(cfg).eval()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], missing
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max()
    assert diff < 1e-4, diff
    with torch.no_grad():  # a negative control: a changed weight shows
        ours.model.layers[1].self_attn.kv_b_proj.weight.mul_(1.5)
        assert (ours(ids) - theirs(ids).logits).abs().max() > 1e-3


def test_training_batch_queries_are_answerable():
    ids, mask = recall.training_batch(1024, 4, torch.Generator().manual_seed(0))
    assert ids.shape == mask.shape == (4, 1024)
    queries = 32
    ctx = 1024 - queries * recall.RECORD
    for row, m in zip(ids.tolist(), mask):
        assert int(m.sum()) == queries * recall.VALUE_LEN and not m[:ctx].any()
        for q in range(queries):
            rec = row[ctx + q * recall.RECORD: ctx + (q + 1) * recall.RECORD]
            at = row.index(rec[1])  # keys are unique in the context
            assert at < ctx and row[at - 1] == recall.KEY and row[at + 1:at + 5] == rec[2:]
            assert (at + 1) % recall.ALIGN <= recall.ALIGN - recall.VALUE_LEN


def test_prompts_spread_needles_and_grade():
    items = recall.prompts(8192, 4)
    assert items == recall.prompts(8192, 4)  # deterministic
    assert recall.prompts(8192, 4, seed=1)[0]["ids"] != items[0]["ids"]
    for it in items:
        assert len(it["ids"]) == 8192 and it["ids"][-2] == recall.KEY
        assert it["ids"][it["needle"]:it["needle"] + 4] == it["answer"]
        assert it["ids"][it["needle"] - 1] == it["ids"][-1]  # the queried key
    for block, n in ((16, 2), (64, 4)):  # needles on every rank
        assert {(it["needle"] // block) % n for it in items} == set(range(n))
    outs = [it["answer"] for it in items]
    outs[3] = outs[3][:3] + [0]
    g = recall.grade(items, outs, ranks=4, block_size=64)
    assert g["right"] == 31 and g["buckets"][3]["right"] == 3 and g["first_token"] == 1.0
    lo, hi = recall.wilson(31, 32)
    assert lo < 31 / 32 < hi and recall.within(g, g)
