#!/usr/bin/env bash
# GRPO on Geometry3K with Qwen2.5-VL-7B-Instruct on one 8-GPU node, vLLM rollout (extra 'gpu'): verl's
# examples/grpo_trainer/run_qwen2_5_vl-7b.sh, with the same keys and meaning (docs/multimodal.md).
#   python examples/data_preprocess/geo3k.py --out ~/data/geo3k
#   bash examples/grpo_qwen25vl_geo3k_gpu.sh [KEY=VALUE ...]
# Add actor_rollout_ref.actor.freeze_vision_tower=true to train the language model only.
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen2.5-VL-7B-Instruct}"   # a local folder (or a hub id already in the HF cache)
DATA="${DATA:-$HOME/data/geo3k}"
python -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    data.train_batch_size=512 data.max_prompt_length=1024 data.max_response_length=2048 \
    data.filter_overlong_prompts=true data.truncation=error data.image_key=images \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=128 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.fsdp_config.param_offload=false \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=false \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.enable_chunked_prefill=false actor_rollout_ref.rollout.enforce_eager=false \
    actor_rollout_ref.rollout.free_cache_engine=true \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20 \
    actor_rollout_ref.ref.fsdp_config.param_offload=true \
    algorithm.use_kl_in_reward=false \
    trainer.device=cuda trainer.n_gpus_per_node=8 trainer.nnodes=1 \
    trainer.total_epochs=15 trainer.test_freq=5 trainer.save_freq=20 \
    trainer.logger=[console,jsonl] trainer.project_name=rlframe_geo3k \
    trainer.experiment_name=qwen2_5_vl_7b_grpo "$@"
