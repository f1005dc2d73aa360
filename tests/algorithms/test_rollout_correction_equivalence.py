"""Rollout correction in the actor is exact under micro-batching and DP/SP (docs/architecture.md, invariant 1).

Decoupled mode's IS weights arrive with the batch; bypass mode computes weights and rejection per
micro-batch against the policy being trained, and with batch normalization takes their mean over the
whole mini-batch first. Against a single-process, one-micro-batch reference, log-probs, losses and
the gradient agree to 1e-5 relative; the reference's loss is verl 0.9.1's on the same tensors.
"""

import importlib
from dataclasses import replace

import pytest
import torch
from helpers.equivalence import assert_matches
from helpers.fsdp_harness import Scenario, make_batch, run_distributed, run_scenario
from helpers.verl_reference import verl_actor_config, verl_core_algos
from transformers import AutoConfig

from rlframe.algorithms import rollout_correction as rc

NUM_SEQS = 8
BYPASS_REINFORCE = {
    "rollout_is": "sequence",
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": True,
    "rollout_rs": "token_k1",
    "rollout_rs_threshold": "0.5_2.0",
    "bypass_mode": True,
    "loss_type": "reinforce",
}
BYPASS_PPO_CLIP = {
    **BYPASS_REINFORCE,
    "loss_type": "ppo_clip",
    "rollout_rs": "seq_mean_k3",
    "rollout_rs_threshold": 0.5,
}


# decoupled mode with IS weights: the driver's weights arrive with the batch
DECOUPLED_IS = {"rollout_is": "token"}


def corrected(sc, cfg):
    """`sc` with the actor built for the rollout correction `cfg` (bypass mode when it says so)."""
    return replace(sc, update_mode="bypass" if cfg.get("bypass_mode") else "decoupled", correction=dict(cfg))


def with_correction(batch, weights=False):
    """The harness batch, with decoupled IS weights when asked."""
    out = batch.select(deepcopy=True)
    if weights:
        g = torch.Generator().manual_seed(7)
        out.batch["rollout_is_weights"] = torch.rand(out.batch["advantages"].shape, generator=g) * 2
    return out


@pytest.fixture(scope="module")
def vocab(tiny_model_path):
    return AutoConfig.from_pretrained(tiny_model_path).vocab_size


def reference(model_path, batch, cfg, loss_agg_mode="token-mean"):
    sc = Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS, loss_agg_mode=loss_agg_mode)
    return run_scenario(corrected(sc, cfg), model_path, batch)


@pytest.mark.parametrize("cfg", [BYPASS_REINFORCE, BYPASS_PPO_CLIP], ids=["reinforce", "ppo_clip"])
@pytest.mark.parametrize("micro", [1, 3])
def test_bypass_mode_is_exact_under_micro_batching(tiny_model_path, vocab, cfg, micro):
    batch = with_correction(make_batch(vocab, NUM_SEQS))
    ref = reference(tiny_model_path, batch, cfg)
    sc = Scenario(strategy="none", micro_batch_size=micro)
    assert_matches(run_scenario(corrected(sc, cfg), tiny_model_path, batch), ref)


def test_bypass_mode_dynamic_batches_are_exact(tiny_model_path, vocab):
    batch = with_correction(make_batch(vocab, NUM_SEQS))
    ref = reference(tiny_model_path, batch, BYPASS_REINFORCE)
    sc = Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=24)
    assert_matches(run_scenario(corrected(sc, BYPASS_REINFORCE), tiny_model_path, batch), ref)


def test_bypass_reinforce_reference_is_verls_loss(tiny_model_path, vocab):
    """The one-micro-batch loss equals verl's bypass-mode loss on the reference's log-probs (before the step)."""
    core = verl_core_algos()
    helper = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
    batch = with_correction(make_batch(vocab, NUM_SEQS))
    ref = reference(tiny_model_path, batch, BYPASS_REINFORCE)
    log_prob = ref["outputs"]["log_probs"]
    rollout = batch.batch["old_log_probs"]
    response_length = batch.batch["responses"].shape[-1]
    mask = batch.batch["attention_mask"][:, -response_length:].float()
    c = BYPASS_REINFORCE
    weights, new_mask, _ = helper.compute_rollout_correction_and_rejection_mask(
        log_prob, rollout, mask, c["rollout_is"], c["rollout_is_threshold"], True, c["rollout_rs"],
        c["rollout_rs_threshold"],
    )  # fmt: skip
    loss, _ = core.compute_policy_loss_reinforce(
        rollout,
        log_prob,
        batch.batch["advantages"],
        new_mask,
        "token-mean",
        verl_actor_config(loss_agg_mode="token-mean"),
        weights.batch["rollout_is_weights"],
    )
    # verl's token-mean divides by the rejected mask's tokens when called alone; the worker divides by
    # the mini-batch's tokens before rejection (verl's global batch_num_tokens): rescale to compare
    loss = loss * new_mask.sum() / mask.sum()
    assert ref["metrics"]["actor/pg_loss"][0] == pytest.approx(loss.item(), rel=1e-5)


def test_decoupled_weights_are_exact_under_micro_batching(tiny_model_path, vocab):
    batch = with_correction(make_batch(vocab, NUM_SEQS), weights=True)
    ref = reference(tiny_model_path, batch, DECOUPLED_IS)
    sc = Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=24)
    assert_matches(run_scenario(corrected(sc, DECOUPLED_IS), tiny_model_path, batch), ref)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sc",
    [Scenario(world=2, micro_batch_size=1), Scenario(world=4, sp=2, use_dynamic_bsz=True, max_token_len=16)],
    ids=["dp2", "sp2_dp2_dynamic"],
)
def test_bypass_batch_normalization_is_exact_across_dp_and_sp(tiny_model_path, vocab, tmp_path, sc):
    batch = with_correction(make_batch(vocab, NUM_SEQS))
    ref = reference(tiny_model_path, batch, BYPASS_REINFORCE)
    assert_matches(run_distributed(corrected(sc, BYPASS_REINFORCE), tiny_model_path, batch, str(tmp_path)), ref)


def test_the_normalizer_is_the_whole_mini_batch_mean():
    """A micro-batch's normalized weights use the mean over every micro-batch (not its own)."""
    g = torch.Generator().manual_seed(0)
    log_ratio, mask = 0.3 * torch.randn(6, 5, generator=g), torch.ones(6, 5)
    weights, _ = rc.is_weights(log_ratio, mask, "token", (2.0, None))
    total, count = rc.normalizer_sums(weights, mask, "token")
    first, _ = rc.normalize_weights(weights[:2], total, count)
    torch.testing.assert_close(first, weights[:2] / weights.mean())
