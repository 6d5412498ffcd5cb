#!/usr/bin/env bash
# On the one-GPU machine, after the payload parts are staged in /root/stage
# (docs/gpu-testing.md; the folder .s12 brings mooncake_gpu.tar.xz, the
# pruned CUDA build of Mooncake, and whl/, what `vllm serve` needs):
#   bash scripts/gpu/onegpu/pd_device.sh WHAT BUDGET_S TAG
# WHAT: ``matrix`` (benchmarks/gpu_onegpu.py --runs pd: P/D over NIXL and
# Mooncake in vLLM's default mode, then benchmarks/pd_transfer.py GPU to GPU,
# connector against the raw engines) or ``latency`` (benchmarks/pd_latency.py
# --device cuda: the example pair against one instance, new code and old).
# Results in /root/res (kept between the calls of one lease), packed into
# $OUT/pd_TAG.tgz.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$ROOT"
t=$(date +%s)
# shellcheck disable=SC1091
source scripts/gpu/setup_device.sh > "$OUT/setup_$3.log" 2>&1 || { tail -40 "$OUT/setup_$3.log"; exit 3; }
# Mooncake's CUDA build: its Python package (engine only) and the system
# libraries it links that this machine lacks (libibverbs, libmlx5, libnuma,
# libcurl and theirs, from Debian bookworm): only the missing ones are linked in
if [ ! -d /root/mc ]; then
  mkdir -p /root/mc /root/mclibs && tar xJf /root/stage/mooncake_gpu.tar.xz -C /root/mc
  for f in /root/mc/libs/*.so*; do
    n=$(basename "$f")
    ldconfig -p | grep -q "^[[:space:]]*$n " || ln -sf "$f" "/root/mclibs/$n"
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site2 /root/stage/whl/*.whl
fi
export PYTHONPATH=/root/mc/site:/root/site2:$PYTHONPATH LD_LIBRARY_PATH=/root/mclibs:${LD_LIBRARY_PATH:-}
echo "setup_s=$(( $(date +%s) - t )) linked: $(ls /root/mclibs | tr '\n' ' ')"
python3 -c "from mooncake.engine import TransferEngine; print('mooncake engine ok')" 2>&1 | tail -2
left=$(( $2 - ($(date +%s) - t) ))
mkdir -p /root/res
if [ "$1" = matrix ]; then
  python3 benchmarks/gpu_onegpu.py /root/res/pd --runs pd --budget-s $(( left - 70 )) \
    --parallel "${PARALLEL:-4}" --comm nccl --timeout "${TIMEOUT:-330}" 2>&1 | tee "$OUT/run_$3.log" | grep -v "^ "
  timeout 60 python3 benchmarks/pd_transfer.py /root/res/pd-transfer --device cuda --mooncake-cuda \
    --repeats 10 2>&1 | tail -30 | tee "$OUT/transfer_$3.log"
  tar czf "$OUT/pd_$3.tgz" -C /root/res pd pd-transfer
else
  timeout $(( left - 20 )) python3 benchmarks/pd_latency.py /root/res/latency --device cuda --code "${CODE:-new,old}" \
    2>&1 | tail -40 | tee "$OUT/latency_$3.log"
  tar czf "$OUT/pd_$3.tgz" -C /root/res latency
fi
echo "total_s=$(( $(date +%s) - t ))"
