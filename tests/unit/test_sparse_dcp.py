"""The shard-aware sparse path's vLLM glue (integration/sparse_dcp.py): the
drop-in for vLLM's ``_merge_dcp_topk_global``, called as vLLM's indexer op
calls it (a slice of its top-k buffer, rank by rank), against brute force
over the whole row; and the selection of the path.

The DCP group here is a stand-in whose all-gather returns what every rank
contributed (the ranks run one after another in this process: no GPU, and
the op itself needs one); the exchange's arithmetic is tested in
tests/unit/test_sparse_topk.py, the real collective on the H200
(benchmarks/results/h200x1-2026-12-04-sparse-shard-aware)."""

import inspect

import pytest
import torch

from conftest import needs_vllm

pytestmark = needs_vllm
BS, N, K = 4, 2, 6


class Group:
    """All-gather over keys the ranks already contributed, rank-major."""

    def __init__(self, parts):
        self.parts = parts

    def all_gather(self, t, dim=0):
        assert dim == 0
        return torch.cat(self.parts, dim=0)


def rank_rows(scores, n):
    """Each rank's local scores (its owned tokens in order) and local top-k."""
    from harness.reference import stored_at

    table = list(range(1, 1000))
    owned = [[] for _ in range(n)]
    for pos in range(scores.shape[1]):
        rank, slot = stored_at(pos, table, BS, n)
        owned[rank].append((slot, pos))
    out = []
    for r in range(n):
        cols = [p for _, p in sorted(owned[r])]
        local = scores[:, cols]
        out.append((local, local.topk(min(K, local.shape[1]), dim=1).indices.int()))
    return out


def test_drop_in_writes_the_global_topk_into_vllms_buffer(monkeypatch):
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers import sparse_attn_indexer

    from vllm_cp_kv.core.sparse import candidate_keys, local_candidates, topk_reference
    from vllm_cp_kv.integration.sparse_dcp import merge_dcp_topk_global

    # vLLM's own signature, parameter for parameter (the 0.34 one adds
    # tuning keywords the drop-in accepts too: registry item 28)
    ours = list(inspect.signature(merge_dcp_topk_global).parameters)
    theirs = list(inspect.signature(sparse_attn_indexer._merge_dcp_topk_global).parameters)
    assert ours[:len(theirs)] == theirs
    scores = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    ranks = rank_rows(scores, N)
    keys = [candidate_keys(*local_candidates(l, t, r, N, BS)) for r, (l, t) in enumerate(ranks)]
    monkeypatch.setattr(parallel_state, "get_dcp_group", lambda: Group(keys))
    want = topk_reference(scores, torch.full((3,), 40), K)
    for r, (logits, local) in enumerate(ranks):
        buffer = torch.full((5, K + 3), 77, dtype=torch.int32)  # vLLM's wider buffer
        buffer[:3, :K] = local
        merge_dcp_topk_global(logits, buffer[:3, :K], K, r, N, BS)
        assert torch.equal(buffer[:3, :K], want)  # in place, every rank the same
        assert (buffer[:, K:] == 77).all() and (buffer[3:] == 77).all()
    # negative control: rank 1's candidates missing from the exchange
    monkeypatch.setattr(parallel_state, "get_dcp_group",
                        lambda: Group([keys[0], torch.full_like(keys[1], -1)]))
    logits, local = ranks[0]
    buffer = local.clone()
    merge_dcp_topk_global(logits, buffer, K, 0, N, BS)
    assert not torch.equal(buffer, want)


def test_one_rank_is_left_alone():
    from vllm_cp_kv.integration.sparse_dcp import merge_dcp_topk_global

    local = torch.tensor([[3, 1, -1]], dtype=torch.int32)
    merge_dcp_topk_global(torch.randn(1, 8), local, 3, 0, 1, BS)
    assert local.tolist() == [[3, 1, -1]]


@pytest.mark.parametrize("release,pcp,decode,cache,want", [
    ((0, 34), 1, "lse", "auto", True), ((0, 32), 1, "lse", "auto", False),
    ((0, 34), 2, "lse", "auto", False), ((0, 34), 2, "lse", "fp8_ds_mla", True),
    ((0, 32), 2, "lse", "fp8_ds_mla", False), ((0, 34), 2, "materialize", "fp8_ds_mla", False),
    ((0, 34), 1, "materialize", "auto", False), ((0, 34), 1, "lse", "fp8_ds_mla", True)])
def test_the_path_is_chosen_by_release_pcp_cache_and_decode(release, pcp, decode, cache, want):
    """PCP takes the shard-aware path only with fp8_ds_mla (vLLM 0.34's PCP +
    DCP sparse prefill reads the context through the fp8_ds_mla upconvert)."""
    from vllm_cp_kv.integration.checks import sparse_shard_aware
    from vllm_cp_kv.integration.options import CPKVOptions

    assert sparse_shard_aware(CPKVOptions(enable=True, decode=decode), pcp,
                              release=release, kv_cache_dtype=cache) is want


def _builder(base_init_threshold=256):
    """A metadata builder on vLLM's own base class that sets its decode
    threshold as vLLM's FLASH_ATTN_MLA_SPARSE builder does (the real
    builders import CUDA kernels)."""
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    class Builder(AttentionMetadataBuilder):
        def __init__(self, vllm_config):
            self.vllm_config, self.kv_cache_spec = vllm_config, None
            self._init_reorder_batch_threshold(base_init_threshold,
                                               supports_spec_as_decode=True)

        def build(self, *args, **kwargs):
            raise NotImplementedError

    return Builder


def _config(spec, dcp):
    from types import SimpleNamespace

    speculative = None if spec is None else SimpleNamespace(
        num_speculative_tokens=spec, parallel_drafting=False)
    return SimpleNamespace(speculative_config=speculative, use_v2_model_runner=True,
                           parallel_config=SimpleNamespace(decode_context_parallel_size=dcp))


@pytest.mark.parametrize("spec,dcp,vllms,want", [
    (2, 2, 1, 3), (None, 2, 1, 1), (2, 1, 256, 256), (None, 1, 256, 256)])
def test_a_verification_row_stays_a_decode_row_under_dcp(spec, dcp, vllms, want):
    """Under DCP at an interleave other than 1 vLLM's sparse builders take
    only 1-token rows as decode rows (``vllms``: what vLLM's own logic gives,
    the negative control); the shard-aware builders take a verification row
    of 1 + k tokens as one (docs/sparse.md, MTP in full decode graphs), and
    change nothing else."""
    from vllm_cp_kv.integration.sparse_dcp import SpecRowsAsDecode

    builder = _builder()
    assert builder(_config(spec, dcp)).reorder_batch_threshold == vllms
    shard = type("ShardAware", (SpecRowsAsDecode, builder), {})
    assert shard(_config(spec, dcp)).reorder_batch_threshold == want


def test_both_sparse_backends_get_the_builder_and_only_fa3_the_lse_impl():
    from vllm_cp_kv.integration.sparse_dcp import (FA3SparseLSE, SpecRowsAsDecode,
                                                   shard_aware_sparse_backend)

    builder = _builder()

    class Impl:
        pass

    def backend(name):
        return type(name, (), {"get_name": staticmethod(lambda: name),
                               "get_builder_cls": staticmethod(lambda: builder),
                               "get_impl_cls": staticmethod(lambda: Impl)})

    for name, lse in (("FLASH_ATTN_MLA_SPARSE", True), ("FLASHMLA_SPARSE", False)):
        inner = backend(name)
        got = shard_aware_sparse_backend(inner)
        assert issubclass(got, inner) and got.get_name() == name
        assert issubclass(got.get_builder_cls(), SpecRowsAsDecode)
        assert issubclass(got.get_builder_cls(), builder)
        assert issubclass(got.get_impl_cls(), FA3SparseLSE) is lse
        assert issubclass(got.get_impl_cls(), Impl)
