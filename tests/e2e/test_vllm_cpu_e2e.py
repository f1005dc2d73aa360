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


def test_grpo_with_the_vllm_rollout_syncs_every_step_and_a_distillation_rerun_samples_the_same(tmp_path, cache_dir):
    """Run a: GRPO, 3 steps; vLLM's probabilities stay the actor's after every weight sync. Run b, the same data.seed
    with distillation.enabled=true and the rollout still vLLM: its first step samples the same prompts and tokens as
    run a's (nothing has been updated yet), and the teacher pass runs on vLLM's samples. The teacher is the student's
    own checkpoint, so before the first update its log-probs are the actor's, bit for bit: the first step's k3 term
    is exactly 0 (temperature 1)."""
    distill = [
        "distillation.enabled=true",
        "distillation.teacher_models.teacher_model.model_path=builtin://smollm2-135m-instruct",
    ]
    runs = {}
    for name, steps, extra in (("a", 3, []), ("b", 2, distill)):
        run_dir = tmp_path / name
        out = run_main(
            JOB
            + extra
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
    distilled = [m for m in read_metrics(runs["b"]) if "actor/pg_loss" in m]
    assert len(distilled) == 2
    assert distilled[0]["actor/distillation/loss"] == 0.0
    for m in distilled:
        assert m["actor/distillation/abs_loss"] >= 0 and m["timing_s/teacher"] > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_separate_async_with_vllm_on_the_rollout_pool_cuts_continues_and_trains_each_prompt_once(
    tmp_path, cache_dir, tp
):
    """trainer.v1.trainer_mode=separate_async with rollout.name=vllm: `tp` training processes, one rollout replica
    whose vLLM engine takes the pushed weights each step (`tp` 2: a TP group of two processes, its rollout server's
    peers stepping with TP rank 0). η = 1 with partial rollout; short add_digits prompts keep the training step to
    seconds, and decoding is slowed to ~0.45 s an engine step (`rollout.decode`) so that each push finds the next
    batch generating: its rows are cut (the engine's requests aborted on every TP rank at the same step) and
    continued on the new weights. No trained token is older than η, cut rows span two versions, every prompt is
    trained exactly once. TP 2 runs SmolLM2's head size with heads that split over two ranks (SmolLM2's 9 do not):
    a random model, whose rows run to their budget."""
    from collections import Counter

    from helpers.gpu_models import tp2_stand_in

    run_dir = tmp_path / "async"
    dumps = run_dir / "rollouts"
    short = {
        "data.train_files": "builtin://add_digits",
        "data.val_files": "builtin://add_digits",
        "data.max_prompt_length": "64",
        f"{ROLLOUT}.max_model_len": "96",
        "trainer.n_gpus_per_node": str(tp),  # the training processes keep an engine of the same TP for validation
    }
    if tp == 2:
        short["actor_rollout_ref.model.path"] = tp2_stand_in(str(tmp_path / "model"))
    job = [o for o in JOB if o.split("=")[0] not in short] + [f"{k}={v}" for k, v in short.items()]
    out = run_main(
        job
        + [
            "trainer.v1.trainer_mode=separate_async",
            f"{ROLLOUT}.nnodes=1",
            f"{ROLLOUT}.n_gpus_per_node={tp}",
            f"{ROLLOUT}.tensor_model_parallel_size={tp}",
            "trainer.v1.sampler.max_off_policy_threshold=2",  # η = 1
            "trainer.v1.separate_async.parameter_sync_step=1",
            "algorithm.rollout_correction.rollout_is=token",
            "trainer.total_training_steps=3",
            f"trainer.default_local_dir={run_dir}",
            f"trainer.rollout_data_dir={dumps}",
        ],
        cache_dir,
        extra_env={"RLFRAME_DELAY_AT": "rollout.decode:5:0.4-0.5"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    steps = [m for m in read_metrics(run_dir) if "actor/pg_loss" in m]
    assert len(steps) == 3
    staleness = "training/off_policy/trajectory_staleness"
    assert max(m[f"{staleness}_worst/max"] for m in steps) <= 1
    assert sum(m["async/interrupted_samples"] for m in steps) > 0
    assert max(m["training/off_policy/trajectory_spans/max"] for m in steps) == 2
    trained = Counter()
    for step in (1, 2, 3):
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        counts = Counter(row["index"] for row in rows)
        assert len(counts) == 4 and set(counts.values()) == {4}  # 4 prompts of n = 4 samples
        trained.update(counts.keys())
    assert len(trained) == 12 and set(trained.values()) == {1}


def test_lora_on_the_rollout_pool_at_eta0_samples_the_sync_runs_tokens_with_the_adapter_served_by_vllm(
    tmp_path, cache_dir
):
    """A LoRA actor (rank 8) with vLLM on separate_async's rollout pool, η = 0: the pool's engine starts from dummy
    weights (load_format=dummy), gets the base weights at the first push and the adapter alone after every step, and
    samples exactly the tokens the synchronous LoRA run's colocated vLLM samples, with log-probs the actor's."""
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
    lora += ["actor_rollout_ref.actor.optim.lr=1e-3", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2"]
    pool = [
        "trainer.v1.trainer_mode=separate_async",
        f"{ROLLOUT}.nnodes=1",
        f"{ROLLOUT}.n_gpus_per_node=1",
        "trainer.v1.sampler.max_off_policy_threshold=1",  # η = 0
        "trainer.v1.separate_async.parameter_sync_step=1",
    ]
    runs = {}
    for name, mode in (("sync", []), ("pool", pool)):
        run_dir = tmp_path / name
        job = [o for o in JOB if not o.startswith("trainer.n_gpus_per_node=")]
        out = run_main(
            job
            + lora
            + mode
            + [f"trainer.default_local_dir={run_dir}", f"trainer.rollout_data_dir={run_dir / 'rollouts'}"],
            cache_dir,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        runs[name] = run_dir
    steps = [m for m in read_metrics(runs["pool"]) if "actor/pg_loss" in m]
    assert len(steps) == 2
    for m in steps:  # the pool's engine samples with the actor's weights: neither dummy ones nor the bare base
        assert m["training/rollout_probs_diff_mean"] < PROB_DIFF_MEAN, m
        assert m["training/rollout_probs_diff_max"] < PROB_DIFF_MAX, m
    for step in (1, 2):
        assert rollouts(runs["pool"] / "rollouts", step) == rollouts(runs["sync"] / "rollouts", step)
