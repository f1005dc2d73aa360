"""GRPO through Ray with the vLLM rollout on vLLM's CPU build: SmolLM2-135M-Instruct, 2 worker processes (DP 2).

Each worker builds its engine (external_launcher, in the worker process), samples its share of the step, syncs the
weights after each update. Over the run vLLM's sampled-token probabilities stay the actor's to fp32 noise
(`training/rollout_probs_diff_*`, logged every step as verl logs them), and a rerun with the same `data.seed` samples
the same tokens.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers.runs import read_metrics, run_main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROLLOUT = "actor_rollout_ref.rollout"
# fp32 on both sides (see test_vllm_cpu.py): measured ~1e-6 mean, ~1e-5 max per step
PROB_DIFF_MEAN, PROB_DIFF_MAX = 1e-4, 1e-3

JOB = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.model.path=builtin://smollm2-135m-instruct",
    "data.train_files=builtin://gsm8k_arith",
    "data.val_files=builtin://gsm8k_arith",
    "data.train_batch_size=4",
    f"{ROLLOUT}.n=4",
    "data.max_prompt_length=192",
    "data.max_response_length=24",
    "data.filter_overlong_prompts=true",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.optim.lr=1e-4",  # far above the example's: each update moves the policy visibly
    f"{ROLLOUT}.temperature=1.0",
    f"{ROLLOUT}.name=vllm",
    f"{ROLLOUT}.max_model_len=224",
    f"{ROLLOUT}.max_num_seqs=16",
    f"{ROLLOUT}.enforce_eager=true",
    "trainer.n_gpus_per_node=2",
    "trainer.device=cpu",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.logger=[jsonl]",
    "trainer.resume_mode=disable",
    "data.seed=7",
]


def rollouts(folder, step: int) -> list[tuple[str, str]]:
    with open(os.path.join(folder, f"{step}.jsonl")) as f:
        return [(row["prompt"], row["response"]) for row in map(json.loads, f)]


def test_grpo_with_the_vllm_rollout_syncs_every_step_and_reruns_the_same(tmp_path, cache_dir):
    runs = {}
    for name, steps in (("a", 3), ("b", 1)):
        run_dir = tmp_path / name
        out = run_main(
            JOB
            + [
                f"trainer.total_training_steps={steps}",
                f"trainer.default_local_dir={run_dir}",
                f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
            ],
            cache_dir,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        runs[name] = run_dir
    steps = [m for m in read_metrics(runs["a"]) if "actor/pg_loss" in m]
    assert len(steps) == 3
    for m in steps:
        assert m["training/rollout_probs_diff_mean"] < PROB_DIFF_MEAN, m
        assert m["training/rollout_probs_diff_max"] < PROB_DIFF_MAX, m
        assert "training/rollout_probs_diff_std" in m
    print(
        "vLLM-CPU GRPO, |p - p'| mean/max per step:",
        [f"{m['training/rollout_probs_diff_mean']:.1e}/{m['training/rollout_probs_diff_max']:.1e}" for m in steps],
    )
    first = rollouts(runs["a"] / "rollouts", 1)
    assert len(first) == 16 and len({response for _, response in first}) > 1
    assert rollouts(runs["b"] / "rollouts", 1) == first  # same data.seed: the same prompts and the same tokens
