#!/usr/bin/env bash
# GRPO on the built-in add_digits task ("What is 3 + 4?" -> "7") with the quickstart's random-init model
# (builtin://tiny-quickstart: 2 layers, a 64-token vocabulary), 2 CPU worker processes: exact-answer
# accuracy goes from 0 to about 0.95 in 400 steps (README). rlframe's defaults are verl 0.9.1's (GPU sizes):
# every size of this small run is set here. Extra key=value arguments override the config (as in verl).
# It ends by printing the reward summary and drawing the curves into $RUN_DIR/curves.png.
set -euo pipefail
PYTHON="${PYTHON:-python}"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/tiny_grpo}"
"$PYTHON" -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://tiny-quickstart \
    data.train_files=builtin://add_digits data.val_files=builtin://add_digits \
    data.train_batch_size=16 actor_rollout_ref.rollout.n=16 \
    data.max_prompt_length=16 data.max_response_length=3 data.filter_overlong_prompts=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128 actor_rollout_ref.rollout.micro_batch_size=128 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr=3e-4 actor_rollout_ref.actor.entropy_coeff=0.003 \
    actor_rollout_ref.model.use_remove_padding=true \
    trainer.n_gpus_per_node=2 trainer.device=cpu \
    trainer.total_training_steps=400 trainer.test_freq=50 trainer.val_before_train=true \
    trainer.logger=[jsonl] trainer.resume_mode=disable \
    trainer.default_local_dir="$RUN_DIR" "$@"
"$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/../scripts/summarize_run.py" "$RUN_DIR"
# the curves (reward and validation, lengths, entropy, KL, losses, step time): the line names the PNG
"$PYTHON" -m rlframe.cli plot "$RUN_DIR" -o "$RUN_DIR/curves.png"
echo "one page with the curves and the config: rlframe report $RUN_DIR"
