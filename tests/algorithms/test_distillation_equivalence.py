"""The distillation term in the actor's loss is exact under micro-batching, remove-padding, DP and SP
(docs/architecture.md, invariant 1).

The batch carries the teacher's log-probs of the response tokens; the actor adds the distillation term of
`rlframe.algorithms.distillation` (checked against verl 0.9.1's functions in test_distillation_losses.py) to its
PPO loss. Against a single-process, unsharded, padded, one-micro-batch reference on the same batch, log-probs,
losses (`actor/distillation/loss` included) and the full gradient agree to 1e-5 relative.
"""

from dataclasses import replace

import pytest
import torch
from helpers.equivalence import NUM_SEQS, assert_matches
from helpers.fsdp_harness import Scenario, make_batch, relative_error, run_distributed, run_scenario
from transformers import AutoConfig

SUPERVISED_K3 = {"loss_mode": "k3", "distillation_loss_coef": 0.5}
PG_K1 = {"loss_mode": "k1", "use_policy_gradient": True, "loss_max_clamp": 1.0, "clip_ratio_high": 0.28}
ALONE_K2 = {"loss_mode": "k2", "use_task_rewards": False}
TOPK = {"loss_mode": "forward_kl_topk", "topk": 4, "log_prob_min_clamp": -6.0, "loss_max_clamp": 3.0}
SETTINGS = {
    "supervised_k3": SUPERVISED_K3,
    "policy_gradient_k1_clamped": PG_K1,
    "k2_without_task_loss": ALONE_K2,
    "topk_forward_kl": TOPK,
}


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    """The harness batch with a teacher's log-probs, and its top-k log-probs and ids: a random distribution over
    the vocabulary per response position."""
    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    out = make_batch(vocab, NUM_SEQS)
    g = torch.Generator().manual_seed(11)
    out.batch["teacher_log_probs"] = -4.0 + 1.5 * torch.randn(out.batch["old_log_probs"].shape, generator=g)
    teacher = torch.log_softmax(3 * torch.randn(*out.batch["old_log_probs"].shape, vocab, generator=g), dim=-1)
    top = teacher.topk(TOPK["topk"], dim=-1)
    out.batch["teacher_topk_log_probs"], out.batch["teacher_topk_ids"] = top.values, top.indices
    return out


def reference_of(model_path, batch, settings, loss_agg_mode="token-mean"):
    sc = Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS, loss_agg_mode=loss_agg_mode)
    return run_scenario(replace(sc, distillation=settings), model_path, batch)


@pytest.fixture(scope="module")
def references(tiny_model_path, batch):
    return {name: reference_of(tiny_model_path, batch, settings) for name, settings in SETTINGS.items()}


def test_the_distillation_term_changes_the_gradient(tiny_model_path, batch, references):
    without = run_scenario(
        Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS), tiny_model_path, batch
    )
    for name, reference in references.items():
        assert "actor/distillation/loss" in reference["metrics"], name
        worst = max(relative_error(grad, reference["grads"][key]) for key, grad in without["grads"].items())
        assert worst > 1e-3, name


SINGLE_PROCESS = {
    "micro_1": Scenario(strategy="none", use_remove_padding=False, micro_batch_size=1),
    "remove_padding_micro_3": Scenario(strategy="none", use_remove_padding=True, micro_batch_size=3),
    "dynamic_budget_24": Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=24),
    "two_mini_batches": Scenario(strategy="none", micro_batch_size=2, mini_batch_size=NUM_SEQS // 2),
}


@pytest.mark.parametrize("knob", list(SINGLE_PROCESS))
@pytest.mark.parametrize("settings", list(SETTINGS))
def test_distillation_is_exact_under_micro_batching(tiny_model_path, batch, references, settings, knob):
    sc = replace(SINGLE_PROCESS[knob], distillation=SETTINGS[settings])
    if knob == "two_mini_batches":  # two optimizer steps: its own reference, cut into the same mini-batches
        reference = run_scenario(
            replace(sc, use_remove_padding=False, micro_batch_size=NUM_SEQS // 2), tiny_model_path, batch
        )
    else:
        reference = references[settings]
    assert_matches(run_scenario(sc, tiny_model_path, batch), reference)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_distillation_is_exact_for_sequence_aggregations(tiny_model_path, batch, mode):
    reference = reference_of(tiny_model_path, batch, SUPERVISED_K3, mode)
    sc = Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=24, loss_agg_mode=mode)
    assert_matches(run_scenario(replace(sc, distillation=SUPERVISED_K3), tiny_model_path, batch), reference)


DISTRIBUTED = {
    "dp2_fsdp2_dynamic": Scenario(world=2, use_dynamic_bsz=True, max_token_len=24),
    "sp2_dp2_dynamic": Scenario(world=4, sp=2, use_dynamic_bsz=True, max_token_len=16),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DISTRIBUTED))
@pytest.mark.parametrize("settings", ["supervised_k3", "policy_gradient_k1_clamped", "topk_forward_kl"])
def test_distributed_distillation_matches_single_process(tiny_model_path, batch, references, tmp_path, name, settings):
    sc = replace(DISTRIBUTED[name], distillation=SETTINGS[settings])
    result = run_distributed(sc, tiny_model_path, batch, str(tmp_path))
    assert_matches(result, references[settings])
    for metrics in result["all_metrics"]:  # every rank reports the same (globally reduced) term
        assert metrics["actor/distillation/loss"] == result["metrics"]["actor/distillation/loss"]


def test_policy_gradient_distillation_in_an_on_policy_update_is_exact(tiny_model_path, batch):
    """An on-policy update takes π_old from its own forward: the distillation surrogate uses it too."""
    sc = Scenario(strategy="none", update_mode="on_policy", distillation=PG_K1)
    reference = run_scenario(replace(sc, use_remove_padding=False, micro_batch_size=NUM_SEQS), tiny_model_path, batch)
    assert_matches(run_scenario(replace(sc, use_dynamic_bsz=True, max_token_len=24), tiny_model_path, batch), reference)


def test_the_top_k_term_is_the_top_k_forward_kl_of_the_models_logits(tiny_model_path, batch, references):
    """The reference's top-k term equals `topk_forward_kl` on a plain forward's logits of the response tokens."""
    from transformers import AutoModelForCausalLM

    from rlframe.algorithms.distillation import topk_forward_kl

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    tensors = batch.batch
    length = tensors["responses"].shape[-1]
    with torch.no_grad():
        logits = model(
            input_ids=tensors["input_ids"],
            attention_mask=tensors["attention_mask"],
            position_ids=tensors["position_ids"],
            use_cache=False,
        ).logits[:, -length - 1 : -1]
    losses = topk_forward_kl(logits, tensors["teacher_topk_log_probs"], tensors["teacher_topk_ids"], -6.0)["losses"]
    mask = tensors["attention_mask"][:, -length:].bool()
    expected = losses.clamp(-3.0, 3.0)[mask].sum() / mask.sum()  # token-mean
    (got,) = references["topk_forward_kl"]["metrics"]["actor/distillation/loss"]
    assert got == pytest.approx(float(expected), rel=1e-5)
