#!/usr/bin/env bash
# GRPO on the built-in image task colour_vl (a picture of two colours: "Which colour covers the most? 1 red
# 2 green 3 blue 4 yellow" -> the digit) with the tiny random-init vision-language model builtin://tiny-vl
# (a Qwen2-VL: one vision block, two language layers), 2 CPU worker processes. The images go through the
# dataset, the rollout and the training forward as a Qwen2.5-VL's do (docs/multimodal.md). Extra key=value
# arguments override the config; TASK=count_vl counts squares instead. It ends with the reward summary and
# the curves in $RUN_DIR/curves.png.
set -euo pipefail
PYTHON="${PYTHON:-python}"
TASK="${TASK:-colour_vl}"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/tiny_vl_grpo_$TASK}"
"$PYTHON" -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://tiny-vl \
    data.train_files=builtin://"$TASK" data.val_files=builtin://"$TASK" data.image_key=images \
    data.train_batch_size=16 actor_rollout_ref.rollout.n=8 \
    data.max_prompt_length=80 data.max_response_length=3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 actor_rollout_ref.rollout.micro_batch_size=64 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr=3e-4 actor_rollout_ref.actor.entropy_coeff=0.003 \
    actor_rollout_ref.model.use_remove_padding=true \
    trainer.n_gpus_per_node=2 trainer.device=cpu \
    trainer.total_training_steps=200 trainer.test_freq=25 trainer.val_before_train=true \
    trainer.logger=[jsonl] trainer.resume_mode=disable \
    trainer.default_local_dir="$RUN_DIR" "$@"
"$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/../scripts/summarize_run.py" "$RUN_DIR"
"$PYTHON" -m rlframe.cli plot "$RUN_DIR" -o "$RUN_DIR/curves.png"
echo "one page with the curves and the config: rlframe report $RUN_DIR"
