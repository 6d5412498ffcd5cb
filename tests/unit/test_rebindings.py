"""Scoped rebindings of vLLM internals that only GPU runs exercise for real
(vllm_api.py's registry), checked here on their plumbing: item 11, TRITON_MLA's
decode writing a float32 LSE inside the block and vLLM's function restored
after it. The kernel itself ran on one H200 (docs/gpu-testing.md): without
this, the debug check failed by a bf16 LSE's error at 8K context."""

import pytest
import torch

from conftest import needs_vllm

pytestmark = needs_vllm


def test_triton_decode_writes_a_float32_lse_inside_the_block_only(monkeypatch):
    from vllm.v1.attention.backends.mla import triton_mla

    from vllm_cp_kv.integration.vllm_api import float32_decode_lse

    seen = []

    def kernel(q, k, v, o, lse, *args, **kwargs):  # stands in for the Triton kernel
        seen.append((lse.dtype, tuple(lse.shape), args, kwargs))
        lse.fill_(10.0 + 2 ** -10)  # not representable in bf16

    monkeypatch.setattr(triton_mla, "decode_attention_fwd", kernel)
    model_lse = torch.zeros(3, 4, dtype=torch.bfloat16)
    with float32_decode_lse() as box:
        triton_mla.decode_attention_fwd(None, None, None, None, model_lse, "table", k_scale=1)
    assert triton_mla.decode_attention_fwd is kernel  # restored
    assert seen == [(torch.float32, (3, 4), ("table",), {"k_scale": 1})]
    assert box["lse"].dtype == torch.float32 and (box["lse"] == 10.0 + 2 ** -10).all()
    assert (model_lse == 0).all()  # the model-dtype buffer is not the one written


def test_the_rebinding_is_undone_when_the_kernel_raises(monkeypatch):
    from vllm.v1.attention.backends.mla import triton_mla

    from vllm_cp_kv.integration.vllm_api import float32_decode_lse

    def kernel(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(triton_mla, "decode_attention_fwd", kernel)
    with pytest.raises(RuntimeError, match="kernel failed"):
        with float32_decode_lse():
            triton_mla.decode_attention_fwd(None, None, None, None, torch.zeros(1, 1))
    assert triton_mla.decode_attention_fwd is kernel
