#!/usr/bin/env bash
# The whole test suite: set up the environment if missing, then pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/cpu_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -q -rs --durations=30 tests "$@"
