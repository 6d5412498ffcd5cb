"""Disaggregated prefill offline: a sharded prefill instance hands its KV to a
decode instance through the cp_kv connector; compared with one instance.

Usage: python -m vllm_cp_kv.tools.pd_offline MODEL WORKDIR [--transport nixl|mooncake]
           [--decode-tp N] [--prefill-tp 2] [--dtype bfloat16] [--backend CPU_MLA]
           [--block-size N] [--max-num-seqs N] [--blocks-expiry S] [--drop-positions]
           [--transfer-timeout S] [--cpu-rope-kernel]

Three processes, as vLLM's own P/D examples do without HTTP: the prefill
instance (TP=2, cp_kv sharding, ``kv_producer``) runs every prompt with
``max_tokens=1`` and publishes the ``kv_transfer_params``; the decode instance
(not sharded, ``kv_consumer``) runs the same prompts with those params; the
reference is one unsharded instance with the decode's TP. All prompts run as
one batch on every side (``--max-num-seqs 1``: one at a time everywhere).
Prints ``PD_RESULT {json}`` and writes WORKDIR/pd_result.json.
``--drop-positions`` is the negative control (a decode-side test hook writes
blocks without their logical positions).

Every instance runs the PyTorch rope instead of vLLM 0.32's CPU rotary kernel,
which is wrong for MLA (see ``_llm``; ``--cpu-rope-kernel`` keeps it). With the
kernel, outputs depend on the batch layout and on prefill vs decode path, so
no P/D run can match a single instance. Exact identity also needs fp32
(``--dtype float32 --backend CPU_MLA --block-size 16``; AMX_MLA is bf16 only).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from .tiny_model import prompts

NUM_PROMPTS, MAX_TOKENS = 8, 32


def _kv_config(role: str, transport: str, port: int, expiry_s: float,
               timeout_s: float) -> dict:
    return {"kv_connector": "ShardedKVConnector",
            "kv_connector_module_path": "vllm_cp_kv.integration.connector",
            "kv_role": role,
            "kv_connector_extra_config": {"transport": transport,
                                          "side_channel_port": port,
                                          "blocks_expiry_s": expiry_s,
                                          "transfer_timeout_s": timeout_s}}


def _llm(a, tp: int, role: str | None, shard: bool):
    from vllm import LLM

    kw = dict(model=a.model, tokenizer=a.model, dtype=a.dtype, tensor_parallel_size=tp,
              max_model_len=1024, max_num_seqs=a.max_num_seqs, block_size=a.block_size,
              seed=0, enforce_eager=True)
    if a.backend:
        kw["attention_config"] = {"backend": a.backend}
    if not a.cpu_rope_kernel:
        # vLLM 0.32's CPU rotary kernel (torch.ops._C.rotary_embedding) is wrong
        # on MLA's inputs: it rotates q[..., nope:] ([T, H, 64], a strided view)
        # incorrectly and, for k_pe (a strided view into kv_a_proj's output),
        # reads and writes with the wrong token stride, corrupting other tokens'
        # kv_c. The result depends on the batch layout, so prefill and decode
        # (and batched and single runs) disagree. The PyTorch rope is exact.
        kw["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    if role:
        kw["kv_transfer_config"] = _kv_config(role, a.transport, a.port, a.blocks_expiry,
                                                a.transfer_timeout)
    if shard:
        kw["additional_config"] = {"cp_kv": {"enable": True}}
    return LLM(**kw)


def _sampling(params=None, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=1, extra_args=extra)


def _result(outs) -> dict:
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_lens": [len(o.prompt_token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs]}


def role_reference(a):
    llm = _llm(a, a.decode_tp, None, shard=False)
    return _result(llm.generate(prompts(NUM_PROMPTS), _sampling()))


def role_prefill(a):
    llm = _llm(a, a.prefill_tp, "kv_producer", shard=True)
    outs = llm.generate(prompts(NUM_PROMPTS),
                        _sampling({"do_remote_decode": True}, max_tokens=1))
    path = os.path.join(a.workdir, "params.json")
    with open(path + ".tmp", "w") as f:
        json.dump([o.kv_transfer_params for o in outs], f)
    os.rename(path + ".tmp", path)
    done = os.path.join(a.workdir, "decode.done")
    while not os.path.exists(done):  # the engine serves the decode's reads meanwhile
        time.sleep(0.2)
    return {"prefilled": len(outs), "first_tokens": [o.outputs[0].token_ids[0] for o in outs]}


def role_decode(a):
    llm = _llm(a, a.decode_tp, "kv_consumer", shard=False)
    path = os.path.join(a.workdir, "params.json")
    while not os.path.exists(path):
        time.sleep(0.2)
    with open(path) as f:
        params = json.load(f)
    if a.drop_positions:
        for p in params:
            p["cp_kv_test_ignore_positions"] = True
    try:
        outs = llm.generate(prompts(NUM_PROMPTS), [_sampling(p) for p in params])
        return _result(outs)
    finally:
        open(os.path.join(a.workdir, "decode.done"), "w").close()


def _spawn(a, role: str, cores: str, env: dict):
    argv = [sys.executable, "-m", "vllm_cp_kv.tools.pd_offline", a.model, a.workdir,
            "--role", role, "--transport", a.transport, "--decode-tp", str(a.decode_tp),
            "--prefill-tp", str(a.prefill_tp), "--dtype", a.dtype, "--port", str(a.port),
            "--block-size", str(a.block_size), "--max-num-seqs", str(a.max_num_seqs),
            "--blocks-expiry", str(a.blocks_expiry),
            "--transfer-timeout", str(a.transfer_timeout)]
    if a.backend:
        argv += ["--backend", a.backend]
    if a.cpu_rope_kernel:
        argv.append("--cpu-rope-kernel")
    if a.drop_positions:
        argv.append("--drop-positions")
    log = open(os.path.join(a.workdir, f"{role}.log"), "w")
    return subprocess.Popen(argv, env={**os.environ, **env, "VLLM_CPU_OMP_THREADS_BIND": cores},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc) -> None:
    """The process and vLLM's engine and workers it started."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("workdir")
    ap.add_argument("--transport", default="nixl", choices=["nixl", "mooncake"])
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=NUM_PROMPTS,
                    help="1: every side runs one request at a time")
    ap.add_argument("--backend", default=None, help="e.g. CPU_MLA (block size 16)")
    ap.add_argument("--port", type=int, default=5700)
    ap.add_argument("--blocks-expiry", type=float, default=120,
                    help="prefill side: free unclaimed blocks after this many seconds "
                         "(the connector's blocks_expiry_s; raise it for serial decodes)")
    ap.add_argument("--transfer-timeout", type=float, default=30,
                    help="decode side: fail a request whose reads take longer "
                         "(the connector's transfer_timeout_s)")
    ap.add_argument("--drop-positions", action="store_true")
    ap.add_argument("--cpu-rope-kernel", action="store_true",
                    help="keep vLLM's CPU rotary kernel (wrong for MLA in vLLM 0.32; "
                         "by default the PyTorch rope runs instead)")
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    # vLLM's engine-core process keeps stepping after generate() returns, so
    # the prefill side hands its finished blocks to the workers and serves reads
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if a.role:
        res = {"reference": role_reference, "prefill": role_prefill,
               "decode": role_decode}[a.role](a)
        with open(os.path.join(a.workdir, f"{a.role}.json"), "w") as f:
            json.dump(res, f)
        return
    os.makedirs(a.workdir, exist_ok=True)
    for name in os.listdir(a.workdir):
        if name.startswith(("params", "decode", "prefill", "reference", "pd_result")):
            os.remove(os.path.join(a.workdir, name))
    env = {"VLLM_CP_KV_TEST_HOOKS": "1"} if a.drop_positions else {}
    t0 = time.time()
    procs = [_spawn(a, "reference", "0|1" if a.decode_tp == 2 else "0", env)]
    try:
        procs[0].wait(timeout=a.timeout)
        procs += [_spawn(a, "prefill", "0|1", env),
                  _spawn(a, "decode", "0|1" if a.decode_tp == 2 else "1", env)]
        ref, prefill, decode = procs
        rc_d = decode.wait(timeout=a.timeout)
        rc_p = prefill.wait(timeout=120)
    finally:  # a timeout or a dead peer must not leave engines behind
        for proc in procs:
            _kill(proc)
    out = {"transport": a.transport, "prefill_tp": a.prefill_tp, "decode_tp": a.decode_tp,
           "dtype": a.dtype, "backend": a.backend, "block_size": a.block_size,
           "max_num_seqs": a.max_num_seqs, "drop_positions": a.drop_positions,
           "cpu_rope_kernel": a.cpu_rope_kernel, "rc": [ref.returncode, rc_p, rc_d],
           "wall_s": round(time.time() - t0, 1)}
    if out["rc"] == [0, 0, 0]:
        with open(os.path.join(a.workdir, "reference.json")) as f:
            r = json.load(f)
        with open(os.path.join(a.workdir, "decode.json")) as f:
            d = json.load(f)
        with open(os.path.join(a.workdir, "prefill.json")) as f:
            p = json.load(f)
        with open(os.path.join(a.workdir, "decode.log")) as f:
            received = [int(l.split(" received ")[1].split(" tokens")[0])
                        for l in f if "cp_kv connector: request" in l and " received " in l]
        out.update(identical=sum(x == y for x, y in zip(r["tokens"], d["tokens"])),
                   prompts=len(r["tokens"]), prompt_lens=r["prompt_lens"],
                   decode_num_cached_tokens=d["num_cached_tokens"],
                   # the prefill's own first token against the reference's
                   prefill_first_token_same=[t == toks[0] for t, toks in
                                             zip(p["first_tokens"], r["tokens"])],
                   received_tokens=sorted(received),
                   first_diff=[next((i for i, (x, y) in enumerate(zip(p, q)) if x != y),
                                    None if len(p) == len(q) else min(len(p), len(q)))
                               for p, q in zip(r["tokens"], d["tokens"])])
    with open(os.path.join(a.workdir, "pd_result.json"), "w") as f:
        json.dump(out, f)
    print("PD_RESULT", json.dumps(out))


if __name__ == "__main__":
    main()
