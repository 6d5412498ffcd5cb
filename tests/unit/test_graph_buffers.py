"""CUDA graphs replay the decode kernels on the addresses they saw at
capture (vLLM's ``build_for_cudagraph_capture``): whatever the sharded
builder hands the kernels and the merge must be the same storage at every
step, rewritten in place, with the captured shape. Here, without a GPU, the
builder's planning (``planning.plan_batch``, which every sharded build runs)
and vLLM's own ``_build_decode`` (what the GPU builders wrap) run twice the
way vLLM's V2 runner calls them: once on a capture-shaped batch, once on a
later batch of the same padded size with other contents. The second must
reuse the first's addresses and hold the second batch's values, checked
against a brute-force count of each rank's tokens. The same for rows with
several query tokens (MTP verification, a padded uniform batch) and for the
PCP padding mask that MoE layers read inside piecewise graphs.

Negative control: the plugin before this change made new tensors every
build; on that code the address assertions fail (run by hand once, see
docs/cuda-graphs.md).
"""

from types import SimpleNamespace

import pytest
import torch

from conftest import needs_vllm

pytestmark = needs_vllm
BS, N, COLS, MAX_REQS = 16, 2, 12, 8


def _runtime(rank=0):
    from vllm_cp_kv.integration.geometry import ShardGeometry
    from vllm_cp_kv.integration.runtime import ShardRuntime

    group = SimpleNamespace(device_communicator=SimpleNamespace(dist_module=None),
                            device_group=None)
    return ShardRuntime(ShardGeometry(rank=rank, size=N, block_size=BS, axis="tp"), group,
                        None)


class Runner:
    """vLLM's V2 runner's persistent inputs (block table, sequence lengths,
    query offsets), rewritten per step; padded rows get no query token."""

    def __init__(self):
        self.table = torch.zeros(MAX_REQS, COLS, dtype=torch.int32)
        self.seq_lens = torch.zeros(MAX_REQS, dtype=torch.int32)
        self.qsl = torch.zeros(MAX_REQS + 1, dtype=torch.int32)

    def common(self, seq_lens, query_lens, padded_reqs, padded_tokens, max_seq_len, seed):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        gen = torch.Generator().manual_seed(seed)
        n = len(seq_lens)
        self.table.copy_(torch.randint(1, 500, self.table.shape, generator=gen))
        self.seq_lens.zero_()
        self.seq_lens[:n] = torch.tensor(seq_lens)
        self.seq_lens[n:padded_reqs] = 999  # stale lengths in padding rows
        qsl = torch.zeros(padded_reqs + 1, dtype=torch.int32)
        qsl[1:n + 1] = torch.cumsum(torch.tensor(query_lens), 0)
        qsl[n + 1:] = qsl[n]
        self.qsl[: padded_reqs + 1] = qsl
        return CommonAttentionMetadata(
            query_start_loc=self.qsl[: padded_reqs + 1], query_start_loc_cpu=qsl.clone(),
            seq_lens=self.seq_lens[:padded_reqs], num_reqs=padded_reqs,
            num_actual_tokens=padded_tokens, max_query_len=max(query_lens),
            max_seq_len=max_seq_len, block_table_tensor=self.table[:padded_reqs],
            slot_mapping=torch.zeros(padded_tokens, dtype=torch.int64),
            seq_lens_cpu_upper_bound=self.seq_lens[:padded_reqs].clone())


def owned_brute_force(visible: int, rank: int) -> int:
    """Tokens ``0 .. visible - 1`` whose block ``rank`` owns (block j on j % N)."""
    return sum(1 for t in range(visible) if (t // BS) % N == rank)


def expected_rows(seq_lens, query_lens, rank):
    """Per query token: (request row, owned tokens it sees)."""
    out = []
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        for t in range(q):
            out.append((i, owned_brute_force(s - q + t + 1, rank)))
    return out


def kernel_inputs(runtime, common, num_decodes):
    """What a GPU sharded build hands vLLM's decode kernels: the view of
    ``plan_batch`` through vLLM's own ``MLACommonMetadataBuilder._build_decode``."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

    from vllm_cp_kv.integration import decode
    from vllm_cp_kv.integration.planning import plan_batch

    with runtime.step():
        made = plan_batch(runtime.plan_inputs(common.block_table_tensor), common, num_decodes,
                          whole=False, lse_decode=True)
    builder = SimpleNamespace(dcp_world_size=1)
    builder._build_decode = lambda **kw: MLACommonMetadataBuilder._build_decode(builder, **kw)
    md = decode.build_local(builder, made.decode, N)
    return made.decode, md


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


@pytest.mark.parametrize("rank", [0, 1])
def test_one_query_rows_reuse_their_storage_across_steps(rank):
    runtime, runner = _runtime(rank), Runner()
    # capture: 4 dummy decode rows at vLLM's capture bound (max_model_len)
    cap = runner.common([1, 1, 1, 1], [1] * 4, 4, 4, max_seq_len=4096, seed=0)
    v1, md1 = kernel_inputs(runtime, cap, 4)
    held = v1.local_lens.clone()
    # replay: 3 real rows padded to the captured 4, other lengths and blocks
    lens = [70, 5, 33]
    step = runner.common(lens, [1] * 3, 4, 4, max_seq_len=70, seed=1)
    v2, md2 = kernel_inputs(runtime, step, 4)
    for a, b in ((md1.seq_lens, md2.seq_lens), (md1.block_table, md2.block_table),
                 (v1.query_start_loc, v2.query_start_loc), (v1.local_lens, v2.local_lens)):
        assert same_storage(a, b)
    assert md2.seq_lens.tolist() == [owned_brute_force(s, rank) for s in lens] + [0]
    assert not torch.equal(held, md2.seq_lens)  # rewritten in place
    assert torch.equal(md2.block_table, runner.table[:4])  # vLLM's own table rows
    # the host bound a kernel is launched with: the capture's covers the replay's
    assert v1.max_local_len >= v2.max_local_len >= max(md2.seq_lens.tolist())


@pytest.mark.parametrize("rank", [0, 1])
def test_rows_of_several_query_tokens_reuse_their_storage(rank):
    """MTP k = 2: rows of 3 query tokens, each a row of its own with its own
    causal limit; vLLM pads a uniform batch of 2 real requests to the 4 it
    captured (12 tokens), so the view keeps 12 rows, the padding ones empty."""
    runtime, runner = _runtime(rank), Runner()
    cap = runner.common([3] * 4, [3] * 4, 4, 12, max_seq_len=4096, seed=0)
    v1, md1 = kernel_inputs(runtime, cap, 4)
    lens = [50, 17]
    step = runner.common(lens, [3, 3], 4, 12, max_seq_len=50, seed=2)
    v2, md2 = kernel_inputs(runtime, step, 4)
    assert v1.multi_query and v2.multi_query
    for a, b in ((md1.seq_lens, md2.seq_lens), (md1.block_table, md2.block_table),
                 (v1.query_start_loc, v2.query_start_loc)):
        assert same_storage(a, b)
    want = expected_rows(lens, [3, 3], rank)
    assert md2.seq_lens.tolist() == [n for _, n in want] + [0] * 6
    for t, (row, _) in enumerate(want):
        assert torch.equal(md2.block_table[t], runner.table[row])
    assert v2.query_start_loc.tolist() == list(range(13))


def test_an_uncaptured_batch_keeps_its_own_row_count():
    """Eager and piecewise batches are not padded: the view has exactly the
    batch's query tokens (a decode row next to prefill rows)."""
    runtime, runner = _runtime(), Runner()
    step = runner.common([40, 9, 300], [2, 1, 200], 3, 203, max_seq_len=300, seed=3)
    with runtime.step():
        from vllm_cp_kv.integration.planning import plan_batch

        made = plan_batch(runtime.plan_inputs(step.block_table_tensor), step, 2,
                          whole=False, lse_decode=True)
    assert made.decode.local_lens.tolist() == [n for _, n in expected_rows(
        [40, 9], [2, 1], 0)]


def test_the_pcp_padding_mask_keeps_its_storage(monkeypatch):
    """PCP + MoE: the gathered padding mask a captured MoE layer reads is the
    manager's persistent buffer, for a real step and for a capture or dummy
    forward alike (the earlier code made a new tensor for each)."""
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from vllm_cp_kv.integration import pcp

    mgr = object.__new__(pcp.CPKVPCPManager)
    mgr.device, mgr.pcp_world_size = torch.device("cpu"), 2
    local_buffer = torch.zeros(8, dtype=torch.bool)
    mgr._input_buffers = SimpleNamespace(is_padding=local_buffer)
    monkeypatch.setattr(pcp, "_MANAGER", [lambda: mgr])
    counts = iter([[5, 3], [2, 6]])
    monkeypatch.setattr(pcp, "rank_token_counts", lambda m, s, p: next(counts))
    monkeypatch.setattr(PCPManager, "partition_batch",
                        lambda self, b, d: SimpleNamespace(is_padding=local_buffer[:6]))
    mgr._global_batch = SimpleNamespace(num_reqs=1, num_scheduled_tokens=[8],
                                        is_prefilling_np=[True])
    mgr.cp_kv_runtime = lambda: None  # kv_sharding: false (no batch plan)
    masks = []
    for _ in range(2):
        local = mgr.partition_batch(None, None)
        masks.append(pcp.gathered_padding(False, None, local.is_padding, 2))
    assert same_storage(masks[0], masks[1])
    assert masks[1].tolist() == [False] * 2 + [True] * 4 + [False] * 6
    dummy = pcp.gathered_padding(True, None, torch.tensor([False, True, True]), 2)
    assert dummy.data_ptr() == masks[0].data_ptr()
    assert dummy.tolist() == [False, True, True] * 2


@pytest.mark.parametrize("dummy", [True, False])
def test_the_owned_writes_check_skips_vllms_dummy_runs_only(dummy):
    """vLLM 0.34's V2 runner fills a dummy run's slot mapping with -1 (no
    write): the debug switch's owned-writes check does not apply there (it
    stopped the warmup of every debug run on the H200). In a real step the
    same -1 slots, where this rank owns a block, are lost KV and raise."""
    from vllm_cp_kv.core.debug import CPKVInvariantError
    from vllm_cp_kv.integration.planning import plan_batch

    runtime, runner = _runtime(0), Runner()
    runtime.debug = True
    step = runner.common([40, 9], [40, 9], 2, 49, max_seq_len=40, seed=4)
    step.slot_mapping.fill_(-1)
    with runtime.step(dummy=dummy):
        if dummy:
            plan_batch(runtime.plan_inputs(step.block_table_tensor), step, 0, whole=False,
                       lse_decode=True)
        else:
            with pytest.raises(CPKVInvariantError, match="slot mapping writes non-owned"):
                plan_batch(runtime.plan_inputs(step.block_table_tensor), step, 0,
                           whole=False, lse_decode=True)


def test_fp8_flashmla_rows_of_no_token_read_one():
    """FlashMLA's dense FP8 kernel faults on rows of no tokens: its builder
    gets the lengths with 0 raised to 1 (persistent, as the lengths), the
    merge still sees the true 0s; other builders keep the true lengths."""
    from types import SimpleNamespace

    from vllm_cp_kv.integration.decode import fp8_rows_need_a_token
    from vllm_cp_kv.integration.step import DecodeBuffers

    buffers = DecodeBuffers(6, torch.zeros(6, 4, dtype=torch.int32))
    buffers.lens[:4] = torch.tensor([0, 5, 0, 64], dtype=torch.int32)
    got = buffers.at_least_one(4)
    assert got.tolist() == [1, 5, 1, 64] and buffers.lens[:4].tolist() == [0, 5, 0, 64]
    assert got.data_ptr() == buffers.kernel_lens.data_ptr()  # the same storage each step

    class FlashMLAMetadataBuilder:
        is_fp8_kvcache = True

    class ShardedKVBuilder_FLASHMLA(FlashMLAMetadataBuilder):
        pass

    assert fp8_rows_need_a_token(ShardedKVBuilder_FLASHMLA())
    ShardedKVBuilder_FLASHMLA.is_fp8_kvcache = False
    assert not fp8_rows_need_a_token(ShardedKVBuilder_FLASHMLA())
    assert not fp8_rows_need_a_token(SimpleNamespace(is_fp8_kvcache=True))  # not FlashMLA
