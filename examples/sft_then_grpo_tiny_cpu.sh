#!/usr/bin/env bash
# SFT, then GRPO: the quickstart's random-init model (builtin://tiny-quickstart) is first fine-tuned on 16
# demonstrations of add_digits ("3+4=" -> "7"; examples/data_preprocess/add_digits_sft.py) with `rlframe sft`
# (verl's SFT keys), and its Hugging Face checkpoint then starts the quickstart's GRPO run unchanged
# (examples/grpo_tiny_cpu.sh). STEPS sets the GRPO steps; the table of SFT alone, RL alone and SFT then RL is in
# docs/sft.md. Extra key=value arguments override the GRPO run's config.
set -euo pipefail
PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/tiny_sft_then_grpo}"
SFT_STEPS="${SFT_STEPS:-40}"
"$PYTHON" "$HERE/data_preprocess/add_digits_sft.py" --out "$RUN_DIR/sft_data" --num-train 16
"$PYTHON" -m rlframe.trainer.sft_trainer \
    model.path=builtin://tiny-quickstart \
    data.train_files="$RUN_DIR/sft_data/train.parquet" data.val_files="$RUN_DIR/sft_data/val.parquet" \
    data.train_batch_size=16 data.micro_batch_size_per_gpu=16 optim.lr=1e-3 \
    trainer.total_training_steps="$SFT_STEPS" trainer.device=cpu trainer.logger=[console] \
    'checkpoint.save_contents=[model,optimizer,extra,hf_model]' trainer.default_local_dir="$RUN_DIR/sft"
RUN_DIR="$RUN_DIR/grpo" exec bash "$HERE/grpo_tiny_cpu.sh" \
    actor_rollout_ref.model.path="$RUN_DIR/sft/global_step_$SFT_STEPS/actor/huggingface" \
    trainer.total_training_steps="${STEPS:-100}" trainer.test_freq=25 "$@"
