"""The plugin's own prefill over the full view, for backends whose prefill
cannot read a cached context (vLLM 0.32's CPU_MLA: vLLM turns prefix
caching and chunked prefill off for it). With the materialized full view
the plugin can: per request, the latent of every token up to the row's
last one is up-projected (``kv_b_proj``, as vLLM's chunked-context prefill
does) and attended causally, offset by the context, in the same
non-absorbed form as vLLM's unsharded SDPA prefill.
"""

from __future__ import annotations

import torch

# Backends whose prefill cannot read a cached context in vLLM 0.32.
OWN_PREFILL_BACKENDS = ("CPU_MLA",)


def prefill_over_view(impl, q: torch.Tensor, full: torch.Tensor, made,
                      output: torch.Tensor) -> None:
    """Write the prefill rows' attention output into ``output``.

    Args:
        impl: the MLA impl (its ``kv_b_proj``, head sizes and scale).
        q: ``[T, H, nope + rope]`` queries of the prefill tokens.
        full: ``[B, block_size, latent + rope]`` the full view.
        made: the batch's ``BatchPlan`` (``prefill_rows``, ``full_table``).
        output: ``[T, H * v]`` written in place.
    """
    heads, nope, v_dim = impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim
    rope, latent = impl.qk_rope_head_dim, impl.kv_lora_rank
    out = output.view(-1, heads, v_dim)
    bs = full.shape[1]
    for row, start, length, seq in made.prefill_rows:
        blocks = made.full_table[row, : -(-seq // bs)].long()
        tokens = full[blocks].reshape(-1, full.shape[-1])[:seq]
        kv = impl.kv_b_proj(tokens[:, :latent])[0].view(seq, heads, nope + v_dim)
        k_nope, v = kv.split([nope, v_dim], dim=-1)
        k = torch.cat([k_nope, tokens[:, None, latent:].expand(seq, heads, rope)], dim=-1)
        causal = (torch.arange(seq, device=q.device)[None, :]
                  <= torch.arange(seq - length, seq, device=q.device)[:, None])
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:start + length].transpose(0, 1), k.transpose(0, 1),
            v.transpose(0, 1), attn_mask=causal, scale=impl.scale)
        out[start:start + length] = o.transpose(0, 1).to(out.dtype)
