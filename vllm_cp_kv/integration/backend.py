"""The sharded MLA backend: wraps the platform's MLA backend.

``sharded_backend(inner)`` returns a subclass of ``inner`` (CPU_MLA,
AMX_MLA on CPU; FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA on GPU; the sparse
backends) whose

* metadata builder plans once per batch (all layers): the full-view gather
  for the prefill rows' cached context, with the block table translated to
  the full view, and for decode rows the view of this rank's own blocks;
* impl writes new KV owner-only (vLLM's DCP slot mapping), then per layer
  - prefill rows: gathers the planned blocks into the scratch full view and
    runs the inner kernel unchanged on it;
  - decode rows (``cp_kv.decode = "lse"``, the default for dense MLA):
    attends to this rank's owned blocks only and merges the ranks' partial
    outputs by LSE (``core/decode.py``); queries, outputs and LSEs cross
    ranks, never the context. With ``"materialize"`` (and always for
    sparse models) decode rows read the full view too.

The impl reports ``dcp_world_size == 1`` to the ``MLAAttention`` layer: the
layer must not all-gather queries or merge by itself (vLLM's merge kernel
is Triton-only); the impl does both where needed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from functools import cache

import torch

from vllm.logger import init_logger

from ..core import debug as core_debug
from ..core.decode import paged_attention_with_lse, query_token_lens
from ..core.ownership import owned_token_count
from ..core.plan import plan_materialization, plan_split_requests
from .options import debug_enabled, options_of
from .runtime import BatchPlan, DecodeView, get_runtime

logger = init_logger("vllm." + __name__)  # under vLLM's log config


def split_rows(builder, common) -> int:
    """Decode rows at the front of the batch, exactly as vLLM's MLA builder
    counts them (the same function and arguments)."""
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    try:
        from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport

        uniform = getattr(builder, "query_len_support", None) != QueryLenSupport.VARLEN
    except ImportError:  # pragma: no cover - vLLM moved it
        uniform = True
    num_decodes, *_ = split_decodes_and_prefills(
        common, decode_threshold=builder.reorder_batch_threshold or 1,
        require_uniform=uniform,
        treat_short_extends_as_decodes=not getattr(builder, "use_pcp", False))
    return num_decodes


def read_lens(common, num_decodes: int, whole: bool, lse_decode: bool,
              prefill_whole: bool = False) -> torch.Tensor:
    """Tokens each request reads through the full view in this step (host).

    Prefill rows read their cached context (their new tokens come straight
    from the projections), or every token when ``whole`` (sparse attention
    and the indexer read this step's tokens from the cache too) or
    ``prefill_whole`` (the plugin's own prefill over the view, below).
    Decode rows read their whole sequence, or nothing when they attend to
    the owned blocks (``lse_decode``).
    """
    qsl = common.query_start_loc_cpu.long()
    q = qsl[1:] - qsl[:-1]
    seq = host_seq_lens(common)[: q.numel()]
    lens = (seq if whole or prefill_whole else seq - q).clone()
    lens[:num_decodes] = 0 if lse_decode else seq[:num_decodes]
    return lens


def host_seq_lens(common) -> torch.Tensor:
    """Sequence lengths on the host. The upper bound avoids a device sync; it
    is exact without speculative decoding, which the startup checks refuse."""
    host = getattr(common, "seq_lens_cpu_upper_bound", None)
    return (host if host is not None else common.seq_lens.cpu()).long()


def prefill_with_context(common, num_decodes: int) -> bool:
    """Whether a prefill row of the batch continues a cached context."""
    qsl = common.query_start_loc_cpu.long()
    q = (qsl[1:] - qsl[:-1])[num_decodes:]
    return bool((host_seq_lens(common)[num_decodes: num_decodes + q.numel()] > q).any())


def decode_view(common, num_decodes: int, spec, gather_heads: bool) -> DecodeView:
    """This rank's paged view of the decode rows' owned tokens, one row per
    query token (rows with several query tokens: ``core/decode.py``). The
    lengths are computed here, on the device and in int32, whichever model
    runner built the batch: vLLM's V2 runner fills ``dcp_local_seq_lens``
    without its host upper bound, and its lengths are per request."""
    table = common.block_table_tensor[:num_decodes]
    qsl_cpu = common.query_start_loc_cpu[: num_decodes + 1]
    query_lens = (qsl_cpu[1:] - qsl_cpu[:-1]).tolist()
    rows, local = query_token_lens(common.seq_lens[:num_decodes], query_lens, spec)
    # an upper bound is enough for the kernels' launch sizes (owned counts
    # grow with the sequence)
    max_local = int(owned_token_count(host_seq_lens(common)[:num_decodes], spec).max()) \
        if num_decodes else 0
    if rows is None:
        return DecodeView(block_table=table, local_lens=local, max_local_len=max_local,
                          gather_heads=gather_heads,
                          query_start_loc=common.query_start_loc[: num_decodes + 1],
                          query_start_loc_cpu=qsl_cpu)
    one = torch.arange(rows.numel() + 1, dtype=torch.int32)
    return DecodeView(block_table=table.index_select(0, rows), local_lens=local,
                      max_local_len=max_local, gather_heads=gather_heads,
                      query_start_loc=one.to(table.device), query_start_loc_cpu=one,
                      multi_query=True)


def decode_threshold(vllm_config, inner_threshold: int | None) -> int | None:
    """Longest row the shard-aware decode takes: a verification row of
    speculative decoding (vLLM's ``max_decode_query_len``), never more than
    the inner backend's own threshold. FLASH_ATTN_MLA and FLASHMLA route
    prefills of up to 512 and 128 tokens to their decode path; over a long
    cached context such a row would read the owned blocks once per query
    token, so here it is a prefill that reads one full view (as vLLM's DCP
    lowers the threshold where its kernels cannot mask the layout)."""
    from vllm.v1.attention.backend import max_decode_query_len

    if inner_threshold is None:
        return None
    return min(inner_threshold, max_decode_query_len(vllm_config))


def plan_batch(common, block_size: int, num_decodes: int, *, whole: bool,
               lse_decode: bool, gather_heads: bool,
               prefill_whole: bool = False) -> BatchPlan:
    """The batch's :class:`BatchPlan`, made once per step and shared by every
    builder of the KV cache group (the MLA latent and, for sparse models,
    the indexer cache), since they read the same blocks."""
    runtime = get_runtime(block_size)
    batch = runtime.batch()
    key = (whole, prefill_whole)
    made = batch.plans.get(key)
    if made is not None:
        if made.full_table is not None and made.full_table.shape[0] != common.num_reqs:
            raise RuntimeError("cp_kv: two builds of one step disagree on the "
                               "batch; stale step state.")
        return made
    table = common.block_table_tensor[: common.num_reqs]
    # Kernels size their index from each request's full length.
    columns = -(-common.max_seq_len // block_size)
    step = batch.pcp_step
    batch.has_prefill |= num_decodes < common.num_reqs
    if step is not None:
        # PCP: ranks run different chunks; plan from the global batch
        if len(step.row_keys) != common.num_reqs:
            raise RuntimeError(
                f"cp_kv: the PCP step recorded {len(step.row_keys)} local "
                f"rows but the batch has {common.num_reqs}; stale step state.")
        reads = step.seq_lens if not lse_decode else step.seq_lens * step.is_prefill
        lens = torch.from_numpy(reads.astype("int64"))
        plan, full, global_table = plan_split_requests(
            runtime.spec, table, step.row_keys, step.keys, lens,
            min_columns=columns)
        if runtime.debug:
            # vLLM's PCP write path gathers new KV across ranks: the
            # owned-writes check runs on the poisoned-cache tests
            core_debug.check_plan_covers(plan, global_table, lens)
    else:
        lens = read_lens(common, num_decodes, whole, lse_decode, prefill_whole)
        plan = plan_materialization(runtime.spec, table, lens, min_columns=columns)
        full = plan.full_block_table
        if runtime.debug:
            core_debug.check_owned_writes(
                runtime.spec, common.slot_mapping, table,
                common.query_start_loc_cpu, common.seq_lens[: common.num_reqs])
            core_debug.check_plan_covers(plan, table, lens)
            logger.info_once("cp_kv: debug invariants hold (owned writes, plan "
                             "coverage).")
    reads = bool((lens > 0).any())
    made = BatchPlan(plan=plan if reads else None,
                     full_table=full.to(table.device), reads=reads,
                     num_decodes=num_decodes)
    if lse_decode and num_decodes:
        made.decode = decode_view(common, num_decodes, runtime.spec, gather_heads)
    if prefill_whole:
        made.prefill_rows = prefill_rows(common, num_decodes)
    batch.plans[key] = made
    return made


def prefill_rows(common, num_decodes: int) -> list[tuple[int, int, int, int]]:
    """Host ``(row, first query token, query tokens, sequence tokens)`` of each
    prefill row, query tokens counted from the first prefill token."""
    qsl = common.query_start_loc_cpu.long().tolist()
    seq = host_seq_lens(common).tolist()
    base = qsl[num_decodes]
    return [(i, qsl[i] - base, qsl[i + 1] - qsl[i], int(seq[i]))
            for i in range(num_decodes, common.num_reqs)]


def translated(common, full_table):
    """``common`` as the unsharded kernels must see it: the full-view block
    table, and no DCP-local lengths (nothing is DCP-local in the view)."""
    return dataclasses.replace(common, block_table_tensor=full_table,
                               dcp_local_seq_lens=None,
                               dcp_local_seq_lens_cpu_upper_bound=None)


@cache
def sharded_backend(inner: type, unsharded_view, float32_lse=None) -> type:
    """Return the sharded subclass of MLA backend ``inner``.

    ``unsharded_view(vllm_config)``: the context in which vLLM's MLA code
    initializes as if DCP were off; ``float32_lse()``: the context in which
    the inner decode kernel returns a float32 LSE, for backends whose kernel
    returns it in the model dtype (TRITON_MLA), yielding a dict whose "lse"
    holds it after the call (``plugin.unsharded_view`` and
    ``plugin.float32_decode_lse``, passed in so that this module never
    rebinds vLLM itself).
    """
    inner_impl = inner.get_impl_cls()
    inner_builder = inner.get_builder_cls()
    # sparse MLA reads every token of the batch through the cache
    sparse = bool(getattr(inner, "is_sparse", lambda: False)())
    lse_context = float32_lse if float32_lse and inner.get_name() in FLOAT32_LSE_BACKENDS \
        else _kernel_lse

    class Builder(inner_builder):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device,
                     *args, **kwargs):
            with unsharded_view(vllm_config):
                super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                                 *args, **kwargs)
            self.cp_kv_lse_decode = lse_decode_enabled(vllm_config, sparse)
            if self.cp_kv_lse_decode:  # read by the model runner after this
                self.reorder_batch_threshold = decode_threshold(
                    vllm_config, self.reorder_batch_threshold)
            # TP shard group: each rank's layer holds H / N query heads
            self.cp_kv_gather_heads = \
                vllm_config.parallel_config.prefill_context_parallel_size == 1
            if self.cp_kv_lse_decode and self.cp_kv_gather_heads and \
                    hasattr(self, "_reserve_attn_logits_workspace"):
                # TRITON_MLA sizes its split-KV workspace for the layer's
                # heads; the shard-aware decode runs it with all H heads
                with self._sized_for_heads_of(
                        vllm_config.parallel_config.decode_context_parallel_size):
                    self._reserve_attn_logits_workspace()
            # debug: vLLM's own decode kernel on the full view, for comparison
            self.cp_kv_kernel_check = debug_enabled() and \
                inner.get_name() in KERNEL_CHECK_BACKENDS
            # vLLM's CPU_MLA prefill cannot read a cached context (vLLM turns
            # prefix caching and chunked prefill off for it); with the full
            # view the plugin can, so it runs such prefills itself
            self.cp_kv_own_prefill = inner.get_name() in OWN_PREFILL_BACKENDS

        def build(self, common_prefix_len, common_attn_metadata,
                  fast_build: bool = False):
            common = common_attn_metadata
            lse = self.cp_kv_lse_decode
            num_decodes = 0 if sparse else split_rows(self, common)
            own = self.cp_kv_own_prefill and prefill_with_context(common, num_decodes)
            made = plan_batch(common, self.kv_cache_spec.block_size, num_decodes,
                              whole=sparse, lse_decode=lse,
                              gather_heads=self.cp_kv_gather_heads,
                              prefill_whole=own)
            metadata = super().build(common_prefix_len,
                                     translated(common, made.full_table), fast_build)
            if not sparse and metadata.num_decodes != num_decodes:
                raise RuntimeError(
                    f"cp_kv: {num_decodes} decode rows planned but the "
                    f"{inner.get_name()} builder split {metadata.num_decodes}.")
            if made.decode is not None and common.block_table_tensor.is_cuda:
                metadata.decode = self._local_decode(common, made.decode)
            if made.decode is not None and self.cp_kv_kernel_check:
                made.build_decode = self._build_decode  # vLLM's kernel on a view
            metadata.cp_kv = made
            return metadata

        def _local_decode(self, common, view):
            """GPU: the decode rows' metadata for this rank's own blocks, as
            vLLM's DCP builds it (its ``_build_decode`` with the local
            lengths), one query token per row, sized for the gathered heads
            under TP."""
            ranks = get_runtime(self.kv_cache_spec.block_size).spec.size \
                if view.gather_heads else self.dcp_world_size
            with self._sized_for_heads_of(ranks):
                return self._build_decode(
                    block_table_tensor=view.block_table, seq_lens_device=view.local_lens,
                    max_seq_len=max(view.max_local_len, 1),
                    query_start_loc_cpu=view.query_start_loc_cpu,
                    query_start_loc_device=view.query_start_loc,
                    num_decode_tokens=view.local_lens.shape[0], max_query_len=1,
                    dcp_tot_seq_lens_device=None)

        @contextlib.contextmanager
        def _sized_for_heads_of(self, ranks: int):
            """vLLM's builders size decode metadata and workspaces for
            ``num_heads * dcp_world_size`` query heads: within the block, for
            the heads of ``ranks`` ranks (this builder initialized with DCP
            off, see ``unsharded_view``)."""
            saved, self.dcp_world_size = self.dcp_world_size, ranks
            try:
                yield
            finally:
                self.dcp_world_size = saved

    class Impl(inner_impl):
        cp_kv_sharded = True  # the layer reads a full view or merges itself

        def __init__(self, *args, **kwargs):
            from vllm.config import get_current_vllm_config

            with unsharded_view(get_current_vllm_config()):
                super().__init__(*args, **kwargs)
            # The layer sees an unsharded kernel: no query all-gather and
            # no LSE merge (see module docstring).
            self.dcp_world_size, self.dcp_rank = 1, 0
            self.total_cp_world_size, self.total_cp_rank = 1, 0
            self.need_to_return_lse_for_decode = False

        def _full_view(self, kv_cache, attn_metadata):
            runtime = get_runtime(kv_cache.shape[1])
            return runtime.materialize(attn_metadata.cp_kv, kv_cache)

        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            view = attn_metadata.cp_kv.decode
            if view is None:
                full = self._full_view(kv_c_and_k_pe_cache, attn_metadata)
                return super().forward_mqa(q, full, attn_metadata, layer)
            if isinstance(q, tuple):
                q = torch.cat(q, dim=-1)
            runtime = get_runtime(kv_c_and_k_pe_cache.shape[1])
            if q.is_cuda:
                out = self._lse_decode_kernel(runtime, q, kv_c_and_k_pe_cache,
                                              attn_metadata, layer)
            else:
                out = runtime.lse_decode_torch(q, kv_c_and_k_pe_cache, view, self.scale,
                                               self.kv_lora_rank)
            if runtime.debug and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._check_against_full_view(runtime, q, out, attn_metadata,
                                              kv_c_and_k_pe_cache, layer)
            return out, None

        def _lse_decode_kernel(self, runtime, q, kv_cache, attn_metadata, layer):
            """GPU: vLLM's DCP decode as vLLM runs it: queries all-gathered
            over the shard group (TP), the inner kernel on this rank's owned
            blocks returning its LSE, vLLM's merge (``cp_lse_ag_out_rs``:
            all-gather of the LSEs, reduce-scatter of the outputs over heads;
            under PCP every rank has all heads: ``cp_lse_ag_out_ar``)."""
            from vllm.v1.attention.ops.dcp import cp_lse_ag_out_ar, cp_lse_ag_out_rs

            view = attn_metadata.cp_kv.decode
            if view.gather_heads:
                q = runtime.gather_heads(q)
            # the kernel sees a plain paged sequence (no DCP masking: a
            # decode query sees every key), and returns its LSE
            if view.multi_query:  # FLASHMLA shapes its queries by the row count
                attn_metadata = copy.copy(attn_metadata)
                attn_metadata.num_decodes = view.local_lens.shape[0]
            self.need_to_return_lse_for_decode = True
            try:
                with lse_context() as float32:
                    out, lse = super().forward_mqa(q, kv_cache, attn_metadata, layer)
                lse = float32.get("lse", lse)
            finally:
                self.need_to_return_lse_for_decode = False
            combine = cp_lse_ag_out_rs if view.gather_heads else cp_lse_ag_out_ar
            merged = combine(out, lse, runtime.group, is_lse_base_on_e=self.lse_base_on_e,
                             seq_lens=view.local_lens, query_start_loc=view.query_start_loc)
            runtime.count_merge(out, lse)
            return merged

        def _check_against_full_view(self, runtime, q, out, attn_metadata, kv_cache,
                                     layer):
            """Debug: once per step, the merged decode output of one layer
            against float32 attention over the materialized full view, and
            vLLM's own decode kernel on that view against the same
            reference (rows of one query token each; both errors go to the
            statistics)."""
            batch = runtime.batch()
            if batch.debug_decode_checked:
                return
            batch.debug_decode_checked = True
            made = attn_metadata.cp_kv
            view = made.decode
            # whole lengths: every rank's owned counts, summed
            lens = runtime.group.all_gather(
                view.local_lens.reshape(1, -1).long(), dim=0).sum(dim=0).cpu()
            plan = plan_materialization(runtime.spec, view.block_table, lens)
            full = runtime.materialize(BatchPlan(plan=plan, full_table=None, reads=True),
                                       kv_cache, for_check=True)
            q_all = runtime.gather_heads(q, count=False) if view.gather_heads else q
            ref, _ = paged_attention_with_lse(q_all, full, plan.full_block_table,
                                              lens, self.scale, self.kv_lora_rank)
            if view.gather_heads:
                h = out.shape[1]
                ref = ref[:, runtime.spec.rank * h:(runtime.spec.rank + 1) * h]
            unsharded = None
            if made.build_decode is not None and not view.multi_query:
                md = copy.copy(attn_metadata)
                md.decode = made.build_decode(
                    block_table_tensor=plan.full_block_table.to(view.block_table.device),
                    seq_lens_device=lens.to(device=view.local_lens.device, dtype=torch.int32),
                    max_seq_len=max(int(lens.max()), 1),
                    query_start_loc_cpu=view.query_start_loc_cpu,
                    query_start_loc_device=view.query_start_loc,
                    num_decode_tokens=lens.numel(), max_query_len=1,
                    dcp_tot_seq_lens_device=None)
                unsharded = super().forward_mqa(q, full, md, layer)[0]
            err, inner_err = core_debug.check_decode_merge(out, ref, runtime.spec, unsharded)
            runtime.stats.note_decode_check(err, inner_err)
            if runtime.stats.debug_decode_checks == 1:
                logger.info("cp_kv: debug: LSE-merged decode equals attention over the "
                            "materialized full view (largest difference %.3g; vLLM's "
                            "kernel on that view: %s).", err, inner_err)

        def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache,
                        attn_metadata, k_scale, output, output_scale=None):
            made = attn_metadata.cp_kv
            if made.reads:
                kv_c_and_k_pe_cache = self._full_view(kv_c_and_k_pe_cache,
                                                      attn_metadata)
            if made.prefill_rows is not None:
                assert output_scale is None, "no fused output quantization here"
                return self._prefill_over_view(q, kv_c_and_k_pe_cache, made, output)
            return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache,
                                       attn_metadata, k_scale, output,
                                       output_scale)

        def _prefill_over_view(self, q, full, made, output) -> None:
            """Prefill rows with a cached context, over the full view: per
            request, the latent of every token up to the row's last one is
            up-projected (``kv_b_proj``, as vLLM's chunked-context prefill
            does) and attended causally (offset by the context), in the
            same non-absorbed form as vLLM's unsharded SDPA prefill."""
            heads, nope, v_dim = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
            rope, latent = self.qk_rope_head_dim, self.kv_lora_rank
            out = output.view(-1, heads, v_dim)
            bs = full.shape[1]
            for row, start, length, seq in made.prefill_rows:
                blocks = made.full_table[row, : -(-seq // bs)].long()
                tokens = full[blocks].reshape(-1, full.shape[-1])[:seq]
                kv = self.kv_b_proj(tokens[:, :latent])[0].view(seq, heads, nope + v_dim)
                k_nope, v = kv.split([nope, v_dim], dim=-1)
                k = torch.cat([k_nope, tokens[:, None, latent:].expand(seq, heads, rope)],
                              dim=-1)
                causal = (torch.arange(seq, device=q.device)[None, :]
                          <= torch.arange(seq - length, seq, device=q.device)[:, None])
                o = torch.nn.functional.scaled_dot_product_attention(
                    q[start:start + length].transpose(0, 1), k.transpose(0, 1),
                    v.transpose(0, 1), attn_mask=causal, scale=self.scale)
                out[start:start + length] = o.transpose(0, 1).to(out.dtype)

    class Backend(inner):
        @staticmethod
        def get_impl_cls():
            return Impl

        @staticmethod
        def get_builder_cls():
            return Builder

    for cls, role in ((Backend, "Backend"), (Impl, "Impl"), (Builder, "Builder")):
        cls.__name__ = cls.__qualname__ = f"ShardedKV{role}_{inner.get_name()}"
    return Backend


# Backends whose decode metadata is all ``_build_decode`` makes, so that the
# debug check can run vLLM's kernel on a full view (AMX_MLA adds fields in
# its build()).
KERNEL_CHECK_BACKENDS = ("CPU_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA")

# Backends whose decode kernel returns its LSE in the model dtype in vLLM
# 0.32 (TRITON_MLA: bf16, off by up to 0.06 for long contexts, a 6% weight
# in the merge); around the shard-aware decode they write a float32 LSE.
FLOAT32_LSE_BACKENDS = ("TRITON_MLA",)


@contextlib.contextmanager
def _kernel_lse():
    """The inner kernel's own LSE (float32 in FA3 and FlashMLA)."""
    yield {}


# Backends whose prefill cannot read a cached context in vLLM 0.32 (CPU_MLA:
# vLLM forces prefix caching and chunked prefill off for it); the plugin
# reads it through the full view instead.
OWN_PREFILL_BACKENDS = ("CPU_MLA",)


def lse_decode_enabled(vllm_config, sparse: bool) -> bool:
    """Decode rows attend to the owned blocks (``cp_kv.decode == "lse"``)."""
    return not sparse and options_of(vllm_config).decode == "lse"


