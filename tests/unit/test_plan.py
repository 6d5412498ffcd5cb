"""Materialization plan against an independent reference (one process;
every rank's pack is computed here and concatenated as the all-gather
would). The reference reads each token from where vLLM's slot-mapping
kernel stored it (harness/reference.py), not through the ownership rule.
Multi-process runs with real collectives are in
tests/distributed/test_materialize_dist.py."""

import pytest
import torch

from builders import BS, make_batch, spec, view_of
from harness.reference import full_view, tokens_of
from vllm_cp_kv.core import debug
from vllm_cp_kv.core.materialize import ScratchPool, pack
from vllm_cp_kv.core.plan import plan_materialization


def simulated_gather(plan, caches):
    return torch.cat([pack(plan, r, c) for r, c in enumerate(caches)])


CASES = {
    "ragged": [1, 17, 95, 33, 160],
    "one_token": [1],
    "rank_owns_nothing": [16],  # one block: rank 0 owns it, others nothing
    "exact_blocks": [64, 128],
}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_matches_brute_force(n, case):
    table, lens, caches = make_batch(n, CASES[case], seed=n)
    plan = plan_materialization(spec(n), table, lens)
    scratch = simulated_gather(plan, caches)
    ref = full_view(table, lens, caches, BS, n)
    for i in range(len(lens)):
        assert torch.equal(tokens_of(view_of(plan, scratch, i), int(lens[i])), ref[i])
    # one collective of the same size everywhere; counts add up
    assert plan.send_block_ids.shape == (n, plan.blocks_per_rank)
    assert int(plan.num_send_blocks.sum()) == int(plan.num_logical_blocks.sum())
    debug.check_plan_covers(plan, table, lens)


def test_rank_that_owns_nothing_still_joins_with_padding():
    table, lens, caches = make_batch(4, [16], seed=1)
    plan = plan_materialization(spec(4), table, lens)
    assert plan.num_send_blocks.tolist() == [1, 0, 0, 0]
    assert plan.blocks_per_rank == 1


def test_shared_blocks_are_gathered_once():
    n = 2
    table, lens, caches = make_batch(n, [128, 128], seed=3, shared_rows=(0, 1, 2))
    plan = plan_materialization(spec(n), table, lens)
    # 8 logical blocks each, the first 4 (2 columns x 2 ranks) shared
    assert int(plan.num_send_blocks.sum()) == 16 - 4
    assert plan.blocks_per_rank == 6  # the distinct blocks, read back
    # sized on the host (context chunks): the reads, 8 a rank, which the
    # shared blocks exceed; those slots send the pad block, the view is the same
    host = plan_materialization(spec(n), table, lens, host_size=True)
    assert host.blocks_per_rank == 8 and host.num_send_blocks.tolist() == [6, 6]
    scratch = simulated_gather(host, caches)
    for i in range(2):
        assert torch.equal(tokens_of(view_of(host, scratch, i), int(lens[i])),
                           full_view(table, lens, caches, BS, n)[i])
    assert torch.equal(plan.full_block_table[0, :4], plan.full_block_table[1, :4])
    scratch = simulated_gather(plan, caches)
    ref = full_view(table, lens, caches, BS, n)
    for i in range(2):
        assert torch.equal(tokens_of(view_of(plan, scratch, i), int(lens[i])), ref[i])


def test_corrupted_owned_block_changes_only_its_positions():
    """Negative control: the view really comes from the owner's block."""
    n = 2
    table, lens, caches = make_batch(n, [70, 40], seed=4)
    plan = plan_materialization(spec(n), table, lens)
    clean = simulated_gather(plan, caches)
    victim = int(table[0, 0])  # logical block 1 of request 0 lives on rank 1
    caches[1][victim] += 1
    dirty = simulated_gather(plan, caches)
    changed = (view_of(plan, dirty, 0) != view_of(plan, clean, 0)).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == [1]


def test_scratch_pool_is_bounded_and_reused():
    n = 2
    table, lens, caches = make_batch(n, [160], seed=6)
    plan = plan_materialization(spec(n), table, lens)
    pool = ScratchPool(capacity_blocks=plan.num_scratch_blocks)
    a = pool.get(plan, caches[0])
    b = pool.get(plan, caches[0])
    assert a.data_ptr() == b.data_ptr()
    small = ScratchPool(capacity_blocks=plan.num_scratch_blocks - 2)
    with pytest.raises(RuntimeError, match="scratch blocks"):
        small.get(plan, caches[0])


def test_plan_rejects_table_too_narrow_and_negative_ids():
    table, lens, _ = make_batch(2, [64], seed=7)
    with pytest.raises(ValueError, match="columns"):
        plan_materialization(spec(2), table[:, :1], lens)
    table[0, 1] = -1
    with pytest.raises(ValueError, match="negative"):
        plan_materialization(spec(2), table, lens)


def test_a_host_sized_plan_reads_nothing_back_from_the_device():
    """With ``host_size`` (the context chunks) the plan's shapes come from
    the host: on the meta device (tensors without values, where any read
    back fails) it is built all the same, with the CPU plan's shapes, so on
    a GPU the host never waits for it; without, it reads its size back (the
    control). A negative id then goes unseen by the plan on the device; the
    debug check finds it, and on the host the plan itself."""
    n = 2
    table, lens, _ = make_batch(n, [70, 40, 130], seed=9)
    on_host = plan_materialization(spec(n), table, lens, host_size=True)
    meta = plan_materialization(spec(n), table.to("meta"), lens, host_size=True)
    assert meta.send_block_ids.shape == on_host.send_block_ids.shape
    assert meta.full_block_table.shape == on_host.full_block_table.shape
    with pytest.raises(NotImplementedError, match="meta"):
        plan_materialization(spec(n), table.to("meta"), lens)
    table[1, 0] = -1
    with pytest.raises(debug.CPKVInvariantError, match="negative"):
        debug.check_plan_covers(on_host, table, lens)
    with pytest.raises(ValueError, match="negative"):
        plan_materialization(spec(n), table, lens, host_size=True)


def test_debug_checks_catch_a_stale_plan_and_bad_slots():
    n = 2
    table, lens, _ = make_batch(n, [50, 20], seed=8)
    plan = plan_materialization(spec(n), table, lens)
    other = table.clone()
    other[0, 0] = table[1, 0]
    with pytest.raises(debug.CPKVInvariantError, match="stale"):
        debug.check_plan_covers(plan, other, lens)
    qsl = torch.tensor([0, 50, 70])
    s = spec(n, rank=1)
    good = debug.expected_slot_mapping(s, table, qsl, lens)
    debug.check_owned_writes(s, good, table, qsl, lens)
    bad = good.clone()
    bad[0] = 5  # position 0 is owned by rank 0, not rank 1
    with pytest.raises(debug.CPKVInvariantError, match="non-owned"):
        debug.check_owned_writes(s, bad, table, qsl, lens)


def test_the_debug_checks_hold_under_python_O():
    """``python -O`` drops ``assert`` statements; the debug checks raise their
    named error all the same (a bad slot mapping, checked in a child
    interpreter started with -O)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "assert False, 'asserts are on'\n"
        "from vllm_cp_kv.core import debug\n"
        "from vllm_cp_kv.core.ownership import CPShardSpec\n"
        "s = CPShardSpec(rank=1, size=2, block_size=16)\n"
        "table = torch.tensor([[3, 4]], dtype=torch.int32)\n"
        "qsl, lens = torch.tensor([0, 40]), torch.tensor([40])\n"
        "bad = debug.expected_slot_mapping(s, table, qsl, lens)\n"
        "bad[0] = 5\n"
        "try:\n"
        "    debug.check_owned_writes(s, bad, table, qsl, lens)\n"
        "except debug.CPKVInvariantError as e:\n"
        "    print('raised', 'non-owned' in str(e))\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised True"
