"""Run vLLM offline generation once and write a JSON result.

Usage: python -m vllm_cp_kv.tools.generate MODEL OUT_JSON [--tp N] [--pcp N]
           [--shard] [--cp-kv JSON] [--block-size N] [--backend NAME]
           [--max-num-batched-tokens N] [--gpu-mem F] [--poison]
           [--corrupt-after-prefill] [--no-plugin]

Used by the demo and the end-to-end tests: each configuration runs in its
own process so vLLM's workers start fresh. With ``--poison`` every rank's
KV cache is filled with a sentinel before generation and the number of
written slots per rank is reported afterwards; ``--corrupt-after-prefill``
overwrites one block this rank owns after the first (prefill) step (a
negative control).
"""

from __future__ import annotations

import argparse
import json
import os

SENTINEL = 1234.0  # exactly representable in bf16

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


def prompts(n: int) -> list[str]:
    return [PROMPT_SEEDS[i % len(PROMPT_SEEDS)] + f" [{i}]" for i in range(n)]


# -- functions run inside every worker through LLM.collective_rpc ----------
def _caches(worker):
    runner = worker.model_runner
    return [c for c in runner.kv_caches] if isinstance(runner.kv_caches, list) \
        else list(runner.kv_caches.values())


def _backend_name(worker):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ctx = worker.vllm_config.compilation_config.static_forward_context
    return sorted({type(layer.impl).__name__ for layer in ctx.values()
                   if isinstance(layer, MLAAttention)})


def _poison(worker):
    for cache in _caches(worker):
        cache.fill_(SENTINEL)
    return len(_caches(worker))


def _written_rows(worker):
    """Per layer: number of token rows not equal to the sentinel."""
    counts = []
    for cache in _caches(worker):
        rows = cache.reshape(-1, cache.shape[-1])
        counts.append(int((rows != SENTINEL).any(dim=-1).sum()))
    return counts


def _corrupt_one_owned_block(worker):
    """Overwrite the first written block of layer 0 on shard rank 1."""
    from vllm.distributed.parallel_state import get_dcp_group

    if get_dcp_group().rank_in_group != 1:
        return None
    cache = _caches(worker)[0]
    blocks = cache.reshape(cache.shape[0], -1, cache.shape[-1])
    written = (blocks != SENTINEL).any(dim=-1).any(dim=-1).nonzero().flatten()
    block = int(written[0])
    gen = __import__("torch").Generator().manual_seed(0)
    blocks[block] = (__import__("torch").randn(blocks[block].shape, generator=gen)
                     * 4).to(blocks.dtype)
    return block


def _last_token_stats(worker):
    """The last-token gather's running totals (``cp_kv_stats``: steps per
    path, bytes moved, bytes vLLM's full gather would move; PCP runs only)."""
    mgr = getattr(worker.model_runner, "pcp_manager", None)
    return None if mgr is None else getattr(mgr, "cp_kv_stats", None)


def run(a) -> dict:
    from vllm import LLM, SamplingParams

    kw = dict(model=a.model, tokenizer=a.model, dtype=a.dtype,
              tensor_parallel_size=a.tp, max_model_len=a.max_model_len,
              max_num_seqs=a.max_num_seqs, seed=0, enforce_eager=True)
    if a.pcp > 1:
        kw["prefill_context_parallel_size"] = a.pcp
    if a.gpu_mem:
        kw.update(gpu_memory_utilization=a.gpu_mem, disable_custom_all_reduce=True)
    if a.block_size:
        kw["block_size"] = a.block_size
    if a.backend:
        kw["attention_config"] = {"backend": a.backend}
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if a.shard or a.cp_kv:
        kw["additional_config"] = {"cp_kv": {"enable": True,
                                             **json.loads(a.cp_kv or "{}")}}
    llm = LLM(**kw)
    vllm_config = llm.llm_engine.vllm_config
    cache_config = vllm_config.cache_config
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens,
                        ignore_eos=True, logprobs=1)
    texts = prompts(a.num_prompts)
    from vllm_cp_kv.integration import plugin

    parallel = vllm_config.parallel_config
    res: dict = {"shard": a.shard, "tp": a.tp, "pcp": a.pcp,
                 "cp_kv": kw.get("additional_config"),
                 # tokens the scheduler can hold: one block spans DCP ranks
                 "capacity_tokens": cache_config.num_gpu_blocks * cache_config.block_size
                 * parallel.decode_context_parallel_size,
                 "plugin_loaded": plugin._INSTALLED,
                 "kv_cache_tokens": getattr(cache_config, "kv_cache_size_tokens", None),
                 "num_gpu_blocks": cache_config.num_gpu_blocks,
                 "block_size": cache_config.block_size,
                 "dcp": vllm_config.parallel_config.decode_context_parallel_size,
                 "chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
                 "backends": llm.collective_rpc(_backend_name)}
    if a.poison:
        llm.collective_rpc(_poison)
    if a.corrupt_after_prefill:
        engine = llm.llm_engine
        for i, p in enumerate(texts):
            engine.add_request(str(i), p, sp)
        engine.step()  # prefill of every request
        res["corrupted_block"] = llm.collective_rpc(_corrupt_one_owned_block)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        outs.sort(key=lambda o: int(o.request_id))
    else:
        outs = llm.generate(texts, sp)
    res["prompt_lens"] = [len(o.prompt_token_ids) for o in outs]
    res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    res["logprobs"] = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                      o.outputs[0].token_ids)]
                       for o in outs]
    res["texts"] = [o.outputs[0].text for o in outs]
    if a.poison:
        res["written_rows"] = llm.collective_rpc(_written_rows)
    if a.pcp > 1:
        res["last_token"] = llm.collective_rpc(_last_token_stats)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pcp", type=int, default=1)
    ap.add_argument("--shard", action="store_true")
    ap.add_argument("--cp-kv", default=None,
                    help='more cp_kv options, e.g. \'{"kv_sharding": false}\'')
    ap.add_argument("--gpu-mem", type=float, default=None,
                    help="gpu_memory_utilization (GPU runs)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--backend", default=None, help="e.g. CPU_MLA")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--no-plugin", action="store_true",
                    help="plain vLLM: do not load the installed plugin")
    ap.add_argument("--poison", action="store_true")
    ap.add_argument("--corrupt-after-prefill", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if a.no_plugin:
        os.environ["VLLM_PLUGINS"] = "none"
    res = run(a)
    with open(a.out, "w") as f:
        json.dump(res, f)
    print("RESULT", json.dumps({k: res[k] for k in ("shard", "kv_cache_tokens")}))


if __name__ == "__main__":
    main()
