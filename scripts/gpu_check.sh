#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on one NVIDIA GPU in under 8 minutes, the GPU tests, bench/gpu_mfu.py and a
# few GRPO steps with vLLM, as one table (step, status, key figure). Steps whose package is missing are
# skipped, not failed. `--dry-run` checks on a CPU what a CPU can (CI runs it: tests/test_gpu_check_script.py).
#   bash scripts/gpu_check.sh [--dry-run] [--wheelhouse DIR] [--only STEP,...] [--verbose]
# PYTHON picks the interpreter (default: the repo's .venv if present, else python3); the repo is put on
# PYTHONPATH, so rlframe need not be installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" --python "$PYTHON" "$@"
