#!/usr/bin/env bash
# Builds (or reuses) a vLLM GPU payload and splits it into staging folders at
# the repo root (git-ignored), one 36 MiB part each (PART_SIZE): .s01 .. .sNN
# for vLLM 0.32 (the default), .v01 .. .vNN for another release.
# Usage (on this CPU machine): bash scripts/gpu/build_payload.sh [--vllm 0.34.0] [WORKDIR]
# WORKDIR defaults to .work/gpu-payload (0.32) or .work/gpu-payload-VERSION;
# about 8 minutes on 2 cores, 6 GB. The torch, triton and NCCL versions are
# the ones the release pins (torch from vLLM's metadata; triton and NCCL read
# from the downloaded torch wheel's).
# The recipe (cp312 wheels installed with --target, unneeded files deleted,
# non-sm_90 CUDA code zeroed, xz) is the one measured in
# ../shared/gpu-vllm/README.md. docs/gpu-testing.md says how to stage and run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VLLM=0.32.0
if [ "${1:-}" = --vllm ]; then VLLM=$2; shift 2; fi
case $VLLM in
  0.32.0) TORCH=2.13.0 VISION=0.28.0 EXTRA="" STAGE=.s W=${1:-$ROOT/.work/gpu-payload} ;;
  # 0.34 imports orjson in its HTTP server (new since 0.32)
  0.34.0) TORCH=2.14.0 VISION=0.29.0 EXTRA="orjson" STAGE=.v W=${1:-$ROOT/.work/gpu-payload-$VLLM} ;;
  *) echo "no recipe for vLLM $VLLM (0.32.0, 0.34.0)"; exit 2 ;;
esac
mkdir -p "$W"; cd "$W"
if [ ! -f payload.tar.xz ] || [ ! -f payload.done ]; then
  [ -x pipvenv/bin/pip ] || { python3 -m venv pipvenv && pipvenv/bin/pip install -q -U pip; }
  P=""; for n in 39 38 37 36 35 34 33 32 31 30 29 28 27 26 25 24 23 22 21 20 19 18 17 12 5; do P="$P --platform manylinux_2_${n}_x86_64"; done
  PIP="$W/pipvenv/bin/pip"
  OPTS="--only-binary=:all: --python-version 3.12 --implementation cp $P --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64"
  mkdir -p whl
  $PIP download -q --no-deps $OPTS -d whl torch==$TORCH
  # triton and NCCL as torch pins them
  PINS=$(unzip -p whl/torch-$TORCH-*.whl "torch-$TORCH.dist-info/METADATA" |
         sed -n 's/^Requires-Dist: \(triton\|nvidia-nccl-cu13\) *(\?\(==\|~=\)\([0-9.]*\).*/\1\2\3/p' | tr '\n' ' ')
  echo "torch $TORCH pins: $PINS"
  $PIP download -q --no-deps $OPTS -d whl $PINS
  $PIP download -q --no-deps $OPTS -d whl vllm==$VLLM torchvision==$VISION $EXTRA annotated-types==0.8.0 \
    apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.3 starlette==1.10.0 \
    llguidance==1.7.6 msgspec==0.23.0 openai==2.54.0 jiter distro sniffio==1.3.1 openai-harmony==0.0.8 \
    opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 \
    pydantic_core==2.50.5 typing-inspection==0.4.5 pyzmq==27.3.0 xgrammar==0.2.8 setproctitle \
    depyf==0.20.0 astor dill nvtx==0.2.15 blake3 typing_extensions==4.16.0 compressed-tensors==0.17.0 \
    loguru frozendict nixl-cu13==1.5.1 nixl==1.5.1
  rm -rf site; $PIP install -q --no-deps --no-compile $OPTS --target site whl/*.whl
  (cd site
   rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs triton/backends/nvidia/bin/ptxas-blackwell \
     triton/backends/nvidia/lib/cupti/*.a triton/backends/nvidia/lib/cupti/libnvperf* \
     triton/instrumentation/libGPUInstrumentationTestLib.so torch/bin/protoc*; rm -rf bin
   find . -name '*.so*' -size +1M | while read -r f; do python3 "$ROOT/scripts/gpu/fatprune.py" "$f" >/dev/null; done)
  tar -cf - site | xz -T2 -6 > payload.tar.xz
  touch payload.done
fi
# parts small enough that one part and the tracked tree (about 15 MB of
# committed results) stay under the device call's 64 MiB
rm -rf "$ROOT"/$STAGE[0-9][0-9] parts; mkdir parts; split -b "${PART_SIZE:-36M}" -d -a 2 payload.tar.xz parts/p.
i=1; for p in parts/p.*; do d=$(printf "%s/$STAGE%02d" "$ROOT" $i); mkdir -p "$d"; cp "$p" "$d/"; i=$((i+1)); done
echo "staging folders: $(cd "$ROOT" && ls -d $STAGE[0-9][0-9] | tr '\n' ' ')"
