"""Refactors keep the numbers: fixed-seed runs give bitwise the metrics recorded in tests/assets/golden/.

Three short runs through `python -m rlframe.trainer.main_ppo` on the tiny model cover the update paths
(GRPO with Ulysses sp=2, dynamic micro-batches, KL and entropy losses, the update that computes its own
old log-probs; PPO with a critic, two epochs, padded layout, fused head, clip_cov; bypass
rollout correction, a reference model and a reward-model worker is elsewhere). Every logged number except
clocks and throughput must equal the recording exactly: a change that moves any of them changed the math.

The recordings hold on any x86-64 machine, Intel or AMD (2 CPU threads per worker, torch 2.13.0 CPU): the runs pin
ATen's kernels to their baseline build, MKL to its vendor-neutral code path and oneDNN to SSE4.1 (`ISA_PINNED`),
because the default paths follow the CPU and the last float bits with them: a machine with AVX-512 FP16 gave losses
1e-6 apart from one without, and with the AVX2 pins an AMD EPYC still gave losses 2e-8 apart from the Intel machine
that recorded them (MKL's AVX2 path is Intel's; `MKL_CBWR=COMPATIBLE` is the one MKL documents as the same on
every x86 vendor).
After a deliberate change of the numbers, record again with
`RLFRAME_RECORD_GOLDEN=1 pytest tests/e2e/test_golden_run.py` and say why in the commit.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers.runs import read_metrics, run_main
from helpers.small_config import SMALL

pytestmark = pytest.mark.slow

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "golden")
RECORD = os.environ.get("RLFRAME_RECORD_GOLDEN") == "1"

COMMON = [
    *SMALL,
    "actor_rollout_ref.actor.optim.lr=3e-3",
    "trainer.logger=[jsonl]",
    "trainer.val_before_train=false",
    "trainer.resume_mode=disable",
    "trainer.total_training_steps=3",
    "trainer.test_freq=2",
    "trainer.n_gpus_per_node=2",
]

RUNS = {
    "grpo_sp2_dynamic_kl": [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    ],
    "ppo_critic_two_epochs_clip_cov": [
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.shuffle=true",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.use_fused_kernels=true",
        "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.05",
    ],
    "grpo_bypass_seq_is": [
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.rollout_is=sequence",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=k3+",
    ],
}

# the kernels' instruction set, the same on every x86-64 machine of the last decade (MKL's conditional numerical
# reproducibility; ATen's CPU dispatch; oneDNN's, for the ops that reach it)
ISA_PINNED = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}

# clocks, throughput and the host's memory: everything else is arithmetic on the seed
UNTIMED_PREFIXES = ("timing_", "perf/", "rollout/server_", "time", "memory/")


def numbers_of(run_dir: str) -> list[dict]:
    """Per logged line: every metric that is arithmetic, not a clock."""
    return [{k: v for k, v in line.items() if not k.startswith(UNTIMED_PREFIXES)} for line in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def pinned_cache(tmp_path_factory):
    """The runs' own RLFRAME_CACHE: the built-in tiny model is generated in the first run, under `ISA_PINNED`. Its
    random initialization follows the kernels' instruction set too (torch's vectorized normal_), so a model another
    test generated with the CPU's own kernels (AVX-512 here) would be another model."""
    return tmp_path_factory.mktemp("golden_cache")


@pytest.mark.parametrize("name", sorted(RUNS))
def test_fixed_seed_run_is_bitwise_the_recorded_one(name, tmp_path, pinned_cache):
    run_dir = tmp_path / "run"
    out = run_main([*COMMON, *RUNS[name], f"trainer.default_local_dir={run_dir}"], pinned_cache, extra_env=ISA_PINNED)
    assert out.returncode == 0, out.stderr[-4000:]
    got = numbers_of(str(run_dir))
    path = os.path.join(GOLDEN_DIR, f"{name}.json")
    if RECORD:
        os.makedirs(GOLDEN_DIR, exist_ok=True)
        with open(path, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
    with open(path) as f:
        expected = json.load(f)
    assert len(got) == len(expected)
    for step, (line, recorded) in enumerate(zip(got, expected)):
        assert sorted(line) == sorted(recorded), f"line {step}: metric names differ"
        differ = {k: (line[k], recorded[k]) for k in line if line[k] != recorded[k]}
        assert not differ, f"line {step}: {differ}"
