#!/usr/bin/env bash
# On the one-GPU machine, after the payload parts are staged in /root/stage:
#   bash scripts/gpu/onegpu/serve_bench.sh CONFIGS TAG [KV_MIB]
# benchmarks/serve_bench.py with both TP ranks on the one GPU (--onegpu),
# bf16, FLASH_ATTN_MLA, the demo model with GPU head sizes, the harness's
# collectives through shared host memory (ONEGPU_COMM=gloo: gloo; shm_check.py
# checks them on the GPU first); results in
# /root/res/serve (kept between the calls of one lease: run the servers one
# call each) and packed into $OUT/serve_TAG.tgz. vllm serve needs uvicorn and
# watchfiles, which neither the machine nor the payload has: carry them as
# wheels in .whl (docs/gpu-testing.md).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
# shellcheck disable=SC1091
source scripts/gpu/setup_device.sh > "$OUT/setup_$2.log" 2>&1 || { tail -40 "$OUT/setup_$2.log"; exit 3; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site2 .whl/*.whl && export PYTHONPATH=/tmp/site2:$PYTHONPATH
fi
COMM=${ONEGPU_COMM:-shm}  # the harness's collectives: shm (shm_comm.py) or gloo
if [ "$COMM" = shm ]; then
  python3 scripts/gpu/onegpu/shm_check.py 2>&1 | tee "$OUT/shm_check_$2.log" || exit 4
fi
python3 benchmarks/serve_bench.py /root/res/serve --device cuda --onegpu --onegpu-comm "$COMM" \
  --backend FLASH_ATTN_MLA --dtype bfloat16 --kv-mib "${3:-118}" --configs "$1" \
  --timeout 400 2>&1 | tee "$OUT/serve_$2.log"
tar czf "$OUT/serve_$2.tgz" -C /root/res serve
