"""On-policy distillation's section (`distillation`, verl 0.9.1's keys): the teacher and the distillation loss.

The teacher is a frozen causal LM that scores the policy's sampled tokens in the training processes, like the
reference policy (docs/distillation.md); verl serves it from inference replicas on a pool of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from rlframe.algorithms.distillation import ESTIMATOR_MODES, LOSS_MODES, POLICY_LOSS_MODES, TOPK_MODES
from rlframe.config.schema import Section, key, named_sections, section

DISTILLATION = "distillation"
LOSS = f"{DISTILLATION}.distillation_loss"
TEACHERS = f"{DISTILLATION}.teacher_models"
DEFAULT_TEACHER = "teacher_model"  # verl's entry for one teacher, dropped when other entries are named
TEACHER = f"{TEACHERS}.{DEFAULT_TEACHER}"
TEACHER_PATH_KEY = f"{TEACHER}.model_path"
# what rlframe does not implement of verl's distillation, with the reason (config checks and refusals name it)
TEACHER_POOL = (
    "a teacher pool of its own is not implemented: the teacher scores the samples in the training processes "
    "(trainer.nnodes × trainer.n_gpus_per_node), beside the actor; leave distillation.nnodes=0"
)


def teachers_of(distillation: Any) -> dict[str, Any]:
    """The teachers a run distills from, by entry name (a typed section or a DictConfig alike).

    As verl 0.9.1: `teacher_model` alone is the one teacher; once other entries are named, `teacher_model` is
    dropped and each other entry is a teacher for the rows whose `teacher_key` field equals its `key`.
    """
    entries = dict(distillation.teacher_models.items())
    named = {name: entry for name, entry in entries.items() if name != DEFAULT_TEACHER}
    if named:
        return named
    return {DEFAULT_TEACHER: entries[DEFAULT_TEACHER]} if DEFAULT_TEACHER in entries else {}


def teacher_path_key(name: str) -> str:
    """The model_path key of the teacher entry `name`."""
    return f"{TEACHERS}.{name}.model_path"


def routes_rows(distillation: Any) -> bool:
    """True when rows are routed to teachers by `teacher_key` (several teachers); one teacher takes every row."""
    return len(teachers_of(distillation)) > 1


def _positive(value: Optional[float]) -> None:
    if value is not None and value <= 0:
        raise ValueError("must be > 0 (or null)")


@dataclass
class DistillationLossConfig(Section):
    loss_mode: str = key(
        "k3",
        "per-token divergence: k1/kl, abs, k2/mse, k3/low_var_kl (KL estimators on the sampled token), "
        "forward_kl_topk (KL(teacher ‖ student) over the teacher's top-k tokens)",
        choices=LOSS_MODES,
    )
    topk: Optional[int] = key(32, "forward_kl_topk: how many of the teacher's top tokens per position it compares")
    use_task_rewards: bool = key(True, "add the PPO loss on the task rewards; false: train on distillation alone")
    distillation_loss_coef: float = key(1.0, "weight of the distillation term beside the task loss")
    loss_max_clamp: Optional[float] = key(
        None, "clamp each token's distillation loss to ±this (null: none)", check=_positive
    )
    log_prob_min_clamp: Optional[float] = key(None, "forward_kl_topk: floor of both top-k log-probs (null: none)")
    use_policy_gradient: bool = key(
        False, "the negative token losses are a reward in a PPO surrogate (false: back-propagated directly)"
    )
    policy_loss_mode: str = key(
        "vanilla", "the surrogate of use_policy_gradient (verl has only vanilla)", choices=POLICY_LOSS_MODES
    )
    clip_ratio: float = key(0.2, "use_policy_gradient: the surrogate's clip range where low/high are null")
    clip_ratio_low: Optional[float] = key(0.2, "use_policy_gradient: the ratio's range starts at 1 − this")
    clip_ratio_high: Optional[float] = key(0.2, "use_policy_gradient: ... and ends at 1 + this")

    def check(self, path: str, root: Any) -> None:
        if not root.distillation.enabled:
            return
        if self.loss_mode in TOPK_MODES:
            if self.topk is None or self.topk < 1:
                raise ValueError(f"{path}.topk={self.topk}: loss_mode={self.loss_mode} needs topk >= 1")
            if root.actor_rollout_ref.model.use_fused_kernels:
                raise ValueError(
                    f"{path}.loss_mode={self.loss_mode} with actor_rollout_ref.model.use_fused_kernels=true: the "
                    "top-k loss reads the student's full distribution, which the fused head never holds; set "
                    "use_fused_kernels=false or use a KL estimator (k3, k2, abs)"
                )
        if self.loss_mode in ("k1", "kl") and not self.use_policy_gradient:
            raise ValueError(
                f"{path}.loss_mode={self.loss_mode} with {path}.use_policy_gradient=false: back-propagating k1 "
                "directly is wrong, its gradient does not depend on the teacher (verl refuses it too); set "
                "use_policy_gradient=true, or use k3"
            )

    def warnings(self, path: str, root: Any) -> list[str]:
        if root.distillation.enabled and self.loss_mode in TOPK_MODES and self.use_policy_gradient:
            return [
                f"{path}.loss_mode={self.loss_mode} with {path}.use_policy_gradient=true: the update then moves only "
                "the sampled token's log-prob, so the top-k distribution's signal is mostly unused (verl warns "
                "alike); use_policy_gradient=false back-propagates it"
            ]
        return []

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = {}
        if self.loss_mode in ESTIMATOR_MODES:
            for name in ("topk", "log_prob_min_clamp"):
                out[f"{path}.{name}"] = f"{path}.loss_mode={self.loss_mode} reads only the sampled tokens"
        if not self.use_policy_gradient:
            for name in ("policy_loss_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high"):
                out[f"{path}.{name}"] = f"{path}.use_policy_gradient=false: the loss is back-propagated directly"
        if not self.use_task_rewards:
            out[f"{path}.distillation_loss_coef"] = f"{path}.use_task_rewards=false: the distillation term is alone"
        return out


@dataclass
class TeacherModelConfig(Section):
    model_path: Optional[str] = key(None, "the teacher's checkpoint (HF folder or builtin://); same tokenizer")
    # last: the field's name shadows `key` in the class body
    key: Optional[str] = key(None, "the teacher_key value routed to this teacher (with several teachers)")


@dataclass
class DistillationConfig(Section):
    enabled: bool = key(False, "on-policy distillation: a teacher scores the samples, the actor's loss adds a term")
    distillation_loss: DistillationLossConfig = section(DistillationLossConfig)
    n_gpus_per_node: int = key(8, "GPUs per node of a teacher pool of its own (with nnodes > 0; not implemented)")
    nnodes: int = key(0, "nodes of a teacher pool of its own; 0: the teacher shares the training processes")
    teacher_models: Dict[str, TeacherModelConfig] = named_sections(
        TeacherModelConfig,
        (DEFAULT_TEACHER,),
        "teacher_model, or named teachers that replace it, routed by teacher_key (docs/distillation.md)",
    )
    teacher_key: str = key("data_source", "the row field whose value picks a row's teacher (with several teachers)")

    def check(self, path: str, root: Any) -> None:
        if not self.enabled:
            return
        if self.nnodes != 0:
            raise ValueError(f"{path}.nnodes={self.nnodes}: {TEACHER_POOL}")
        teachers = teachers_of(self)
        if not teachers:
            raise ValueError(f"{path}.enabled=true needs a teacher: {TEACHER_PATH_KEY}, or named teachers")
        if DEFAULT_TEACHER not in teachers:
            self._check_named(path, teachers)
        elif not teachers[DEFAULT_TEACHER].model_path:
            raise ValueError(
                f"{path}.enabled=true needs {TEACHER_PATH_KEY}: the teacher's checkpoint (an HF folder or "
                "builtin://NAME) with the policy's tokenizer"
            )

    def _check_named(self, path: str, teachers: dict[str, TeacherModelConfig]) -> None:
        default = self.teacher_models.get(DEFAULT_TEACHER)
        names = ", ".join(teachers)
        if default is not None and default.model_path:
            raise ValueError(
                f"{TEACHER_PATH_KEY}={default.model_path} beside the named teachers {names}: verl 0.9.1 drops "
                f"{DEFAULT_TEACHER} once other teachers are named, so this teacher would never score a row; name it "
                f"like the others (+{TEACHERS}.NAME.model_path=…, +{TEACHERS}.NAME.key=…)"
            )
        owners: dict[str, str] = {}
        for name, teacher in teachers.items():
            if not teacher.model_path:
                raise ValueError(f"{teacher_path_key(name)} is not set: every named teacher needs its checkpoint")
            if teacher.key is None and len(teachers) > 1:
                raise ValueError(
                    f"{TEACHERS}.{name}.key is not set: a named teacher scores the rows whose "
                    f"{self.teacher_key!r} field ({path}.teacher_key) equals its key"
                )
            if teacher.key in owners:
                raise ValueError(
                    f"{TEACHERS}.{name}.key={teacher.key!r} is also {TEACHERS}.{owners[teacher.key]}.key: "
                    "each routing value picks one teacher"
                )
            owners[teacher.key] = name

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if not self.enabled:
            return {path: f"{path}.enabled=false"}
        out = {f"{path}.n_gpus_per_node": f"{path}.nnodes=0: the teacher shares the training processes"}
        teachers = teachers_of(self)
        if len(teachers) == 1:
            name = next(iter(teachers))
            out[f"{path}.teacher_key"] = out[f"{TEACHERS}.{name}.key"] = "one teacher takes every row"
        if DEFAULT_TEACHER not in teachers and DEFAULT_TEACHER in self.teacher_models:
            out[TEACHER] = f"named teachers ({', '.join(teachers)}) replace {DEFAULT_TEACHER}, as in verl"
        return out
