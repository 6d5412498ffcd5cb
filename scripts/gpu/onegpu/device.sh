#!/usr/bin/env bash
# On the one-GPU machine, after the payload parts are staged in /root/stage
# (docs/gpu-testing.md):
#   bash scripts/gpu/onegpu/device.sh GROUPS BUDGET_S TAG     e.g.  graphs 540 a
# Unpacks vLLM 0.32 (scripts/gpu/setup_device.sh), runs
# benchmarks/gpu_onegpu.py into /root/res/onegpu (kept between calls of one
# lease: the summary merges them; PARALLEL runs at a time, default 6; the
# harness's collectives on NCCL unless ONEGPU_COMM says otherwise) and packs
# it into $OUT/onegpu_TAG.tgz. The negative control (tp2-FA-old) needs the
# plugin before the captured-decode fix in .old/vllm_cp_kv (carried).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
t=$(date +%s)
# shellcheck disable=SC1091
source scripts/gpu/setup_device.sh > "$OUT/setup_$3.log" 2>&1 || { tail -40 "$OUT/setup_$3.log"; exit 3; }
echo "setup_s=$(( $(date +%s) - t ))"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" 2>&1 | tail -1
left=$(( $2 - ($(date +%s) - t) ))
python3 benchmarks/gpu_onegpu.py /root/res/onegpu --runs "$1" --budget-s "$left" \
  --parallel "${PARALLEL:-6}" --comm "${ONEGPU_COMM:-nccl}" --timeout "${TIMEOUT:-300}" 2>&1 | tee "$OUT/run_$3.log" | grep -v "^ "
tar czf "$OUT/onegpu_$3.tgz" -C /root/res onegpu
echo "total_s=$(( $(date +%s) - t ))"
