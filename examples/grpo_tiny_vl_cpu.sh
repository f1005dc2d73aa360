#!/usr/bin/env bash
# GRPO on the built-in image task colour_vl (a picture of two colours: "Which colour covers the most? 1 red
# 2 green 3 blue 4 yellow" -> the digit) with the tiny random-init vision-language model builtin://tiny-vl
# (a Qwen2-VL: one vision block, two language layers), 2 CPU worker processes: the quickstart's run
# (examples/grpo_tiny_cpu.sh, whose keys it reuses) with images. The pictures go through the dataset, the
# rollout and the training forward as a Qwen2.5-VL's do (docs/multimodal.md). Extra key=value arguments
# override the config; TASK=count_vl counts squares instead. It ends with the reward summary and the curves
# in $RUN_DIR/curves.png.
set -euo pipefail
TASK="${TASK:-colour_vl}"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/tiny_vl_grpo_$TASK}" exec bash "$(dirname "${BASH_SOURCE[0]}")/grpo_tiny_cpu.sh" \
    actor_rollout_ref.model.path=builtin://tiny-vl \
    data.train_files=builtin://"$TASK" data.val_files=builtin://"$TASK" data.image_key=images \
    actor_rollout_ref.rollout.n=8 data.max_prompt_length=80 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 actor_rollout_ref.rollout.micro_batch_size=64 \
    trainer.total_training_steps=200 trainer.test_freq=25 "$@"
