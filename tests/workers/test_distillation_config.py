"""The `distillation` section (rlframe/workers/config/distillation.py): verl 0.9.1's keys and defaults, and what
rlframe refuses by name before Ray starts."""

import pytest

from rlframe.algorithms.distillation import DistillationLoss
from rlframe.config.key_status import ignored_keys
from rlframe.config.verl_keys import verl_defaults
from rlframe.trainer.config import compose, typed

TEACHERS = "distillation.teacher_models"
TEACHER = f"{TEACHERS}.teacher_model"
ENABLED = ["distillation.enabled=true", f"{TEACHER}.model_path=builtin://tiny"]
# verl's multi-teacher spelling: named entries that replace teacher_model, routed by data_source
TWO_TEACHERS = [
    f"+{TEACHERS}.gsm.model_path=builtin://tiny",
    f"+{TEACHERS}.gsm.key=gsm8k",
    f"+{TEACHERS}.math.model_path=builtin://tiny-quickstart",
    f"+{TEACHERS}.math.key=math",
]


def test_every_declared_distillation_key_has_verls_default():
    cfg = typed(compose([]))
    section = cfg.distillation
    for name, value in verl_defaults().items():
        parts = name.split(".")
        if parts[0] != "distillation":
            continue
        node = section
        for part in parts[1:]:
            node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
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
            ENABLED + [f"+{TEACHERS}.gsm.model_path=builtin://tiny", f"+{TEACHERS}.gsm.key=gsm8k"],
            f"{TEACHER}.model_path=builtin://tiny beside the named teachers gsm: verl 0.9.1 drops teacher_model",
        ),
        (
            ["distillation.enabled=true", *TWO_TEACHERS[:3]],
            f"{TEACHERS}.math.key is not set: a named teacher scores the rows whose 'data_source' field",
        ),
        (
            ["distillation.enabled=true", *TWO_TEACHERS[:3], f"+{TEACHERS}.math.key=gsm8k"],
            f"{TEACHERS}.math.key='gsm8k' is also {TEACHERS}.gsm.key: each routing value picks one teacher",
        ),
        (
            ["distillation.enabled=true", *TWO_TEACHERS[1:]],
            f"{TEACHERS}.gsm.model_path is not set: every named teacher needs its checkpoint",
        ),
        (
            [f"+{TEACHERS}.gsm.num_replicas=2"],
            f"{TEACHERS}.gsm.num_replicas=2: the teacher is not served by inference replicas",
        ),
        (
            [f"+{TEACHERS}.gsm.modle_path=x"],
            f"unknown config key '{TEACHERS}.gsm.modle_path'.*Did you mean {TEACHERS}.gsm.model_path",
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


def test_named_teachers_replace_teacher_model_and_are_routed_by_teacher_key():
    from rlframe.workers.config.distillation import routes_rows, teachers_of

    # verl's default num_replicas taken; teacher_model's key set but unused: named teachers replace it
    overrides = ["distillation.enabled=true", *TWO_TEACHERS, f"+{TEACHERS}.gsm.num_replicas=0", f"{TEACHER}.key=x"]
    cfg = typed(compose(overrides))
    teachers = {name: (t.model_path, t.key) for name, t in teachers_of(cfg.distillation).items()}
    assert teachers == {"gsm": ("builtin://tiny", "gsm8k"), "math": ("builtin://tiny-quickstart", "math")}
    assert routes_rows(cfg.distillation)
    ignored = dict(ignored_keys(compose(overrides), overrides))
    assert "named teachers (gsm, math) replace teacher_model" in ignored[f"{TEACHER}.key"]
    assert "distillation.teacher_key" not in ignored
    one = typed(compose(["distillation.enabled=true", *TWO_TEACHERS[:2]]))  # one named teacher takes every row
    assert list(teachers_of(one.distillation)) == ["gsm"] and not routes_rows(one.distillation)


def test_every_row_must_route_to_a_teacher_before_start(tmp_path):
    """`prepare`'s data step reads each training row's teacher_key field: a row no teacher takes fails there."""
    from types import SimpleNamespace

    from rlframe.trainer.main_ppo import check_teacher_routing

    distillation = typed(compose(["distillation.enabled=true", *TWO_TEACHERS])).distillation
    rows = [{"data_source": "gsm8k"}, {"data_source": "math"}]
    origins = [("train.parquet", 0), ("train.parquet", 1)]
    check_teacher_routing(distillation, SimpleNamespace(rows=rows, origins=origins))
    rows[1] = {"data_source": "geo"}
    with pytest.raises(ValueError, match=r"train.parquet, row 1, column 'data_source': 'geo' routes to no teacher"):
        check_teacher_routing(distillation, SimpleNamespace(rows=rows, origins=origins))
    rows[1] = {"source": "math"}
    with pytest.raises(ValueError, match=r"row 1: no column 'data_source' \(distillation.teacher_key\)"):
        check_teacher_routing(distillation, SimpleNamespace(rows=rows, origins=origins))


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
