"""The actor's update decides its mode once, from the config, when it is built (rlframe.algorithms.update_mode).

Each of the three modes follows from the config sections the worker builds the actor from (and the driver
decides the same from the same sections); what a batch carries in `meta_info` changes nothing; a batch that
lacks a key its mode reads is refused with the key named, before any forward.
"""

from __future__ import annotations

import pytest
import torch
from helpers.fsdp_harness import Scenario, make_batch, role_for
from helpers.small_config import SMALL
from transformers import AutoConfig

from rlframe.algorithms.update_mode import ActorUpdate, UpdateMode, update_mode
from rlframe.trainer.config import compose, typed
from rlframe.workers.actor import PPOActor
from rlframe.workers.model_loading import ModelSpec, load_hf_model
from rlframe.workers.updater import RoleModel

NUM_SEQS = 8
MODES = {
    # GRPO, one epoch, nothing reads the old log-probs before the update: the update computes them
    UpdateMode.ON_POLICY: [],
    # the separate old-log-prob pass, and the driver's IS weights π_old/π_rollout with the batch
    UpdateMode.DECOUPLED: [
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0",
    ],
    # π_old := π_rollout; the loss corrects per micro-batch
    UpdateMode.BYPASS: [
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_rs='token_k1,seq_mean_k3'",
        "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0,0.1'",
    ],
}


def _update(overrides: list[str]) -> tuple[ActorUpdate, UpdateMode]:
    """(the worker's ActorUpdate, the driver's mode) of SMALL with `overrides`, at rollout temperature 0.7."""
    cfg = typed(compose([*SMALL, "actor_rollout_ref.rollout.temperature=0.7", *overrides]))
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    return ActorUpdate.from_config(actor, cfg.algorithm, rollout), update_mode(actor, cfg.algorithm)


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.value)
def test_the_mode_and_the_parsed_correction_come_from_the_config(mode):
    update, drivers = _update(MODES[mode])
    assert update.mode is mode and drivers is mode  # the driver and the actor agree without a flag in the data
    assert update.temperature == 0.7  # every log-prob is of logits / the rollout's temperature
    correction = update.correction
    if mode is UpdateMode.DECOUPLED:
        assert correction.rollout_is == "token" and correction.is_bounds == (2.0, 0.5)  # IcePop's [0.5, 2]
        assert update.applies_is_weights
    if mode is UpdateMode.BYPASS:
        assert correction.rs_bounds == {"token_k1": (0.5, 2.0), "seq_mean_k3": (None, 0.1)}  # parsed once
        assert not correction.needs_mini_batch_normalizer and not update.applies_is_weights


def test_decoupled_mode_without_correction_when_the_pass_is_kept():
    update, _ = _update(["actor_rollout_ref.actor.skip_on_policy_old_log_prob=false"])
    assert update.mode is UpdateMode.DECOUPLED and not update.applies_is_weights


def _actor(model_path: str, update: ActorUpdate) -> PPOActor:
    """A one-process actor of the harness's scenario, built with `update`."""
    config, plan, options = role_for(Scenario(strategy="none"), NUM_SEQS)
    model = load_hf_model(ModelSpec(path=model_path, role="actor", dtype=torch.float32, use_remove_padding=True))
    return PPOActor(RoleModel(model, options, torch.optim.SGD(model.parameters(), lr=0.1)), config, plan, update=update)


@pytest.mark.parametrize(
    "mode, dropped",
    [
        (UpdateMode.DECOUPLED, "rollout_is_weights"),
        (UpdateMode.DECOUPLED, "old_log_probs"),
        (UpdateMode.BYPASS, "old_log_probs"),
        (UpdateMode.ON_POLICY, "advantages"),
        (UpdateMode.ON_POLICY, "ref_log_prob"),  # the harness's actor has use_kl_loss=true
    ],
)
def test_a_batch_without_a_key_its_mode_reads_is_refused_by_name(tiny_model_path, mode, dropped):
    update, _ = _update(MODES[mode])
    actor = _actor(tiny_model_path, update)
    data = make_batch(AutoConfig.from_pretrained(tiny_model_path).vocab_size, NUM_SEQS)
    data.batch["rollout_is_weights"] = torch.ones_like(data.batch["advantages"])
    data.pop(batch_keys=[dropped])
    # what meta_info says is not read: the mode was fixed when the actor was built
    data.meta_info.update(on_policy=True, rollout_correction=None, temperature=5.0)
    with pytest.raises(ValueError, match=f"update in {mode.value} mode reads '{dropped}'"):
        actor.update_policy(data)


def test_the_on_policy_update_needs_no_old_log_probs_and_hands_them_back(tiny_model_path):
    update, _ = _update(MODES[UpdateMode.ON_POLICY])
    actor = _actor(tiny_model_path, update)
    data = make_batch(AutoConfig.from_pretrained(tiny_model_path).vocab_size, NUM_SEQS)
    data.pop(batch_keys=["old_log_probs"])
    metrics, stats = actor.update_policy(data)
    assert set(stats) == {"old_log_probs", "entropys"}
    assert stats["old_log_probs"].shape == data.batch["advantages"].shape
    assert metrics["actor/ppo_kl"] == [0.0]  # one mini-batch: its own forward's log-probs are the old ones
