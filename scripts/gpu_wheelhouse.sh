#!/usr/bin/env bash
# Wheels that rlframe's core needs and a bare GPU image lacks, for an offline GPU machine (docs/gpu.md).
#   bash scripts/gpu_wheelhouse.sh [--with-ray] [DIR] [PYTHON_VERSION]     default: build/gpu_wheels, 3.12
# The lent H200 machines have Python 3.12 with torch, transformers, safetensors, numpy and pytest, but not
# omegaconf, hydra-core, tensordict or torchdata, and no network: these wheels (about 1.3 MB) travel with
# the command (`carry`) and `scripts/gpu_check.sh --wheelhouse DIR` installs them without an index, into a
# folder of its work dir (the machine's environment untouched). The pins are gpu_check.py's CORE_PINS, which
# it installs from the registry where one answers (tests/project/test_gpu_check_script.py keeps the two equal).
# vllm (336 MB, and it pins torch 2.14.0 where the machines have 2.11.0) and a flash-attn build do not fit the
# 64 MiB that can be carried, so the check reports their steps "skipped: vllm not installed (no registry access,
# too large to carry)"; nor does sglang (a 39 MB wheel that needs sglang-kernel, flashinfer and torch 2.14.1).
# ray's 79 MB wheel does not fit either, but --with-ray unpacks it here, leaves out what rlframe never runs
# (Java jars, rllib, the dashboard's web client) and packs the rest as ray-2.60.0-site.tar.xz (~30 MB), which
# gpu_check.py unpacks beside the wheels: the "grpo hf" step (the trainer end to end on CUDA) then runs.
set -euo pipefail
WITH_RAY=0
if [ "${1:-}" = "--with-ray" ]; then WITH_RAY=1; shift; fi
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
if [ "$WITH_RAY" = 1 ]; then
    # ray's own needs that the machines lack (jsonschema and its three)
    "$PYTHON" -m pip download "${PLATFORM[@]}" jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
        referencing==0.37.0 rpds-py==2026.9.1 cloudpickle==3.1.3
    TREE="$(mktemp -d)"
    trap 'rm -rf "$TREE"' EXIT
    "$PYTHON" -m pip download --only-binary :all: --python-version "$PYVER" --platform manylinux2014_x86_64 \
        --no-deps -d "$TREE" ray==2.60.0
    (cd "$TREE" && unzip -q ray-2.60.0-*.whl -d site && rm -rf site/ray/jars site/ray/rllib site/ray/dashboard/client/build)
    tar -C "$TREE/site" -cf - . | xz -T0 -6 > "$DIR/ray-2.60.0-site.tar.xz"
fi
du -sh "$DIR"
