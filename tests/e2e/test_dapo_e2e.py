"""End to end on CPU: DAPO (dynamic sampling, dapo reward manager) and rollout correction train on the built-in task
(in this process, on one Ray the module starts)."""

import pytest
from helpers.runs import COMMON, read_metrics, run_in_process

pytestmark = pytest.mark.slow

DAPO = [
    "data.gen_batch_size=6",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=seq_reward",
    "reward_model.reward_manager=dapo",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True",
    "+reward_model.reward_kwargs.max_resp_len=8",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
]


def test_dapo_with_decoupled_rollout_correction_trains(module_ray, tmp_path):
    run_in_process(
        COMMON
        + DAPO
        + [
            f"trainer.default_local_dir={tmp_path}",
            "trainer.total_training_steps=3",
            "algorithm.rollout_correction.rollout_is=sequence",
            "algorithm.rollout_correction.rollout_is_batch_normalize=true",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
        ]
    )
    steps = read_metrics(tmp_path)
    assert [m["training/global_step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["train/num_gen_batches"] >= 1
        assert m["train/filter_groups/kept_prompts"] >= 4  # data.train_batch_size
        assert m["train/filter_groups/generated_prompts"] == 6 * m["train/num_gen_batches"]
        assert "reward/overlong_reward/mean" in m
        assert m["rollout_corr/rollout_is_batch_norm_factor"] > 0
        assert 0 <= m["rollout_corr/rollout_rs_masked_fraction"] <= 1
        assert abs(m["actor/pg_loss"]) < float("inf")


def test_bypass_mode_reinforce_trains(module_ray, tmp_path):
    run_in_process(
        COMMON
        + [
            f"trainer.default_local_dir={tmp_path}",
            "trainer.total_training_steps=2",
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.loss_type=reinforce",
            "algorithm.rollout_correction.rollout_is=sequence",  # as verl's run_with_rollout_corr.sh
            "algorithm.rollout_correction.rollout_is_batch_normalize=true",
            "algorithm.rollout_correction.rollout_rs=seq_max_k2",
            "algorithm.rollout_correction.rollout_rs_threshold=2.5",
        ]
    )
    steps = read_metrics(tmp_path)
    assert len(steps) == 2
    for m in steps:
        assert "timing_s/old_log_prob" not in m  # π_old is the rollout's: no old-log-prob pass
        assert "rollout_corr/kl" in m and "rollout_corr/rollout_is_mean" in m
        assert abs(m["actor/pg_loss"]) < float("inf")
