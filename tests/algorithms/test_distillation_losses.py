"""The distillation losses (rlframe.algorithms.distillation) against verl 0.9.1's own functions on random inputs.

verl's `distillation_loss` (trainer/distillation/losses.py) takes the student's log-probs in its no-padding layout
(one row of every sequence's tokens); `verl_layout` writes rlframe's [bs, len] response tensors in that layout
(a one-token prompt per row), so both sides see the same numbers. Compared in fp64: the loss, its gradient with
respect to the student's log-probs (or logits), and the metrics both report.
"""

import pytest
import torch
from helpers.verl_reference import verl_actor_config, verl_distillation_losses
from tensordict import TensorDict

from rlframe.algorithms import distillation as distill
from rlframe.algorithms.loss import LOSS_AGG_MODES, Aggregation

SEEDS = [0, 1, 2]
BS, LENGTH, VOCAB, TOPK = 6, 7, 11, 4


def random_mask() -> torch.Tensor:
    """Row 1 has one token, row 2 holes, row 5 none."""
    mask = torch.ones(BS, LENGTH, dtype=torch.float64)
    mask[0, 5:] = 0
    mask[1, 1:] = 0
    mask[2, [1, 3]] = 0
    mask[3, 6:] = 0
    mask[5] = 0
    return mask


def random_log_probs(seed):
    """(student, teacher, old) log-probs [bs, len], spread so that the clamps and the PPO clip all act."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.rand(BS, LENGTH, generator=gen, dtype=torch.float64).clamp(1e-6, 0.98).log()
    teacher = (student + 3 * torch.randn(BS, LENGTH, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    old = (student + 0.3 * torch.randn(BS, LENGTH, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    return student.requires_grad_(), teacher, old


def response_lengths(mask: torch.Tensor) -> list[int]:
    """Each row's length up to its last valid token (verl's attention mask covers holes inside a response)."""
    return [int(row.nonzero().max()) + 1 if row.any() else 0 for row in mask]


def verl_layout(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[bs, len, *] response values as verl's no-padding model output: per row its tokens, then the prompt's slot.

    verl reads response token j of a row with a one-token prompt at the row's offset + j (the left shift of
    next-token outputs), so each row is its `length` values followed by one unused value.
    """
    rows = []
    for row, length in zip(values, lengths, strict=True):
        rows += [row[:length], torch.zeros_like(row[:1])]
    return torch.cat(rows)


def verl_data(mask: torch.Tensor, old: torch.Tensor, **tensors) -> TensorDict:
    lengths = response_lengths(mask)
    attention = torch.zeros(BS, 1 + LENGTH, dtype=torch.long)
    attention[:, 0] = 1
    for i, length in enumerate(lengths):
        attention[i, 1 : 1 + length] = 1
    data = {
        "prompts": torch.ones(BS, 1, dtype=torch.long),
        "responses": torch.ones(BS, LENGTH, dtype=torch.long),
        "attention_mask": attention,
        "response_mask": mask.bool(),
        "old_log_probs": old,
        "dp_size": torch.tensor(1),
        "batch_num_tokens": mask.sum(),
        "global_batch_size": torch.tensor(BS),
        **{name: verl_layout(value, lengths) for name, value in tensors.items()},
    }
    return TensorDict(data, batch_size=[])


def verl_distillation_config(**loss_fields):
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    loss = DistillationLossConfig(**loss_fields)
    return DistillationConfig(enabled=False, distillation_loss=loss)


def settings_of(loss_mode, use_policy_gradient, loss_max_clamp, log_prob_min_clamp=None):
    return distill.DistillationLoss(
        loss_mode=loss_mode,
        topk=TOPK,
        loss_max_clamp=loss_max_clamp,
        log_prob_min_clamp=log_prob_min_clamp,
        use_policy_gradient=use_policy_gradient,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )


def verl_loss_fields(settings: distill.DistillationLoss) -> dict:
    return {
        "loss_mode": settings.loss_mode,
        "topk": settings.topk,
        "loss_max_clamp": settings.loss_max_clamp,
        "log_prob_min_clamp": settings.log_prob_min_clamp,
        "use_policy_gradient": settings.use_policy_gradient,
        "clip_ratio_low": settings.clip_ratio_low,
        "clip_ratio_high": settings.clip_ratio_high,
    }


def ours(token_losses, student, old, mask, settings, agg_mode):
    agg = Aggregation(agg_mode, mask.sum(), torch.tensor(float(BS)))
    loss, metrics = distill.distillation_loss(token_losses, student, old, mask, settings, agg)
    return loss, metrics


def verls(settings, agg_mode, mask, old, model_output, **tensors):
    losses, _ = verl_distillation_losses()
    config = verl_actor_config(loss_agg_mode=agg_mode, clip_ratio_c=distill.DUAL_CLIP_RATIO_C)
    distillation_config = verl_distillation_config(**verl_loss_fields(settings))
    data = verl_data(mask, old, **tensors)
    lengths = response_lengths(mask)
    output = {name: verl_layout(value, lengths) for name, value in model_output.items()}
    return losses.distillation_loss(config, distillation_config, output, data)


def metric_value(metric) -> float:
    """A verl metric's value: a float, or a `Metric` holding one value."""
    values = getattr(metric, "values", [metric])
    assert len(values) == 1
    return float(values[0])


# verl refuses back-propagating k1 directly (its gradient ignores the teacher), and so does rlframe's config
ESTIMATOR_CASES = [
    (mode, pg) for mode in distill.ESTIMATOR_MODES for pg in (False, True) if pg or mode not in ("k1", "kl")
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("loss_mode", "use_policy_gradient"), ESTIMATOR_CASES)
def test_estimator_distillation_loss_matches_verl(loss_mode, use_policy_gradient, agg_mode, seed):
    student, teacher, old = random_log_probs(seed)
    mask = random_mask()
    for loss_max_clamp in (None, 2.0):
        settings = settings_of(loss_mode, use_policy_gradient, loss_max_clamp)
        token_losses = distill.estimator_losses(student, teacher, loss_mode)
        loss, metrics = ours(token_losses, student, old, mask, settings, agg_mode)
        (grad,) = torch.autograd.grad(loss, student)

        verl_loss, verl_metrics = verls(
            settings, agg_mode, mask, old, {"log_probs": student}, teacher_logprobs=teacher.unsqueeze(-1)
        )
        (verl_grad,) = torch.autograd.grad(verl_loss, student)
        torch.testing.assert_close(loss, verl_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, verl_grad, rtol=1e-12, atol=1e-12)
        assert float(metrics["abs_loss"]) == pytest.approx(metric_value(verl_metrics["distillation/abs_loss"]))
        if use_policy_gradient:
            for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
                assert float(metrics[name]) == pytest.approx(metric_value(verl_metrics[f"distillation/{name}"]))


def random_topk(seed):
    """(student logits [bs, len, vocab], teacher top-k log-probs and ids [bs, len, k]) of a random teacher."""
    gen = torch.Generator().manual_seed(100 + seed)
    logits = (2 * torch.randn(BS, LENGTH, VOCAB, generator=gen, dtype=torch.float64)).requires_grad_()
    teacher = torch.log_softmax(3 * torch.randn(BS, LENGTH, VOCAB, generator=gen, dtype=torch.float64), -1)
    top = teacher.topk(TOPK, dim=-1)
    return logits, top.values, top.indices


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("log_prob_min_clamp", [None, -2.0])
def test_topk_forward_kl_matches_verl(log_prob_min_clamp, seed):
    """rlframe's top-k forward KL, its masses and its gradient equal verl's FSDP function on the same tokens."""
    _, fsdp_losses = verl_distillation_losses()  # puts verl's source on the path first
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    logits, teacher_topk, ids = random_topk(seed)
    out = distill.topk_forward_kl(logits, teacher_topk, ids, log_prob_min_clamp)

    config = DistillationConfig(
        enabled=False,
        distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", topk=TOPK, log_prob_min_clamp=log_prob_min_clamp, use_policy_gradient=False
        ),
    )
    nested = {
        name: torch.nested.as_nested_tensor(list(value), layout=torch.jagged)
        for name, value in (("log_probs", teacher_topk), ("ids", ids))
    }
    verl_out = fsdp_losses.compute_forward_kl_topk(
        logits.reshape(1, BS * LENGTH, VOCAB), nested["log_probs"], nested["ids"], config, "thd"
    )
    verl_losses = verl_out["distillation_losses"].reshape(BS, LENGTH).clamp_min(0.0)  # verl's registered loss floors
    torch.testing.assert_close(out["losses"], verl_losses, rtol=1e-12, atol=1e-12)
    for name in ("student_mass", "teacher_mass"):
        torch.testing.assert_close(out[name], verl_out[name].reshape(BS, LENGTH), rtol=1e-12, atol=1e-12)
    weights = torch.randn(BS, LENGTH, dtype=torch.float64)
    (grad,) = torch.autograd.grad((out["losses"] * weights).sum(), logits)
    (verl_grad,) = torch.autograd.grad((verl_losses * weights).sum(), logits)
    torch.testing.assert_close(grad, verl_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("use_policy_gradient", [False, True])
def test_topk_distillation_loss_matches_verl(use_policy_gradient, agg_mode):
    """The top-k token losses through verl's `distillation_loss` (clamp, then aggregate or policy gradient)."""
    logits, teacher_topk, ids = random_topk(0)
    student = torch.log_softmax(logits, -1).gather(-1, ids[..., :1]).squeeze(-1)  # a sampled token's log-prob
    _, _, old = random_log_probs(0)
    mask = random_mask()
    settings = settings_of("forward_kl_topk", use_policy_gradient, loss_max_clamp=1.5)
    out = distill.topk_forward_kl(logits, teacher_topk, ids)
    loss, _ = ours(out["losses"], student, old, mask, settings, agg_mode)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)

    model_output = {"log_probs": student, "distillation_losses": out["losses"]}
    model_output.update(student_mass=out["student_mass"].detach(), teacher_mass=out["teacher_mass"].detach())
    verl_loss, verl_metrics = verls(settings, agg_mode, mask, old, model_output)
    (verl_grad,) = torch.autograd.grad(verl_loss, logits)
    torch.testing.assert_close(loss, verl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, verl_grad, rtol=1e-12, atol=1e-12)
    valid = mask.bool()
    assert verl_metrics["distillation/student_mass"] == pytest.approx(float(out["student_mass"].detach()[valid].mean()))


def test_combine_follows_use_task_rewards():
    """With task rewards: task + coef·distillation; without: the distillation term alone (coef ignored, as verl)."""
    task, term = torch.tensor(2.0), torch.tensor(0.5)
    with_task = distill.DistillationLoss(use_task_rewards=True, distillation_loss_coef=0.1)
    without = distill.DistillationLoss(use_task_rewards=False, distillation_loss_coef=0.1)
    assert float(distill.combine(task, term, with_task)) == pytest.approx(2.05)
    assert float(distill.combine(None, term, without)) == 0.5


def test_unknown_estimator_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="valid names: kl, k1"):
        distill.estimator_losses(torch.zeros(1, 1), torch.zeros(1, 1), "forward_kl_topk")
