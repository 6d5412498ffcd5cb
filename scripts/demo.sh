#!/usr/bin/env bash
# The main job: set up the environment if missing, build a tiny DeepSeek-V2
# model offline, run vLLM with KV sharding off and on, print a summary.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/cpu_env.sh"
exec "$ROOT/.venv/bin/python" "$ROOT/examples/demo_offline.py" "$@"
