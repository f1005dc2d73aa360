#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install rlframe into it.
#   bash scripts/setup.sh [EXTRAS]      e.g. "test", "test,tensorboard", "gpu"
# RLFRAME_VENV picks the environment (default: .venv in the repo). Without CUDA the CPU
# build of torch is installed first, so nothing later pulls the multi-GB CUDA build; set
# RLFRAME_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) where PyPI only has CUDA builds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLFRAME_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] CUDA device found: installing torch from the package index"
    "${PIP[@]}" install "torch>=2.6,<2.15"
else
    echo "[setup] no CUDA device: installing the CPU build of torch 2.13.0"
    if [ -n "${RLFRAME_TORCH_INDEX:-}" ]; then
        "${PIP[@]}" install "torch==2.13.0" --index-url "$RLFRAME_TORCH_INDEX"
    else
        "${PIP[@]}" install "torch==2.13.0"
    fi
fi

SPEC="$ROOT"
[ -n "$EXTRAS" ] && SPEC="$ROOT[$EXTRAS]"
echo "[setup] installing rlframe${EXTRAS:+ with extras [$EXTRAS]}"
"${PIP[@]}" install --editable "$SPEC"
echo "[setup] done: $VENV"
