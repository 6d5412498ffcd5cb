#!/usr/bin/env bash
# The test suite: set up the environment if missing, then pytest.
#   bash scripts/test.sh                   the whole suite (tests/)
#   bash scripts/test.sh -m quick -x       the whole suite's selection: options
#                                          only, so tests/ is what runs
#   bash scripts/test.sh tests/unit [...]  only the given paths (the first
#                                          argument names a file or folder,
#                                          optionally with ::test): tests/ is
#                                          not added
# The folders (tests/conftest.py): unit (one process, the fast tier, also
# -m quick), distributed (process groups, no engine), vllm (real vLLM),
# pd (the KV transports and prefill/decode).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
bash "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/cpu_env.sh"
cd "$ROOT"
# no path first: the whole tests/ folder, with the options given
if [ $# -eq 0 ] || [ ! -e "${1%%::*}" ]; then
  set -- tests "$@"
fi
exec "$ROOT/.venv/bin/python" -m pytest -q -rs --durations=30 "$@"
