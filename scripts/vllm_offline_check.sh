#!/usr/bin/env bash
# The vLLM steps of the GPU check on a machine without a registry, from the landed parts (docs/gpu.md, "vLLM offline").
#   bash scripts/vllm_offline_check.sh [--dry-run] [STEPS]     STEPS: gpu_check step names, comma-separated
# Once all parts are in $RLFRAME_VLLM_OFFLINE (default /tmp/rlframe-vllm-offline; `scripts/vllm_offline.py land`
# puts them there, a call at a time), the first run joins them, checks every sha256, installs the wheels with
# `pip install --no-index --no-deps --target $RLFRAME_VLLM_OFFLINE/site` beside the image's torch and imports vllm;
# later runs reuse that folder. Then scripts/gpu_check.sh runs STEPS (default: "grpo vllm,vllm rollout") with the
# core wheelhouse (build/gpu_wheels, scripts/gpu_wheelhouse.sh --with-ray: ray and rlframe's core) and no registry,
# within what is left of one device call's 600 s. --dry-run (on a CPU): join, verify and print the pip command, then
# gpu_check's own --dry-run of STEPS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LANDING="${RLFRAME_VLLM_OFFLINE:-/tmp/rlframe-vllm-offline}"
PYTHON="${PYTHON:-python3}"
CALL_S=560  # a device call allows 600 s; the rest is its start and teardown
DRY_RUN=()
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=(--dry-run); shift; fi
STEPS="${1:-grpo vllm,vllm rollout}"
cd "$ROOT"

if [ ${#DRY_RUN[@]} -gt 0 ] || [ ! -s "$LANDING/site/pythonpath.txt" ]; then
    "$PYTHON" scripts/vllm_offline.py install --landing "$LANDING" --python "$PYTHON" "${DRY_RUN[@]}"
fi
WHEELHOUSE=()
[ -d build/gpu_wheels ] && WHEELHOUSE=(--wheelhouse build/gpu_wheels)
if [ ${#DRY_RUN[@]} -eq 0 ]; then
    export PYTHONPATH="$(cat "$LANDING/site/pythonpath.txt")${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "[vllm_offline] gpu_check --only \"$STEPS\" within $((CALL_S - SECONDS)) s (install took ${SECONDS} s)"
PYTHON="$PYTHON" exec bash scripts/gpu_check.sh "${DRY_RUN[@]}" "${WHEELHOUSE[@]}" --no-install --only "$STEPS" \
    --work-dir "$LANDING/check-$(date +%s)" --budget-s "$((CALL_S - SECONDS))"  # a folder per call
