"""Disaggregated-prefill transfer: the connector's read path against the raw
transfer engine moving the same bytes, NIXL (UCX) and Mooncake (TCP) on
loopback.

Usage: python benchmarks/pd_transfer.py OUT_DIR [--transports nixl mooncake]
           [--repeats 30] [--warmup 3] [--layers 4] [--block-size 64] [--blocks 64]
           [--device cpu|cuda]

One request of ``--blocks`` logical blocks of ``--block-size`` tokens in
DeepSeek's layout: per layer the MLA latent (576 bf16 per token: kv_lora_rank
512 + rope 64, 73,728 bytes per 64-token block) and, for the sparse model
(V3.2), the indexer cache (128 fp8 keys + one fp32 scale per token, 8,448
bytes per block). Two owner processes hold it sharded by the project's rule
(``owned_manifest`` on a fresh, consecutive virtual table); this process is
the unsharded receiver. Per transport, layout (latent, latent+indexer) and
decode block table (``fresh``: consecutive ids, what a fresh decode
allocates; ``grouped``: each owner's blocks consecutive, the table where runs
merge), interleaved, after warm-up:

* connector: ``validate_manifest`` + ``check_complete`` + ``read_owned_blocks``
  (the connector worker's code: ``merge_runs``, ``read_descriptors``,
  ``Transport.read``);
* raw: a separate nixl agent / Mooncake TransferEngine in this process, byte
  ranges written down from the ownership rule, contiguous ranges coalesced,
  one batched read per owner, direct engine calls, no project code;
* plan: the connector's code with a transport that moves nothing (its CPU
  cost).

The receiver's caches are zeroed before and compared with the source after
every request; the connector's descriptor count must equal the raw path's
count of contiguous regions. Writes OUT_DIR/pd_transfer.json and .png, with
the goal raw time / connector time >= 0.8 per row (``goal``).

``--device cuda``: GPU to GPU. Owner r holds its caches on GPU ``r % G`` (G
GPUs visible; with one GPU both owners share it), the receiver on GPU 0;
NIXL registers and describes them as ``VRAM`` of their device (the
connector's ``memory_kind``; the raw path writes the same by hand) and UCX
moves them (between GPUs of one host: its ``cuda_ipc`` transport over NVLink;
``UCX_TLS`` and ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` are recorded). Mooncake is
skipped there unless ``--mooncake-cuda``: none of its CUDA builds comes with
the GPU payload, and their TCP transport stages GPU memory through host
buffers (docs/disaggregated.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import torch

from common import meta, write_json  # (also puts the repo root on sys.path)
from harness.loopback import owner_processes, serve_until_done, transport_available
from vllm_cp_kv.core.manifest import check_complete, owned_manifest, validate_manifest
from vllm_cp_kv.integration.connector.transfer import (Transport, make_transport,
                                                       read_owned_blocks)

HOST = "127.0.0.1"
N = 2  # owner ranks (shard group)
TIMEOUT_S = 60.0
GOAL_RATIO = 0.8  # raw time / connector time
LAYOUTS = ("latent", "latent+indexer")
TABLES = ("fresh", "grouped")
ARGS = None  # the parsed command line (set in main, and in each owner process)


def cache_specs(layers: int, block_size: int) -> list[tuple[str, tuple, torch.dtype]]:
    """Per layer the latent then the indexer cache: (kind, block shape, dtype)."""
    latent = ("latent", (block_size, 576), torch.bfloat16)
    indexer = ("indexer", (block_size * 132,), torch.uint8)
    return [latent, indexer] * layers


def device_of(rank: int | None) -> torch.device:
    """Owner ``rank``'s device (``None``: the receiver's)."""
    if ARGS.device != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", 0 if rank is None else rank % torch.cuda.device_count())


def source_caches(specs, device=None) -> list[torch.Tensor]:
    """The request's unsharded KV: per cache ``[blocks, *block shape]``
    (made on the CPU, the same everywhere, then moved to ``device``)."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn((ARGS.blocks, *shape), generator=gen).to(dtype)
             if dtype.is_floating_point else
             torch.randint(0, 256, (ARGS.blocks, *shape), generator=gen, dtype=dtype)
             ).to(device or "cpu")
            for _, shape, dtype in specs]


def virtual_table() -> list[int]:
    return list(range(1, 1 + -(-ARGS.blocks // N)))  # block 0 is vLLM's null block


def decode_table(kind: str) -> list[int]:
    if kind == "fresh":
        return list(range(1, 1 + ARGS.blocks))
    per_rank = -(-ARGS.blocks // N)  # "grouped": logical j -> rank j % N's range
    return [1 + (j % N) * per_rank + j // N for j in range(ARGS.blocks)]


def num_tokens() -> int:
    return ARGS.blocks * ARGS.block_size


def owner(rank, transport, args, to_recv, from_recv):
    global ARGS
    ARGS = args
    specs = cache_specs(args.layers, args.block_size)
    device = device_of(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    src = source_caches(specs, device)
    caches = [torch.zeros((len(virtual_table()) + 1, *shape), dtype=dtype, device=device)
              for _, shape, dtype in specs]
    manifest = owned_manifest(rank, N, args.block_size, virtual_table(), num_tokens())
    for cache, full in zip(caches, src):  # this rank stores only its own blocks
        for j, phys in manifest:
            cache[phys] = full[j]
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the blocks are written before anyone reads
    t = make_transport(transport, HOST)
    to_recv.put((rank, {"transport_meta": t.register(caches), "manifest": manifest,
                        "layer_addrs": [c.data_ptr() for c in caches],
                        "num_blocks": caches[0].shape[0]}))
    serve_until_done(t, from_recv)


class RawNixl:
    """Plain nixl agent calls (no progress thread, as in the connector); GPU
    memory as NIXL's ``VRAM`` of its device, written down here by hand."""

    def __init__(self, local, infos):
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(f"raw-{uuid.uuid4().hex[:8]}",
                                nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        for c in local:
            self.agent.register_memory(c)  # nixl reads the tensor's device itself
        self.local = ("VRAM", local[0].device.index) if local[0].is_cuda else ("DRAM", 0)
        self.remote = {r: (i["transport_meta"].get("mem_type", "DRAM"),
                           i["transport_meta"].get("device_id", 0)) for r, i in infos.items()}
        self.peers = {r: self.agent.add_remote_agent(i["transport_meta"]["agent_metadata"])
                      for r, i in infos.items()}

    def read(self, rank, ranges):
        a = self.agent
        (lt, ld), (rt, rd) = self.local, self.remote[rank]
        handle = a.initialize_xfer(
            "READ", a.get_xfer_descs([(dst, n, ld) for _, dst, n in ranges], lt),
            a.get_xfer_descs([(src, n, rd) for src, _, n in ranges], rt),
            self.peers[rank])
        state = a.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = a.check_xfer_state(handle)
        a.release_xfer_handle(handle)
        assert state == "DONE", state


class RawMooncake:
    """Plain Mooncake TransferEngine calls."""

    def __init__(self, local, infos):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        assert self.engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
        for c in local:
            assert self.engine.register_memory(c.data_ptr(), c.numel() * c.element_size()) == 0
        self.sessions = {r: i["transport_meta"]["session"] for r, i in infos.items()}

    def read(self, rank, ranges):
        dst, src, nbytes = zip(*[(d, s, n) for s, d, n in ranges])
        assert self.engine.batch_transfer_sync_read(
            self.sessions[rank], list(dst), list(src), list(nbytes)) == 0


RAW = {"nixl": RawNixl, "mooncake": RawMooncake}


class PlanOnly(Transport):
    """The connector's code with nothing moved: its CPU cost alone."""

    def read(self, peer_meta, reads, timeout_s):
        pass


def coalesce(ranges):
    """Merge ``(src, dst, nbytes)`` ranges contiguous on both sides."""
    out = []
    for s, d, n in ranges:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


def bench_case(transport, raw, infos, local, src, idx, table):
    local_ids = decode_table(table)
    nbytes = [local[i][0].numel() * local[i].element_size() for i in idx]
    local_addrs = [local[i].data_ptr() for i in idx]
    peers = {r: {"transport_meta": info["transport_meta"],
                 "layer_addrs": [info["layer_addrs"][i] for i in idx]}
             for r, info in infos.items()}

    def connector(t=transport):
        manifests = {r: validate_manifest(info["manifest"], r, N, ARGS.blocks, info["num_blocks"])
                     for r, info in infos.items()}
        check_complete(manifests, ARGS.blocks)
        return read_owned_blocks(t, manifests, peers, local_ids, local_addrs, nbytes,
                                 TIMEOUT_S)[0]

    # raw: every owned block's bytes, from the rule owner(j) = j % N at
    # virtual_table[j // N], written down without the project's code
    vt = virtual_table()
    raw_ranges = {r: coalesce([(peers[r]["layer_addrs"][k] + vt[j // N] * nb,
                                local_addrs[k] + local_ids[j] * nb, nb)
                               for k, nb in enumerate(nbytes)
                               for j in range(r, ARGS.blocks, N)])
                  for r in infos}

    def raw_path():
        for r in sorted(raw_ranges):
            raw.read(r, raw_ranges[r])
        return sum(len(v) for v in raw_ranges.values())

    ids = torch.tensor(local_ids, device=local[0].device)

    def timed(fn):
        for i in idx:
            local[i].zero_()
        if local[0].is_cuda:  # the zeroing kernel has run before a byte lands
            torch.cuda.synchronize(local[0].device)
        t0 = time.perf_counter()
        descs = fn()
        dt = time.perf_counter() - t0
        for i in idx:  # every byte of every block where the decode expects it
            assert torch.equal(local[i][ids].view(torch.uint8), src[i].view(torch.uint8)), \
                f"cache {i}: received bytes differ from the source"
        return dt, descs

    times = {"connector": [], "raw": [], "plan": []}
    descs = {}
    plan = PlanOnly()
    for rep in range(ARGS.warmup + ARGS.repeats):
        order = [("connector", connector), ("raw", raw_path)]
        for name, fn in order[::-1] if rep % 2 else order:
            dt, descs[name] = timed(fn)
            if rep >= ARGS.warmup:
                times[name].append(dt)
        t0 = time.perf_counter()
        connector(plan)
        if rep >= ARGS.warmup:
            times["plan"].append(time.perf_counter() - t0)
    assert descs["connector"] == descs["raw"], descs  # merged runs = contiguous regions
    med = {k: statistics.median(v) for k, v in times.items()}
    total = ARGS.blocks * sum(nbytes)
    return {"caches": len(idx), "bytes": total, "blocks": ARGS.blocks,
            "descriptors": descs["connector"], "raw_descriptors": descs["raw"],
            "unmerged_descriptors": ARGS.blocks * len(idx),
            "connector_ms": med["connector"] * 1e3, "raw_ms": med["raw"] * 1e3,
            "plan_ms": med["plan"] * 1e3,
            "connector_ms_all": [t * 1e3 for t in times["connector"]],
            "raw_ms_all": [t * 1e3 for t in times["raw"]],
            "ratio": med["raw"] / med["connector"],
            # robust to load drifting between repeats: each repeat's own ratio
            "ratio_paired": statistics.median(
                r / c for r, c in zip(times["raw"], times["connector"])),
            "connector_GBps": total / med["connector"] / 1e9,
            "raw_GBps": total / med["raw"] / 1e9}


def bench_transport(name):
    with owner_processes(owner, N, name, ARGS) as infos:
        specs = cache_specs(ARGS.layers, ARGS.block_size)
        device = device_of(None)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        src = source_caches(specs, device)
        local = [torch.zeros((ARGS.blocks + 8, *shape), dtype=dtype, device=device)
                 for _, shape, dtype in specs]
        transport = make_transport(name, HOST)
        transport.register(local)
        raw = RAW[name](local, infos)
        rows = []
        for layout in LAYOUTS:
            idx = [i for i, (kind, _, _) in enumerate(specs)
                   if kind == "latent" or layout == "latent+indexer"]
            for table in TABLES:
                row = {"transport": name, "layout": layout, "decode_table": table,
                       **bench_case(transport, raw, infos, local, src, idx, table)}
                print(f"{name:8s} {layout:15s} {table:7s} {row['bytes'] / 2**20:6.1f} MiB "
                      f"descs {row['descriptors']:4d} (blocks x caches {row['unmerged_descriptors']})"
                      f"  connector {row['connector_ms']:7.2f} ms  raw {row['raw_ms']:7.2f} ms"
                      f"  plan {row['plan_ms']:5.2f} ms  ratio {row['ratio']:.2f}"
                      f" (paired {row['ratio_paired']:.2f})", flush=True)
                rows.append(row)
        return rows


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--transports", nargs="+", default=["nixl", "mooncake"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: owners on the GPUs, the receiver on GPU 0")
    ap.add_argument("--mooncake-cuda", action="store_true",
                    help="with --device cuda: run Mooncake too (needs its CUDA build, "
                         "e.g. mooncake-transfer-engine-cuda13)")
    ARGS = ap.parse_args()
    out = {**meta(), "torch": torch.__version__, "load_avg_start": os.getloadavg(),
           "UCX_TLS": os.environ.get("UCX_TLS", "(default)"), "device": ARGS.device,
           "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY",
                                                           "(default)"),
           "gpus": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                    if ARGS.device == "cuda" else []),
           "config": {k: v for k, v in vars(ARGS).items() if k != "out_dir"},
           "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
           "rows": [], "skipped": {}}
    for name in ARGS.transports:
        if not transport_available(name):
            out["skipped"][name] = "not installed"
            continue
        if name == "mooncake" and ARGS.device == "cuda" and not ARGS.mooncake_cuda:
            out["skipped"][name] = ("GPU memory: no Mooncake CUDA build with the GPU payload "
                                    "(docs/disaggregated.md; --mooncake-cuda tries one)")
            continue
        try:
            out["rows"] += bench_transport(name)
        except AssertionError:
            raise
        except Exception as e:  # a transport that does not work here
            out["skipped"][name] = f"{type(e).__name__}: {e}"
            print(f"{name}: skipped: {out['skipped'][name]}", flush=True)
    out["load_avg_end"] = os.getloadavg()
    ratios = [r["ratio"] for r in out["rows"]]
    out["goal"] = {"ratio_raw_over_connector_at_least": GOAL_RATIO,
                   "min_ratio": min(ratios) if ratios else None,
                   "met": bool(ratios) and min(ratios) >= GOAL_RATIO}
    print(f"goal raw/connector >= {GOAL_RATIO}: "
          f"{'met' if out['goal']['met'] else 'NOT met'} (min {out['goal']['min_ratio']})")
    path = os.path.join(ARGS.out_dir, "pd_transfer.json")
    write_json(path, out)
    try:
        from plot import plot_pd_transfer
    except ImportError as e:  # no matplotlib where it ran
        print(path, f"(no plot: {e})")
        return
    print(path, plot_pd_transfer(path))


if __name__ == "__main__":
    main()
