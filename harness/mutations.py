"""Mutations for ``scripts/mutation_check.py``: each breaks one guarded
thing in a copy of the tree, and names the tests that must then fail.

``(path, text, replacement, tests)``; ``QUICK`` (indices) is the subset the
suite runs (tests/distributed/test_mutations.py): the cheapest guards of this round's
work. A mutation whose text is no longer in its file is reported STALE
(the guard moved: update the entry), never skipped.
"""

MUTATIONS = [
    ("vllm_cp_kv/core/ownership.py", "return logical_blocks % self.size",
     "return (logical_blocks + 1) % self.size", "tests/unit/test_ownership.py"),
    ("vllm_cp_kv/core/ownership.py",
     "tail = torch.where(spec.owner_of(full) == r, seq % bs, torch.zeros_like(seq))",
     "tail = seq % bs",
     "tests/unit/test_ownership.py::test_owned_token_count_equals_vllms_dcp_local_lengths"),
    ("vllm_cp_kv/core/capacity.py",
     "per_req = -(-(-(-max_model_len // block_size)) // shard_size)",
     "per_req = max_model_len // block_size // shard_size", "tests/unit/test_capacity.py"),
    ("vllm_cp_kv/core/capacity.py",
     "by_bytes = available_bytes * shard_size // ((num_layers + shard_size) * page_bytes)",
     "by_bytes = available_bytes * shard_size // (num_layers * page_bytes)",
     "tests/unit/test_capacity.py"),
    ("vllm_cp_kv/core/manifest.py", "return [(j, int(virtual_table[spec.table_index(j)]))",
     "return [(j, int(virtual_table[spec.table_index(j) - 1]))", "tests/unit/test_manifest.py"),
    ("vllm_cp_kv/core/decode.py", "weights = weights / total.clamp(min=1e-30)",
     "weights = weights / weights.shape[0]", "tests/unit/test_decode.py"),
    ("vllm_cp_kv/core/decode.py",
     "keep = torch.arange(k.shape[1], device=k.device)[None, :] < lens.to(k.device)[:, None]",
     "keep = torch.arange(k.shape[1], device=k.device)[None, :] >= 0 * lens.to(k.device)[:, None]",
     "tests/unit/test_decode.py"),
    ("vllm_cp_kv/core/plan.py", "owner = spec.owner_of(j)", "owner = (j + 1) % n",
     "tests/unit/test_plan.py tests/distributed/test_materialize_dist.py"),
    ("vllm_cp_kv/integration/checks.py", "        check_cuda_graphs(args.compilation_config)",
     "        pass", "tests/unit/test_startup_checks.py::test_row_cuda_graphs"),
    ("vllm_cp_kv/integration/checks.py", "        derive_torch_rope(args.compilation_config)",
     "        pass", "tests/unit/test_startup_checks.py::test_derived_settings"),
    ("vllm_cp_kv/integration/geometry.py", "    return PCPxTP(pcp, tp).size", "    return tp",
     "tests/unit/test_startup_checks.py tests/unit/test_capacity.py"),
    ("vllm_cp_kv/integration/runtime.py",
     "        if self._batch is not None:\n            yield self._batch",
     "        if False:\n            yield self._batch", "tests/unit/test_step_context.py"),
    ("vllm_cp_kv/integration/runtime.py",
     "        if batch is not None and count and (batch.has_plans or batch.bytes):",
     "        if batch is not None and (batch.has_plans or batch.bytes):",
     "tests/unit/test_step_context.py"),
    ("vllm_cp_kv/tools/compat.py",
     '    return [f"{target}: no longer assigns {missing}"] if missing else []',
     "    return []", "tests/unit/test_compat.py"),
    # this round (issues 35, 36)
    ("vllm_cp_kv/integration/planning.py", "        lens[real:].zero_()", "        pass",
     "tests/unit/test_graph_buffers.py"),
    ("vllm_cp_kv/integration/planning.py",
     "        return DecodeView(block_table=table, local_lens=lens[:num_decodes],",
     "        return DecodeView(block_table=table, local_lens=lens[:num_decodes].clone(),",
     "tests/unit/test_graph_buffers.py"),
    ("vllm_cp_kv/integration/pcp.py",
     "    return manager.cp_kv_write_padding(is_padding.expand(pcp, -1))",
     "    return is_padding.repeat(pcp)", "tests/unit/test_graph_buffers.py"),
    ("vllm_cp_kv/core/debug.py", "    if not ok:", "    if False:",
     "tests/unit/test_plan.py tests/unit/test_chunks.py"),
    ("vllm_cp_kv/integration/checks.py", "    if options.prefetch and (pcp > 1",
     "    if False and (pcp > 1", "tests/unit/test_startup_checks.py::test_row_prefetch"),
    ("vllm_cp_kv/integration/checks.py", "    if debug_enabled():", "    if False:",
     "tests/unit/test_startup_checks.py::test_row_cuda_graphs"),
    ("vllm_cp_kv/tools/compat.py", "    for target, params in item.signatures:",
     "    for target, params in ():", "tests/unit/test_compat.py"),
    # PCP x TP (issue 40): the merge without the PCP sum; vLLM 0.32's DCP
    # numbering (PCP first) replaced by the world's
    ("vllm_cp_kv/core/groups.py", "        dist.all_reduce(mine, group=pcp_group)",
     "        pass", "tests/distributed/test_pcp_tp_group.py"),
    ("vllm_cp_kv/core/groups.py", "            return tp_rank * self.pcp + pcp_rank",
     "            return pcp_rank * self.tp + tp_rank", "tests/distributed/test_pcp_tp_group.py"),
    # this round: the TP rank's heads under PCP x TP; an unsharded prefill's
    # replica rank; FP8 over PCP off TRITON_MLA; PCP x TP before vLLM 0.34
    ("vllm_cp_kv/integration/geometry.py", "        return self.rank % self.head_ranks",
     "        return self.rank", "tests/distributed/test_pcp_tp_group.py"),
    ("vllm_cp_kv/integration/connector/worker.py",
     "        if is_producer and rank >= geometry.size:",
     "        if False:", "tests/unit/test_connector_units.py"),
    ("vllm_cp_kv/integration/checks.py",
     "    if pcp > 1 and is_dense_fp8(kv_cache_dtype, sparse) and name not in PCP_FP8_BACKENDS:",
     "    if False:", "tests/unit/test_startup_checks.py::test_row_fp8_pcp"),
    ("vllm_cp_kv/integration/checks.py", "    return release if release is not None and "
     "release < (0, 34) else None", "    return None",
     "tests/unit/test_startup_checks.py::test_row_pcp_and_tp"),
    ("vllm_cp_kv/integration/decode.py", "    split = spec.head_ranks == spec.size",
     "    split = True", "tests/distributed/test_pcp_tp_group.py"),
    # speculation under PCP x TP in graphs (vLLM's own fails there)
    ("vllm_cp_kv/integration/checks.py",
     "        if _on_gpu() and not args.enforce_eager and pcp > 1:",
     "        if _on_gpu() and not args.enforce_eager and pcp > 1 and tp == 1:",
     "tests/unit/test_startup_checks.py::test_row_spec_pcp_graphs"),
    # the chunked context under PCP: a row's part of a chunk capped by its
    # own context; the chunk tables as wide on every rank
    ("vllm_cp_kv/core/plan.py", "    tokens = torch.minimum((row_context.long() - start).clamp(min=0),",
     "    tokens = torch.minimum((row_context.long() * 0 + 10**9),",
     "tests/unit/test_plan_pcp.py tests/unit/test_chunks.py"),
    ("vllm_cp_kv/integration/planning.py",
     "        columns = max(columns, -(-int(step.seq_lens.max(initial=0)) // bs))",
     "        columns = columns", "tests/unit/test_plan_pcp.py"),
    # the shard-aware sparse path (issue 49): the tie rule (lower position
    # first), -inf as padding, local positions to logical ones, the owned
    # part of a selection, and no scratch on that path
    ("vllm_cp_kv/core/sparse.py",
     "    key = (ordered << _POSITION_BITS) | (_POSITION_MASK - pos.clamp(0, _POSITION_MASK))",
     "    key = (ordered << _POSITION_BITS) | pos.clamp(0, _POSITION_MASK)",
     "tests/unit/test_sparse_topk.py"),
    ("vllm_cp_kv/core/sparse.py", '    real = (pos >= 0) & (s > float("-inf"))',
     "    real = pos >= 0", "tests/unit/test_sparse_topk.py"),
    ("vllm_cp_kv/core/sparse.py", " + rank * interleave ", " + rank ",
     "tests/unit/test_sparse_topk.py"),
    ("vllm_cp_kv/core/sparse.py",
     "    mine = (pos >= 0) & (spec.owner_of(block) == spec.rank)",
     "    mine = pos >= 0", "tests/unit/test_sparse_topk.py"),
    ("vllm_cp_kv/tools/cli.py", "        scratch=not shard_aware_sparse(layout, a))",
     "        scratch=True)", "tests/unit/test_capacity.py"),
    # a prefill row's context read owned (issue 51): each rank's own share
    # of the context, only short rows with a context, the gathered side's
    # collective in the cost model
    ("vllm_cp_kv/integration/context.py",
     "                       owned_token_count(ctx[rows], spec))",
     "                       ctx[rows])", "tests/unit/test_context.py"),
    ("vllm_cp_kv/core/context.py",
     "    cand = has_context & (query_lens <= max_query) & (query_lens > 0)",
     "    cand = has_context & (query_lens > 0)", "tests/unit/test_context.py"),
    ("vllm_cp_kv/core/context.py",
     "        return (link.seconds(OWNED_COLLECTIVES if bool(owned.any()) else 0,",
     "        return (link.seconds(0,", "tests/unit/test_context.py"),
    # the MLA architectures (issue 53): a refused family's row lost where
    # vLLM calls it non-MLA, the cache net blind to compressed rows
    ("vllm_cp_kv/integration/checks.py",
     "        reason = refusal(arch, allow_unverified=True)",
     "        reason = None", "tests/unit/test_startup_checks.py"),
    ("vllm_cp_kv/integration/models.py", "    if tokens != 1:", "    if tokens < 1:",
     "tests/unit/test_startup_checks.py::test_row_cache_kind"),
    # ... and a refused architecture left to vLLM's config error (a model
    # type this transformers lacks) instead of refused by its name
    ("vllm_cp_kv/integration/checks.py",
     "    _check_named_architectures(args.model, getattr(args, \"revision\", None), options)",
     "    pass", "tests/unit/test_startup_checks.py::"
     "test_refused_by_name_before_vllm_builds_its_model_config"),
    # a sparse model's verification rows sent to the prefill branch again
    # under DCP (issue 49: MTP in full decode graphs)
    ("vllm_cp_kv/integration/sparse_dcp.py",
     "        if self.reorder_batch_threshold is not None and supports_spec_as_decode:",
     "        if False:", "tests/unit/test_sparse_dcp.py"),
    # the owned context under PCP (issue 51): the merge's head blocks in
    # TP-major order (a rank gets another PCP rank's tokens), a replicated
    # request's piece attended once per PCP rank, a piece's context without
    # the earlier pieces' new tokens
    ("vllm_cp_kv/core/context.py",
     "    o = out[dst].view(p, m, h, v).transpose(0, 1).reshape(m, p * h, v)",
     "    o = out[dst].view(p, m, h, v).permute(1, 2, 0, 3).reshape(m, p * h, v)",
     "tests/unit/test_context_pcp.py"),
    ("vllm_cp_kv/core/context.py",
     "            k = first.get(g) if bool(replicated[g]) else None",
     "            k = None", "tests/unit/test_context_pcp.py"),
    ("vllm_cp_kv/integration/context.py",
     "                       owned_token_count(ctx[pieces.req] + pieces.offset, spec),",
     "                       owned_token_count(ctx[pieces.req], spec),",
     "tests/unit/test_context_pcp.py"),
    # ... and one step's owned rows unbounded (their all-head partials)
    ("vllm_cp_kv/core/context.py",
     "    cand &= torch.cumsum(torch.where(cand, query_lens, 0), 0) <= budget",
     "    pass", "tests/unit/test_context.py"),
]

# the suite's share: a decode buffer rewritten in place, the PCP mask's
# buffer, the debug checks under -O, the prefetch refusal
QUICK = (14, 16, 17, 18)
