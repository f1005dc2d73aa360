"""On-policy distillation end to end: two GRPO steps of `builtin://tiny` with a teacher, on 2 CPU Ray workers.

A teacher is the tiny model with every weight perturbed (so it disagrees with the policy, with the same
tokenizer). The run goes in-process (`prepare` → `create_worker_groups` → the trainer) so that the teacher pass's
input and output can be recorded, and compared with a direct forward of the teacher's checkpoint: the one teacher's
(top-k), or with two teachers routed by data source (verl's multi-teacher keys), each row's own teacher's.
"""

import math

import pytest
import torch
from helpers.runs import COMMON, read_metrics

pytestmark = pytest.mark.slow

DISTILLATION_METRICS = ("actor/distillation/loss", "actor/distillation/abs_loss", "timing_s/teacher")


def perturbed(tiny_model_path: str, folder, seed: int) -> str:
    """The tiny model with N(0, 0.05²) added to every weight, and its tokenizer, saved in `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def teacher_path(tiny_model_path, tmp_path):
    return perturbed(tiny_model_path, tmp_path / "teacher", seed=0)


# two teachers routed by data_source, each a task's rows (a batch mixes them; a rank may hold none of one)
TASKS = {"countdown_add": 0, "add_digits": 1}  # the data source and its teacher's noise seed


def direct_teacher_log_probs(teacher_path: str, batch) -> torch.Tensor:
    """log p_teacher(· | everything before a response token) [bs, len, vocab] at temperature 1, from a plain
    padded forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    tensors = batch.batch
    response_length = tensors["responses"].shape[-1]
    with torch.no_grad():
        logits = model(
            input_ids=tensors["input_ids"],
            attention_mask=tensors["attention_mask"],
            position_ids=tensors["position_ids"],
            use_cache=False,
        ).logits
    return torch.log_softmax(logits[:, -response_length - 1 : -1].float(), dim=-1)


@pytest.mark.parametrize("loss_mode", ["k3", "forward_kl_topk"], ids=["k3_two_teachers", "forward_kl_topk"])
def test_two_distillation_steps_log_finite_metrics_and_the_teachers_exact_log_probs(
    tiny_model_path, teacher_path, tmp_path, monkeypatch, loss_mode
):
    from rlframe.trainer.launch import create_worker_groups
    from rlframe.trainer.main_ppo import prepare
    from rlframe.trainer.ray_trainer import RayPPOTrainer

    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    if loss_mode == "k3":
        teachers = {task: perturbed(tiny_model_path, tmp_path / task, seed) for task, seed in TASKS.items()}
        named = [f"+distillation.teacher_models.{task}_teacher.{k}={v}" for task, path in teachers.items()
                 for k, v in (("model_path", path), ("key", task))]  # fmt: skip
        teacher_keys = [f"data.train_files=[{','.join(f'builtin://{task}' for task in TASKS)}]", *named]
    else:
        teachers = None
        teacher_keys = [f"distillation.teacher_models.teacher_model.model_path={teacher_path}"]
    run = prepare(
        COMMON
        + teacher_keys
        + [
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.total_training_steps=2",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.rollout.temperature=0.8",  # the teacher still scores at T = 1, as verl's
            "distillation.enabled=true",
            f"distillation.distillation_loss.loss_mode={loss_mode}",
            "distillation.distillation_loss.topk=5",
            "distillation.distillation_loss.distillation_loss_coef=0.5",
        ]
    )
    groups = create_worker_groups(run.cfg, run.plan, run.schedule_steps)
    passes = []
    teacher_pass = groups.actor_rollout.compute_teacher_log_prob

    def recorded(batch):
        out = teacher_pass(batch)
        passes.append((batch, out))
        return out

    groups.actor_rollout.compute_teacher_log_prob = recorded
    try:
        RayPPOTrainer(run, groups).fit()
    finally:
        groups.shutdown()

    steps = [m for m in read_metrics(run.cfg.trainer.default_local_dir) if m["step"] > 0 and "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    names = DISTILLATION_METRICS
    if loss_mode == "forward_kl_topk":
        names += ("actor/distillation/student_mass", "actor/distillation/teacher_mass")
    for metrics in steps:
        for name in names:
            assert math.isfinite(metrics[name]), (name, metrics[name])
        assert metrics["actor/distillation/abs_loss"] > 0  # the perturbed teacher disagrees with the policy

    assert len(passes) == 2
    routed = set()
    for batch, out in passes:
        response_length = batch.batch["responses"].shape[-1]
        valid = batch.batch["attention_mask"][:, -response_length:].bool()
        if teachers is None:
            expected = direct_teacher_log_probs(teacher_path, batch)
        else:  # each row's own teacher
            sources = batch.non_tensor_batch["data_source"]
            routed.update(sources)
            each = {task: direct_teacher_log_probs(path, batch) for task, path in teachers.items()}
            expected = torch.stack([each[source][row] for row, source in enumerate(sources)])
        if loss_mode == "forward_kl_topk":  # the teacher's 5 most likely tokens in place of each response token
            top = expected.topk(5, dim=-1)
            got = out.batch["teacher_topk_log_probs"]
            torch.testing.assert_close(got[valid], top.values[valid], rtol=1e-5, atol=1e-5)
            assert torch.equal(out.batch["teacher_topk_ids"][valid], top.indices[valid])
        else:
            got = out.batch["teacher_log_probs"]
            sampled = expected.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(got[valid], sampled[valid], rtol=1e-5, atol=1e-5)
        assert (got[~valid] == 0).all()
    assert teachers is None or routed == set(TASKS)  # both teachers scored rows


def test_distillation_in_separate_async_mode(teacher_path, tmp_path, cache_dir):
    """The teacher pass runs on the trained batch, after the rollout stage: a rollout pool of its own changes
    nothing about it (three steps, one off-policy)."""
    from helpers.runs import run_main

    run_dir = tmp_path / "run"
    out = run_main(
        COMMON
        + [
            f"trainer.default_local_dir={run_dir}",
            "trainer.total_training_steps=3",
            "trainer.n_gpus_per_node=1",
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.sampler.max_off_policy_threshold=2",
            "trainer.v1.separate_async.parameter_sync_step=2",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "distillation.enabled=true",
            f"distillation.teacher_models.teacher_model.model_path={teacher_path}",
            "distillation.distillation_loss.loss_mode=forward_kl_topk",
            "distillation.distillation_loss.topk=5",
        ],
        cache_dir,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    steps = [m for m in read_metrics(run_dir) if m["step"] > 0 and "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for metrics in steps:
        for name in DISTILLATION_METRICS + ("actor/distillation/student_mass", "actor/distillation/teacher_mass"):
            assert math.isfinite(metrics[name]), (name, metrics[name])
