"""Every policy loss, advantage estimator and straight-through KL type trains end to end with verl's
names as overrides: one short CPU GRPO run each (1 step, the tiny model, `run_ppo` in this process),
all in one Ray the module starts once. Each run pairs a loss with an estimator to keep the cost low."""

import math

import pytest
from helpers.runs import run_in_process
from helpers.small_config import SMALL

pytestmark = pytest.mark.slow

COMMON = [
    *SMALL,
    "trainer.logger=[jsonl]",
    "trainer.val_before_train=false",
    "trainer.resume_mode=disable",
    "trainer.total_training_steps=1",
    "trainer.n_gpus_per_node=1",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",  # several micro-batches per mini-batch
    "data.max_response_length=8",
]
P = "actor_rollout_ref.actor"
RUNS = {  # name -> overrides (loss, estimator, KL type, aggregation)
    "cispo+opo": [f"{P}.policy_loss.loss_mode=cispo", "algorithm.adv_estimator=opo"],
    "gpg+gpg": [f"{P}.policy_loss.loss_mode=gpg", "algorithm.adv_estimator=gpg"],
    "dro+grpo_passk": [
        f"{P}.policy_loss.loss_mode=dro",
        f"{P}.policy_loss.dro_beta=0.1",
        "algorithm.adv_estimator=grpo_passk",
    ],
    "sapo+optimal_token_baseline": [
        f"{P}.policy_loss.loss_mode=sapo",
        "algorithm.adv_estimator=optimal_token_baseline",
        f"{P}.calculate_sum_pi_squared=true",
    ],
    "dppo_tv+grpo_vectorized+k3+": [
        f"{P}.policy_loss.loss_mode=dppo_tv",
        "algorithm.adv_estimator=grpo_vectorized",
        f"{P}.use_kl_loss=true",
        f"{P}.kl_loss_type=k3+",
    ],
    "dppo_kl+rloo_vectorized+kl_in_reward_low_var_kl+": [
        f"{P}.policy_loss.loss_mode=dppo_kl",
        "algorithm.adv_estimator=rloo_vectorized",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=low_var_kl+",
    ],
    "geo_mean": [f"{P}.policy_loss.loss_mode=geo_mean"],
    "clip_cov": [f"{P}.policy_loss.loss_mode=clip_cov", f"{P}.policy_loss.clip_cov_ratio=0.05"],
    "kl_cov+token-sum": [f"{P}.policy_loss.loss_mode=kl_cov", f"{P}.loss_agg_mode=token-sum"],
    "bypass_mode+tir_optimal_token_baseline": [
        f"{P}.policy_loss.loss_mode=bypass_mode",
        "algorithm.adv_estimator=tir_optimal_token_baseline",
        f"{P}.calculate_sum_pi_squared=true",
    ],
    "gdpo": [
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[score,acc]",  # the built-in task's scorer returns both
        "algorithm.gdpo_reward_weights=[1.0,0.5]",
    ],
    "gae+pf_ppo_pow": ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true", "critic.ppo_mini_batch_size=2"],
    # ReMax generates a greedy baseline per prompt (its own generate pass, timed as gen_max)
    "remax": ["algorithm.adv_estimator=remax"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
}

EXPECTED_METRICS = {  # what a run must log besides the loss
    "bypass_mode+tir_optimal_token_baseline": ["rollout_corr/rollout_is_mean", "rollout_corr/kl"],
    "gdpo": [f"gdpo/{key}/{stat}" for key in ("score", "acc") for stat in ("mean", "std", "max", "min")],
}


@pytest.mark.parametrize("name", list(RUNS))
def test_trains_one_step(name, module_ray, tmp_path):
    metrics = run_in_process([*COMMON, *RUNS[name], f"trainer.default_local_dir={tmp_path}"])
    # finite (a random policy's groups often score alike, so the gradient may be 0)
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
    expected = EXPECTED_METRICS.get(name, ())
    assert set(expected) <= set(metrics), sorted(set(expected) - set(metrics))
    assert ("timing_s/gen_max" in metrics) == (name == "remax")  # only ReMax's baseline pass
