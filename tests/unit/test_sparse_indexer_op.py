"""The DeepSeek-V3.2 indexer op wrapper (integration/sparse.py), against vLLM
0.32's real ``sparse_attn_indexer`` signature.

vLLM has no sparse attention on CPU, so the op itself is replaced by a
recorder with the real signature (a fake, said here): the test checks what
the wrapper hands it. The GPU runs (benchmarks/gpu_vllm_checks.py, group
``sparse``) run the real op on the materialized view.
"""

import functools
from types import SimpleNamespace

import pytest
import torch

from conftest import needs_vllm

pytestmark = needs_vllm


@pytest.fixture
def wrapped(monkeypatch):
    from vllm.model_executor.layers.sparse_attn_indexer import sparse_attn_indexer

    from vllm_cp_kv.integration import sparse

    calls, writes = [], []

    @functools.wraps(sparse_attn_indexer)  # inspect.signature: the real one
    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return "topk"

    full = torch.full((4, 64, 132), 7, dtype=torch.uint8)
    layers = []  # the layer name each full view is keyed by
    runtime = SimpleNamespace(
        materialize=lambda plan, cache, layer: layers.append(layer) or full)
    monkeypatch.setattr(sparse, "_write_owned",
                        lambda k, md, cache, a: writes.append((k, md, cache)))
    return sparse.sharded_indexer_op(recorder), calls, writes, full, runtime, layers


def _args(cache, skip_insert):
    """Positional and keyword arguments as vllm/models/deepseek_v32 passes them."""
    t = torch.zeros(1)
    args = (t, "layer.0.k_cache", cache, t, None, t, t, 128, "ue8m0", 512, 128,
            4096, 8192, t)
    return args, dict(skip_k_cache_insert=skip_insert, use_pcp=not skip_insert,
                      pcp_shard_decode_requests=False,
                      dense_mha_metadata_layer_name="", dcp_rank=1,
                      dcp_world_size=2, cp_kv_cache_interleave_size=64,
                      skip_topk_buffer_clear=True)


def _context(monkeypatch, metadata, runtime=None):
    """vLLM's forward context: the batch's metadata, and the indexer cache
    layer the worker bound the runtime to."""
    import vllm.forward_context as fc

    layers = {"layer.0.k_cache": SimpleNamespace(cp_kv_runtime=runtime)}
    monkeypatch.setattr(fc, "get_forward_context",
                        lambda: SimpleNamespace(attn_metadata=metadata,
                                                no_compile_layers=layers))


@pytest.mark.parametrize("skip_insert", [True, False])  # TP; PCP inserts in the op
def test_sharded_batch_runs_the_op_on_the_full_view(wrapped, monkeypatch, skip_insert):
    op, calls, writes, full, runtime, layers = wrapped
    persistent = torch.zeros(8, 64, 132, dtype=torch.uint8)
    md = SimpleNamespace(cp_kv=SimpleNamespace(plan=object()))
    _context(monkeypatch, {"layer.0.k_cache": md}, runtime)
    args, kwargs = _args(persistent, skip_insert)
    assert op(*args, **kwargs) == "topk"
    (_, got), = calls
    assert got["kv_cache"] is full  # the materialized view, not the cache
    assert layers == ["layer.0.k_cache"]  # keyed by the indexer cache's layer
    assert got["skip_k_cache_insert"] is True
    assert (got["dcp_world_size"], got["dcp_rank"]) == (1, 0)
    assert got["topk_tokens"] == 512 and got["skip_topk_buffer_clear"] is True
    # keys are inserted into the persistent cache (owner-only) only where
    # the op would have inserted them itself
    assert [w[2] is persistent for w in writes] == ([] if skip_insert else [True])


def test_without_a_plan_the_op_is_vllms(wrapped, monkeypatch):
    op, calls, writes, *_ = wrapped
    persistent = torch.zeros(8, 64, 132, dtype=torch.uint8)
    args, kwargs = _args(persistent, False)
    no_plan = SimpleNamespace(cp_kv=SimpleNamespace(plan=None))  # nothing to gather
    for metadata in (None, {"layer.0.k_cache": SimpleNamespace()},  # profile, unsharded
                     {"layer.0.k_cache": no_plan}):
        _context(monkeypatch, metadata)
        calls.clear()
        op(*args, **kwargs)
        (got_args, got_kwargs), = calls
        # untouched: the same objects, in the same places
        assert len(got_args) == len(args) and all(a is b for a, b in zip(got_args, args))
        assert got_kwargs == kwargs
    assert writes == []
