"""Train the small MLA model of the accuracy checks (docs/accuracy.md).

    python scripts/train_recall.py train RUN_DIR [--seconds 300] [--lr 5e-4] [--seed 0]
    python scripts/train_recall.py package RUN_DIR models/recall-dsv2

``train`` (torch only: it runs on the GPU machine, which has no
transformers or safetensors) trains a DeepSeek-V2 of vLLM's architecture
(MLA with the decoupled RoPE dims, 3 dense layers) on the associative
recall task of ``vllm_cp_kv.tools.recall`` and writes ``RUN_DIR/state-0.pt``
and ``state-1.pt`` (bf16 weights under the Hugging Face names vLLM loads, in
two files under the GPU machine's 16 MiB per file), ``train_log.json``
(the loss curve, the configuration, the seed) and the accuracy of the
greedy answers of the trained weights at lengths up to 128K, computed by
this script's own model. It saves every ``--save-every`` steps, so a run cut
short still leaves weights. ``package`` (on the CPU machine) turns that
into a model folder: ``config.json``, the tokenizer, ``model.safetensors``,
the log and a loss plot.

The model here is the reference implementation of vLLM's
``DeepseekV2ForCausalLM`` forward with ``q_lora_rank=None`` and dense MLPs
(tests/vllm/test_recall.py checks it against transformers' on random weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from vllm_cp_kv.tools import recall  # noqa: E402  (torch only)

CONFIG = dict(vocab_size=recall.VOCAB, hidden_size=256, intermediate_size=512,
              num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8,
              q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
              qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6,
              rope_theta=10000.0, max_position_embeddings=163840)
# Sequence lengths in turn: short ones teach the lookup fast, long ones make
# it hold over many distractors. A length is left for the next once the
# running accuracy on the answers reaches ADVANCE_AT.
CURRICULUM = [256, 1024, 4096, 16384, 32768, 65536]
ADVANCE_AT = 0.97
TOKENS_PER_STEP = 65536
EVAL_LENGTHS = [1024, 4096, 16384, 32768, 65536, 131072]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x, cos, sin):
    """Interleaved pairs (vLLM's ``is_neox_style=False``): x [B, T, H, D]."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.h, self.nope, self.rope = c["num_attention_heads"], c["qk_nope_head_dim"], \
            c["qk_rope_head_dim"]
        self.v, self.r = c["v_head_dim"], c["kv_lora_rank"]
        hid = c["hidden_size"]
        self.q_proj = nn.Linear(hid, self.h * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hid, self.r + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, c["rms_norm_eps"])
        self.kv_b_proj = nn.Linear(self.r, self.h * (self.nope + self.v), bias=False)
        self.o_proj = nn.Linear(self.h * self.v, hid, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.r, self.rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.h, self.nope + self.v)
        k_nope, v = kv.split([self.nope, self.v], -1)
        q = torch.cat([q_nope, rope(q_pe, cos, sin)], -1)
        k_pe = rope(k_pe.unsqueeze(2), cos, sin).expand(b, t, self.h, self.rope)
        k = torch.cat([k_nope, k_pe], -1)
        d = self.nope + self.rope
        v = F.pad(v, (0, d - self.v))  # one head size for the flash kernel
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, scale=d ** -0.5)
        return self.o_proj(o.transpose(1, 2)[..., :self.v].reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hid: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hid, inter, bias=False)
        self.up_proj = nn.Linear(hid, inter, bias=False)
        self.down_proj = nn.Linear(inter, hid, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c["hidden_size"], c["intermediate_size"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class DeepseekV2(nn.Module):
    """Parameter names as in the Hugging Face checkpoint (``model.*``, ``lm_head``)."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        d = c["qk_rope_head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids, select=None):
        """Logits at the positions ``select`` picks from the hidden states
        (a boolean mask or a slice; all of them by default)."""
        pos = torch.arange(ids.shape[1], device=ids.device).float()
        ang = torch.outer(pos, self.inv_freq)[None, :, None, :]  # [1, T, 1, D/2]
        cos, sin = ang.cos(), ang.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = x if select is None else x[select]
        return self.lm_head(self.model.norm(x))


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, std=std)


@torch.no_grad()
def evaluate(model, lengths, per_bucket: int, device) -> dict:
    """Greedy accuracy on prompts of seed 1 (the tests use seed 0). One
    forward over prompt + answer[:-1]: the greedy answer is right exactly
    when the argmax at each of those positions is the answer's next token."""
    model.eval()
    res = {}
    for length in lengths:
        items = recall.prompts(length, per_bucket, seed=1)
        outs = []
        for it in items:
            x = torch.tensor([it["ids"] + it["answer"][:-1]], device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(x, (slice(None), slice(-recall.VALUE_LEN, None)))
            outs.append(logits[0].argmax(-1).tolist())
        g = recall.grade(items, outs)
        res[length] = {k: g[k] for k in ("right", "n", "accuracy", "interval", "first_token")}
        print(f"eval {length}: {g['right']}/{g['n']} first {g['first_token']:.2f}", flush=True)
    model.train()
    return res


def save(model, run_dir: str, log: dict) -> None:
    """bf16 weights in two files (``state-0.pt``: the layers,
    ``state-1.pt``: the embedding, final norm and head), each small enough
    to come back from the GPU machine, and the log."""
    state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}
    first = {k: v for k, v in state.items() if k.startswith("model.layers.")}
    torch.save(first, os.path.join(run_dir, "state-0.pt"))
    torch.save({k: v for k, v in state.items() if k not in first},
               os.path.join(run_dir, "state-1.pt"))
    with open(os.path.join(run_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)


def load(run_dir: str) -> dict:
    return {k: v for i in range(2)
            for k, v in torch.load(os.path.join(run_dir, f"state-{i}.pt")).items()}


def train(a) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(a.seed)
    gen = torch.Generator(device).manual_seed(a.seed)
    c = dict(CONFIG, num_hidden_layers=a.layers)
    if a.smoke:  # a CPU check of the loop, not the model
        c.update(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=2, kv_lora_rank=64, qk_nope_head_dim=32,
                 qk_rope_head_dim=16, v_head_dim=32)
    model = DeepseekV2(c).to(device)
    init_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    lengths = [x for x in CURRICULUM if x <= a.max_length]
    log = {"config": c, "seed": a.seed, "lr": a.lr, "curriculum": lengths,
           "advance_at": ADVANCE_AT, "tokens_per_step": a.tokens, "device": str(device),
           "torch": torch.__version__, "steps": [], "stages": []}
    os.makedirs(a.run_dir, exist_ok=True)
    start, step, stage, ema = time.time(), 0, 0, 0.0
    while time.time() - start < a.seconds:
        frac = (time.time() - start) / a.seconds
        lr = a.lr * min(1.0, (step + 1) / 200) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        # the last stage rotates through every length, so short ones are kept
        length = lengths[stage] if stage + 1 < len(lengths) else lengths[step % len(lengths)]
        ids, mask = recall.training_batch(length, max(1, a.tokens // length), gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(ids[:, :-1], mask[:, 1:])
        target = ids[:, 1:][mask[:, 1:]]
        loss = F.cross_entropy(logits.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = 0.9 * ema + 0.1 * float((logits.argmax(-1) == target).float().mean())
        if ema >= ADVANCE_AT and stage + 1 < len(lengths):  # this length is learnt: longer
            stage, ema = stage + 1, 0.0
            log["stages"].append([step, round(time.time() - start, 1), lengths[stage]])
        if step % 10 == 0:
            log["steps"].append([step, round(time.time() - start, 1), length,
                                 round(float(loss), 4), round(ema, 4), lr])
            print(f"step {step} t={time.time() - start:.0f}s len={length} "
                  f"loss={float(loss):.4f} acc~{ema:.3f}", flush=True)
        if step % a.save_every == 0:
            save(model, a.run_dir, log)
    log["train_seconds"] = round(time.time() - start, 1)
    log["train_steps"] = step
    save(model, a.run_dir, log)
    # the weights as they will be served: bf16
    model.load_state_dict({k: v.float() for k, v in load(a.run_dir).items()})
    log["eval"] = evaluate(model, [x for x in EVAL_LENGTHS if x <= a.eval_max],
                           a.eval_per_bucket, device)
    save(model, a.run_dir, log)


def build_tokenizer():
    """A word-level tokenizer with one word per id of the task
    (``recall.VOCAB``): ``<pad> <s> </s> KEY``, reserved ``r4``-``r15``,
    keys ``k0``..., values ``v0``..., filler ``w0``.... The task works on
    ids; the words only make prompts and answers readable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "KEY"] + [f"r{i}" for i in range(4, recall.KEY_TOKENS[0])]
    for prefix, (lo, hi) in (("k", recall.KEY_TOKENS), ("v", recall.VALUE_TOKENS),
                             ("w", recall.FILLER)):
        words += [f"{prefix}{i}" for i in range(hi - lo)]
    assert len(words) == recall.VOCAB and words[recall.KEY] == "KEY"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="r4"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="r4")


def package(a) -> None:
    from safetensors.torch import save_file
    from transformers import DeepseekV2Config

    with open(os.path.join(a.run_dir, "train_log.json")) as f:
        log = json.load(f)
    tok = build_tokenizer()
    c = dict(log["config"])
    cfg = DeepseekV2Config(
        **c, first_k_dense_replace=c["num_hidden_layers"], n_routed_experts=4,
        head_dim=c["qk_rope_head_dim"], tie_word_embeddings=False, topk_method="greedy",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    os.makedirs(a.out_dir, exist_ok=True)
    cfg.save_pretrained(a.out_dir)
    tok.save_pretrained(a.out_dir)
    state = load(a.run_dir)
    save_file({k: v.contiguous() for k, v in state.items()},
              os.path.join(a.out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a.out_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = log["steps"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s[0] for s in steps], [s[3] for s in steps], lw=0.8)
    chance = recall.VALUE_TOKENS[1] - recall.VALUE_TOKENS[0]
    ax.axhline(math.log(chance), ls="--", c="grey", label=f"chance (ln {chance})")
    ax.set(xlabel="step", ylabel="loss on repeated values", yscale="log",
           title="recall-dsv2 training (scripts/train_recall.py)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out_dir, "loss.png"), dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("run_dir")
    t.add_argument("--seconds", type=float, default=300)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--tokens", type=int, default=TOKENS_PER_STEP)
    t.add_argument("--max-length", type=int, default=65536)
    t.add_argument("--layers", type=int, default=3)
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--eval-max", type=int, default=131072)
    t.add_argument("--eval-per-bucket", type=int, default=4)
    t.add_argument("--smoke", action="store_true", help="a tiny model (CPU check)")
    p = sub.add_parser("package")
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    a = ap.parse_args()
    train(a) if a.cmd == "train" else package(a)


if __name__ == "__main__":
    main()
