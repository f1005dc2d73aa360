"""The update that computes its own old log-probs (actor_rollout_ref.actor.skip_on_policy_old_log_prob).

An update whose first optimizer step takes its own forward's log-probs, detached, as the old ones, and
whose later mini-batches take theirs from one forward without gradients before that step, must equal
the update after the separate old-log-prob pass: the same gradient of the last step and the same
parameters after it, the same metrics, and the same old log-probs and entropy handed back for the
driver's metrics, on 1 and 2 FSDP workers (one and several mini-batches, static and dynamic
micro-batches, shuffled, Ulysses sp 2). And the rule for when the pass can be skipped, key by key.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from helpers.fsdp_harness import (
    RecordingSGD,
    Scenario,
    make_batch,
    make_role,
    relative_error,
    scenario_dims,
    single_dims,
)
from helpers.world import spawned_world
from omegaconf import OmegaConf
from transformers import AutoConfig

from rlframe.algorithms.on_policy import SKIP_KEY, old_log_prob_pass_reason
from rlframe.protocol import DataProto
from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
from rlframe.workers.model_loading import ModelSpec, load_hf_model

NUM_SEQS = 8


def _one_step(sc: Scenario, model_path: str, shard: DataProto, on_policy: bool, groups, mesh) -> dict:
    """A fresh FSDP actor takes one step on `shard`, with or without the separate old-log-prob pass."""
    dp_group, sp_group = groups
    model = load_hf_model(ModelSpec(path=model_path, role="actor", dtype=torch.float32, use_remove_padding=True))
    model = wrap_fsdp(model, FSDPSpec("fsdp2", torch.float32, torch.float32, False, True), mesh, "cpu")
    optimizer = RecordingSGD(model, lr=0.5)
    sc = replace(sc, update_mode="on_policy" if on_policy else "decoupled")
    actor = make_role(sc, NUM_SEQS, model, optimizer, single_dims(sc, dp_group, sp_group))
    data = shard.select(deepcopy=True)
    if on_policy:
        data.pop(batch_keys=["old_log_probs"])
        metrics, stats = actor.update_policy(data)
    else:
        log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
        data.batch["old_log_probs"] = log_probs
        metrics, _ = actor.update_policy(data)
        stats = {"old_log_probs": log_probs, "entropys": entropy}
    params = {name: tensor.detach().clone() for name, tensor in full_params(model).items()}
    return {"metrics": metrics, "stats": stats, "grads": optimizer.grads, "params": params}


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter of an FSDP2 model, unsharded."""
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}


def _rank_steps(rank: int, sc: Scenario, model_path: str, data_path: str) -> dict:
    dims = scenario_dims(sc)
    shard = DataProto.load_from_disk(data_path).chunk(sc.dp)[dims.dp_rank]
    groups = dims.dp_group, dims.sp_group
    return {mode: _one_step(sc, model_path, shard, mode == "skip", groups, dims.fsdp_mesh) for mode in ("pass", "skip")}


def _run(sc: Scenario, model_path: str, data: DataProto, out_dir) -> list[dict]:
    data_path = os.path.join(out_dir, "data.pkl")
    data.save_to_disk(data_path)
    return spawned_world(sc.world).run(_rank_steps, sc, model_path, data_path)


SCENARIOS = {
    "1 worker": Scenario(world=1, micro_batch_size=3),
    "2 workers, dynamic micro-batches": Scenario(world=2, use_dynamic_bsz=True, max_token_len=24),
    "2 workers, sp 2": Scenario(world=2, sp=2, micro_batch_size=2),
    "2 workers, no entropy bonus, shuffle": Scenario(world=2, extra={"entropy_coeff": 0.0, "shuffle": True}),
    "1 worker, 4 mini-batches": Scenario(world=1, micro_batch_size=1, mini_batch_size=2),
    "2 workers, 2 mini-batches, dynamic, shuffle": Scenario(
        world=2, use_dynamic_bsz=True, max_token_len=24, mini_batch_size=4, extra={"shuffle": True}
    ),
    "2 workers, sp 2, 2 mini-batches": Scenario(world=2, sp=2, micro_batch_size=2, mini_batch_size=4),
}


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_on_policy_step_equals_the_step_after_an_old_log_prob_pass(tiny_model_path, tmp_path, name):
    sc = SCENARIOS[name]
    data = make_batch(AutoConfig.from_pretrained(tiny_model_path).vocab_size, NUM_SEQS)
    for rank, result in enumerate(_run(sc, tiny_model_path, data, tmp_path)):
        ref, skip = result["pass"], result["skip"]
        for key in ("params", "grads") if rank == 0 else ("params",):
            assert ref[key].keys() == skip[key].keys()
            for param, value in ref[key].items():
                assert relative_error(skip[key][param], value) <= 1e-6, (name, rank, key, param)
        for key in ("old_log_probs", "entropys"):  # what the driver's metrics read
            assert relative_error(skip["stats"][key], ref["stats"][key]) <= 1e-6, (name, rank, key)
        assert ref["metrics"].keys() == skip["metrics"].keys()
        for metric, values in ref["metrics"].items():
            assert skip["metrics"][metric] == pytest.approx(values, rel=1e-6, abs=1e-6), (name, rank, metric)


def test_an_update_of_several_epochs_does_not_compute_its_own_old_log_probs(tiny_model_path):
    sc = Scenario(world=1, strategy="none", update_mode="on_policy", extra={"ppo_epochs": 2})
    model = load_hf_model(ModelSpec(path=tiny_model_path, role="actor", dtype=torch.float32, use_remove_padding=True))
    with pytest.raises(ValueError, match="computes its own old log-probs takes one epoch: ppo_epochs=2"):
        make_role(sc, NUM_SEQS, model, RecordingSGD(model))


def _reason(cfg) -> str | None:
    return old_log_prob_pass_reason(cfg.actor_rollout_ref.actor, cfg.algorithm)


def _cfg(**overrides):
    """The keys the rule reads, at a GRPO run's values that let the update compute the old log-probs."""
    actor = {
        "skip_on_policy_old_log_prob": True,
        "ppo_epochs": 1,
        "ppo_mini_batch_size": 4,
        "policy_loss": {"loss_mode": "vanilla"},
    }
    cfg = OmegaConf.create(
        {
            "data": {"train_batch_size": 4},
            "actor_rollout_ref": {"actor": actor},
            "algorithm": {
                "use_kl_in_reward": False,
                "adv_estimator": "grpo",
                "rollout_correction": {"bypass_mode": False, "rollout_is": None, "rollout_rs": None},
            },
        }
    )
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize(
    "key, value, reason",
    [
        (SKIP_KEY, False, "skip_on_policy_old_log_prob=false"),
        ("algorithm.rollout_correction.bypass_mode", True, "the old log-probs are the rollout's"),
        ("actor_rollout_ref.actor.ppo_epochs", 2, "ppo_epochs=2"),
        ("algorithm.use_kl_in_reward", True, "KL penalty"),
        ("algorithm.adv_estimator", "optimal_token_baseline", "optimal_token_baseline"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "clip_cov", "loss_mode=clip_cov"),
        ("algorithm.rollout_correction.rollout_is", "token", "rollout_is=token"),
        ("algorithm.rollout_correction.rollout_rs", "token_k1", "rollout_rs=token_k1"),
    ],
)
def test_what_needs_the_old_log_probs_before_the_update_keeps_the_pass(key, value, reason):
    assert _reason(_cfg()) is None
    assert reason in _reason(_cfg(**{key: value}))


def test_several_mini_batches_of_one_epoch_skip_the_pass():
    assert _reason(_cfg(**{"data.train_batch_size": 16})) is None  # 4 optimizer steps
