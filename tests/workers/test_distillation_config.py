"""The `distillation` section (rlframe/workers/config/distillation.py): verl 0.9.1's keys and defaults, and what
rlframe refuses by name before Ray starts."""

import pytest

from rlframe.algorithms.distillation import DistillationLoss
from rlframe.config.key_status import ignored_keys
from rlframe.config.verl_keys import verl_defaults
from rlframe.trainer.config import compose, typed

TEACHER = "distillation.teacher_models.teacher_model"
ENABLED = ["distillation.enabled=true", f"{TEACHER}.model_path=builtin://tiny"]


def test_every_declared_distillation_key_has_verls_default():
    cfg = typed(compose([]))
    section = cfg.distillation
    for name, value in verl_defaults().items():
        parts = name.split(".")
        if parts[0] != "distillation":
            continue
        node = section
        for part in parts[1:]:
            node = getattr(node, part, None)
            if node is None:
                break
        else:
            assert node == value, name
    assert section.enabled is False and section.distillation_loss.loss_mode == "k3"


def test_an_enabled_run_reads_its_loss_settings_as_verl_names_them():
    cfg = typed(
        compose(
            ENABLED
            + [
                "distillation.distillation_loss.use_policy_gradient=true",
                "distillation.distillation_loss.loss_mode=k1",
                "distillation.distillation_loss.clip_ratio_high=0.28",
                "distillation.distillation_loss.clip_ratio_low=null",
                "distillation.distillation_loss.loss_max_clamp=5",
            ]
        )
    )
    settings = DistillationLoss.from_config(cfg.distillation.distillation_loss)
    assert settings == DistillationLoss(
        loss_mode="k1", use_policy_gradient=True, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_max_clamp=5.0
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distillation.enabled=true"], f"needs {TEACHER}.model_path"),
        (ENABLED + ["distillation.nnodes=1"], "distillation.nnodes=1: a teacher pool of its own is not implemented"),
        (
            ENABLED + ["distillation.distillation_loss.loss_mode=k1"],
            "loss_mode=k1 with distillation.distillation_loss.use_policy_gradient=false",
        ),
        (
            ENABLED
            + ["distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=0"],
            "topk=0: loss_mode=forward_kl_topk needs topk >= 1",
        ),
        (
            ENABLED
            + [
                "distillation.distillation_loss.loss_mode=forward_kl_topk",
                "actor_rollout_ref.model.use_fused_kernels=true",
            ],
            "forward_kl_topk with actor_rollout_ref.model.use_fused_kernels=true",
        ),
        (ENABLED + ["distillation.distillation_loss.loss_mode=k4"], "loss_mode='k4' is not one of kl, k1"),
        (ENABLED + ["distillation.distillation_loss.loss_max_clamp=0"], "loss_max_clamp=0.0: must be > 0"),
        (
            ENABLED + ["distillation.distillation_loss.policy_loss_mode=gspo"],
            "policy_loss_mode='gspo' is not one of vanilla",
        ),
        (
            ["+distillation.teacher_models.teacher_model2.model_path=builtin://tiny"],
            "teacher_model2.model_path=builtin://tiny: more than one teacher",
        ),
        (
            [f"{TEACHER}.inference.tensor_model_parallel_size=4"],
            "tensor_model_parallel_size=4: the teacher is not served by an inference engine",
        ),
        ([f"{TEACHER}.num_replicas=2"], "num_replicas=2: the teacher is not served by inference replicas"),
    ],
)
def test_what_rlframe_cannot_honor_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        typed(compose(overrides))


def test_verls_teacher_inference_keys_are_taken_at_their_defaults():
    """A verl command line that spells out the teacher's inference defaults composes to the same run."""
    overrides = ENABLED + [
        f"{TEACHER}.inference.tensor_model_parallel_size=2",
        f"{TEACHER}.inference.temperature=1.0",  # follows actor_rollout_ref.rollout.temperature
        f"{TEACHER}.num_replicas=0",
    ]
    assert typed(compose(overrides)).distillation == typed(compose(ENABLED)).distillation


def test_keys_without_effect_are_reported():
    overrides = ENABLED + ["distillation.distillation_loss.clip_ratio_high=0.3", "distillation.teacher_key=task"]
    ignored = dict(ignored_keys(compose(overrides), overrides))
    assert "use_policy_gradient=false" in ignored["distillation.distillation_loss.clip_ratio_high"]
    assert "one teacher" in ignored["distillation.teacher_key"]


def test_a_teacher_with_another_tokenizer_is_refused_before_start(tiny_model_path, tmp_path):
    """The teacher scores the policy's token ids: `prepare`'s data step compares the two vocabularies."""
    from transformers import AutoTokenizer

    from rlframe.trainer.main_ppo import check_teacher_tokenizer

    policy = AutoTokenizer.from_pretrained(tiny_model_path)
    other = AutoTokenizer.from_pretrained(tiny_model_path)
    other.add_tokens(["<teacher_only>"])
    other.save_pretrained(tmp_path / "teacher")
    same = typed(compose(["distillation.enabled=true", f"{TEACHER}.model_path={tiny_model_path}"]))
    check_teacher_tokenizer(same, policy)
    differs = typed(compose(["distillation.enabled=true", f"{TEACHER}.model_path={tmp_path / 'teacher'}"]))
    with pytest.raises(ValueError, match=r"model_path=.*teacher: its tokenizer differs from the policy's"):
        check_teacher_tokenizer(differs, policy)
