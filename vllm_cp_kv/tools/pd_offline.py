"""Disaggregated prefill offline: a sharded prefill instance hands its KV to a
decode instance through the cp_kv connector; compared with one instance.

Usage: python -m vllm_cp_kv.tools.pd_offline MODEL WORKDIR [--transport nixl|mooncake]
           [--decode-tp N] [--prefill-tp 2] [--dtype bfloat16] [--backend CPU_MLA]
           [--block-size N] [--max-num-seqs N] [--blocks-expiry S]
           [--transfer-timeout S] [--cpu-rope-kernel] [--waves 2 [--wave2 suffix|same]]
       GPU:   ... --device cuda [--prefill-pcp 2] [--gpu-mem F] [--decode-gpu-mem F]
           [--num-prompts N] [--prompt-repeat R] [--max-model-len L] [--strict]
           [--floor] [--recall 32768,131072 [--recall-per-bucket N]]

Three processes, as vLLM's own P/D examples do without HTTP: the prefill
instance (sharded with cp_kv, ``kv_producer``) runs every prompt with
``max_tokens=1`` and publishes the ``kv_transfer_params``; the decode instance
(not sharded, ``kv_consumer``) runs the same prompts with those params; the
reference is one unsharded instance with the decode's TP. All prompts of a
wave run as one batch on every side (``--max-num-seqs 1``: one at a time
everywhere). Prints ``PD_RESULT {json}`` and writes WORKDIR/pd_result.json.

Recorded besides the tokens: the tokens the decode received per request (its
log), whether both instances' caches are empty afterwards (vLLM's
``reset_prefix_cache`` succeeds only when every block is free: the prefill
polls it until the decode's reads freed its blocks), and the decode's
transfer figures as vLLM's stats channel reports them (``vllm:cp_kv_*``,
docs/disaggregated.md) against the bytes of the blocks moved, computed from
the model config (layers x block size x MLA latent width x dtype bytes).

``--waves 2``: a second wave hits the prefill instance's prefix cache. Wave 2
is each wave-1 prompt plus a new suffix of ``--suffix-len`` tokens
(``--wave2 same``: the same prompts again); the prefill runs it once the
decode finished wave 1, so wave 2 hits blocks that went through the
connector's delayed free (held for the decode, read, freed, still cached).
Why not sooner: a prefill holding blocks for a decode that is busy elsewhere
steps its idle engine in a loop, which on a 2-core machine slowed the decode's
wave 1 from seconds to 3.5 minutes. Recorded: vLLM's prefix-cache counters on
the prefill per wave (``vllm:prefix_cache_hits`` / ``_queries``), every wave-2
prompt token received by the decode, and wave 2's tokens against the
reference's.

CPU (the default): every instance runs the PyTorch rope instead of vLLM
0.32's CPU rotary kernel, which is wrong for MLA (see ``_llm``;
``--cpu-rope-kernel`` keeps it). With the kernel, outputs depend on the batch
layout and on prefill vs decode path, so no P/D run can match a single
instance. Exact identity also needs fp32 (``--dtype float32 --backend
CPU_MLA --block-size 16``; AMX_MLA is bf16 only).

GPU (``--device cuda``, vLLM's V2 runner): the prefill shards over the PCP
group (``--prefill-pcp 2``, TP=1, ``CUDA_VISIBLE_DEVICES=0,1``,
``--gpu-mem`` of each GPU), the decode runs TP=1 on GPU 0
(``CUDA_VISIBLE_DEVICES=0``, ``--decode-gpu-mem``; it shares GPU 0 with prefill
rank 0 and starts once the prefill has finished its wave, so that their memory
profiling does not overlap), the reference is one instance on GPU 0 before
both. A ``CUDA_VISIBLE_DEVICES`` set by the caller is kept for every instance,
and ``--kv-bytes`` fixes each rank's KV memory (both for the one-GPU harness,
scripts/gpu/onegpu, where all ranks share GPU 0). The model needs DeepSeek head sizes (``python -m
vllm_cp_kv.tools.tiny_model DIR --gpu-heads``). The decode's own prefix
caching is off (``--decode-prefix-caching`` turns it on; the decode then
reads only the blocks its cache lacks, and "received" counts those). With
``--strict`` the run exits 1 unless every check holds.

``--floor``: a fourth instance, unsharded, with the prefill's layout and no
connector, next to the reference: how far two unsharded layouts (the
prefill's and the decode's) part on these prompts (``floor_first_diff``),
the floor the P/D tokens are held to where near-ties flip (bf16 and more so
FP8, whose rounding turns the layouts' last-bit differences into whole
quantization steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

from .offline import build_llm, prefix_cache_counters, spec_decode_counters
from .tiny_model import prompts, token_prompts

NUM_PROMPTS, MAX_TOKENS = 8, 32
WAVE_MARK = "cp_kv pd_offline: decode wave"  # the decode log's wave boundary


def _llm(a, role: str):
    """``role``: reference, floor (the prefill's layout, unsharded), prefill
    or decode."""
    gpu = a.device == "cuda"
    kw = dict(tp=a.prefill_tp if role in ("prefill", "floor") else a.decode_tp, dtype=a.dtype,
              backend=a.backend, block_size=a.block_size, max_model_len=a.max_model_len,
              max_num_seqs=a.max_num_seqs,
              # vLLM's counters (prefix-cache hits, the connector's transfer
              # figures; with speculation also the reference's drafts)
              disable_log_stats=role in ("reference", "floor") and not a.spec)
    if gpu:
        kw.update(gpu_mem=a.gpu_mem if role == "prefill" else a.decode_gpu_mem,
                  kv_bytes=a.kv_bytes)  # per rank; skips memory profiling
        if role in ("prefill", "floor") and a.prefill_pcp > 1:
            kw.update(pcp=a.prefill_pcp)  # with --prefill-tp: PCP x TP (vLLM 0.34)
        if role == "decode" and not a.decode_prefix_caching:
            kw["enable_prefix_caching"] = False
        kw["eager"] = not a.cuda_graphs  # every instance: vLLM's CUDA graphs or none
    elif not a.cpu_rope_kernel:
        # vLLM 0.32's CPU rotary kernel (torch.ops._C.rotary_embedding) is wrong
        # on MLA's inputs: it rotates q[..., nope:] ([T, H, 64], a strided view)
        # incorrectly and, for k_pe (a strided view into kv_a_proj's output),
        # reads and writes with the wrong token stride, corrupting other tokens'
        # kv_c. The result depends on the batch layout, so prefill and decode
        # (and batched and single runs) disagree. The PyTorch rope is exact.
        kw["rope"] = "torch"
    if role == "prefill" and a.waves > 1:
        kw["enable_prefix_caching"] = True
    if a.spec:  # every side: the prefill fills the draft layer's KV too
        kw["speculative_config"] = json.loads(a.spec)
    if a.kv_cache_dtype:  # every side (an FP8 decode reads the prefill's FP8 bytes)
        kw["kv_cache_dtype"] = a.kv_cache_dtype
    if role not in ("reference", "floor"):
        kw["kv_role"] = "kv_producer" if role == "prefill" else "kv_consumer"
        kw["kv_extra"] = {"transport": a.transport, "side_channel_port": a.port,
                          "blocks_expiry_s": a.blocks_expiry,
                          "transfer_timeout_s": a.transfer_timeout}
    shard = (role == "prefill" and not a.prefill_plain) or (role == "decode" and a.decode_shard)
    return build_llm(a.model, shard=shard, **kw)


def _sampling(a, params=None, max_tokens=None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens or a.max_tokens,
                          ignore_eos=True, logprobs=1, extra_args=extra)


def _waves(a, llm) -> list[list]:
    """The prompts of every wave (wave 2: each wave-1 prompt plus the same
    new suffix of token ids, or the wave-1 prompts again)."""
    first = prompts(a.num_prompts, a.prompt_repeat)
    if a.recall:  # the trained model's task: token-id prompts, graded in _summarize
        from vllm.inputs import TokensPrompt

        first = [TokensPrompt(prompt_token_ids=it["ids"]) for it in _recall_items(a)]
    if a.waves == 1:
        return [first]
    if a.wave2 == "same" or a.recall:
        return [first] * a.waves
    from vllm.inputs import TokensPrompt

    tok = llm.get_tokenizer()
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    out = [first]
    for k in range(1, a.waves):
        suffix = token_prompts([a.suffix_len], vocab, seed=99 + k)[0]
        out.append([TokensPrompt(prompt_token_ids=tok.encode(p) + suffix) for p in first])
    return out


def _recall_items(a) -> list[dict]:
    from . import recall

    return [it for n in a.recall.split(",") for it in recall.prompts(int(n), a.recall_per_bucket)]


def _result(outs) -> dict:
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_lens": [len(o.prompt_token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs]}


def _transfer_metrics(llm) -> dict:
    """The connector's figures as vLLM's stats channel reported them."""
    out = {"ok": 0, "failed": 0, "bytes": 0, "blocks": 0}
    for m in llm.get_metrics():
        labels = getattr(m, "labels", {}) or {}
        if m.name == "vllm:cp_kv_transfers" and labels.get("role") == "decode":
            out[labels.get("result", "ok")] += int(m.value)
        elif m.name == "vllm:cp_kv_transfer_bytes":
            out["bytes"] += int(m.value)
        elif m.name == "vllm:cp_kv_transfer_blocks":
            out["blocks"] += int(m.value)
    return out


def _cache_empty(llm, timeout_s: float) -> float | None:
    """Seconds until every block of the instance is free (vLLM's
    ``reset_prefix_cache`` succeeds only then), or ``None`` on timeout."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if llm.reset_prefix_cache():
            return round(time.time() - t0, 2)
        time.sleep(0.5)
    return None


def _page_bytes(llm) -> int:
    """Bytes of one KV block of every layer, the MTP draft layers included:
    each layer's caches as ``vllm-cp-kv capacity`` counts them
    (``cli.model_kv_layout``: the MLA latent, fp8_ds_mla's 656-byte rows,
    DeepSeek-V3.2's indexer keys and scales)."""
    from .cli import model_kv_layout

    cfg = llm.llm_engine.vllm_config
    hf = cfg.model_config.hf_text_config
    layout = model_kv_layout(cfg.model_config.model,
                             str(cfg.model_config.dtype).removeprefix("torch."),
                             str(cfg.cache_config.cache_dtype))
    spec = cfg.speculative_config
    layers = hf.num_hidden_layers + (
        getattr(hf, "num_nextn_predict_layers", 0) or 0
        if spec is not None and spec.method == "mtp" else 0)
    return layers * cfg.cache_config.block_size * (layout["latent"] + layout["indexer"])


def _capacity(llm) -> int:
    """Tokens of KV the instance holds (one block spans its DCP ranks)."""
    cfg = llm.llm_engine.vllm_config
    return (cfg.cache_config.num_gpu_blocks * cfg.cache_config.block_size
            * cfg.parallel_config.decode_context_parallel_size)


def role_reference(a, role="reference"):
    llm = _llm(a, role)
    waves = [_result(llm.generate(w, _sampling(a))) for w in _waves(a, llm)]
    return {**waves[0], "waves": waves,
            "spec_decode": spec_decode_counters(llm) if a.spec else None}


def role_prefill(a):
    llm = _llm(a, "prefill")
    if a.device == "cpu":
        # The instances share the machine's cores, and a prefill holding
        # blocks for a transfer keeps stepping its engine, after each step of
        # which vLLM's workers spin for a second: a decode still starting next
        # to that was starved (NIXL's UCX backend took 125 s on 2 cores and
        # the blocks expired). Prefill once the decode is up (or gone).
        _wait_file(os.path.join(a.workdir, "decode.ready"),
                   os.path.join(a.workdir, "decode.done"))
    waves, first_tokens = [], []
    for k, wave in enumerate(_waves(a, llm)):
        if k:  # after the decode finished the wave before (its blocks were freed)
            wave_done = os.path.join(a.workdir, f"wave{k - 1}.done")
            if _wait_file(wave_done, os.path.join(a.workdir, "decode.done")) != wave_done:
                break  # the decode gave up
        before = prefix_cache_counters(llm)
        outs = llm.generate(wave, _sampling(a, {"do_remote_decode": True}, max_tokens=1))
        after = prefix_cache_counters(llm)
        _publish(a, k, [o.kv_transfer_params for o in outs])
        waves.append({"prompts": len(outs),
                      "prompt_lens": [len(o.prompt_token_ids) for o in outs],
                      "num_cached_tokens": [o.num_cached_tokens for o in outs],
                      **{key: after[key] - before[key] for key in after}})
        first_tokens.append([o.outputs[0].token_ids[0] for o in outs])
    # the engine serves the decode's reads meanwhile
    _wait_file(os.path.join(a.workdir, "decode.done"))
    return {"prefilled": waves[0]["prompts"], "first_tokens": first_tokens[0],
            "first_tokens_waves": first_tokens, "waves": waves,
            # every block back once the decode's reads are done (or expired)
            "cache_empty_after_s": _cache_empty(llm, a.blocks_expiry + 60)}


def _wait_file(*paths: str) -> str:
    """The first of ``paths`` that exists, once one does."""
    while True:
        for path in paths:
            if os.path.exists(path):
                return path
        time.sleep(0.2)


def _publish(a, k: int, params) -> None:
    path = os.path.join(a.workdir, f"params{k}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(params, f)
    os.rename(path + ".tmp", path)


def role_decode(a):
    try:
        llm = _llm(a, "decode")
        open(os.path.join(a.workdir, "decode.ready"), "w").close()
        waves = []
        for k, wave in enumerate(_waves(a, llm)):
            path = os.path.join(a.workdir, f"params{k}.json")
            _wait_file(path)
            with open(path) as f:
                params = json.load(f)
            print(f"{WAVE_MARK} {k + 1}", flush=True)
            waves.append(_result(llm.generate(wave, [_sampling(a, p) for p in params])))
            open(os.path.join(a.workdir, f"wave{k}.done"), "w").close()
        return {**waves[0], "waves": waves, "transfer_metrics": _transfer_metrics(llm),
                "page_bytes": _page_bytes(llm),
                "spec_decode": spec_decode_counters(llm) if a.spec else None,
                "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
                "capacity_tokens": _capacity(llm),
                "cache_empty_after_s": _cache_empty(llm, 30)}
    finally:
        open(os.path.join(a.workdir, "decode.done"), "w").close()


def _spawn(a, role: str):
    argv = [sys.executable, "-m", "vllm_cp_kv.tools.pd_offline", a.model, a.workdir,
            "--role", role]
    for key, value in vars(a).items():
        if key in ("model", "workdir", "role", "timeout") or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    if a.device == "cuda" and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(
            str(i) for i in range(a.prefill_pcp * a.prefill_tp if role in ("prefill", "floor")
                                  else a.decode_tp))}
    else:
        tp = a.prefill_tp if role in ("prefill", "floor") else a.decode_tp  # the reference: the decode's
        if tp > 2:  # more ranks than cores: one thread each, unbound
            env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        else:
            env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else
                   ("1" if role == "decode" else "0")}
    log = open(os.path.join(a.workdir, f"{role}.log"), "w")
    return subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc) -> None:
    """The process and vLLM's engine and workers it started."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


RECEIVED = re.compile(r"cp_kv connector: request (\S+) received (\d+) tokens \((\d+) blocks")
CACHED = re.compile(r"; (\d+) leading blocks")
RANK = re.compile(r"\(decode rank (\d+)/\d+")


def _received(path: str, waves: int) -> list[list[dict]]:
    """Per wave, one entry per pull the decode logged (one per request and
    decode rank): request, tokens and blocks received, leading blocks its
    own prefix cache held (not read), and the decode rank (0 unsharded)."""
    pulls = [[] for _ in range(waves)]
    k = 0
    with open(path) as f:
        for line in f:
            if line.startswith(WAVE_MARK):
                k = int(line.split()[-1]) - 1
                continue
            m = RECEIVED.search(line)
            if m:
                cached, rank = CACHED.search(line), RANK.search(line)
                pulls[k].append({"request": m[1], "tokens": int(m[2]), "blocks": int(m[3]),
                                 "cached": int(cached[1]) if cached else 0,
                                 "rank": int(rank[1]) if rank else 0})
    return pulls


def _owned_blocks(prompt_len: int, block_size: int, size: int, rank: int) -> int:
    """Blocks of a prompt that decode rank ``rank`` of ``size`` owns."""
    return len(range(rank, math.ceil(prompt_len / block_size), size))


def _wait_for(path: str, proc, timeout_s: float) -> None:
    end = time.time() + timeout_s
    while not os.path.exists(path):
        if proc.poll() is not None or time.time() > end:
            return
        time.sleep(0.5)


def _instance_arguments(ap: argparse.ArgumentParser) -> None:
    """The instances: model, layout, device, memory, dtypes, prompts."""
    ap.add_argument("model")
    ap.add_argument("workdir")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--transport", default="nixl", choices=["nixl", "mooncake"])
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--prefill-tp", type=int, default=None,
                    help="prefill TP (CPU default 2: the shard group; GPU default 1)")
    ap.add_argument("--prefill-pcp", type=int, default=None,
                    help="GPU: prefill PCP size, the shard group (default 2)")
    ap.add_argument("--gpu-mem", type=float, default=0.3,
                    help="GPU: the prefill's gpu_memory_utilization (of each GPU)")
    ap.add_argument("--kv-bytes", type=int, default=None,
                    help="GPU: kv_cache_memory_bytes per rank of every instance "
                         "(no memory profiling)")
    ap.add_argument("--decode-gpu-mem", type=float, default=0.3,
                    help="GPU: the decode's and the reference's gpu_memory_utilization")
    ap.add_argument("--decode-prefix-caching", action="store_true",
                    help="GPU: keep the decode's own prefix caching on")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="every instance's KV cache dtype (e.g. fp8), the reference's too")
    ap.add_argument("--block-size", type=int, default=None,
                    help="CPU default 32; GPU default 64")
    ap.add_argument("--max-num-seqs", type=int, default=NUM_PROMPTS,
                    help="1: every side runs one request at a time")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--prompt-repeat", type=int, default=None,
                    help="repeat each prompt text (CPU default 1, GPU 4: up to ~2,200 tokens)")
    ap.add_argument("--max-model-len", type=int, default=None, help="CPU 1024, GPU 4096")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--backend", default=None, help="e.g. CPU_MLA (block size 16)")


def _run_arguments(ap: argparse.ArgumentParser) -> None:
    """The run: ports, timeouts, waves, checks, roles."""
    ap.add_argument("--port", type=int, default=5700)
    ap.add_argument("--blocks-expiry", type=float, default=None,
                    help="prefill side: free unclaimed blocks after this many seconds "
                         "(the connector's blocks_expiry_s; CPU 120, GPU 300)")
    ap.add_argument("--transfer-timeout", type=float, default=30,
                    help="decode side: fail a request whose reads take longer "
                         "(the connector's transfer_timeout_s)")
    ap.add_argument("--waves", type=int, default=1,
                    help="2: a second wave that hits the prefill's prefix cache")
    ap.add_argument("--wave2", default="suffix", choices=["suffix", "same"],
                    help="wave 2: each prompt plus a new suffix, or the same prompts")
    ap.add_argument("--suffix-len", type=int, default=24)
    ap.add_argument("--cpu-rope-kernel", action="store_true",
                    help="keep vLLM's CPU rotary kernel (wrong for MLA in vLLM 0.32; "
                         "by default the PyTorch rope runs instead)")
    ap.add_argument("--spec", default=None,
                    help='speculative_config of every instance, e.g. \'{"method": "mtp", '
                         '"num_speculative_tokens": 2}\' (a model with an MTP layer)')
    ap.add_argument("--recall", default=None,
                    help="context lengths: the trained recall model's prompts instead of "
                         "tiny_model's, graded ('recall': reference and decode)")
    ap.add_argument("--recall-per-bucket", type=int, default=1)
    ap.add_argument("--floor", action="store_true",
                    help="also run the prefill's layout unsharded, without a connector: "
                         "the floor of two unsharded layouts on these prompts")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 unless every check holds (see pd_result.json 'checks')")
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="GPU: every instance in vLLM's default CUDA-graph mode")
    ap.add_argument("--decode-shard", action="store_true",
                    help="the decode instance shards its KV too (cp_kv over its TP ranks): "
                         "each decode rank pulls only the blocks it owns")
    ap.add_argument("--prefill-plain", action="store_true",
                    help="the prefill instance does not shard (cp_kv off; its connector "
                         "serves one rank's whole cache)")
    ap.add_argument("--summarize", action="store_true",
                    help="only write WORKDIR/pd_result.json from the roles' results there "
                         "(a run stopped after every role had written its own; the same "
                         "arguments as the run)")


def parse_args(argv=None) -> argparse.Namespace:
    """The tool's arguments, with the platform's defaults filled in."""
    ap = argparse.ArgumentParser()
    _instance_arguments(ap)
    _run_arguments(ap)
    a = ap.parse_args(argv)
    gpu = a.device == "cuda"
    a.prefill_tp = a.prefill_tp or (1 if gpu else 2)
    a.prefill_pcp = a.prefill_pcp or (2 if gpu else 1)
    # GPU: 64 on both sides whatever backend each picks (FLASHMLA needs 64,
    # FLASH_ATTN_MLA and TRITON_MLA take multiples of 16): the decode refuses a
    # prefill of another block size (handshake mismatch)
    a.block_size = a.block_size or (64 if gpu else 32)
    a.prompt_repeat = a.prompt_repeat or (4 if gpu else 1)
    a.max_model_len = a.max_model_len or (4096 if gpu else 1024)
    a.blocks_expiry = a.blocks_expiry or (300.0 if gpu else 120.0)
    return a


def main() -> None:
    a = parse_args()
    # vLLM's engine-core process keeps stepping after generate() returns, so
    # the prefill side hands its finished blocks to the workers and serves reads
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if a.role:
        res = {"reference": role_reference, "prefill": role_prefill,
               "floor": lambda a: role_reference(a, "floor"),
               "decode": role_decode}[a.role](a)
        with open(os.path.join(a.workdir, f"{a.role}.json"), "w") as f:
            json.dump(res, f)
        return
    out = summarize_only(a) if a.summarize else run_all(a)
    print("PD_RESULT", json.dumps(out))
    if a.strict and not all((out.get("checks") or {"ran": False}).values()):
        sys.exit(1)


def summarize_only(a) -> dict:
    """pd_result.json from a workdir whose roles all finished (their
    ``*.json`` and logs there) but whose driver was stopped before it wrote
    the summary; ``rc`` is unknown then (None)."""
    out = {**_facts(a), "rc": None, "summarized_after_the_run": True}
    out.update(_summarize(a))
    with open(os.path.join(a.workdir, "pd_result.json"), "w") as f:
        json.dump(out, f)
    return out


def run_all(a) -> dict:
    """The reference, the prefill and the decode, one process each, in
    order; their results summarized into ``workdir/pd_result.json``."""
    os.makedirs(a.workdir, exist_ok=True)
    for name in os.listdir(a.workdir):
        if name.startswith(("params", "decode", "prefill", "reference", "floor", "pd_result",
                            "wave")):
            os.remove(os.path.join(a.workdir, name))
    t0 = time.time()
    procs = [_spawn(a, "reference")]
    # the floor next to the reference where the ranks fix their KV bytes
    # (neither profiles the other's memory), else after it
    together = a.device == "cpu" or a.kv_bytes is not None
    floor = _spawn(a, "floor") if a.floor and together else None
    try:
        procs[0].wait(timeout=a.timeout)
        if a.floor and floor is None:
            floor = _spawn(a, "floor")
        if floor is not None:
            floor.wait(timeout=a.timeout)
        procs.append(_spawn(a, "prefill"))
        if a.device == "cuda":  # GPU 0 is shared: let the prefill size its cache first
            _wait_for(os.path.join(a.workdir, "params0.json"), procs[1], a.timeout)
        procs.append(_spawn(a, "decode"))
        ref, prefill, decode = procs
        rc_d = decode.wait(timeout=a.timeout)
        rc_p = prefill.wait(timeout=a.blocks_expiry + 180)
    finally:  # a timeout or a dead peer must not leave engines behind
        for proc in procs + [floor] * (floor is not None):
            _kill(proc)
    out = {**_facts(a), "rc": [ref.returncode, rc_p, rc_d],
           "wall_s": round(time.time() - t0, 1)}
    if floor is not None:
        out["floor_rc"] = floor.returncode
    if out["rc"] == [0, 0, 0]:
        out.update(_summarize(a))
    with open(os.path.join(a.workdir, "pd_result.json"), "w") as f:
        json.dump(out, f)
    return out


def _facts(a) -> dict:
    return {"device": a.device, "transport": a.transport, "prefill_tp": a.prefill_tp,
            "prefill_pcp": a.prefill_pcp, "decode_tp": a.decode_tp, "dtype": a.dtype,
            "backend": a.backend, "block_size": a.block_size, "waves": a.waves,
            "max_num_seqs": a.max_num_seqs, "max_tokens": a.max_tokens,
            "cpu_rope_kernel": a.cpu_rope_kernel,
            "spec": json.loads(a.spec) if a.spec else None}


def _first_diffs(a_tokens, b_tokens) -> list[int | None]:
    """Per prompt: the first position where the two differ (None: identical)."""
    return [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y),
                 None if len(s) == len(t) else min(len(s), len(t)))
            for s, t in zip(a_tokens, b_tokens)]


def _wave_result(a, k: int, r: dict, d: dict, p: dict, pulled: list, copies: int) -> dict:
    """Wave ``k``'s result: tokens against the reference, what arrived
    (``pulled``: the decode's reads of the wave), the prefill's cache hits."""
    bs = d["block_size"]
    rw, dw, pw = r["waves"][k], d["waves"][k], p["waves"][k]
    # received plus the decode's own cache hits, summed over its ranks
    covered: dict[str, int] = {}
    for x in pulled:
        covered[x["request"]] = covered.get(x["request"], 0) + x["tokens"] + x["cached"] * bs
    wave = {
        "identical": sum(x == y for x, y in zip(rw["tokens"], dw["tokens"])),
        "prompts": len(rw["tokens"]), "prompt_lens": rw["prompt_lens"],
        "received_tokens": sorted(x["tokens"] for x in pulled),
        "all_prompt_tokens_arrived":
            sorted(covered.values()) == sorted(n * copies for n in rw["prompt_lens"]),
        "prefill_prefix_cache_hits": pw["prefix_cache_hits"],
        "prefill_prefix_cache_queries": pw["prefix_cache_queries"],
        "prefill_num_cached_tokens": pw["num_cached_tokens"],
        "first_diff": _first_diffs(rw["tokens"], dw["tokens"])}
    if a.decode_shard:  # each rank exactly the blocks it owns, of every prompt
        want = sorted((rank, _owned_blocks(n, bs, a.decode_tp, rank))
                      for n in rw["prompt_lens"] for rank in range(a.decode_tp))
        wave["blocks_per_decode_rank_exact"] = \
            sorted((x["rank"], x["blocks"] + x["cached"]) for x in pulled) == want
    return wave


def _summarize(a) -> dict:
    def load(name):
        with open(os.path.join(a.workdir, f"{name}.json")) as f:
            return json.load(f)

    r, d, p = load("reference"), load("decode"), load("prefill")
    pulls = _received(os.path.join(a.workdir, "decode.log"), a.waves)
    bs = d["block_size"]
    # an unsharded decode's every rank receives every block; a sharded one's
    # each rank the blocks it owns
    copies = 1 if a.decode_shard else a.decode_tp
    waves = [_wave_result(a, k, r, d, p, pulls[k], copies) for k in range(a.waves)]
    # the bytes of the blocks moved: every block of every prompt, read by every
    # decode rank, less the blocks a decode's own prefix cache held
    all_lens = [n for k in range(a.waves) for n in r["waves"][k]["prompt_lens"]]
    blocks = (sum(math.ceil(n / bs) for n in all_lens) * copies
              - sum(x["cached"] for w in pulls for x in w))
    expected_bytes = blocks * d["page_bytes"]
    metrics = d["transfer_metrics"]
    out = {**{k: waves[0][k] for k in ("identical", "prompts", "prompt_lens",
                                       "received_tokens", "first_diff")},
           "decode_tokens": d["waves"][0]["tokens"],  # to compare runs (transports)
           "decode_num_cached_tokens": d["num_cached_tokens"],
           # the prefill's own first token against the reference's
           "prefill_first_token_same": [t == toks[0] for t, toks in
                                        zip(p["first_tokens"], r["tokens"])],
           "wave_results": waves,
           "prefill_cache_empty_after_s": p["cache_empty_after_s"],
           "decode_cache_empty_after_s": d["cache_empty_after_s"],
           "decode_transfer_metrics": metrics, "expected_transfer_bytes": expected_bytes,
           "decode_block_size": d["block_size"], "page_bytes_all_layers": d["page_bytes"]}
    n = sum(len(w["prompt_lens"]) for w in waves)
    out["checks"] = {
        "identical_tokens": all(w["identical"] == w["prompts"] for w in waves),
        "every_prompt_token_received": all(w["all_prompt_tokens_arrived"] for w in waves),
        "prefill_cache_empty": p["cache_empty_after_s"] is not None,
        "decode_cache_empty": d["cache_empty_after_s"] is not None,
        "transfers_counted": metrics["ok"] == n * a.decode_tp and metrics["failed"] == 0,
        "transfer_bytes_exact": metrics["bytes"] == expected_bytes,
    }
    if a.decode_shard:
        out["checks"]["blocks_per_decode_rank_exact"] = all(
            w["blocks_per_decode_rank_exact"] for w in waves)
        out["decode_capacity_tokens"] = d.get("capacity_tokens")
    if a.spec:  # the draft layer's KV arrived: the decode's drafts are accepted as
        # the reference's (the decode drafts once more per request: its first
        # step proposes what the reference proposed after its own prefill)
        out["spec_decode"] = {"reference": r["spec_decode"], "decode": d["spec_decode"]}
        key = "spec_decode_num_accepted_tokens"
        out["checks"]["spec_decode_accepted_equal"] = \
            r["spec_decode"][key] == d["spec_decode"][key]
    if a.floor and os.path.exists(os.path.join(a.workdir, "floor.json")):
        f = load("floor")
        out["floor_first_diff"] = _first_diffs(r["tokens"], f["tokens"])
    if a.recall:  # the task's accuracy, the decode against the reference (the
        # owners: the ranks that held each needle, the prefill's unless the decode shards)
        from . import recall

        items = _recall_items(a)
        ranks = (a.decode_tp if a.decode_shard else
                 1 if a.prefill_plain else a.prefill_tp * a.prefill_pcp)
        out["recall"] = {
            "reference": recall.grade_lengths(items, r["tokens"], block_size=bs),
            "decode": recall.grade_lengths(items, d["waves"][0]["tokens"], ranks=ranks,
                                           block_size=bs)}
    if a.waves > 1:
        out["checks"]["prefill_prefix_cache_hit_in_later_waves"] = all(
            w["prefill_prefix_cache_hits"] > 0 for w in waves[1:])
    return out


if __name__ == "__main__":
    main()
