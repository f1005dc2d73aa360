#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-0.5B-Instruct on one 8-GPU node, vLLM rollout (extra 'gpu').
#   python examples/data_preprocess/gsm8k.py --out ~/data/gsm8k
#   bash examples/grpo_gsm8k_qwen05b_gpu.sh [KEY=VALUE ...]
# The same command line works with verl's key names.
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"   # a local folder (or a hub id already in the HF cache)
DATA="${DATA:-$HOME/data/gsm8k}"
python -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    trainer.device=cuda trainer.n_gpus_per_node=8 trainer.nnodes=1 \
    trainer.total_epochs=15 trainer.test_freq=5 trainer.save_freq=20 \
    trainer.logger=[console,jsonl,wandb] trainer.project_name=rlframe_gsm8k \
    trainer.experiment_name=qwen2.5_0.5b_grpo "$@"
