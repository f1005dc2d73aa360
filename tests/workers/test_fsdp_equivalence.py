"""Parallel knobs do not change the math (docs/architecture.md, invariant 1).

Against a single-process, unsharded, padded, one-micro-batch reference on the same batch, the
actor's log-probs, entropy, losses and the full gradient of one optimizer step agree to 1e-5
relative (‖a − b‖ / ‖b‖ per tensor, per parameter), for every knob.
"""

import pytest
import torch
from helpers.equivalence import NUM_SEQS, assert_matches
from helpers.fsdp_harness import Scenario, make_batch, relative_error, run_distributed, run_scenario
from transformers import AutoConfig

from rlframe.algorithms.loss import LOSS_AGG_MODES


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    return make_batch(AutoConfig.from_pretrained(tiny_model_path).vocab_size, NUM_SEQS)


@pytest.fixture(scope="module")
def reference(tiny_model_path, batch):
    return _reference(tiny_model_path, batch, "actor", "token-mean")


def _reference(model_path, batch, role, loss_agg_mode, loss_mode="vanilla"):
    sc = Scenario(
        strategy="none",
        use_remove_padding=False,
        micro_batch_size=NUM_SEQS,
        role=role,
        loss_agg_mode=loss_agg_mode,
        loss_mode=loss_mode,
    )
    return run_scenario(sc, model_path, batch)


# ---------------------------------------------------------------- single process, no spawn
@pytest.mark.parametrize("micro", [1, 2, 3, NUM_SEQS])
def test_static_micro_batch_size_does_not_change_update(tiny_model_path, batch, reference, micro):
    sc = Scenario(strategy="none", use_remove_padding=False, micro_batch_size=micro)
    assert_matches(run_scenario(sc, tiny_model_path, batch), reference)


def test_remove_padding_matches_padded(tiny_model_path, batch, reference):
    sc = Scenario(strategy="none", use_remove_padding=True, micro_batch_size=3)
    assert_matches(run_scenario(sc, tiny_model_path, batch), reference)


@pytest.mark.parametrize("budget", [16, 40, 1000])
def test_dynamic_micro_batching_matches_reference(tiny_model_path, batch, reference, budget):
    sc = Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=budget)
    assert_matches(run_scenario(sc, tiny_model_path, batch), reference)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_agg_mode_is_exact_under_micro_batching(tiny_model_path, batch, mode):
    ref = _reference(tiny_model_path, batch, "actor", mode)
    sc = Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=24, loss_agg_mode=mode)
    assert_matches(run_scenario(sc, tiny_model_path, batch), ref)


# clip_cov / kl_cov choose tokens by a covariance over the whole mini-batch, geo_mean averages
# per-sequence losses: each is exact only because the worker takes those statistics mini-batch-wide
NEW_LOSS_MODES = ["cispo", "gpg", "dro", "sapo", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov", "kl_cov"]


@pytest.mark.parametrize("loss_mode", NEW_LOSS_MODES)
def test_every_policy_loss_is_exact_under_micro_batching(tiny_model_path, batch, loss_mode):
    agg = "seq-mean-token-mean" if loss_mode == "geo_mean" else "token-mean"
    ref = _reference(tiny_model_path, batch, "actor", agg, loss_mode)
    sc = Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=24, loss_agg_mode=agg, loss_mode=loss_mode)
    assert_matches(run_scenario(sc, tiny_model_path, batch), ref)


def test_critic_micro_batching_matches_reference(tiny_model_path, batch):
    ref = _reference(tiny_model_path, batch, "critic", "token-mean")
    sc = Scenario(strategy="none", role="critic", micro_batch_size=3)
    assert_matches(run_scenario(sc, tiny_model_path, batch), ref)


# ---------------------------------------------------------------- multi-process (gloo + FSDP)
DISTRIBUTED = {
    "dp2_fsdp2_static": Scenario(world=2, micro_batch_size=2),
    "dp2_fsdp2_dynamic_prefetch": Scenario(world=2, use_dynamic_bsz=True, max_token_len=24, forward_prefetch=True),
    "dp2_fsdp1_prefetch": Scenario(world=2, strategy="fsdp", micro_batch_size=3, forward_prefetch=True),
    "dp2_padded": Scenario(world=2, use_remove_padding=False, micro_batch_size=4),
    "dp4": Scenario(world=4, micro_batch_size=1),
    "dp4_hsdp_fsdp2": Scenario(world=4, fsdp_size=2, micro_batch_size=2),
    "dp4_hsdp_fsdp1": Scenario(world=4, fsdp_size=2, strategy="fsdp", micro_batch_size=2),
    "dp2_offload_grad_ckpt": Scenario(world=2, micro_batch_size=2, param_offload=True, gradient_checkpointing=True),
    "dp2_fsdp1_offload": Scenario(world=2, strategy="fsdp", micro_batch_size=4, param_offload=True),
    "sp2_dp1": Scenario(world=2, sp=2, micro_batch_size=3),
    "sp2_dp2_dynamic": Scenario(world=4, sp=2, use_dynamic_bsz=True, max_token_len=16),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_distributed_actor_matches_single_process(tiny_model_path, batch, reference, tmp_path, name):
    result = run_distributed(DISTRIBUTED[name], tiny_model_path, batch, str(tmp_path))
    assert_matches(result, reference)
    # every rank reports the same (globally reduced) losses
    for metrics in result["all_metrics"]:
        assert metrics["actor/pg_loss"] == result["metrics"]["actor/pg_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_multi_turn_masks_with_holes_are_exact_under_every_knob(tiny_model_path, tmp_path, mode):
    """Tool turns leave holes in response_mask (attended, not trained): remove-padding, static and dynamic
    micro-batches, DP and Ulysses SP still reproduce the single-process reference on such trajectories."""
    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    trajectories = make_batch(vocab, NUM_SEQS, seed=2, holes=True)
    holes = trajectories.batch["attention_mask"][:, -trajectories.batch["responses"].shape[1] :]
    assert (holes - trajectories.batch["response_mask"]).sum() > NUM_SEQS  # real holes, in most rows
    ref = _reference(tiny_model_path, trajectories, "actor", mode)
    without = _reference(tiny_model_path, make_batch(vocab, NUM_SEQS, seed=2), "actor", mode)["grads"]
    assert max(relative_error(grad, ref["grads"][name]) for name, grad in without.items()) > 1e-3  # holes matter
    for sc in (
        Scenario(strategy="none", use_remove_padding=True, micro_batch_size=3, loss_agg_mode=mode),
        Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=16, loss_agg_mode=mode),
    ):
        assert_matches(run_scenario(sc, tiny_model_path, trajectories), ref)
    sc = Scenario(world=4, sp=2, use_dynamic_bsz=True, max_token_len=16, loss_agg_mode=mode)
    assert_matches(run_distributed(sc, tiny_model_path, trajectories, str(tmp_path)), ref)


@pytest.mark.slow
def test_skewed_lengths_per_rank_dynamic_bsz_finishes_and_matches(tiny_model_path, tmp_path):
    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    skewed = make_batch(vocab, NUM_SEQS, seed=1, skew=True)
    ref = _reference(tiny_model_path, skewed, "actor", "token-mean")
    sc = Scenario(world=2, use_dynamic_bsz=True, max_token_len=16)
    assert_matches(run_distributed(sc, tiny_model_path, skewed, str(tmp_path)), ref)


@pytest.mark.slow
def test_distributed_critic_matches_single_process(tiny_model_path, batch, tmp_path):
    ref = _reference(tiny_model_path, batch, "critic", "token-mean")
    sc = Scenario(world=2, sp=2, role="critic", use_dynamic_bsz=True, max_token_len=20)
    assert_matches(run_distributed(sc, tiny_model_path, batch, str(tmp_path)), ref)


@pytest.mark.slow
def test_several_mini_batches_and_epochs_match_across_dp(tiny_model_path, batch, tmp_path):
    # 2 mini-batches of 4 sequences × 2 epochs = 4 optimizer steps. DP rank r holds rows 4r..4r+3 and
    # cuts them into minis of 2, so global mini k is rows {2k, 2k+1, 4+2k, 4+2k+1}: the reference
    # sees the batch in that order, so its contiguous minis are the same sets.
    order = [0, 1, 4, 5, 2, 3, 6, 7]
    epochs = {"ppo_epochs": 2}
    ref = run_scenario(
        Scenario(strategy="none", use_remove_padding=False, micro_batch_size=4, mini_batch_size=4, extra=epochs),
        tiny_model_path,
        batch.select_idxs(order),
    )
    inverse = torch.argsort(torch.tensor(order))
    ref["outputs"] = {name: out[inverse] for name, out in ref["outputs"].items()}
    sc = Scenario(world=2, micro_batch_size=1, mini_batch_size=4, extra=epochs)
    result = run_distributed(sc, tiny_model_path, batch, str(tmp_path))
    assert len(result["metrics"]["actor/pg_loss"]) == 4
    assert_matches(result, ref)  # the gradient compared is the last (4th) step's


@pytest.mark.slow
@pytest.mark.parametrize("loss_mode", ["clip_cov", "kl_cov"])
def test_batch_statistic_losses_match_across_dp_and_sp(tiny_model_path, batch, tmp_path, loss_mode):
    # the token choice (clip_cov, kl_cov) is made over the mini-batch gathered from both DP ranks
    ref = _reference(tiny_model_path, batch, "actor", "token-sum", loss_mode)
    sc = Scenario(world=4, sp=2, use_dynamic_bsz=True, max_token_len=16, loss_agg_mode="token-sum", loss_mode=loss_mode)
    assert_matches(run_distributed(sc, tiny_model_path, batch, str(tmp_path)), ref)


@pytest.mark.slow
def test_reshard_after_forward_false_changes_no_bit_and_gathers_less(tiny_model_path, batch, tmp_path):
    # fsdp_config.reshard_after_forward=false keeps the gathered parameters through an optimizer step's
    # micro-batches (PPOUpdater); 2 optimizer steps of 2 micro-batches per rank: the second step's
    # gradient is exact only if the first step's parameters were resharded before the optimizer stepped
    runs = {}
    for reshard in (True, False):
        out_dir = tmp_path / f"reshard_{reshard}"
        out_dir.mkdir()
        sc = Scenario(world=2, micro_batch_size=1, mini_batch_size=4, reshard_after_forward=reshard)
        runs[reshard] = run_distributed(sc, tiny_model_path, batch, str(out_dir))
    freed, kept = runs[True], runs[False]
    assert len(kept["metrics"]["actor/pg_loss"]) == 2
    assert kept["metrics"] == freed["metrics"]
    for name, tensor in freed["outputs"].items():
        assert torch.equal(kept["outputs"][name], tensor), name
    assert kept["grads"].keys() == freed["grads"].keys()
    for name, grad in freed["grads"].items():
        assert torch.equal(kept["grads"][name], grad), name
    assert kept["update_all_gathers"] < freed["update_all_gathers"] / 2, (kept, freed)
