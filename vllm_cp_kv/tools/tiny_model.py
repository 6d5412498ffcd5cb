"""Build a tiny random-weight DeepSeek-V2 (MLA + MoE) model fully offline.

Usage: python -m vllm_cp_kv.tools.tiny_model OUT_DIR [--gpu-heads]

The tokenizer is a byte-level BPE trained on an inline corpus. Weights use
``initializer_range=0.2`` so greedy outputs are diverse and depend on the
context (with the default init a random model repeats one token, which
would make identity tests meaningless). DeepSeek-V2 ``topk_method="greedy"``
routing is deterministic run to run on vLLM CPU (V3's ``noaux_tc`` is not).
The CPU MLA decode kernel needs ``kv_lora_rank + qk_rope_head_dim == 576``;
``--gpu-heads`` uses DeepSeek head sizes (nope 128, v 128) that GPU MLA
prefill backends require.
"""

from __future__ import annotations

import argparse
import json
import os

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny tokenizer for offline tests.",
    "Context parallel prefill shards the KV cache across ranks.",
    "Each logical block lives on exactly one rank of the shard group.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
]


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(CORPUS * 40, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def build(out_dir: str, *, gpu_heads: bool = False, num_layers: int = 3,
          moe: bool = True, seed: int = 0, init: float = 0.2, hidden: int = 384,
          heads: int = 6, vocab: int = 700, max_positions: int = 4096) -> str:
    """Write a model directory and return its path (skips if present)."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    from transformers import DeepseekV2Config

    tok = build_tokenizer(vocab)
    nope, v = (128, 128) if gpu_heads else (32, 32)
    cfg = DeepseekV2Config(
        hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=heads, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=nope, v_head_dim=v, head_dim=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1 if moe else num_layers,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        initializer_range=init, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        vocab_size=len(tok))
    return _write(cfg, tok, out_dir, seed)


def build_mtp(out_dir: str, *, num_layers: int = 2, hidden: int = 384, heads: int = 6,
              vocab: int = 700, seed: int = 0, init: float = 0.2,
              max_positions: int = 4096, gpu_heads: bool = False, mix: float = 0.01,
              moe: bool = False) -> str:
    """A tiny DeepSeek-V3 with one MTP layer (vLLM's ``mtp`` speculative
    method): ``num_layers`` dense MLA decoder layers with random weights
    and, at ``model.layers.<num_layers>.*``, the MTP layer (a decoder layer
    with ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head``). Random MTP
    weights would never be accepted, so every layer's attention output is
    scaled by ``mix`` and its MLP output by 0 (the residual stream keeps the
    token's embedding: the target's next token depends mostly on the last
    one, and on the context through attention) and the MTP layer repeats the
    target's last step one token later (``eh_proj`` passes the new token's
    embedding; its head and norm are the target's ``lm_head`` and final
    norm): its drafts are accepted where the context does not change the
    target's choice, and depend on its attention over the MTP layer's own
    KV. ``moe``: the MTP layer's MLP is a mixture of experts, as DeepSeek-V3's
    (its experts' outputs scaled by 0 too: the router still runs). Skips if
    present."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config

    tok = build_tokenizer(vocab)
    nope, v = (128, 128) if gpu_heads else (32, 32)
    # num_layers + 1 decoder layers: the last one is the MTP layer's block
    cfg = DeepseekV3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=num_layers + 1, num_attention_heads=heads,
        num_key_value_heads=heads, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=nope, v_head_dim=v, head_dim=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=num_layers + (0 if moe else 1), n_group=1, topk_group=1,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        initializer_range=init, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        vocab_size=len(tok))
    _write(cfg, tok, out_dir, seed)
    from safetensors.torch import load_file

    prefix = f"model.layers.{num_layers}."
    main_file = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(main_file)
    for key in list(tensors):
        if key.endswith("self_attn.o_proj.weight"):
            tensors[key] = tensors[key] * mix
        elif ".mlp." in key and key.endswith("down_proj.weight"):  # dense, experts, shared
            tensors[key] = tensors[key] * 0.0
    save_file(tensors, main_file, metadata={"format": "pt"})
    # eh_proj's input is [enorm(embedding of the token), hnorm(hidden)]
    pass_embedding = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    weights = {prefix + name: t.to(torch.bfloat16).contiguous() for name, t in {
        "enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
        "eh_proj.weight": pass_embedding,
        "shared_head.norm.weight": tensors["model.norm.weight"].float(),
        "shared_head.head.weight": tensors["lm_head.weight"].float(),
    }.items()}
    save_file(weights, os.path.join(out_dir, "mtp.safetensors"))
    _add_to_index(out_dir, "mtp.safetensors", weights)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        data = json.load(f)
    data.update(num_hidden_layers=num_layers, num_nextn_predict_layers=1)
    if moe:  # the router's score-correction bias is a parameter with noaux_tc only
        data.update(topk_method="noaux_tc")
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return out_dir


def build_held_out(out_dir: str) -> str:
    """A second tiny DeepSeek-V2 unlike the demo's (other width, 8 heads so
    TP=4 divides them, 2 layers, dense, another seed and vocabulary): tests
    that compare sharded with unsharded runs use it with their own prompts
    (:func:`token_prompts`), so nothing is tuned to the demo's model.

    ``init=0.1``: greedy outputs stay diverse (about 100 distinct tokens in
    128) and context-dependent, while float rounding is amplified less than
    with 0.2, where vLLM's own CPU decode kernel (float32) moves the
    unsharded run's logprobs by up to 1.5e-4 over 128 tokens against exact
    attention; with 0.1 sharded and unsharded agree within 1.2e-5."""
    return build(out_dir, hidden=256, heads=8, num_layers=2, moe=False, seed=7,
                 vocab=600, init=0.1)


def build_demo(out_dir: str, gpu_heads: bool = False) -> str:
    """The demo's model: 12 dense layers (the sharded layout's scratch, one
    layer's full view, is then a small share of a small KV budget)."""
    return build(out_dir, num_layers=12, hidden=256, heads=4, moe=False, seed=3,
                 gpu_heads=gpu_heads)


PROMPT_SEEDS = [  # 3 to about 560 tokens with the tiny tokenizer
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Context parallel prefill shards the KV cache across ranks. " * 3,
    "Each logical block lives on exactly one rank of the shard group. " * 12,
    " ".join(f"Numbers: {i} {i + 1} {i + 2}." for i in range(60)),
    "Hello world, this is a tiny tokenizer for offline tests. " * 20,
    "vLLM " * 7,
    "The lazy dog sleeps while the fox jumps. " * 28,
]


def prompts(n: int, repeat: int = 1) -> list[str]:
    """``n`` text prompts for the tiny models (3 to about 560 tokens)."""
    return [PROMPT_SEEDS[i % len(PROMPT_SEEDS)] * repeat + f" [{i}]" for i in range(n)]


def token_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of fixed pseudo-random token ids, one per length."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def build_v3_attention(out_dir: str) -> str:
    """Two layers with DeepSeek-V3 attention shapes (hidden 7168, 128 heads,
    q_lora 1536, kv_lora 512, rope 64, nope 128, v 128), a small dense MLP
    and vocabulary, random weights: for time-to-first-token runs on a GPU."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import DeepseekV2Config

    tok = build_tokenizer(700)
    cfg = DeepseekV2Config(
        vocab_size=1024, hidden_size=7168, intermediate_size=2048,
        moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
        max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    # about 1 GB of weights: initialized on the GPU when there is one
    return _write(cfg, tok, out_dir, seed=0,
                  device="cuda" if torch.cuda.is_available() else "cpu")


def build_dsv32(out_dir: str, *, v3_shapes: bool = False, init: float = 0.1,
                max_positions: int = 4096, glm5: bool = False, heads: int = 64,
                mtp: bool = False) -> str:
    """A DeepSeek-V3.2 (sparse attention, DSA) model with random weights.

    Tiny (default): hidden 256, 2 dense layers, 64 heads, q_lora 128, DeepSeek
    head sizes, an indexer of 64 heads x 128 with ``index_topk=512`` (prompts
    longer than 512 tokens attend sparsely). ``v3_shapes``: DeepSeek-V3.2's
    attention and indexer shapes (hidden 7168, 128 heads, q_lora 1536,
    ``index_topk=2048``), for time-to-first-token runs. ``max_positions``:
    the tiny model's context (decode-step runs at 64K need more than 4096).
    ``heads``: attention heads of the tiny model (vLLM 0.34's FLASHMLA_SPARSE
    with ``fp8_ds_mla`` runs DCP only below 32 heads a rank and 64 gathered).
    ``mtp``: one MTP layer as DeepSeek-V3.2 ships it (``model.layers.2.*``:
    a DSA decoder layer with its own indexer, plus ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head``; random, so its drafts are rarely
    accepted, but every decode step verifies 1 + k tokens a row).
    ``glm5``: the same model as GLM-5 declares it (``model_type
    glm_moe_dsa``, ``GlmMoeDsaForCausalLM``, which vLLM runs on its
    DeepSeek-V3.2 code with GLM-5's defaults: fp32 routing, DCP over
    all-to-all with the query replicated).

    Built through DeepSeek-V2's classes (transformers releases without
    DeepSeek-V3.2, as on the GPU machine), plus the indexer weights under
    the names vLLM loads (``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``).
    """
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV2Config

    tok = build_tokenizer(700)
    if v3_shapes:
        dims = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                    max_position_embeddings=131072)
        index = dict(index_n_heads=64, index_head_dim=128, index_topk=2048)
    else:
        dims = dict(hidden_size=256, num_attention_heads=heads, q_lora_rank=128,
                    max_position_embeddings=max_positions)
        index = dict(index_n_heads=64, index_head_dim=128, index_topk=512)
    cfg = DeepseekV2Config(
        vocab_size=1024 if v3_shapes else len(tok), intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=3 if mtp else 2, first_k_dense_replace=3 if mtp else 2,
        num_key_value_heads=dims["num_attention_heads"], kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
        n_routed_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        initializer_range=init, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **dims)
    device = "cuda" if v3_shapes and torch.cuda.is_available() else "cpu"
    _write(cfg, tok, out_dir, seed=0, device=device)
    weights = _dsa_weights(cfg, dims, index, mtp=mtp, init=init)
    save_file(weights, os.path.join(out_dir, "indexer.safetensors"))
    _add_to_index(out_dir, "indexer.safetensors", weights)
    _declare_dsa(out_dir, index, glm5=glm5, mtp=mtp)
    return out_dir


def _dsa_weights(cfg, dims: dict, index: dict, *, mtp: bool, init: float) -> dict:
    """The indexer's weights of every layer, and the MTP block's own parts
    (its decoder layer is ``layers.2``), random (seed 1), bf16."""
    import torch

    gen = torch.Generator().manual_seed(1)
    hidden, q_lora = dims["hidden_size"], dims["q_lora_rank"]
    heads, dim = index["index_n_heads"], index["index_head_dim"]

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * init).to(torch.bfloat16)

    weights = {}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.self_attn.indexer."
        weights.update({p + "wq_b.weight": rand(heads * dim, q_lora),
                        p + "wk.weight": rand(dim, hidden),
                        p + "k_norm.weight": torch.ones(dim, dtype=torch.bfloat16),
                        p + "k_norm.bias": torch.zeros(dim, dtype=torch.bfloat16),
                        p + "weights_proj.weight": rand(heads, hidden)})
    if mtp:
        weights.update({f"model.layers.2.{name}": t for name, t in {
            "enorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            "hnorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            "eh_proj.weight": rand(hidden, 2 * hidden),
            "shared_head.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            "shared_head.head.weight": rand(cfg.vocab_size, hidden)}.items()})
    return weights


def _declare_dsa(out_dir: str, index: dict, *, glm5: bool, mtp: bool) -> None:
    """config.json as DeepSeek-V3.2 (or GLM-5) declares it: the model type,
    architecture, indexer settings and MTP layer count."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        data = json.load(f)
    data = {k: v for k, v in data.items() if v is not None}  # strict configs
    if mtp:
        data.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    data.update(model_type="glm_moe_dsa" if glm5 else "deepseek_v32",
                architectures=["GlmMoeDsaForCausalLM" if glm5 else "DeepseekV32ForCausalLM"],
                n_group=1, topk_group=1, **index)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def _add_to_index(out_dir: str, filename: str, weights: dict) -> None:
    """Sharded checkpoints list their tensors: add the extra file's."""
    path = os.path.join(out_dir, "model.safetensors.index.json")
    if not os.path.exists(path):
        return  # single-file checkpoint: vLLM loads every *.safetensors
    with open(path) as f:
        index = json.load(f)
    index["weight_map"].update({name: filename for name in weights})
    with open(path, "w") as f:
        json.dump(index, f, indent=2)


def _write(cfg, tok, out_dir: str, seed: int, device: str = "cpu",
           keep: dict | None = None) -> str:
    """Random bf16 weights, tokenizer, and a config without the fields other
    transformers releases reject on load (plus ``keep``: keys vLLM's model
    reads that transformers' config no longer writes)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        data = json.load(f)
    for key in ("layer_types", "mlp_layer_types"):
        data.pop(key, None)
    data.update({k: v for k, v in (keep or {}).items() if k not in data})
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return out_dir


# Architectures of docs/models.md whose configs transformers has: a tiny
# config of each (defaults, 2 layers), for the startup checks on vLLM's
# real config path (config only: the check refuses before weights load)
ARCH_CONFIGS = {"KimiLinearForCausalLM": "KimiLinearConfig", "HYV4ForCausalLM": "HYV4Config",
                "Glm4MoeLiteForCausalLM": "Glm4MoeLiteConfig", "AXK1ForCausalLM": "AXK1Config",
                "LongcatFlashForCausalLM": "LongcatFlashConfig"}


def build_arch_config(arch: str, out_dir: str) -> str:
    """A directory with the tiny tokenizer and a config of ``arch`` (no
    weights: enough for vLLM to build its model config)."""
    import transformers

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(700)
    tok.save_pretrained(out_dir)
    cfg = getattr(transformers, ARCH_CONFIGS[arch])(
        num_hidden_layers=2, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    data = {**cfg.to_dict(), "architectures": [arch]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(data, f)
    return out_dir


def build_dense_arch(arch: str, out_dir: str, *, seed: int = 0,
                     gpu_heads: bool = False, max_positions: int = 4096) -> str:
    """A tiny random-weight model of a dense-MLA architecture of
    docs/models.md other than DeepSeek-V2/V3 (``Glm4MoeLiteForCausalLM``,
    ``AXK1ForCausalLM``): the shapes of :func:`build` (latent 512 + rope 64,
    the CPU MLA kernel's 576; one dense layer, one MoE layer of 4 experts)
    in transformers' own config and model class; ``gpu_heads``: the head
    sizes of :func:`build`'s (nope and v 128, which GPU MLA prefill
    backends require)."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import transformers

    tok = build_tokenizer(700)
    shapes = dict(hidden_size=384, intermediate_size=768, moe_intermediate_size=192,
                  num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
                  q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64,
                  qk_nope_head_dim=128 if gpu_heads else 32, v_head_dim=128 if gpu_heads else 32,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                  n_group=1, topk_group=1, norm_topk_prob=False,
                  max_position_embeddings=max_positions,
                  tie_word_embeddings=False, initializer_range=0.2,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, vocab_size=len(tok))
    layers = {"Glm4MoeLiteForCausalLM": dict(mlp_layer_types=["dense", "sparse"]),
              "AXK1ForCausalLM": dict(first_k_dense_replace=1)}[arch]
    cfg = getattr(transformers, ARCH_CONFIGS[arch])(**shapes, **layers)
    # vLLM's model reads the older key for the dense layers
    _write(cfg, tok, out_dir, seed, keep={"first_k_dense_replace": 1})
    if arch == "AXK1ForCausalLM":  # vLLM's layers all hold this norm (used by MoE layers)
        _add_missing_norms(out_dir, "post_mlp_layernorm", shapes["num_hidden_layers"],
                           shapes["hidden_size"])
    return out_dir


def _add_missing_norms(out_dir: str, name: str, layers: int, hidden: int) -> None:
    """Unit RMSNorm weights vLLM's model loads but transformers' does not
    save (``model.layers.<i>.<name>.weight``)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(path)
    for i in range(layers):
        weights.setdefault(f"model.layers.{i}.{name}.weight",
                           torch.ones(hidden, dtype=torch.bfloat16))
    save_file(weights, path, metadata={"format": "pt"})


def build_llama(out_dir: str) -> str:
    """A tiny non-MLA (Llama) model, for the startup check that rejects it."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = build_tokenizer(700)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=4096, vocab_size=len(tok),
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--gpu-heads", action="store_true")
    ap.add_argument("--dense", action="store_true", help="no MoE layers")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--init", type=float, default=0.2,
                    help="initializer_range (smaller: less chaotic, less diverse)")
    ap.add_argument("--llama", action="store_true", help="tiny non-MLA model")
    ap.add_argument("--v3-attention", action="store_true",
                    help="2 layers with DeepSeek-V3 attention shapes (TTFT runs)")
    ap.add_argument("--dsv32", action="store_true",
                    help="DeepSeek-V3.2 sparse attention (with --v3-attention: "
                         "DeepSeek-V3.2 shapes)")
    ap.add_argument("--mtp", action="store_true",
                    help="DeepSeek-V3, dense, with one MTP layer (--layers decoder layers)")
    a = ap.parse_args()
    if a.mtp:
        print(build_mtp(a.out_dir, num_layers=a.layers, gpu_heads=a.gpu_heads, init=a.init))
        return
    if a.dsv32:
        print(build_dsv32(a.out_dir, v3_shapes=a.v3_attention))
        return
    if a.llama or a.v3_attention:
        print((build_llama if a.llama else build_v3_attention)(a.out_dir))
        return
    print(build(a.out_dir, gpu_heads=a.gpu_heads, num_layers=a.layers,
                moe=not a.dense, init=a.init))


if __name__ == "__main__":
    main()
