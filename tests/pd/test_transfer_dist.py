"""Owned-block transfer with real NIXL (UCX, loopback) and Mooncake (TCP):
two prefill "ranks" (processes) hold a sharded cache in the block ownership
layout (the MLA latent, or for sparse models the latent plus the indexer
K/scale cache, vLLM's page layouts with random bytes); a receiver process pulls each rank's owned blocks, by the
manifest with explicit logical positions, into its own unsharded block
table. The result must be byte-identical to the unsharded layout built
directly from the same data (the reference), contiguous runs must merge
into fewer descriptors, and dropping the positions (negative control) must
break the identity. The data path is the connector's: make_transport,
owned_manifest / validate_manifest / check_complete, then
read_owned_blocks (merge_runs, read_descriptors, Transport.read).
A missing transport skips locally and fails under CI (``CI=true``).
"""

import pytest
import torch

from vllm_cp_kv.core.manifest import (check_complete, merge_runs, owned_manifest,
                                      validate_manifest, without_positions)
from vllm_cp_kv.core.ownership import num_logical_blocks
from pd_support import skip_or_fail
from harness.loopback import owner_processes, serve_until_done, transport_available

N, BS, D, LAYERS = 2, 16, 576, 2
NUM_TOKENS = 21 * BS + 5  # 22 logical blocks
NUM_BLOCKS = 40  # physical blocks per rank / at the receiver
# per layer: (per-block shape, dtype) of each cache
LATENT = ((BS, D), torch.bfloat16)  # kv_c + k_pe, 1152 bytes per token
INDEXER = ((BS * 132,), torch.uint8)  # BS x 128 fp8 keys, then BS fp32 scales
LAYOUTS = {"latent": [LATENT] * LAYERS, "latent+indexer": [LATENT, INDEXER] * LAYERS}


def reference_caches(layout):
    """Unsharded KV of one request: per cache [n_logical, *block shape]."""
    n = num_logical_blocks(NUM_TOKENS, BS)
    gen = torch.Generator().manual_seed(0)
    return [torch.randn((n, *shape), generator=gen).to(dtype) if dtype.is_floating_point
            else torch.randint(0, 256, (n, *shape), generator=gen, dtype=dtype)
            for shape, dtype in LAYOUTS[layout]]


def empty_caches(layout):
    return [torch.zeros((NUM_BLOCKS, *shape), dtype=dtype) for shape, dtype in LAYOUTS[layout]]


def virtual_table():
    n = num_logical_blocks(NUM_TOKENS, BS)
    return [3 + c for c in range(-(-n // N))]  # consecutive: runs merge


def prefill_rank(rank, transport, layout, to_recv, from_recv):
    from vllm_cp_kv.integration.connector.transfer import make_transport

    ref = reference_caches(layout)
    caches = empty_caches(layout)
    manifest = owned_manifest(rank, N, BS, virtual_table(), NUM_TOKENS)
    for cache, full in zip(caches, ref):  # this rank stores only its owned blocks
        for j, phys in manifest:
            cache[phys] = full[j]
    t = make_transport(transport, "127.0.0.1")
    meta = t.register(caches)
    to_recv.put((rank, {"transport_meta": meta, "layer_addrs": [c.data_ptr() for c in caches],
                        "num_blocks": NUM_BLOCKS, "manifest": manifest}))
    serve_until_done(t, from_recv)


def receive(transport, layout, infos, ignore_positions=False):
    from vllm_cp_kv.integration.connector.transfer import make_transport, read_owned_blocks

    n = num_logical_blocks(NUM_TOKENS, BS)
    local_ids = [5 + j for j in range(n)]  # the decode's own block table
    caches = empty_caches(layout)
    t = make_transport(transport, "127.0.0.1")
    t.register(caches)
    manifests = {r: validate_manifest(info["manifest"], r, N, n, info["num_blocks"])
                 for r, info in infos.items()}
    check_complete(manifests, n)
    if ignore_positions:
        manifests = without_positions(manifests)
    page = [c[0].numel() * c.element_size() for c in caches]  # bytes per block
    descriptors, _ = read_owned_blocks(t, manifests, infos, local_ids,
                                       [c.data_ptr() for c in caches], page, timeout_s=60)
    return [c[local_ids[0]:local_ids[0] + n] for c in caches], descriptors


def same_bytes(got, ref):
    return all(torch.equal(g.view(torch.uint8), r.view(torch.uint8)) for g, r in zip(got, ref))


def run_case(transport, layout="latent", ignore_positions=False):
    with owner_processes(prefill_rank, N, transport, layout) as infos:
        return receive(transport, layout, infos, ignore_positions)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_owned_blocks_rebuild_the_unsharded_layout(transport, layout):
    if not transport_available(transport):
        skip_or_fail(f"{transport} is not installed")
    got, descriptors = run_case(transport, layout)
    assert same_bytes(got, reference_caches(layout))
    n = num_logical_blocks(NUM_TOKENS, BS)
    # rank r's owned blocks sit in consecutive remote blocks but every other
    # local slot: each block is its own run here (n per cache) ...
    assert descriptors == len(LAYOUTS[layout]) * n


def test_contiguous_runs_merge():
    """... while consecutive on both sides they merge into one descriptor."""
    entries = owned_manifest(0, 1, BS, list(range(10, 30)), 20 * BS)
    runs = merge_runs(entries, list(range(100, 120)))
    assert len(runs) == 1 and runs[0].num_blocks == 20


@pytest.mark.parametrize("transport", ["nixl"])
def test_dropping_positions_breaks_the_layout(transport):
    """Negative control: without the position mapping the cache is wrong."""
    if not transport_available(transport):
        skip_or_fail(f"{transport} is not installed")
    got, _ = run_case(transport, "latent+indexer", ignore_positions=True)
    assert not same_bytes(got, reference_caches("latent+indexer"))
