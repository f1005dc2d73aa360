#!/usr/bin/env bash
# Wheels that rlframe's core needs and a bare GPU image lacks, for an offline GPU machine (docs/gpu.md).
#   bash scripts/gpu_wheelhouse.sh [DIR] [PYTHON_VERSION]     default: build/gpu_wheels, 3.12
# The lent H200 machines have Python 3.12 with torch, transformers, safetensors, numpy and pytest, but not
# omegaconf, hydra-core, tensordict or torchdata, and no network: these wheels (about 1.3 MB) travel with
# the command (`carry`) and `scripts/gpu_check.sh --wheelhouse DIR` installs them without an index, into a
# folder of its work dir (the machine's environment untouched). The pins are gpu_check.py's CORE_PINS, which
# it installs from the registry where one answers (tests/project/test_gpu_check_script.py keeps the two equal).
# vllm (336 MB), ray (79 MB) and a flash-attn build do not fit the 64 MiB that can be carried, so the check
# reports their steps "skipped: vllm not installed (no registry access, too large to carry)"; nor does
# sglang (the `sglang` extra: a 39 MB wheel that needs sglang-kernel, flashinfer and torch 2.14.1 besides).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/build/gpu_wheels}"
PYVER="${2:-3.12}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
mkdir -p "$DIR"
PLATFORM=(--only-binary :all: --python-version "$PYVER" --platform manylinux_2_28_x86_64
          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --no-deps -d "$DIR")
# versions as in the CPU development environment; tensordict 0.15.3 is pure Python (torch >= 2.11)
"$PYTHON" -m pip download "${PLATFORM[@]}" omegaconf==2.3.1 hydra-core==1.3.8 tensordict==0.15.3 \
    pyvers==0.2.3 torchdata==0.11.0
# antlr4-python3-runtime (hydra's parser runtime) is an sdist only: build its pure-Python wheel here
"$PYTHON" -m pip wheel --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3
du -sh "$DIR"
