#!/usr/bin/env bash
# The quickstart's GRPO run (examples/grpo_tiny_cpu.sh) with asynchronous rollout: one training process and a
# rollout pool of one process (trainer.v1.trainer_mode=separate_async, docs/async.md). THRESHOLD is verl's
# max_off_policy_threshold: the staleness bound is η = THRESHOLD - 1 versions, and the rollout pool generates up
# to η batches ahead (num_warmup_batches). The behaviour policy is corrected with token-level importance
# weights (verl's decoupled mode, rollout_is=token). Extra key=value arguments override the config.
set -euo pipefail
PYTHON="${PYTHON:-python}"
THRESHOLD="${THRESHOLD:-2}"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/tiny_grpo_async_t$THRESHOLD}"
"$PYTHON" -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://tiny-quickstart \
    data.train_files=builtin://add_digits data.val_files=builtin://add_digits \
    data.train_batch_size=16 actor_rollout_ref.rollout.n=16 \
    data.max_prompt_length=16 data.max_response_length=3 data.filter_overlong_prompts=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=256 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=256 actor_rollout_ref.rollout.micro_batch_size=256 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr=3e-4 actor_rollout_ref.actor.entropy_coeff=0.003 \
    actor_rollout_ref.model.use_remove_padding=true \
    trainer.n_gpus_per_node=1 trainer.device=cpu \
    trainer.v1.trainer_mode=separate_async \
    actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1 \
    trainer.v1.sampler.max_off_policy_threshold="$THRESHOLD" \
    trainer.v1.separate_async.num_warmup_batches=$((THRESHOLD - 1)) \
    trainer.v1.separate_async.parameter_sync_step=1 \
    algorithm.rollout_correction.rollout_is=token \
    trainer.total_training_steps=400 trainer.test_freq=50 trainer.val_before_train=true \
    trainer.logger=[jsonl] trainer.resume_mode=disable \
    trainer.default_local_dir="$RUN_DIR" "$@"
"$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/../scripts/summarize_run.py" "$RUN_DIR"
"$PYTHON" -m rlframe.cli plot "$RUN_DIR" -o "$RUN_DIR/curves.png"
