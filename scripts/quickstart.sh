#!/usr/bin/env bash
# The main job, from a fresh clone: build the venv, then GRPO on the built-in task (tiny model, CPU).
#   bash scripts/quickstart.sh [KEY=VALUE ...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLFRAME_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
PYTHON="$VENV/bin/python" exec bash "$ROOT/examples/grpo_tiny_cpu.sh" "$@"
