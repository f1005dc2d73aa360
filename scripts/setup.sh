#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install rlframe into it.
#   bash scripts/setup.sh [EXTRAS]      e.g. "test", "test,tensorboard", "gpu"
# RLFRAME_VENV picks the environment (default: .venv in the repo). Without CUDA the CPU
# build of torch is installed first, so nothing later pulls the multi-GB CUDA build; set
# RLFRAME_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) where PyPI only has CUDA builds.
#
# The `gpu` extra (docs/gpu.md) installs in three steps, because one `pip install -e '.[gpu]'` cannot:
#   1. torch pinned to what vLLM pins (vllm 0.33.0 -> torch 2.14.0, PyPI's CUDA 13.0 build);
#   2. rlframe with its extras (vLLM and the versions it resolves to);
#   3. flash-attn, whose only PyPI file is an sdist whose setup.py imports torch and wheel: built with
#      --no-build-isolation against the torch of step 1 (after wheel, packaging, psutil and ninja), or
#      installed from a prebuilt wheel named by RLFRAME_FLASH_ATTN_WHEEL (a path or URL) that matches
#      this torch, CUDA major and Python. The build needs nvcc of torch's CUDA major (13); MAX_JOBS
#      bounds its parallel compilers (each takes several GiB of memory; default 4).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLFRAME_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
GPU_TORCH="2.14.0"           # vllm==0.33.0's pin (its Requires-Dist)
FLASH_ATTN="2.8.3.post2"     # the newest flash-attn on PyPI

wants_gpu() { [[ ",$EXTRAS," == *",gpu,"* ]]; }

if wants_gpu; then
    # vllm 0.33.0 declares Requires-Python >=3.11,<3.15: say so before pip fails deep in a resolve
    if ! "$PYTHON" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))'; then
        echo "[setup] the gpu extra needs Python 3.11-3.14 (vllm 0.33.0); $PYTHON is $("$PYTHON" -V 2>&1)." >&2
        echo "[setup] set PYTHON=python3.11 (or newer) and RLFRAME_VENV to a fresh folder" >&2
        exit 1
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip

if wants_gpu; then
    echo "[setup] gpu extra: torch==$GPU_TORCH (the CUDA 13.0 build vLLM 0.33.0 pins)"
    "${PIP[@]}" install "torch==$GPU_TORCH"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
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

if wants_gpu; then
    if [ -n "${RLFRAME_FLASH_ATTN_WHEEL:-}" ]; then
        echo "[setup] flash-attn from the prebuilt wheel $RLFRAME_FLASH_ATTN_WHEEL"
        "${PIP[@]}" install --no-deps "$RLFRAME_FLASH_ATTN_WHEEL"
    else
        TORCH_CUDA="$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda or "")')"
        NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
        command -v nvcc >/dev/null 2>&1 && NVCC="$(command -v nvcc)"
        NVCC_CUDA="$("$NVCC" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p')"
        if [ -z "$NVCC_CUDA" ] || [ "${NVCC_CUDA%%.*}" != "${TORCH_CUDA%%.*}" ]; then
            echo "[setup] flash-attn builds from source against torch (CUDA ${TORCH_CUDA:-none}) and needs nvcc of the" >&2
            echo "[setup] same CUDA major (found: ${NVCC_CUDA:-no nvcc}); install the CUDA ${TORCH_CUDA%%.*} toolkit" >&2
            echo "[setup] (CUDA_HOME), or set RLFRAME_FLASH_ATTN_WHEEL to a prebuilt wheel. rlframe runs without" >&2
            echo "[setup] flash-attn (packed attention falls back to torch SDPA per sequence, slower)." >&2
            exit 1
        fi
        echo "[setup] flash-attn $FLASH_ATTN: building against torch $GPU_TORCH (CUDA $TORCH_CUDA, nvcc $NVCC_CUDA), MAX_JOBS=${MAX_JOBS:-4}"
        "${PIP[@]}" install wheel packaging psutil ninja
        MAX_JOBS="${MAX_JOBS:-4}" "${PIP[@]}" install --no-build-isolation "flash-attn==$FLASH_ATTN"
    fi
    "$VENV/bin/python" -c 'import flash_attn, torch, vllm; print(f"[setup] torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, flash-attn {flash_attn.__version__}")'
fi
echo "[setup] done: $VENV"
