"""Break one guarded thing at a time in a copy of the tree and confirm the
test that guards it fails (the tests' own negative controls aside).

Usage: bash -c 'source scripts/cpu_env.sh && .venv/bin/python scripts/mutation_check.py'
Prints one line per mutation: "FAILS (good)" or "PASSES (BAD)". No vLLM
engine starts (unit and config-path tests only; a minute on 2 cores).
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = tempfile.mkdtemp(prefix="cpkv-mutations-")
files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=HERE,
                       capture_output=True, text=True, check=True).stdout.split()
subprocess.run(["tar", "-cf", os.path.join(ROOT, "tree.tar"), *files], cwd=HERE, check=True)
subprocess.run(["tar", "-xf", "tree.tar"], cwd=ROOT, check=True)
MUTATIONS = [
    ("vllm_cp_kv/core/ownership.py", "return logical_blocks % self.size", "return (logical_blocks + 1) % self.size", "tests/test_ownership.py"),
    ("vllm_cp_kv/core/ownership.py", "tail = torch.where(spec.owner_of(full) == r, seq % bs, torch.zeros_like(seq))", "tail = seq % bs", "tests/test_ownership.py::test_owned_token_count_equals_vllms_dcp_local_lengths"),
    ("vllm_cp_kv/core/capacity.py", "per_req = -(-(-(-max_model_len // block_size)) // shard_size)", "per_req = max_model_len // block_size // shard_size", "tests/test_capacity.py"),
    ("vllm_cp_kv/core/capacity.py", "by_bytes = available_bytes * shard_size // ((num_layers + shard_size) * page_bytes)", "by_bytes = available_bytes * shard_size // (num_layers * page_bytes)", "tests/test_capacity.py"),
    ("vllm_cp_kv/core/manifest.py", "return [(j, int(virtual_table[spec.table_index(j)]))", "return [(j, int(virtual_table[spec.table_index(j) - 1]))", "tests/test_manifest.py"),
    ("vllm_cp_kv/core/decode.py", "weights = weights / total.clamp(min=1e-30)", "weights = weights / weights.shape[0]", "tests/test_decode.py"),
    ("vllm_cp_kv/core/decode.py", "k = kv_cache.index_select(0, table[i, : -(-n // bs)]).view(-1, d)[:n].to(compute)", "k = kv_cache.index_select(0, table[i, : -(-n // bs)]).view(-1, d).to(compute)", "tests/test_decode.py"),
    ("vllm_cp_kv/core/plan.py", "owner = spec.owner_of(j)", "owner = (j + 1) % n", "tests/test_plan.py tests/test_materialize_dist.py"),
    ("vllm_cp_kv/integration/checks.py", "        check_cuda_graphs(args.compilation_config, options)", "        pass", "tests/test_startup_checks.py::test_row_cuda_graphs"),
    ("vllm_cp_kv/integration/checks.py", "        derive_torch_rope(args.compilation_config)", "        pass", "tests/test_startup_checks.py::test_derived_settings"),
    ("vllm_cp_kv/integration/geometry.py", "    return pcp if pcp > 1 else tp", "    return tp", "tests/test_startup_checks.py tests/test_capacity.py"),
    ("vllm_cp_kv/integration/runtime.py", "        if self._batch is not None:\n            yield self._batch", "        if False:\n            yield self._batch", "tests/test_step_context.py"),
    ("vllm_cp_kv/integration/runtime.py", "        if batch is not None and count and (batch.has_plans or batch.bytes):", "        if batch is not None and (batch.has_plans or batch.bytes):", "tests/test_step_context.py"),
    ("vllm_cp_kv/tools/compat.py", "            problems.append(f\"{item.targets[0]}: no longer assigns {missing}\")", "            pass", "tests/test_compat.py"),
]
env = {**os.environ, "PYTHONPATH": ROOT}
for path, old, new, test in MUTATIONS:
    p = os.path.join(ROOT, path)
    src = open(p).read()
    assert old in src, (path, old)
    open(p, "w").write(src.replace(old, new, 1))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *test.split()],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        last = [l for l in r.stdout.splitlines() if "passed" in l or "failed" in l or "error" in l][-1:]
        print(f"{'FAILS (good)' if r.returncode else 'PASSES (BAD)'} | {path}: {new[:60]!r} | {test} | {last}")
    finally:
        open(p, "w").write(src)
