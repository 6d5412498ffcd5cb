"""The torch merge of every rank's partial attention output by LSE, over
the shard group (CPU: vLLM's GPU merge kernels, ``cp_lse_ag_out_rs`` /
``_ar``, are CUDA only), and the bytes vLLM's GPU merge moves
(:func:`merge_bytes`). Used by the shard-aware decode
(``decode.run_cpu``) and by the owned context of short prefill rows
(``context.py``)."""

from __future__ import annotations

import torch

from ..core.decode import merge_by_lse


def combine(runtime, out: torch.Tensor, lse: torch.Tensor, split_heads: bool,
            return_lse: bool = False):
    """Merge every rank's partial output by LSE (torch): one all-gather of
    output and LSE packed as 32-bit words (vLLM's CPU shared-memory
    all-gather takes floating types, not bytes), then the merge of the
    heads this rank returns (``split_heads``: its ``H / N``, TP; else all).
    ``return_lse``: ``(out, lse)``, the merged LSE float32 (a context
    partial that vLLM merges on: ``integration/context.py``)."""
    spec = runtime.spec
    _, h, d = out.shape
    # the output's bits as 4-byte words (the lengths' in the debug check too)
    words = out.contiguous().view(torch.float32)
    width = words.shape[-1]
    packed = torch.cat([words, lse.float().unsqueeze(-1)], dim=-1)
    parts = runtime.group.all_gather(packed.unsqueeze(0), dim=0)  # [N, B, H, words]
    runtime.received(parts)
    if split_heads:
        h //= spec.size
        parts = parts[:, :, spec.rank * h:(spec.rank + 1) * h]
    outs = parts[..., :width].contiguous().view(out.dtype)
    lses = parts[..., width:].contiguous().squeeze(-1)
    if return_lse:
        return merge_by_lse(outs, lses), torch.logsumexp(lses, dim=0)
    return merge_by_lse(outs, lses)


def merge_bytes(partials: int, *, v_dim: int, out_bytes: int, size: int,
                scatter: bool) -> int:
    """What vLLM's LSE merge (``cp_lse_ag_out_rs`` / ``_ar``) brings into a
    rank for ``partials`` (rows x heads) partial outputs of ``v_dim``: the
    float32 LSEs all-gathered, the outputs reduce-scattered (``scatter``)
    or all-reduced (a ring's ``2 (N - 1) / N``)."""
    share = (size - 1) if scatter else 2 * (size - 1)
    return partials * 4 * (size - 1) + partials * v_dim * out_bytes * share // size
