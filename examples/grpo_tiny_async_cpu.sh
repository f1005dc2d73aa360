#!/usr/bin/env bash
# The quickstart's GRPO run (examples/grpo_tiny_cpu.sh, whose keys it reuses) with asynchronous rollout: one
# training process and a rollout pool of one process (trainer.v1.trainer_mode=separate_async, docs/async.md).
# THRESHOLD is verl's max_off_policy_threshold: the staleness bound is η = THRESHOLD - 1 versions, and the rollout
# pool generates up to η batches ahead (num_warmup_batches). The behaviour policy is corrected with token-level
# importance weights (verl's decoupled mode, rollout_is=token). Extra key=value arguments override the config.
# At η = 4 (THRESHOLD=5) a smaller step learns better: add actor_rollout_ref.actor.optim.lr=2e-4 (README's table).
set -euo pipefail
THRESHOLD="${THRESHOLD:-2}"
RUN_DIR="${RUN_DIR:-checkpoints/rlframe/tiny_grpo_async_t$THRESHOLD}" exec bash "$(dirname "${BASH_SOURCE[0]}")/grpo_tiny_cpu.sh" \
    trainer.n_gpus_per_node=1 \
    trainer.v1.trainer_mode=separate_async \
    actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1 \
    trainer.v1.sampler.max_off_policy_threshold="$THRESHOLD" \
    trainer.v1.separate_async.num_warmup_batches=$((THRESHOLD - 1)) \
    trainer.v1.separate_async.parameter_sync_step=1 \
    algorithm.rollout_correction.rollout_is=token "$@"
