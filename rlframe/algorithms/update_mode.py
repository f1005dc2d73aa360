"""How the actor's update reads its batch: one of three modes, decided once from the config.

- `decoupled` (verl 0.9.1's decoupled mode, three policies): π_old comes from the separate old-log-prob
  pass; with `algorithm.rollout_correction.rollout_is` the driver's IS weights π_old/π_rollout arrive as
  `rollout_is_weights` and scale the advantages, and rejection has already narrowed `response_mask`.
- `bypass` (verl's bypass mode, `rollout_correction.bypass_mode=true`, two policies): π_old := π_rollout
  (the driver copies `rollout_log_probs` into `old_log_probs`, no pass runs); the loss corrects π_θ
  against π_rollout per micro-batch (`rollout_correction.bypass_policy_loss`, `loss_type`).
- `on_policy` (rlframe's, `actor.skip_on_policy_old_log_prob`): no pass runs and no old log-probs arrive;
  the update computes them from the policy it starts from (`rlframe.algorithms.on_policy`).

The driver and the actor each call `update_mode` on the same config sections, so they agree without a
flag in the data; the actor checks that its batch carries what its mode reads (`ActorUpdate.batch_keys`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from rlframe.algorithms.config import RolloutCorrection
from rlframe.algorithms.distillation import DistillationLoss
from rlframe.algorithms.on_policy import old_log_prob_pass_reason
from rlframe.config.keys import ACTOR


class UpdateMode(Enum):
    """Where the actor's update takes π_old from (see the module docstring)."""

    DECOUPLED = "decoupled"
    BYPASS = "bypass"
    ON_POLICY = "on_policy"


def update_mode(actor: Any, algorithm: Any) -> UpdateMode:
    """The mode of the typed sections `actor_rollout_ref.actor` and `algorithm`."""
    if algorithm.rollout_correction.bypass_mode:
        return UpdateMode.BYPASS
    if old_log_prob_pass_reason(actor, algorithm) is None:
        return UpdateMode.ON_POLICY
    return UpdateMode.DECOUPLED


@dataclass(frozen=True)
class ActorUpdate:
    """What the actor's update and scoring take from the config besides its own section, built with the actor.

    `temperature` is the rollout's sampling temperature: every log-prob (old, reference, update) is of
    logits / T, as the responses were sampled (verl 0.9.1). `correction` is `algorithm.rollout_correction`,
    parsed; the actor reads it in bypass mode (the loss) and in decoupled mode (whether IS weights arrive).
    `distillation` is the distillation loss's settings when `distillation.enabled` (None: no teacher term).
    """

    mode: UpdateMode = UpdateMode.DECOUPLED
    correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    temperature: float = 1.0
    distillation: DistillationLoss | None = None

    @classmethod
    def from_config(cls, actor: Any, algorithm: Any, rollout: Any, distillation: Any = None) -> ActorUpdate:
        """The update of the sections `actor_rollout_ref.actor`, `algorithm`, `actor_rollout_ref.rollout` and
        `distillation` (None: not read)."""
        enabled = distillation is not None and distillation.enabled
        return cls(
            mode=update_mode(actor, algorithm),
            correction=RolloutCorrection.parse(algorithm.rollout_correction),
            temperature=float(rollout.temperature),
            distillation=DistillationLoss.from_config(distillation.distillation_loss) if enabled else None,
        )

    @property
    def applies_is_weights(self) -> bool:
        """Decoupled mode with `rollout_is`: the driver's IS weights multiply the advantages."""
        return self.mode is UpdateMode.DECOUPLED and self.correction.rollout_is is not None

    def batch_keys(self, use_kl_loss: bool) -> dict[str, str]:
        """{key the update reads from its batch: why} in this mode (the model inputs aside)."""
        keys = {"advantages": "the driver's advantages"}
        if use_kl_loss:
            keys["ref_log_prob"] = f"{ACTOR}.use_kl_loss=true: the reference pass's log-probs"
        if self.mode is UpdateMode.DECOUPLED:
            keys["old_log_probs"] = "the old-log-prob pass's log-probs"
        elif self.mode is UpdateMode.BYPASS:
            keys["old_log_probs"] = "π_old := the rollout's log-probs (the driver copies rollout_log_probs)"
        if self.applies_is_weights:
            keys["rollout_is_weights"] = (
                f"algorithm.rollout_correction.rollout_is={self.correction.rollout_is}: the driver's IS weights"
            )
        if self.distillation is not None and self.distillation.uses_topk:
            why = "distillation_loss.loss_mode=forward_kl_topk: the teacher pass's top-k"
            keys["teacher_topk_log_probs"] = f"{why} log-probs"
            keys["teacher_topk_ids"] = f"{why} token ids"
        elif self.distillation is not None:
            keys["teacher_log_probs"] = "distillation.enabled=true: the teacher pass's log-probs"
        return keys
