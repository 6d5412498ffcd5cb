"""Test and GPU-check harness: run vLLM offline generation once and write a
JSON result (not part of the package: it carries verification aids).

Usage: python harness/run_vllm.py MODEL OUT_JSON [--tp N] [--pcp N]
           [--shard] [--cp-kv JSON] [--block-size N] [--backend NAME]
           [--max-num-batched-tokens N] [--gpu-mem F] [--poison]
           [--corrupt-after-prefill] [--no-plugin] [--stats] [--waves 2]

Each configuration runs in its own process so vLLM's workers start fresh.
With ``--poison`` every rank's KV cache is filled with a sentinel before
generation and the number of written slots per rank is reported afterwards;
``--corrupt-after-prefill`` overwrites one block this rank owns after the
first (prefill) step (a negative control). ``--stats`` adds the plugin's
running totals per rank (bytes received per step, prefill and decode apart);
``--waves 2`` runs the prompts twice, one wave after the other (prefix
caching), with vLLM's own prefix-cache counters per wave.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import os

from vllm_cp_kv.tools.offline import (build_llm, engine_kwargs, prefix_cache_counters,
                                      spec_decode_counters)
from vllm_cp_kv.tools.tiny_model import prompts, token_prompts

SENTINEL = 1234.0  # exactly representable in bf16


def token_prompt(length: int, vocab: int):
    """One prompt of ``length`` fixed pseudo-random token ids."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=token_prompts([length], vocab, seed=length)[0])


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


def _sentinel(cache):
    """bf16 latent caches: 1234.0; byte caches (fp8_ds_mla latent, the
    sparse indexer's fp8 keys and scales): 0x5A."""
    return SENTINEL if cache.dtype.is_floating_point else 0x5A


def _poison(worker):
    for cache in _caches(worker):
        cache.fill_(_sentinel(cache))
    _repoison_zeroed_blocks(worker)
    return len(_caches(worker))


def _repoison_zeroed_blocks(worker) -> None:
    """vLLM 0.33+ zeroes every newly allocated block before the forward
    where its caches differ in precision (``needs_kv_cache_zeroing``: the
    sparse model's fp8_ds_mla latent next to its indexer cache), on every
    rank, whole blocks: to the counts a zeroed row would look written. The
    blocks are filled with the sentinel again after vLLM's zeroing (0x5A is
    a finite FP8 value, so no NaN gets in where zeros were meant)."""
    import torch

    runner = worker.model_runner
    zeroer = getattr(runner, "kv_block_zeroer", None) or getattr(runner, "_kv_block_zeroer", None)
    if zeroer is None or getattr(zeroer, "_cp_kv_poison", False):
        return
    zero = zeroer.zero_block_ids

    def zero_then_poison(ids, *args, **kwargs):
        out = zero(ids, *args, **kwargs)
        if len(ids):
            idx = torch.as_tensor(list(ids), dtype=torch.long)
            for cache in _caches(worker):
                cache[idx.to(cache.device)] = _sentinel(cache)
        return out

    zeroer.zero_block_ids, zeroer._cp_kv_poison = zero_then_poison, True


def _written(worker):
    """Per layer cache: ``[row width, rows written, blocks written]`` (the
    sparse indexer's pages hold keys then scales, so count it by blocks).
    A row is written where any of its bits differ from the sentinel's,
    compared 8 bytes at a time where the row and its alignment allow, a
    few hundred blocks at a time (a whole-cache comparison's temporary has
    a byte per element)."""
    import torch

    out = []
    for cache in _caches(worker):
        rows = cache.reshape(cache.shape[0], -1, cache.shape[-1])
        sentinel = torch.full((1,), _sentinel(cache), dtype=cache.dtype)
        size = rows.element_size()
        if (rows.shape[-1] * size) % 8 == 0 and (rows.storage_offset() * size) % 8 == 0 \
                and rows.is_contiguous():
            rows = rows.view(torch.int64)
            sentinel = sentinel.repeat(8 // size).view(torch.int64)
        sentinel = sentinel.to(rows.device)
        written_rows = written_blocks = 0
        for start in range(0, rows.shape[0], 512):
            changed = (rows[start:start + 512] != sentinel).any(dim=-1)
            written_rows += int(changed.sum())
            written_blocks += int(changed.any(dim=-1).sum())
        out.append([cache.shape[-1], written_rows, written_blocks])
    return out


def _count_collectives(worker):
    """Count, per engine step, the bytes of the other ranks' data this rank
    takes in through its groups' collectives: the TP group's (and the shard
    group's, where another) communicator, wrapped where every CPU
    collective of vLLM and of the plugin passes (``dist_module``: vLLM's
    shared-memory or torch.distributed operations); on GPU the CUDA
    communicator's all-reduce, all-gather and reduce-scatter, which vLLM's
    group collectives call in eager mode. Independent of the
    plugin's own counters; each step is recorded with whether it was a pure
    decode step (one scheduled token per request) and its request count."""
    from vllm.distributed import parallel_state as ps

    state = worker.__dict__.setdefault("cp_kv_collectives", {"now": 0, "steps": []})
    wrapped = set()

    def counted(fn, size_of):
        def run(*args, **kwargs):
            state["now"] += size_of(*args, **kwargs)
            return fn(*args, **kwargs)
        return run

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    for get in (ps.get_tp_group, ps.get_dcp_group):
        group = get()
        comm = group.device_communicator
        others, world = group.world_size - 1, group.world_size
        module = getattr(comm, "dist_module", None)
        if module is None:  # GPU: the CUDA communicator's own methods, which
            # every collective of vLLM's groups calls in eager mode (a CUDA
            # graph's replay bypasses Python: count with enforce_eager)
            # (all_gatherv / reduce_scatterv serve DP and EP: not counted)
            if comm is None or id(comm) in wrapped:
                continue
            wrapped.add(id(comm))
            comm.all_reduce = counted(comm.all_reduce, lambda t, *a, **k: others * nbytes(t))
            comm.all_gather = counted(comm.all_gather, lambda t, *a, **k: others * nbytes(t))
            comm.reduce_scatter = counted(comm.reduce_scatter,
                                          lambda t, *a, **k: others * nbytes(t) // world)
            continue
        if id(module) in wrapped:
            continue
        wrapped.add(id(module))
        module.all_reduce = counted(module.all_reduce, lambda t, **k: others * nbytes(t))
        module.all_gather_into_tensor = counted(
            module.all_gather_into_tensor, lambda out, inp, **k: nbytes(out) - nbytes(inp))
        module.gather = counted(module.gather, lambda t, *a, **k: others * nbytes(t))
    orig = worker.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        counts = list(scheduler_output.num_scheduled_tokens.values())
        state["now"] = 0
        out = orig(scheduler_output, *args, **kwargs)
        if counts:
            state["steps"].append([state["now"], len(counts), all(n == 1 for n in counts)])
        return out

    if not getattr(orig, "_cp_kv_counting", False):
        execute_model._cp_kv_counting = True
        worker.execute_model = execute_model
    return sorted(wrapped) != []


def _time_steps(worker):
    """Time every engine step on this worker: the host seconds inside
    ``execute_model`` and ``sample_tokens`` (vLLM's V2 runner samples in
    the latter) and, on GPU, CUDA events at ``execute_model``'s entry and
    exit (read by :func:`_step_times`, so no step waits for the GPU). Works
    with and without the plugin (the comparison with vLLM's own DCP)."""
    import torch

    state = worker.__dict__.setdefault("cp_kv_step_times", [])
    orig = worker.execute_model
    if getattr(orig, "_cp_kv_timed", False):
        return True
    cuda = torch.cuda.is_available()
    recorded = [False]  # the last execute_model added a row

    def execute_model(scheduler_output, *args, **kwargs):
        tokens = sum(scheduler_output.num_scheduled_tokens.values())
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        if cuda:
            marks[0].record()
        start = time.perf_counter()
        out = orig(scheduler_output, *args, **kwargs)
        host = time.perf_counter() - start
        if cuda:
            marks[1].record()
        if tokens:
            state.append([tokens, start, host, marks, 0.0, None, None])
        recorded[0] = bool(tokens)  # sample_tokens times into this step's row
        return out

    execute_model._cp_kv_timed = True
    worker.execute_model = execute_model
    sample = getattr(worker, "sample_tokens", None)
    if sample is not None:
        def sample_tokens(*args, **kwargs):
            start = time.perf_counter()
            try:
                return sample(*args, **kwargs)
            finally:
                if state and recorded[0]:
                    end = time.perf_counter()
                    state[-1][4] += end - start
                    state[-1][5] = end
                    if cuda:
                        state[-1][6] = torch.cuda.Event(enable_timing=True)
                        state[-1][6].record()

        worker.sample_tokens = sample_tokens
    return True


def _step_times(worker, reset: bool = True):
    """Per step since the last reset: ``[tokens, host start (s, relative to
    the first), host ms in execute_model, GPU ms from its entry to its exit
    (None on CPU), GPU ms from the first step's entry, host ms in
    sample_tokens, host start (perf_counter, s: the clock is the machine's,
    comparable with the harness's own), sample_tokens' host exit (perf_counter,
    s; None if none ran), GPU ms from the first step's entry to sample_tokens'
    exit (None on CPU or if none ran)]``."""
    import torch

    state = worker.__dict__.get("cp_kv_step_times")
    if not state:
        return []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0, e0 = state[0][1], state[0][3]
    rows = [[n, round(start - t0, 6), round(host * 1e3, 3),
             round(m[0].elapsed_time(m[1]), 3) if m else None,
             round(e0[0].elapsed_time(m[0]), 3) if m else None,
             round(sample * 1e3, 3), start, sample_end,
             round(e0[0].elapsed_time(sm), 3) if sm is not None and e0 else None]
            for n, start, host, m, sample, sample_end, sm in state]
    if reset:
        state.clear()
    return rows


def _collective_steps(worker, reset: bool = False):
    """``[bytes, requests, pure decode]`` per step since the last reset."""
    state = worker.__dict__.get("cp_kv_collectives")
    if state is None:
        return None
    steps = list(state["steps"])
    if reset:
        state["steps"].clear()
    return steps


def _install_indexer_dump(worker, path):
    """Save what the first sparse layer reads, for request 0 (run with one
    prompt): at the first prefill step, the indexer's top-k positions; at
    the first decode step, the indexer and latent cache views (the
    materialized full views when sharded), blocks in logical order."""
    import torch
    from vllm.forward_context import get_forward_context
    from vllm.models.deepseek_v32 import attention

    inner, done = attention.sparse_attn_indexer, set()
    ctx = worker.vllm_config.compilation_config.static_forward_context

    def view_of(cache, made, layer):
        # sharded: the runtime's full view (a memo hit, or one gather that
        # every rank makes here, in the same order)
        return cache if made is None else made.runtime.materialize(made, cache, layer)

    def dump(*args, **kwargs):
        out = inner(*args, **kwargs)
        md = get_forward_context().attn_metadata
        prefix = kwargs.get("k_cache_prefix", args[1] if len(args) > 1 else None)
        m = md.get(prefix) if isinstance(md, dict) else None
        if m is None:
            return out
        rank = torch.distributed.get_rank()
        topk = kwargs.get("topk_tokens", args[9] if len(args) > 9 else None)
        if m.num_prefills and "prefill" not in done:
            done.add("prefill")
            torch.save(out[: m.num_prefill_tokens, :topk].cpu(),
                       f"{path}.prefill_topk.rank{rank}.pt")
        if m.num_decodes and "decode" not in done:
            done.add("decode")
            kv = kwargs.get("kv_cache", args[2] if len(args) > 2 else None)
            made = getattr(m, "cp_kv", None)
            seq = int(m.decode.seq_lens.reshape(-1)[0])
            blocks = m.decode.block_table[0, : -(-seq // kv.shape[1])].long()
            attn = prefix.replace(".indexer.k_cache", ".attn")
            latent = ctx[attn].kv_cache
            torch.save({"seq_len": seq, "blocks": view_of(kv, made, prefix)[blocks].cpu(),
                        "latent": view_of(latent, made, attn)[blocks].cpu()},
                       f"{path}.rank{rank}.pt")
        return out

    attention.sparse_attn_indexer = dump
    return True


def _install_topk_dump(worker, path, limit: int = 48):
    """Save the indexer's top-k rows of the first decode-only steps, every
    sparse layer, as sets (each row sorted, ``-1`` last), per rank: the
    shard-aware path's merged global top-k against an unsharded run's on the
    same prompts (eager runs: a replayed graph runs no Python)."""
    import torch
    from vllm.forward_context import get_forward_context
    from vllm.models.deepseek_v32 import attention

    inner, rec = attention.sparse_attn_indexer, []

    def dump(*args, **kwargs):
        out = inner(*args, **kwargs)
        md = get_forward_context().attn_metadata
        prefix = kwargs.get("k_cache_prefix", args[1] if len(args) > 1 else None)
        m = md.get(prefix) if isinstance(md, dict) else None
        if m is None or not m.num_decodes or m.num_prefills or len(rec) >= limit:
            return out
        k = kwargs.get("topk_tokens", args[9] if len(args) > 9 else None)
        rec.append({"layer": str(prefix),
                    "rows": sorted_rows(out[: m.num_decode_tokens, :k]).cpu()})
        torch.save(rec, f"{path}.rank{torch.distributed.get_rank()}.pt")
        return out

    attention.sparse_attn_indexer = dump
    return True


def _install_sorted_topk(worker):
    """Verification aid for sparse models (not a serving feature): sort each
    row of the indexer's top-k output (valid positions ascending, ``-1``
    last). vLLM's top-k returns the same set in a run-dependent order and the
    sparse kernels sum in that order, so two identical runs differ in the
    last bits; with the order fixed, sharded and unsharded runs can be
    compared token for token. Installed in both runs of a comparison."""
    from vllm.models.deepseek_v32 import attention

    inner = attention.sparse_attn_indexer

    def sorted_topk(*args, **kwargs):
        out = inner(*args, **kwargs)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        k = kwargs.get("topk_tokens", args[9] if len(args) > 9 else None)
        rows = out[: hidden.shape[0], :k]
        rows.copy_(sorted_rows(rows))
        return out

    attention.sparse_attn_indexer = sorted_topk
    return True


def sorted_rows(rows):
    """Each row ascending, negative entries (no token) moved to the end as -1."""
    import torch

    big = torch.iinfo(rows.dtype).max
    keyed = rows.masked_fill(rows < 0, big).sort(dim=1).values
    return keyed.masked_fill(keyed == big, -1)


def _cache_shapes(worker):
    return [[list(c.shape), str(c.dtype)] for c in _caches(worker)]


def _corrupt_one_owned_block(worker, layer=0, index: int = 0, rank: int = 1):
    """Overwrite the ``index``-th written block (by id; 0: the first) of
    cache ``layer`` (0: the first layer; -1: the last, an MTP model's draft
    layer; None: every layer) on shard rank ``rank`` (after a prefill, or
    between waves: a cached block). On a fresh cache vLLM hands out block ids
    in order, so the ``index``-th block holds the first request's column
    ``index``: logical block ``N * index + rank``."""
    import torch
    from vllm.distributed.parallel_state import get_dcp_group

    if get_dcp_group().rank_in_group != rank:
        return None
    caches = _caches(worker) if layer is None else [_caches(worker)[layer]]
    for cache in caches:
        blocks = cache.reshape(cache.shape[0], -1, cache.shape[-1])
        written = (blocks != _sentinel(cache)).any(dim=-1).any(dim=-1).nonzero().flatten()
        block = int(written[index])
        gen = torch.Generator().manual_seed(0)
        blocks[block] = (torch.randn(blocks[block].shape, generator=gen) * 4).to(blocks.dtype)
    return block


def _drop_rank_partial(worker, rank: int):
    """A negative control: the shard-aware decode's LSE merge ignores rank
    ``rank``'s partial output (its LSE set to -inf), as if that rank's
    blocks were lost."""
    from vllm_cp_kv.integration import merge as merging

    inner = merging.merge_by_lse

    def merge(outs, lses):
        lses = lses.clone()
        lses[rank] = float("-inf")
        return inner(outs, lses)

    merging.merge_by_lse = merge  # the torch merge (CPU) of integration/merge.py
    return True


def _last_token_stats(worker):
    """The last-token gather's running totals (``cp_kv_stats``: steps per
    path, bytes moved, bytes vLLM's full gather would move; PCP runs only)."""
    mgr = getattr(worker.model_runner, "pcp_manager", None)
    return None if mgr is None else getattr(mgr, "cp_kv_stats", None)


def engine_options(a) -> dict:
    """The options of :func:`vllm_cp_kv.tools.offline.engine_kwargs`."""
    kw = dict(tp=a.tp, pcp=a.pcp, dcp=a.dcp, dtype=a.dtype, gpu_mem=a.gpu_mem,
              kv_bytes=a.kv_bytes,  # no memory profiling (ranks that share one GPU)
              block_size=a.block_size, backend=a.backend,
              eager=not (a.cuda_graphs or a.graph_mode),
              shard=a.shard, cp_kv=json.loads(a.cp_kv) if a.cp_kv else None,
              # vLLM 0.32's CPU rotary kernel is wrong for MLA (docs/design.md);
              # --kernel-rope keeps it (a negative control)
              rope="kernel" if a.kernel_rope else "torch" if a.torch_rope else None,
              max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs)
    if a.graph_mode:
        kw["graph_mode"] = a.graph_mode
    if a.capture_sizes:
        kw["capture_sizes"] = [int(x) for x in a.capture_sizes.split(",")]
    if a.prefill_graph_sizes is not None:
        kw["prefill_graph_sizes"] = [int(x) for x in a.prefill_graph_sizes.split(",") if x]
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if a.profile_dir:  # vLLM's torch profiler, started around --profile-wave
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": a.profile_dir,
                                 "torch_profiler_with_stack": a.profile_stack}
    if a.kv_cache_dtype:
        kw["kv_cache_dtype"] = a.kv_cache_dtype
    if a.attention_config:  # with the backend (engine_kwargs sets it from --backend)
        kw["attention_config"] = {**({"backend": a.backend} if a.backend else {}),
                                  **json.loads(a.attention_config)}
    if a.spec:
        kw["speculative_config"] = json.loads(a.spec)
    if a.waves > 1 or a.spec:
        kw["disable_log_stats"] = False  # vLLM's prefix-cache and spec-decode counters
    if a.waves > 1:
        kw["enable_prefix_caching"] = True
    elif a.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    return kw


def run(a) -> dict:
    from vllm import SamplingParams

    options = engine_options(a)
    llm = build_llm(a.model, **options)
    vllm_config = llm.llm_engine.vllm_config
    cache_config = vllm_config.cache_config
    # --no-detokenize: vLLM's output processor then does not prime its
    # detokenizer with the whole prompt (tokenizers' DecodeStream decodes all
    # of it at the first token: 155-289 ms at 100K tokens on the GPU machine,
    # the same code whatever the KV layout), so a wave times the engine
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens,
                        ignore_eos=True, logprobs=1, detokenize=not a.no_detokenize)
    vocab = vllm_config.model_config.get_vocab_size()
    texts = prompts(a.num_prompts, a.prompt_repeat)
    if a.token_prompt_len:
        texts = [token_prompt(a.token_prompt_len, vocab)]
    phases = None
    recall_items = None
    if a.recall:  # the trained model's task (vllm_cp_kv.tools.recall)
        from vllm.inputs import TokensPrompt

        from vllm_cp_kv.tools import recall

        recall_items = [it for length in a.recall.split(",")
                        for it in recall.prompts(int(length), a.recall_per_bucket)]
        texts = [TokensPrompt(prompt_token_ids=it["ids"]) for it in recall_items]
    if a.token_prompts:  # "L,L,...;L,L,..." : phases run one after the other
        from vllm.inputs import TokensPrompt

        phases = [[TokensPrompt(prompt_token_ids=ids) for ids in token_prompts(
            [int(x) for x in group.split(",")], vocab, seed=a.prompt_seed + k)]
            for k, group in enumerate(a.token_prompts.split(";"))]
        texts = phases[0]
    from vllm_cp_kv.integration import plugin

    parallel = vllm_config.parallel_config
    res: dict = {"shard": a.shard, "tp": a.tp, "pcp": a.pcp,
                 "cp_kv": engine_kwargs(a.model, **options).get("additional_config"),
                 # tokens the scheduler can hold: one block spans DCP ranks
                 "capacity_tokens": cache_config.num_gpu_blocks * cache_config.block_size
                 * parallel.decode_context_parallel_size,
                 "plugin_loaded": plugin._INSTALLED,
                 "kv_cache_tokens": getattr(cache_config, "kv_cache_size_tokens", None),
                 "num_gpu_blocks": cache_config.num_gpu_blocks,
                 "block_size": cache_config.block_size,
                 "dcp": vllm_config.parallel_config.decode_context_parallel_size,
                 "chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
                 "prefix_caching": cache_config.enable_prefix_caching,
                 "custom_ops": list(vllm_config.compilation_config.custom_ops),
                 "backends": llm.collective_rpc(_backend_name)}
    res["cache_shapes"] = llm.collective_rpc(_cache_shapes)[0]
    if a.sorted_topk:
        llm.collective_rpc(_install_sorted_topk)
    if a.dump_indexer:
        llm.collective_rpc(_install_indexer_dump, args=(a.dump_indexer,))
    if a.dump_topk:
        llm.collective_rpc(_install_topk_dump, args=(a.dump_topk,))
    if a.poison:
        llm.collective_rpc(_poison)
    if a.count_collectives:
        res["collectives_counted"] = llm.collective_rpc(_count_collectives)
    if a.step_times:
        llm.collective_rpc(_time_steps)
    if a.drop_rank is not None:
        llm.collective_rpc(_drop_rank_partial, args=(a.drop_rank,))
    if a.corrupt_after_prefill:
        engine = llm.llm_engine
        for i, p in enumerate(texts):
            engine.add_request(str(i), p, sp)
        engine.step()  # prefill of every request (of the first, at least)
        args = (a.corrupt_layer,)
        if a.corrupt_needle:  # every layer of the block holding request 0's needle
            from vllm_cp_kv.core.ownership import CPShardSpec

            spec = CPShardSpec(0, a.tp * a.pcp, cache_config.block_size)
            j = recall_items[0]["needle"] // spec.block_size  # its logical block
            args = (None, spec.table_index(j), spec.owner_of(j))
            res["corrupted_needle"] = {"logical_block": j, "rank": spec.owner_of(j)}
        res["corrupted_block"] = llm.collective_rpc(_corrupt_one_owned_block, args=args)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        outs.sort(key=lambda o: int(o.request_id))
    elif a.waves > 1:
        outs = run_waves(llm, texts, sp, a, res)
    elif phases is not None and len(phases) > 1:
        res["phases"] = []
        for phase in phases:
            if a.stats:
                llm.collective_rpc("cp_kv_stats", kwargs={"reset": True})
            if a.count_collectives:
                llm.collective_rpc(_collective_steps, kwargs={"reset": True})
            before = spec_decode_counters(llm) if a.spec else None
            outs = llm.generate(phase, sp)
            res["phases"].append(summarize(outs))
            if a.stats:
                res["phases"][-1]["stats"] = llm.collective_rpc("cp_kv_stats")
            if a.count_collectives:
                res["phases"][-1]["collectives"] = llm.collective_rpc(_collective_steps)
            if a.spec:  # this phase's drafts, as run_waves counts prefix hits
                after = spec_decode_counters(llm)
                res["phases"][-1]["spec_decode"] = {
                    key: after[key] - before[key] for key in after}
        outs = None  # per phase above
    else:
        outs = llm.generate(texts, sp)
    if outs:
        res.update(summarize(outs))
    else:  # phases: the flat view over all of them
        res.update({k: [x for ph in res["phases"] for x in ph[k]]
                    for k in ("prompt_lens", "tokens", "logprobs", "texts")})
    if recall_items is not None:
        from vllm_cp_kv.tools import recall

        ranks = a.tp * a.pcp if a.shard else 1
        res["recall"] = recall.grade_lengths(recall_items, res["tokens"], ranks=ranks,
                                             block_size=cache_config.block_size)
    if a.poison:
        res["written"] = llm.collective_rpc(_written)
        # per rank and layer: token rows written (dense checks read these)
        res["written_rows"] = [[rows for _, rows, _ in layers] for layers in res["written"]]
    if a.stats:
        res["stats"] = llm.collective_rpc("cp_kv_stats")
    if a.spec:
        res["spec_decode"] = spec_decode_counters(llm)
    if a.pcp > 1:
        res["last_token"] = llm.collective_rpc(_last_token_stats)
    if a.time_decode:
        contexts = [int(c) for c in a.time_contexts.split(",")]
        if len(contexts) > 1:  # a warm-up timing first (new shapes), dropped
            time_decode(llm, a.time_decode, vocab, context=contexts[0])
        res["decode_steps"] = []
        for c in contexts:
            if a.count_collectives:
                llm.collective_rpc(_collective_steps, kwargs={"reset": True})
            step = time_decode(llm, a.time_decode, vocab, context=c)
            res["decode_steps"].append(step)
            if a.count_collectives:  # per rank: the bytes of each pure decode step
                # of the timed batch, distinct values
                step["bytes_per_decode_step"] = [
                    sorted({b for b, n, pure in steps if pure and n == step["batch"]})
                    for steps in llm.collective_rpc(_collective_steps, kwargs={"reset": True})]
        res["decode_step"] = res["decode_steps"][0]
    return res


def time_decode(llm, steps: int, vocab: int, batch: int = 8, context: int = 2000) -> dict:
    """Wall seconds per decode step of ``batch`` requests at ``context``
    tokens: the same prompts run to 1 and to ``1 + steps`` new tokens, the
    difference over ``steps`` (prefill cancels), the best of three."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_prompts(
        [context] * batch, vocab, seed=1234)]
    best = []
    for n in (1, 1 + steps):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            times.append(time.perf_counter() - start)
        best.append(min(times))
    return {"batch": batch, "context": context, "steps": steps,
            "seconds_per_step": (best[1] - best[0]) / steps, "seconds": best}


def summarize(outs) -> dict:
    return {"prompt_lens": [len(o.prompt_token_ids) for o in outs],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                        o.outputs[0].token_ids)]
                         for o in outs],
            "texts": [o.outputs[0].text for o in outs]}


def _turns(ids, a, llm) -> list:
    """``--turns``: wave ``k + 1``'s prompts, each the one before with a
    new turn of 200-800 random tokens appended (a multi-turn conversation
    whose history is a prefix-cache hit; the turns' lengths fixed by the
    seed)."""
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    rng = random.Random(7)
    out, prev = [], ids
    for k in range(a.waves - 1):
        lens = [rng.randint(200, 800) for _ in ids]
        prev = [x + y for x, y in zip(prev, token_prompts(lens, vocab, seed=100 + k))]
        out.append([TokensPrompt(prompt_token_ids=x) for x in prev])
    return out


def series_wave(k: int, first_all: list, later_all: list) -> list:
    """``--series`` wave ``k``: prompt ``k // 3`` alone, cold; then it with
    the suffix (a hit of the prompt, the suffix's tokens new); then that
    again (a hit of all but its last partial cache unit). Before 2026-12-07
    every prompt after the first was sent with its suffix in all three
    waves (its cold wave ``suffix`` tokens longer, both hits repeats)."""
    i, step = divmod(k, 3)
    return [first_all[i]] if step == 0 else [later_all[i]]


def _write_host_profile(prof, path: str) -> None:
    """This process's functions over the profiled wave (the engine core runs
    here: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), by cumulative and own time."""
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.getvalue())


def run_waves(llm, prompts_, sp, a, res):
    """Wave 1: the prompts; every later wave: each prompt with the same new
    suffix of ``--suffix-len`` tokens (a long shared prefix), after the wave
    before finished. ``--corrupt-between-waves`` overwrites one cached block
    that shard rank 1 owns before the last wave (negative control)."""
    from vllm.inputs import TokensPrompt

    tok = llm.get_tokenizer()
    ids = [p["prompt_token_ids"] if isinstance(p, dict) else tok.encode(p)
           for p in prompts_]
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    suffixes = token_prompts([a.suffix_len] * len(ids), vocab, seed=99)
    first = [TokensPrompt(prompt_token_ids=x) for x in ids]
    later = [TokensPrompt(prompt_token_ids=x + y) for x, y in zip(ids, suffixes)]
    first_all, later_all = first, later
    if a.recall:  # the same prompts again (graded): every full block a prefix hit
        later = first
    turns = _turns(ids, a, llm) if a.turns else None
    res["waves"] = []
    outs = None
    if a.warmup_tokens:  # one unrelated cold prompt first, not a wave: the
        # engine's first long prefill (lazy allocations, first kernel calls)
        # is not charged to wave 1
        warm = token_prompts([a.warmup_tokens], vocab, seed=4321)
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=x) for x in warm], sp)
        res["warmup_seconds"] = time.perf_counter() - start
        if a.stats:  # not counted in wave 1's statistics
            llm.collective_rpc("cp_kv_stats", kwargs={"reset": True})
        if a.step_times:
            llm.collective_rpc(_step_times)
    for k in range(a.waves):
        if turns is not None:  # a conversation: each wave the last one's prompt + a turn
            later = turns[k - 1] if k else first
        wave = series_wave(k, first_all, later_all) if a.series else \
            (first if k == 0 else later)
        if k == a.waves - 1 and a.corrupt_between_waves:
            res["corrupted_block"] = llm.collective_rpc(
                _corrupt_one_owned_block, args=(0, a.corrupt_index))
        before = prefix_cache_counters(llm)
        profiled = k == a.profile_wave
        if profiled:  # the workers (vLLM's torch profiler) and this process
            import cProfile

            llm.start_profile()
            here = cProfile.Profile()
            here.enable()
        start = time.perf_counter()
        outs = llm.generate(wave, sp)
        seconds = time.perf_counter() - start
        if profiled:
            here.disable()
            llm.stop_profile()
            _write_host_profile(here, os.path.join(a.profile_dir, "main_process.txt"))
        after = prefix_cache_counters(llm)
        res["waves"].append({**summarize(outs), "seconds": seconds, "clock": start, **{
            key: after[key] - before[key] for key in after}})
        if a.stats:  # this wave's totals per rank
            res["waves"][-1]["stats"] = llm.collective_rpc("cp_kv_stats",
                                                           kwargs={"reset": True})
        if a.step_times:  # rank 0's steps (the ranks run in lockstep)
            res["waves"][-1]["step_times"] = llm.collective_rpc(_step_times)[0]
    return outs


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
    ap.add_argument("--kv-bytes", type=int, default=None,
                    help="kv_cache_memory_bytes per rank (skips memory profiling)")
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
    ap.add_argument("--prompt-repeat", type=int, default=1,
                    help="repeat each prompt text (longer prompts)")
    ap.add_argument("--token-prompt-len", type=int, default=None,
                    help="one prompt of this many fixed random token ids instead")
    ap.add_argument("--dump-indexer", default=None,
                    help="sparse models: PATH prefix; save the first indexer "
                         "layer's view of request 0 at the first decode step")
    ap.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8_ds_mla")
    ap.add_argument("--attention-config", default=None,
                    help='more of vLLM\'s attention_config, e.g. \'{"sparse_mla_shard_q": false}\'')
    ap.add_argument("--dump-topk", default=None,
                    help="sparse models: save the first decode steps' top-k rows here")
    ap.add_argument("--torch-rope", action="store_true",
                    help="CPU: PyTorch's rope instead of vLLM's rotary kernel")
    ap.add_argument("--kernel-rope", action="store_true",
                    help="CPU: ask for vLLM's rotary kernel (+rotary_embedding)")
    ap.add_argument("--sorted-topk", action="store_true",
                    help="sparse models: fix the order of each top-k row (both "
                         "runs of a comparison; see _install_sorted_topk)")
    ap.add_argument("--poison", action="store_true")
    ap.add_argument("--corrupt-after-prefill", action="store_true")
    ap.add_argument("--recall", default=None,
                    help="context lengths: the recall task's prompts (grades in 'recall')")
    ap.add_argument("--recall-per-bucket", type=int, default=1)
    ap.add_argument("--corrupt-needle", action="store_true",
                    help="with --recall --corrupt-after-prefill: corrupt request 0's "
                         "needle block (every layer) on its owner")
    ap.add_argument("--drop-rank", type=int, default=None,
                    help="decode LSE merge drops this shard rank's partial (a control)")
    ap.add_argument("--corrupt-layer", type=int, default=0,
                    help="the cache --corrupt-after-prefill corrupts (-1: the last, "
                         "an MTP model's draft layer)")
    ap.add_argument("--spec", default=None,
                    help='speculative_config, e.g. \'{"method": "mtp", '
                         '"num_speculative_tokens": 2}\'; adds vLLM\'s counters')
    ap.add_argument("--token-prompts", default=None,
                    help="comma-separated lengths: prompts of fixed random token ids")
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--stats", action="store_true",
                    help="the plugin's per-rank totals (bytes per step)")
    ap.add_argument("--waves", type=int, default=1,
                    help=">= 2: the prompts, then each with a new suffix (prefix caching)")
    ap.add_argument("--suffix-len", type=int, default=24)
    ap.add_argument("--turns", action="store_true",
                    help="with --waves: each wave appends a turn of 200-800 tokens to the "
                         "last wave's prompts (a multi-turn conversation)")
    ap.add_argument("--warmup-tokens", type=int, default=0,
                    help="waves: one cold prompt of this many random tokens before wave 1, "
                         "not timed as a wave")
    ap.add_argument("--series", action="store_true",
                    help="each prompt alone, three waves each: cold, with a new suffix "
                         "(a prefix hit of the whole prompt), the same again "
                         "(sets --waves to 3 x the prompts)")
    ap.add_argument("--corrupt-between-waves", action="store_true")
    ap.add_argument("--corrupt-index", type=int, default=0,
                    help="--corrupt-between-waves: the index-th written block on rank 1")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="GPU: vLLM's default CUDA graphs instead of eager")
    ap.add_argument("--graph-mode", default=None,
                    help="GPU: CUDA graphs in this cudagraph_mode (e.g. FULL_DECODE_ONLY)")
    ap.add_argument("--capture-sizes", default=None, help="e.g. 1,2,4,8")
    ap.add_argument("--prefill-graph-sizes", default=None,
                    help="vLLM 0.34: token counts of the prefill CUDA graphs (the MTP "
                         "drafter's prefill too); '' captures none")
    ap.add_argument("--count-collectives", action="store_true",
                    help="bytes through each worker's collectives, per step (CPU; GPU "
                         "eager only: a CUDA graph's replay runs no Python)")
    ap.add_argument("--time-decode", type=int, default=0,
                    help="after the run: seconds per decode step over this many steps")
    ap.add_argument("--time-contexts", default="2000",
                    help="--time-decode: comma-separated contexts, one timing each")
    ap.add_argument("--dcp", type=int, default=1, help="vLLM's own DCP (no plugin)")
    ap.add_argument("--step-times", action="store_true",
                    help="waves: each engine step's host and GPU milliseconds (rank 0)")
    ap.add_argument("--profile-dir", default=None,
                    help="waves: vLLM's torch profiler traces of --profile-wave, here "
                         "(an absolute path)")
    ap.add_argument("--profile-wave", type=int, default=-1,
                    help="with --profile-dir: the wave (from 0) to profile")
    ap.add_argument("--no-detokenize", action="store_true",
                    help="waves: SamplingParams(detokenize=False): no text, and no "
                         "detokenization of the prompt in the first token's time")
    ap.add_argument("--profile-stack", action="store_true",
                    help="with --profile-dir: the workers' Python stacks in the traces "
                         "(where their host time goes; slows the profiled wave)")
    a = ap.parse_args()
    if a.warmup_tokens >= a.max_model_len:
        ap.error(f"--warmup-tokens {a.warmup_tokens} must be below --max-model-len "
                 f"{a.max_model_len} (the warm-up prompt gets one new token)")
    if (a.profile_wave >= 0) != bool(a.profile_dir):
        ap.error("--profile-wave and --profile-dir go together")
    if a.profile_stack and not a.profile_dir:
        ap.error("--profile-stack needs --profile-dir")
    if a.profile_dir:  # vLLM's profiler wants an absolute path
        a.profile_dir = os.path.abspath(a.profile_dir)
    if a.series:
        a.waves = 3 * len(a.token_prompts.split(","))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if a.no_plugin:
        os.environ["VLLM_PLUGINS"] = "none"
    res = run(a)
    with open(a.out, "w") as f:
        json.dump(res, f)
    print("RESULT", json.dumps({k: res[k] for k in ("shard", "kv_cache_tokens")}))


if __name__ == "__main__":
    main()
