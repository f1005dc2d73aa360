#!/usr/bin/env bash
# PPO with a critic (GAE) on the built-in task, tiny model, 2 CPU worker processes.
set -euo pipefail
PYTHON="${PYTHON:-python}"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/tiny_ppo}"
"$PYTHON" -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=gae \
    data.train_batch_size=8 actor_rollout_ref.rollout.n=4 \
    data.max_prompt_length=64 data.max_response_length=16 data.filter_overlong_prompts=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 critic.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false critic.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr=3e-3 critic.optim.lr=3e-3 critic.cliprange_value=10 \
    trainer.n_gpus_per_node=2 trainer.device=cpu \
    trainer.total_training_steps=100 trainer.test_freq=25 \
    trainer.logger=[jsonl] trainer.resume_mode=disable \
    trainer.default_local_dir="$RUN_DIR" "$@"
"$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/../scripts/summarize_run.py" "$RUN_DIR"
