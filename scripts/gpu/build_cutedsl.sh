#!/usr/bin/env bash
# Builds the CuteDSL add-on for the vLLM 0.34 GPU payload (issue 49: vLLM's
# own DCP sparse decode merges the ranks' top-k with a CuteDSL kernel, and
# raises "DCP sparse-indexer merge requires CuteDSL" without it) and splits it
# into staging folders .c01 .. .cNN at the repo root (git-ignored), 36 MiB each.
# Usage (on this CPU machine, after build_payload.sh --vllm 0.34.0):
#   bash scripts/gpu/build_cutedsl.sh
# On the device: stage each folder into /root/cstage (docs/gpu-testing.md);
# setup_device.sh unpacks it into /root/site-cutedsl and puts it on the path.
# The versions vLLM 0.34 pins (nvidia-cutlass-dsl[cu13] 4.8.0, quack-kernels
# 0.6.5, whose compile helpers vLLM's DSA kernels import), and the CUDA Python
# bindings they import where the payload lacks them: about 105 MB of wheels.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=$ROOT/.work/gpu-cutedsl
SITE=$ROOT/.work/gpu-payload-0.34.0/site
mkdir -p "$W"; cd "$W"
if [ ! -f cutedsl.tar.xz ]; then
  OPTS="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  WHEELS="nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0 nvidia-cutlass-dsl-libs-cu13==4.8.0 quack-kernels==0.6.5 einops"
  # the bindings only where the payload has none (the payload's own stay)
  [ -d "$SITE/cuda/bindings" ] || WHEELS="$WHEELS cuda-bindings==13.5.0"
  [ -d "$SITE/cuda/pathfinder" ] || WHEELS="$WHEELS cuda-pathfinder"
  [ -d "$SITE/google/protobuf" ] || WHEELS="$WHEELS protobuf"
  rm -rf whl site-cutedsl; mkdir whl
  pip3 download -q --no-deps $OPTS -d whl $WHEELS
  pip3 install -q --no-deps --no-compile $OPTS --target site-cutedsl whl/*.whl
  # the .pth that puts dsl_packages on sys.path is not read from PYTHONPATH:
  # setup_device.sh adds that folder itself
  rm -rf site-cutedsl/bin site-cutedsl/nvidia_cutlass_dsl/cu13/lib/stubs
  tar -cf - site-cutedsl | xz -T2 -6 > cutedsl.tar.xz
fi
rm -rf "$ROOT"/.c[0-9][0-9] parts; mkdir parts; split -b 36M -d -a 2 cutedsl.tar.xz parts/c.
i=1; for p in parts/c.*; do d=$(printf "%s/.c%02d" "$ROOT" $i); mkdir -p "$d"; cp "$p" "$d/"; i=$((i+1)); done
echo "staging folders: $(cd "$ROOT" && ls -d .c[0-9][0-9] | tr '\n' ' ')"
