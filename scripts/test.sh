#!/usr/bin/env bash
# The test suite, from a fresh clone: builds/updates the venv, then runs pytest.
#   bash scripts/test.sh [PYTEST ARGS]     e.g. bash scripts/test.sh -m "not slow"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLFRAME_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup.sh" test,tensorboard,wandb,smollm2
cd "$ROOT"
echo "[test] ruff check and ruff format --check (settings in pyproject.toml)"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
export RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec "$VENV/bin/python" -m pytest "$@"
