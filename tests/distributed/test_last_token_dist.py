"""Last-token gather with real collectives (gloo; 2 and 4 processes),
built on vLLM's own ``PCPManager`` on CPU.

Each rank holds its DualChunkSwap chunks of a random global hidden-state
tensor (the layout vLLM's ``_build_batch_layout`` computes). The reference
is vLLM's own full path (``PCPManager.restore_for_sampling``), itself
checked against the global tensor. Fakes, and why: ``get_pcp_group`` is a
gloo adapter (vLLM's group needs its distributed init), and
``async_tensor_h2d`` is a plain copy (no pinned memory without CUDA), as in
vLLM's own tests/v1/worker/test_gpu_pcp_manager.py.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from builders import spawn_ranks
from conftest import needs_vllm
from vllm_cp_kv.core.last_token import gather_sampled_rows, plan_sampled_rows
from vllm_cp_kv.core.materialize import all_gather_into_fn

pytestmark = needs_vllm
H = 64  # hidden size

# (num_scheduled_tokens, is_prefilling) per scenario
SCENARIOS = {
    "ragged_prefills": ([37, 128, 9, 300], [True] * 4),
    "short_prefill_not_split": ([3, 2], [True, True]),
    "decodes_mixed_with_prefills": ([1, 1, 77, 1, 260], [False, False, True, False, True]),
    "one_request": ([1000], [True]),
}


class GlooGroup:
    """Stands in for vLLM's PCP GroupCoordinator (see module docstring)."""

    device_communicator = None
    device_group = None  # the default (world) group

    def __init__(self):
        self.world_size = dist.get_world_size()
        self.rank_in_group = dist.get_rank()
        self.elements_gathered = 0

    def all_gather(self, t, dim=0):
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        self.elements_gathered += t.numel() * self.world_size
        return torch.cat(parts, dim=dim)


def _worker(rank, n, port, errors):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=n)
        from vllm.v1.worker.gpu import pcp_manager as vpcp
        from vllm_cp_kv.integration import last_token as lt

        group = GlooGroup()
        counted = {"elements": 0}
        base = all_gather_into_fn()

        def counting(out, inp):
            counted["elements"] += out.numel()
            base(out, inp)

        vpcp.get_pcp_group = lt.get_pcp_group = lambda: group
        vpcp.async_tensor_h2d = lambda data, device=None, **kw: torch.as_tensor(data, device=device)
        lt.make_all_gather_into = lambda g: counting
        for name, (sched, prefilling) in SCENARIOS.items():
            _check_scenario(name, rank, n, np.array(sched), np.array(prefilling),
                            group, counted, vpcp, lt)
        dist.destroy_process_group()
    except BaseException as e:
        import traceback
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _check_scenario(name, rank, n, sched, prefilling, group, counted, vpcp, lt):
    qsl = np.concatenate([[0], np.cumsum(sched)])
    num_tokens = int(qsl[-1])
    gen = torch.Generator().manual_seed(int(num_tokens))
    global_hidden = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16)
    logits_indices = torch.as_tensor(qsl[1:] - 1)
    batch = SimpleNamespace(logits_indices=logits_indices,
                            idx_mapping_np=np.arange(len(sched)))

    def manager(cls):
        mgr = cls(pcp_world_size=n, pcp_rank=rank, device=torch.device("cpu"),
                  shard_decode_requests=False)
        _, per_rank = mgr._build_batch_layout(sched, np.zeros_like(sched),
                                              prefilling, qsl)
        mgr._global_batch = batch
        padded = max(per_rank)
        local_idx = mgr._padded_gather_idx[rank * padded:(rank + 1) * padded]
        return mgr, global_hidden[local_idx]

    ref_mgr, local = manager(vpcp.PCPManager)
    full, _, _ = vpcp.PCPManager.restore_for_sampling(ref_mgr, local, None)
    assert torch.equal(full, global_hidden), name  # vLLM's path restores the batch

    mgr, local = manager(lt.LastTokenPCPManager)
    counted["elements"] = 0
    out, aux, got_batch = mgr.restore_for_sampling(local, None)
    assert mgr.last_path == "narrow" and got_batch is batch and aux is None
    assert torch.equal(out[logits_indices], full[logits_indices]), name
    b = logits_indices.numel()
    assert counted["elements"] == n * b * H, (name, counted["elements"])
    assert mgr.last_bytes == n * b * H * 2

    # fallbacks: each trigger takes vLLM's full path, bitwise the same
    before = group.elements_gathered
    out, aux, _ = mgr.restore_for_sampling(local, [local])
    assert mgr.last_path == "full" and torch.equal(out, full) and torch.equal(aux[0], full)
    assert group.elements_gathered - before == 2 * n * local.numel()
    runners = {
        "prompt logprobs": SimpleNamespace(speculator=None, prompt_logprobs_worker=SimpleNamespace(
            uses_prompt_logprobs=np.arange(len(sched)) == len(sched) - 1)),
        "speculative decoding": SimpleNamespace(speculator=object(), prompt_logprobs_worker=None),
        None: SimpleNamespace(speculator=None, prompt_logprobs_worker=SimpleNamespace(
            uses_prompt_logprobs=np.zeros(len(sched), dtype=bool))),
    }
    for reason, runner in runners.items():
        bound, local = manager(lt.bound_manager_cls(runner))
        assert bound.full_gather_reason(batch, None) == reason
        out, _, _ = bound.restore_for_sampling(local, None)
        assert bound.last_path == ("narrow" if reason is None else "full")
        assert torch.equal(out[logits_indices], full[logits_indices])


@pytest.mark.parametrize("n", [2, 4])
def test_narrow_equals_full_gather(n):
    spawn_ranks(_worker, n)



def test_round_robin_split():
    """Any index map works: token t on rank t % N at local row t // N."""
    n, t = 3, 20
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, H, generator=gen)
    local_rows = -(-t // n)
    locals_ = [torch.zeros(local_rows, H) for _ in range(n)]
    restore_idx = torch.empty(t, dtype=torch.long)
    for tok in range(t):
        r, row = tok % n, tok // n
        locals_[r][row] = hidden[tok]
        restore_idx[tok] = r * local_rows + row
    full = torch.cat(locals_)[restore_idx]
    assert torch.equal(full, hidden)
    logits_indices = torch.tensor([4, 11, 19])
    plan = plan_sampled_rows(restore_idx, logits_indices, local_rows)

    def fake_gather_for(rank_bufs):  # the collective, done by hand
        def run(out, inp):
            out.copy_(torch.cat(rank_bufs))
        return run

    bufs = [locals_[r][plan.src_row] for r in range(n)]  # what each rank contributes
    for r in range(n):
        out = gather_sampled_rows(plan, r, n, locals_[r], fake_gather_for(bufs))
        assert torch.equal(out, full[logits_indices])
