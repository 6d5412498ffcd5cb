"""The harness's written-rows count (``harness/run_vllm.py --poison``) on a
vLLM that zeroes new blocks (0.33+, caches of mixed precision): a block
vLLM zeroes is poisoned again, so only rows the model wrote count. Found on
the H200 with vLLM 0.34: both PCP ranks of the sparse model counted the
same 45 whole blocks (every block the scheduler handed out), where rank 1
owns 39. Negative control: without the wrapper the zeroed block counts."""

from types import SimpleNamespace

import torch

from harness import run_vllm


class Zeroer:
    def __init__(self, caches):
        self.caches = caches

    def zero_block_ids(self, ids):
        for c in self.caches:
            c[torch.as_tensor(ids)] = 0


def _worker():
    caches = [torch.zeros(6, 4, 8, dtype=torch.uint8), torch.zeros(6, 4, 3, dtype=torch.uint8)]
    runner = SimpleNamespace(kv_caches=caches, kv_block_zeroer=Zeroer(caches))
    return SimpleNamespace(model_runner=runner), caches


def test_a_block_vllm_zeroes_is_not_counted_written():
    worker, caches = _worker()
    run_vllm._poison(worker)
    worker.model_runner.kv_block_zeroer.zero_block_ids([2, 3])  # new blocks of a step
    caches[0][2, 1] = 7  # the model writes one row of block 2 in the first cache
    assert [w[1:] for w in run_vllm._written(worker)] == [[1, 1], [0, 0]]
    run_vllm._poison(worker)  # poisoning again does not wrap twice
    assert worker.model_runner.kv_block_zeroer._cp_kv_poison


def test_without_the_wrapper_the_zeroed_rows_count():
    worker, caches = _worker()
    for c in caches:
        c.fill_(run_vllm._sentinel(c))
    worker.model_runner.kv_block_zeroer.zero_block_ids([2])
    assert [w[1:] for w in run_vllm._written(worker)] == [[4, 1], [4, 1]]


def test_a_series_sends_each_prompt_cold_then_with_its_suffix_twice():
    """``--series`` (the first-token benchmark's hits, benchmarks/gpu_context.py):
    every prompt's first wave is the prompt alone (cold), its next two the
    prompt with the suffix. Negative control: the waves before the fix sent
    prompts after the first with their suffix in the cold wave too."""
    first, later = ["a", "b"], ["a+s", "b+s"]
    waves = [run_vllm.series_wave(k, first, later) for k in range(6)]
    assert waves == [["a"], ["a+s"], ["a+s"], ["b"], ["b+s"], ["b+s"]]
    before = [[later[k // 3]] if k else [first[0]] for k in range(6)]  # the old rule
    assert before != waves and before[3] == ["b+s"]
