#!/usr/bin/env bash
# GRPO on the built-in countdown_add task with the tiny offline model, 2 CPU worker processes.
# rlframe's defaults are verl 0.9.1's (GPU-cluster sizes): every size of this small run is set here.
# Extra key=value arguments override the config (same syntax as verl).
set -euo pipefail
PYTHON="${PYTHON:-python}"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/tiny_grpo}"
"$PYTHON" -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://tiny \
    data.train_files=builtin://countdown_add data.val_files=builtin://countdown_add \
    data.train_batch_size=8 actor_rollout_ref.rollout.n=4 \
    data.max_prompt_length=64 data.max_response_length=16 data.filter_overlong_prompts=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr=3e-3 \
    actor_rollout_ref.model.use_remove_padding=true \
    trainer.n_gpus_per_node=2 trainer.device=cpu \
    trainer.total_training_steps=100 trainer.test_freq=25 \
    trainer.logger=[jsonl] trainer.resume_mode=disable \
    trainer.default_local_dir="$RUN_DIR" trainer.rollout_data_dir="$RUN_DIR/rollouts" "$@"
"$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/../scripts/summarize_run.py" "$RUN_DIR"
"$PYTHON" -m rlframe.cli plot "$RUN_DIR" -o "$RUN_DIR/curves.png"
echo "a page with the curves, the config and rollout samples: rlframe report $RUN_DIR"
