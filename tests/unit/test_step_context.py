"""One owner of the per-step context (``ShardRuntime.step``): the PCP
manager records into the open step and never opens or closes one, so a PCP
step reaches the statistics whatever the order in which vLLM calls the
manager (the earlier design opened a new batch in ``partition_batch`` and
closed it in ``restore_for_sampling``: when the sampling ran inside the
worker's step, as in vLLM's dummy runs, the step was never counted)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import needs_vllm

pytestmark = needs_vllm


def _runtime():
    from vllm_cp_kv.integration.geometry import ShardGeometry
    from vllm_cp_kv.integration.runtime import ShardRuntime

    group = SimpleNamespace(device_communicator=SimpleNamespace(dist_module=None),
                            device_group=None)
    return ShardRuntime(ShardGeometry(rank=0, size=2, block_size=16, axis="pcp"), group,
                        None)


@pytest.fixture
def pcp_manager(monkeypatch):
    """A CPKVPCPManager bound to a runner with a runtime, vLLM's own
    partition and restore replaced by stand-ins (they need a GPU batch)."""
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    from vllm_cp_kv.integration import last_token, pcp

    local = SimpleNamespace(num_reqs=2, idx_mapping_np=np.array([4, 7]),
                            is_padding=torch.zeros(6, dtype=torch.bool))
    monkeypatch.setattr(PCPManager, "partition_batch", lambda self, b, d: local)
    monkeypatch.setattr(last_token.LastTokenPCPManager, "restore_for_sampling",
                        lambda self, h, a: (h, a, None))
    monkeypatch.setattr(pcp, "rank_token_counts", lambda mgr, sched, pre: [6, 4])
    runner = SimpleNamespace(cp_kv_runtime=_runtime())
    mgr = object.__new__(last_token.bound_manager_cls(runner, pcp.CPKVPCPManager))
    mgr.device = torch.device("cpu")
    mgr.pcp_world_size, mgr.dcp_world_size, mgr.pcp_rank = 2, 2, 0
    mgr.shard_decode_requests = False
    mgr._input_buffers = SimpleNamespace(is_padding=torch.zeros(6, dtype=torch.bool))
    mgr._global_batch = SimpleNamespace(
        num_reqs=2, num_scheduled_tokens=np.array([9, 1]),
        idx_mapping_np=np.array([4, 7]), num_computed_tokens_np=np.array([0, 30]),
        is_prefilling_np=np.array([True, False]), query_start_loc_np=np.array([0, 9, 10]))
    return mgr, runner.cp_kv_runtime


def _build(runtime):
    """What a metadata build adds to the step (a plan; bytes received)."""
    batch = runtime.batch()
    batch.plans[(False, False)] = SimpleNamespace(decode=None)
    batch.has_plans = batch.has_prefill = True
    batch.bytes += 100


def test_a_prefill_over_a_cached_context_records_every_ranks_pieces(pcp_manager):
    """vLLM's own split (its manager's methods) of each PCP rank, for the
    owned context path: the decode first, then the 40-token prefill over 64
    cached tokens in 4 chunks of 10 (rank 0: chunks 0 and 3)."""
    mgr, runtime = pcp_manager
    g = mgr._global_batch
    g.num_scheduled_tokens, g.num_computed_tokens_np = np.array([40, 1]), np.array([64, 30])
    g.query_start_loc_np = np.array([0, 40, 41])
    with runtime.step() as batch:
        mgr.partition_batch(None, None)
        step = batch.pcp_step
        assert step.seq_lens.tolist() == [104, 31] and step.query_lens.tolist() == [40, 1]
        assert step.segments == [[(1, 0, 1), (0, 0, 10), (0, 30, 10)],
                                 [(1, 0, 1), (0, 10, 10), (0, 20, 10)]]
        assert step.replicated.tolist() == [False, True]
        assert (step.pcp, step.pcp_rank) == (2, 0)


@pytest.mark.parametrize("sample_inside_step", [True, False])
def test_a_pcp_step_reaches_the_statistics(pcp_manager, sample_inside_step):
    mgr, runtime = pcp_manager
    with runtime.step() as batch:
        mgr.partition_batch(None, None)
        assert batch.pcp_step is not None and batch.pcp_step.keys.tolist() == [4, 7]
        assert batch.pcp_step.seq_lens.tolist() == [9, 31]
        # a cold prefill and a decode: no owned context, no split recorded
        assert batch.pcp_step.segments is None
        assert batch.padding[1].tolist() == [False] * 6 + [False] * 4 + [True] * 2
        _build(runtime)
        if sample_inside_step:  # vLLM's dummy runs: execute and sample in one call
            mgr.restore_for_sampling(torch.zeros(1), None)
            assert runtime.batch() is batch  # still the step's
    if not sample_inside_step:  # the engine step: sample_tokens is a second call
        mgr.restore_for_sampling(torch.zeros(1), None)
    assert runtime.stats.prefill_steps == 1
    assert runtime.stats.prefill_bytes == 100


def test_a_step_inside_a_step_is_the_same_step_and_dummy_runs_are_not_counted():
    runtime = _runtime()
    with runtime.step() as outer:
        with runtime.step(dummy=True) as inner:  # a dummy run inside a step
            assert inner is outer
            _build(runtime)
    assert runtime.stats.prefill_steps == 1
    with runtime.step(dummy=True):
        _build(runtime)
    assert runtime.stats.prefill_steps == 1
    # outside a step, builds share nothing
    assert runtime.batch() is not runtime.batch()


def test_the_forward_context_finds_the_steps_padding_through_the_metadata():
    from vllm_cp_kv.integration import worker_patches as plugin

    local, gathered = torch.zeros(4, dtype=torch.bool), torch.ones(8, dtype=torch.bool)
    batch = SimpleNamespace(padding=(local, gathered))
    md = {"layer.0": SimpleNamespace(cp_kv=SimpleNamespace(batch=batch)),
          "other": SimpleNamespace()}
    assert plugin._recorded_padding(md) == (True, batch.padding)
    assert plugin._recorded_padding([md])[1][1] is gathered  # micro-batches
    assert plugin._recorded_padding({"other": SimpleNamespace()}) == (False, None)
    assert plugin._recorded_padding(None) == (False, None)


def test_a_chained_draft_step_under_pcp_drops_the_split_and_its_padding(pcp_manager):
    """The V2 speculator under PCP: the draft prefill runs on the target's
    split (its forward finds the recorded gathered mask); a chained draft
    step runs the whole batch on every rank (plugin item 15 starts it with
    ``new_forward(replicated=True)``), so its plans and its forward see no
    split and its padding is the global mask repeated per rank. Negative
    control: without ``replicated`` the stale split stays and the draft
    step's forward is refused (its mask has the global batch's length)."""
    from vllm_cp_kv.integration import worker_patches as plugin

    mgr, runtime = pcp_manager
    seen = []
    forward = plugin._gathered_padding(lambda md, cfg, is_padding=None: seen.append(is_padding))
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(prefill_context_parallel_size=2),
                          additional_config={"cp_kv": {"enable": True}})
    draft = torch.tensor([False, False, True])  # the global batch, padded
    with runtime.step() as batch:
        mgr.partition_batch(None, None)
        md = {"mtp.attn": SimpleNamespace(cp_kv=SimpleNamespace(batch=batch))}
        forward(md, cfg, is_padding=torch.zeros(6, dtype=torch.bool))  # the draft prefill
        assert seen[-1] is batch.padding[1]
        runtime.new_forward()  # a new forward that keeps the split: refused
        with pytest.raises(RuntimeError, match="stale step state"):
            forward(md, cfg, is_padding=draft)
        runtime.new_forward(replicated=True)
        assert batch.pcp_step is None and batch.padding is None and batch.plans == {}
        forward(md, cfg, is_padding=draft)
        assert seen[-1].tolist() == draft.tolist() * 2


def test_a_plan_is_frozen_and_refused_once_its_step_ended():
    """The batch plan is frozen (builders replace, readers read); its views
    live in the runtime by epoch, reused within the step and through a
    drafter's new forward, and a plan of an ended step is refused (negative
    control: reading it after the next step began raises)."""
    import dataclasses

    from vllm_cp_kv.integration.step import BatchContext, BatchPlan

    runtime = _runtime()

    def plan():
        return BatchPlan(epoch=runtime.next_epoch(), batch=runtime.batch(), plan=None,
                         full_table=None, reads=False)

    with runtime.step():
        made = plan()
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.decode = None
        runtime.live(made)
        assert runtime.first_check("decode", made) and not runtime.first_check("decode", made)
        runtime.new_forward()
        runtime.live(made)  # the drafter's first forward reads the target's plan
        later = plan()
        assert later.epoch > made.epoch and runtime.first_check("decode", later)
    with runtime.step():
        with pytest.raises(RuntimeError, match="ended step"):
            runtime.live(made)
        runtime.live(plan())
    assert isinstance(made.batch, BatchContext)
