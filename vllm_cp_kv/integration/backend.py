"""The sharded MLA backend: the platform's MLA backend with a sharded
builder and impl (CPU_MLA, AMX_MLA on CPU; FLASH_ATTN_MLA, FLASHMLA,
TRITON_MLA on GPU; the sparse backends).

* :class:`ShardedBuilder` plans once per batch (``planning.plan_batch``, all
  layers): the full-view gather for the prefill rows' cached context, with
  the block table translated to the full view, and for decode rows the view
  of this rank's own blocks (``decode.decode_view``).
* :class:`ShardedImpl` writes new KV owner-only (vLLM's DCP slot mapping),
  then per layer
  - prefill rows: gathers the planned blocks into the scratch full view and
    runs the inner kernel unchanged on it; a context longer than the scratch
    (``chunked``) is gathered chunk by chunk, each chunk read by vLLM's own
    context-chunk attention and the chunks merged by LSE
    (:meth:`ShardedImpl._compute_prefill_context`); a short row over a long
    context may instead attend to each rank's owned context and merge by
    LSE, as a decode row does (``context.py``, ``cp_kv.context_path``);
  - decode rows (``cp_kv.decode = "lse"``, the default for dense MLA): the
    shard-aware decode (``decode.py``). With ``"materialize"`` (and always
    for sparse models) decode rows read the full view too.

Both are mixins placed before the platform's classes; :func:`sharded_backend`
makes the concrete subclasses of one inner backend. The impl reports
``dcp_world_size == 1`` to the ``MLAAttention`` layer: the layer must not
all-gather queries or merge by itself (vLLM's merge kernel is Triton-only);
the impl does both where needed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from functools import cache

import torch

from . import context, decode, decode_audit, vllm_api
from .geometry import group_size_of
from .options import debug_enabled, options_of
from ..core.decode import merge_two_by_lse
from ..core.plan import rows_of_chunk
from .planning import plan_batch, read_lens, split_rows, translated
from .runtime import required_runtime

# Backends whose decode metadata is all ``_build_decode`` makes, so that the
# debug check can run vLLM's kernel on a full view (AMX_MLA adds fields in
# its build()).
KERNEL_CHECK_BACKENDS = ("CPU_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA")

# Backends whose decode kernel returns its LSE in the model dtype in vLLM
# 0.32 (TRITON_MLA: bf16, off by up to 0.06 for long contexts, a 6% weight
# in the merge); around the shard-aware decode they write a float32 LSE.
FLOAT32_LSE_BACKENDS = ("TRITON_MLA",)

# Backends whose prefill is vLLM's MLACommonBaseImpl.forward_mha: the cached
# context is read by _compute_prefill_context in chunks merged by LSE, so
# the plugin can hand it one scratch-sized chunk of the context at a time.
# AMX_MLA's prefill (cpu_mla_extend) attends to the whole context in one
# causal pass and returns no LSE: it reads the whole view.
CHUNKED_CONTEXT_BACKENDS = ("CPU_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA")


@contextlib.contextmanager
def _kernel_lse():
    """The inner kernel's own LSE (float32 in FA3 and FlashMLA)."""
    yield {}


def lse_decode_enabled(vllm_config, sparse: bool) -> bool:
    """Decode rows attend to the owned blocks (``cp_kv.decode == "lse"``)."""
    return not sparse and options_of(vllm_config).decode == "lse"


def decode_kernel_ranks(vllm_config, sparse: bool) -> int:
    """The ranks whose query heads the decode kernel runs on: the TP ranks of
    the shard group (each rank's layer holds H / TP heads, the shard-aware
    decode gathers them): all N of a TP group, TP of a PCP x TP group, 1
    under PCP with TP 1; else this rank's own (a full view)."""
    if not lse_decode_enabled(vllm_config, sparse):
        return 1
    parallel = vllm_config.parallel_config
    if parallel.prefill_context_parallel_size > 1:
        return parallel.tensor_parallel_size if group_size_of(vllm_config) > 1 else 1
    return group_size_of(vllm_config)


def chunked_context_enabled(vllm_config, backend_name: str, sparse: bool) -> bool:
    """Prefill rows may read their cached context in scratch-sized chunks:
    dense MLA with the shard-aware decode (decode rows read no view) and a
    backend of :data:`CHUNKED_CONTEXT_BACKENDS`; under PCP too (the chunks
    are the global requests', each rank's rows read their parts)."""
    return (lse_decode_enabled(vllm_config, sparse)
            and backend_name in CHUNKED_CONTEXT_BACKENDS)


def owned_context_enabled(vllm_config, backend_name: str, sparse: bool) -> bool:
    """Prefill rows may read their cached context owned (``context.py``):
    the chunked context on a backend, cache and layout the owned path has
    a kernel for (``context.owned_context_supported``)."""
    return chunked_context_enabled(vllm_config, backend_name, sparse) and \
        context.owned_context_supported(backend_name, str(vllm_config.cache_config.cache_dtype))


class ShardedBuilder:
    """Mixin over the platform's MLA metadata builder (see the module
    docstring); ``cp_kv_inner`` and ``cp_kv_sparse`` are set per subclass."""

    cp_kv_inner: type
    cp_kv_sparse: bool

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        with vllm_api.unsharded_view(vllm_config):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                             *args, **kwargs)
        name = self.cp_kv_inner.get_name()
        self.cp_kv_layers = (vllm_config, list(layer_names))
        self.cp_kv_lse_decode = lse_decode_enabled(vllm_config, self.cp_kv_sparse)
        if self.cp_kv_lse_decode:  # read by the model runner after this
            self.reorder_batch_threshold = decode.decode_threshold(
                vllm_config, self.reorder_batch_threshold)
        self.cp_kv_decode_ranks = decode_kernel_ranks(vllm_config, self.cp_kv_sparse)
        self.cp_kv_floor_empty_rows = decode.fp8_rows_need_a_token(self)
        if self.cp_kv_lse_decode:  # TRITON_MLA: its split-KV workspace for all heads
            with vllm_api.heads_of(self, self.cp_kv_decode_ranks):
                vllm_api.reserve_decode_workspace(self, name, vllm_config)
        # debug: vLLM's own decode kernel on the full view, for comparison
        self.cp_kv_kernel_check = debug_enabled() and name in KERNEL_CHECK_BACKENDS
        self.cp_kv_chunked = chunked_context_enabled(vllm_config, name, self.cp_kv_sparse)
        self.cp_kv_owned = self._owned_context(vllm_config, name)
        # vLLM's V2 speculator may update draft decode metadata in place
        # between chained draft steps; the batch plan riding on it would go
        # stale, so it rebuilds (and replans) each step (plugin.py item 15)
        self.supports_draft_decode_metadata_update = False

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        common, sparse = common_attn_metadata, self.cp_kv_sparse
        runtime = required_runtime(*self.cp_kv_layers)
        # sparse rows all read the full view (``whole``); their decode rows
        # are counted only for the statistics' step kind
        num_decodes = split_rows(self, common)
        made = plan_batch(runtime.plan_inputs(common.block_table_tensor), common,
                          num_decodes, whole=sparse,
                          lse_decode=self.cp_kv_lse_decode, chunked=self.cp_kv_chunked,
                          owned=self.cp_kv_owned)
        metadata = super().build(common_prefix_len, translated(common, made.full_table),
                                 fast_build)
        if made.loop and made.reads and metadata.prefill is not None:
            made = dataclasses.replace(
                made, vllm_chunks=self._chunk_metadata(made, common, metadata.prefill))
        if not sparse and metadata.num_decodes != num_decodes:
            raise RuntimeError(
                f"cp_kv: {num_decodes} decode rows planned but the "
                f"{self.cp_kv_inner.get_name()} builder split {metadata.num_decodes}.")
        if made.decode is not None and common.block_table_tensor.is_cuda:
            metadata.decode = decode.build_local(self, made.decode, self.cp_kv_decode_ranks,
                                                 self.cp_kv_floor_empty_rows)
            runtime.batch_bytes(self._decode_bytes(made.decode, runtime.spec.size))
        elif made.decode is not None and self.cp_kv_inner.get_name() == "AMX_MLA":
            made = dataclasses.replace(made, amx=decode.build_local_amx(
                made.decode, self.kv_cache_spec.block_size))
        if made.decode is not None and self.cp_kv_kernel_check:
            made = dataclasses.replace(made, decode_builder=self)  # debug: vLLM's kernel
        metadata.cp_kv = made
        return metadata

    def _owned_context(self, vllm_config, name: str) -> dict | None:
        """``context.plan_owned``'s settings where short prefill rows may
        read their context owned (None: every context gathered)."""
        from .checks import check_owned_context

        options = options_of(vllm_config)
        able = owned_context_enabled(vllm_config, name, self.cp_kv_sparse)
        check_owned_context(options.context_path, able, name,
                            str(vllm_config.cache_config.cache_dtype))
        if not able or options.context_path == "gathered":
            return None
        model = vllm_config.model_config
        return dict(mode=options.context_path, max_query=options.owned_context_max_query,
                    heads=model.hf_text_config.num_attention_heads,
                    width=self.kv_cache_spec.head_size, v_dim=self.mla_dims.kv_lora_rank,
                    elt=model.dtype.itemsize)

    def _decode_bytes(self, view, size: int) -> int:
        """This step's shard-aware decode bytes over the builder's layers
        (``decode_audit.gpu_step_bytes``; counted here since a replayed graph runs
        no Python)."""
        config = self.cp_kv_layers[0]
        elt = config.model_config.dtype.itemsize
        # vLLM replicates the query projection only without PCP (qrep)
        parallel = config.parallel_config
        gathers = view.gather_heads and not (
            parallel.dcp_q_replicate and parallel.prefill_context_parallel_size == 1)
        per_layer = decode_audit.gpu_step_bytes(
            view, heads=self.num_heads * self.cp_kv_decode_ranks,
            q_width=self.kv_cache_spec.head_size, v_dim=self.mla_dims.kv_lora_rank,
            q_bytes=elt, out_bytes=elt, size=size, gathers_queries=gathers,
            head_ranks=self.cp_kv_decode_ranks)
        return per_layer * len(self.cp_kv_layers[1])

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        """The inner builder's support where decode rows take the shard-aware
        decode (its per-step inputs live in persistent buffers:
        ``step.DecodeBuffers``). A decode that reads a materialized full
        view (sparse models, ``cp_kv.decode = "materialize"``) gathers a
        per-batch plan and cannot be captured: NEVER, so vLLM keeps
        attention out of its graphs (its default mode becomes PIECEWISE)."""
        from vllm.v1.attention.backend import AttentionCGSupport

        if not lse_decode_enabled(vllm_config, cls.cp_kv_sparse):
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def _chunk_metadata(self, made, common, prefill) -> list:
        """For each context chunk, the prefill metadata vLLM's context loop
        reads it with: the chunk's block table (column 0 = the chunk's first
        block of each row) and vLLM's own chunked-context metadata of the
        chunk's tokens (vLLM may split a chunk further by its workspace),
        with a prefill backend prepared for it (FlashInfer and TRT-LLM plan
        per chunk). None for a chunk no prefill row reads."""
        from vllm.model_executor.layers.attention.mla_attention import (
            build_mla_chunked_context_metadata)

        start = made.num_decodes
        qsl = common.query_start_loc_cpu[start: common.num_reqs + 1]
        # each row's context within its request's part of each chunk (the
        # whole part but under PCP, where a row is one piece of its request)
        context_lens = read_lens(common, made.num_decodes, whole=False, lse_decode=True)
        parts = []
        for chunk in made.chunks:
            tokens, table = rows_of_chunk(chunk, made.chunk_rows, context_lens)
            context = build_mla_chunked_context_metadata(
                context_lens_cpu=tokens[start: common.num_reqs].to(torch.int32),
                prefill_query_start_loc_cpu=qsl - qsl[0],
                chunked_prefill_workspace=self.chunked_prefill_workspace,
                chunked_prefill_workspace_size=self.chunked_prefill_workspace_size,
                block_size=self.page_size, align_chunk_to_block=True,
                device=self.device, dcp_world_size=1,
                dcp_local_block_size=self.page_size,
                dcp_virtual_block_size=self.page_size)
            if context is None:
                parts.append(None)
                continue
            table = table[start: common.num_reqs].to(self.device)
            part = dataclasses.replace(prefill, block_table=table, chunked_context=context,
                                       prefill_backend=prefill.prefill_backend.clone())
            part.prefill_backend.prepare_metadata(part)
            parts.append(part)
        return parts


class ShardedImpl:
    """Mixin over the platform's MLA impl (see the module docstring)."""

    cp_kv_sharded = True  # the layer reads a full view or merges itself
    cp_kv_backend = ""  # the inner backend's name (set per subclass)
    cp_kv_lse_context = staticmethod(_kernel_lse)  # vllm_api.float32_decode_lse where needed

    def __init__(self, *args, **kwargs):
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        if self.cp_kv_backend == "AMX_MLA" and config.parallel_config.dcp_q_replicate:
            from .checks import CPKVConfigError

            raise CPKVConfigError(
                "cp_kv: --dcp-q-replicate does not work with the AMX_MLA backend in vLLM "
                "0.32 (its query absorption uses packed weights of the rank's own heads); "
                "remove the flag or use --attention-backend CPU_MLA.")
        with vllm_api.unsharded_view(config):
            super().__init__(*args, **kwargs)
        vllm_api.impl_reports_unsharded(self)  # see the module docstring
        self.cp_kv_layer: str | None = None  # bound by the worker
        self.cp_kv_module = None  # its MLA layer (weak; W_UK_T, W_UV)
        self.cp_kv_runtime = None  # the worker's ShardRuntime, bound with the layer
        self.cp_kv_decode_ranks = decode_kernel_ranks(config, self.is_sparse)  # the builder's

    def reserve_workspace(self) -> None:
        """vLLM's profile run (0.33+, item 27): TRITON_MLA's impl reserves its
        split-KV workspace for ``num_heads * dcp_world_size`` heads so that
        the KV cache is sized around it. The shard-aware decode runs that
        kernel on the shard group's heads, which an impl reporting DCP off
        would not count: the builder's reservation for them came after the
        KV cache was sized."""
        with vllm_api.heads_of(self, self.cp_kv_decode_ranks):
            super().reserve_workspace()

    def cp_kv_bind(self, layer_name: str, layer=None) -> None:
        """The layer this impl serves (its full views are keyed by its name;
        the owned context path reads its absorption weights)."""
        self.cp_kv_layer = layer_name
        self.cp_kv_module = None if layer is None else weakref.ref(layer)
        self.cp_kv_runtime = getattr(layer, "cp_kv_runtime", None)

    def _full_view(self, kv_cache, made, chunk: int = 0):
        if self.cp_kv_layer is None:
            raise RuntimeError("cp_kv: a sharded attention impl ran before the worker "
                               "bound it to its layer (ShardedKVWorker.bind_layers).")
        return self.cp_kv_runtime.materialize(made, kv_cache, self.cp_kv_layer, chunk)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        made = attn_metadata.cp_kv
        if made.decode is None:  # the inner kernel on the full view, this rank's heads
            full = self._full_view(kv_c_and_k_pe_cache, made)
            return super().forward_mqa(decode.own_heads(self.cp_kv_runtime, q, self.num_heads),
                                       full, attn_metadata, layer)
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        runtime, inner = self.cp_kv_runtime, super().forward_mqa
        if q.is_cuda:
            out = decode.run_gpu(self, inner, runtime, q, kv_c_and_k_pe_cache,
                                 attn_metadata, layer, self.cp_kv_lse_context)
        else:
            out = decode.run_cpu(runtime, q, kv_c_and_k_pe_cache, made.decode, self.scale,
                                 self.kv_lora_rank, self.num_heads, made.amx)
        if runtime.debug and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            decode_audit.check_against_full_view(self, inner, q, out, attn_metadata,
                                                 kv_c_and_k_pe_cache, layer)
        return out, None

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata,
                    k_scale, output, output_scale=None):
        made = attn_metadata.cp_kv
        if made.reads and not made.loop:  # one gather: the whole context
            kv_c_and_k_pe_cache = self._full_view(kv_c_and_k_pe_cache, made)
        elif made.loop and attn_metadata.prefill.chunked_context is None:
            # no row of this rank has a context, so vLLM skips the context
            # loop here; under PCP other ranks' rows may: join each chunk's
            # gather and the owned rows' exchange (collectives) all the same
            for k in range(len(made.chunks) if made.reads else 0):
                self._full_view(kv_c_and_k_pe_cache, made, chunk=k)
            if made.owned is not None and made.owned.exchange is not None:
                self._owned_context(q, kv_c_and_k_pe_cache, made)
        return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache,
                                   attn_metadata, k_scale, output, output_scale)

    def _compute_prefill_context(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale):
        """vLLM's context attention (``MLACommonBaseImpl``), over the full view
        or, when the context is chunked, once per chunk: gather the chunk into
        the scratch, let vLLM read it with the chunk's metadata
        (``ShardedBuilder._chunk_metadata``), merge the chunks' outputs by
        LSE; rows read owned (``context.owned_context``) take their part from
        there. vLLM then merges the result with the new tokens' attention."""
        made = attn_metadata.cp_kv
        if not made.loop:  # kv_c_and_k_pe_cache is the full view already
            return super()._compute_prefill_context(q, kv_c_and_k_pe_cache,
                                                    attn_metadata, k_scale)
        out, lse = self._gathered_context(q, kv_c_and_k_pe_cache, attn_metadata, k_scale)
        if made.owned is None:
            return out, lse
        o, l = self._owned_context(q, kv_c_and_k_pe_cache, made)
        if out is None:  # no row read gathered: the others have no context
            out = q.new_zeros(q.shape[0], q.shape[1], o.shape[-1])
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                             device=q.device)
        tokens = made.owned.tokens
        out[tokens] = 0
        out[tokens, :, : o.shape[-1]] = o.to(out.dtype)
        lse[:, tokens] = l.to(lse.dtype)
        return out, lse

    def _owned_context(self, q, kv_c_and_k_pe_cache, made):
        return context.owned_context(self.cp_kv_runtime, made.owned, q, kv_c_and_k_pe_cache,
                                     self.cp_kv_module(), scale=self.scale,
                                     v_dim=self.kv_lora_rank, gpu_kernel=q.is_cuda)

    def _gathered_context(self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale):
        """The gathered rows' context, chunk by chunk (None, None: none)."""
        made = attn_metadata.cp_kv
        out = lse = None
        if not made.reads:
            return out, lse
        for k, part in enumerate(made.vllm_chunks):
            # every rank gathers every chunk (a collective), also one its own
            # rows do not read (under PCP other ranks' rows may)
            view = self._full_view(kv_c_and_k_pe_cache, made, chunk=k)
            if part is None:  # no prefill row of this rank reads this chunk
                continue
            chunk_metadata = copy.copy(attn_metadata)
            chunk_metadata.prefill = part
            o, l = super()._compute_prefill_context(q, view, chunk_metadata, k_scale)
            if out is None:
                out, lse = o, l
            else:  # vLLM's LSE is [heads, tokens]
                out, lse_t = merge_two_by_lse(out, lse.transpose(0, 1), o, l.transpose(0, 1))
                lse = lse_t.transpose(0, 1).contiguous()
        return out, lse


@cache
def sharded_backend(inner: type) -> type:
    """The sharded subclass of MLA backend ``inner`` (its builder and impl
    are :class:`ShardedBuilder` and :class:`ShardedImpl` over inner's)."""
    name = inner.get_name()
    sparse = bool(getattr(inner, "is_sparse", lambda: False)())  # reads every token
    builder = type(f"ShardedKVBuilder_{name}", (ShardedBuilder, inner.get_builder_cls()),
                   {"cp_kv_inner": inner, "cp_kv_sparse": sparse})
    impl_attrs = {"cp_kv_backend": name, "cp_kv_sparse": sparse}
    if name in FLOAT32_LSE_BACKENDS:
        impl_attrs["cp_kv_lse_context"] = staticmethod(vllm_api.float32_decode_lse)
    impl = type(f"ShardedKVImpl_{name}", (ShardedImpl, inner.get_impl_cls()), impl_attrs)
    return type(f"ShardedKVBackend_{name}", (inner,), {
        "get_impl_cls": staticmethod(lambda: impl),
        "get_builder_cls": staticmethod(lambda: builder)})
