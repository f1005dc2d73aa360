#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on one NVIDIA GPU within 540 s, setup included (one device call allows 600 s),
# the end-to-end GRPO step with vLLM first, then the GPU tests and bench/gpu_mfu.py, as one table (step,
# status, key figure). The driver is read first; packages come from a wheelhouse, the registry or neither
# (said in the first rows); steps whose package is missing are skipped with the reason, not failed.
# `--dry-run` prints the plan and its budget and checks on a CPU what a CPU can (tests/project/test_gpu_check_script.py).
#   bash scripts/gpu_check.sh [--dry-run] [--wheelhouse DIR] [--no-install] [--only STEP,...] [--verbose]
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
