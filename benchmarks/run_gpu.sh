#!/usr/bin/env bash
# All GPU checks and timings of the core in one lease (2 GPUs):
#   bash benchmarks/run_gpu.sh OUT_DIR
# Then, here: python benchmarks/plot.py OUT_DIR benchmarks/results
set -uo pipefail
OUT=${1:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 benchmarks/gpu_last_token.py "$OUT" 2>&1 | tee "$OUT/last_token.log"
python3 benchmarks/gpu_materialize.py "$OUT" 2>&1 | tee "$OUT/materialize.log"
python3 benchmarks/gpu_plan_check.py "$OUT" 2>&1 | tee "$OUT/plan_check.log"
