"""The algorithm package's sections: `algorithm.rollout_correction` and `algorithm.pf_ppo`.

The math they configure is in `rollout_correction.py` and `pf_ppo.py`. The rollout-correction keys are
parsed once (`RolloutCorrection.parse`) when the driver and the actor are built; the math takes the
parsed numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlframe.algorithms.loss import POLICY_LOSS_INFO
from rlframe.config.keys import LOG_PROB_FIELDS, ROLLOUT
from rlframe.config.schema import Section, key

IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
# Policy losses that are positively homogeneous in the advantage (ℓ(w·A) = w·ℓ(A) for w ≥ 0): for
# them, verl's token loss × IS weight equals the loss of the weighted advantage, which is how the
# actor applies the weights.
IS_WEIGHTED_LOSSES = tuple(name for name, info in POLICY_LOSS_INFO.items() if info.advantage_homogeneous)


# ───────────────────────────── rollout correction ─────────────────────────────


def _positive(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{what}: {text!r} must be > 0")
    return value


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """`rollout_is_threshold` → (upper, lower or None): a number truncates (TIS), "L_U" keeps [L, U] (IcePop)."""
    what = "algorithm.rollout_correction.rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{what}={spec!r}: give a number (truncate) or 'lower_upper' (keep the range)")
    text = str(spec).strip()
    if "_" not in text:
        return _positive(text, what), None
    lower_text, upper_text = text.split("_", 1)
    lower, upper = _positive(lower_text, what), _positive(upper_text, what)
    if lower > upper:
        raise ValueError(f"{what}={spec!r}: the lower bound exceeds the upper bound")
    return upper, lower


def parse_rs_options(spec: str) -> list[str]:
    """`rollout_rs` → its options in order, duplicates dropped; unknown names raise."""
    options = list(dict.fromkeys(part.strip() for part in str(spec).split(",") if part.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if not options or unknown:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs={spec!r}: unknown options {unknown}; "
            f"valid: {', '.join(RS_OPTIONS)}"
        )
    return options


def parse_rs_thresholds(options: list[str], spec: Any) -> dict[str, tuple[float | None, float]]:
    """`rollout_rs_threshold` → {option: (lower, upper)}: one entry per option, or one shared by all.

    k1 options bound the ratio (lower, upper); a single value U means (1/U, U). The others bound
    the divergence from above (lower is None).
    """
    what = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None:
        raise ValueError(f"{what} must be set when algorithm.rollout_correction.rollout_rs is set")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"{what}={spec!r}: give one threshold or one per rollout_rs option ({len(options)})")
    parts = parts * len(options) if len(parts) == 1 else parts
    out = {}
    for option, part in zip(options, parts):
        if option.endswith("k1"):
            lower_text, upper_text = part.split("_", 1) if "_" in part else (None, part)
            upper = _positive(upper_text, f"{what} ({option})")
            lower = 1.0 / upper if lower_text is None else _positive(lower_text, f"{what} ({option})")
            if lower > upper:
                raise ValueError(f"{what}={spec!r}: {option}'s lower bound exceeds its upper bound")
            out[option] = (lower, upper)
        else:
            if "_" in part:
                raise ValueError(f"{what}={spec!r}: {option} takes one upper bound, not a range")
            out[option] = (None, _positive(part, f"{what} ({option})"))
    return out


@dataclass(frozen=True)
class RolloutCorrection:
    """`algorithm.rollout_correction` parsed once: thresholds as numbers, rejection options in order.

    `is_bounds` is (upper, lower or None): a lone upper bound truncates (TIS), both keep [lower, upper]
    (IcePop). `rs_bounds` maps each `rollout_rs` option, in order, to its (lower or None, upper).
    """

    rollout_is: str | None = None
    is_bounds: tuple[float, float | None] = (2.0, None)
    rollout_is_batch_normalize: bool = False
    rs_bounds: dict[str, tuple[float | None, float]] = field(default_factory=dict)
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @classmethod
    def parse(cls, section: Any) -> RolloutCorrection:
        """The parsed keys of a section holding verl's seven `algorithm.rollout_correction` keys."""
        rs_bounds = {}
        if section.rollout_rs is not None:
            rs_bounds = parse_rs_thresholds(parse_rs_options(section.rollout_rs), section.rollout_rs_threshold)
        return cls(
            rollout_is=section.rollout_is,
            is_bounds=parse_is_threshold(section.rollout_is_threshold),
            rollout_is_batch_normalize=bool(section.rollout_is_batch_normalize),
            rs_bounds=rs_bounds,
            bypass_mode=bool(section.bypass_mode),
            loss_type=str(section.loss_type),
        )

    @property
    def needs_mini_batch_normalizer(self) -> bool:
        """True when bypass mode's loss uses batch-normalized IS weights (reinforce with rollout_is_batch_normalize).

        The weights follow the policy being trained, so their mean is one over the whole mini-batch under the
        parameters of that optimizer step: the actor computes it first (one forward without gradients) and
        passes every micro-batch the sums (`normalizer_sums`, added over DP ranks).
        """
        return self.loss_type == "reinforce" and self.rollout_is is not None and self.rollout_is_batch_normalize


@dataclass
class RolloutCorrectionConfig(Section):
    rollout_is: str | None = key(
        None, "IS weights rollout→trainer policy: null (metrics only) | token | sequence", choices=(None, *IS_LEVELS)
    )
    rollout_is_threshold: Any = key(2.0, "IS weight bound: U truncates (TIS); 'L_U' zeroes weights outside (IcePop)")
    rollout_is_batch_normalize: bool = key(False, "divide IS weights by their batch mean (token or sequence level)")
    rollout_rs: str | None = key(None, f"rejection options, comma-separated: {' | '.join(RS_OPTIONS)}")
    rollout_rs_threshold: Any = key(None, "one bound per rollout_rs option (k1: 'L_U' ratio range; others: upper)")
    bypass_mode: bool = key(False, "old log-probs := rollout log-probs (skips the old-log-prob pass)")
    loss_type: str = key("ppo_clip", "bypass-mode actor loss: ppo_clip | reinforce", choices=LOSS_TYPES)

    def check(self, path: str, root: Any) -> None:
        RolloutCorrection.parse(self)
        used = self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode
        if used and not root.actor_rollout_ref.rollout.calculate_log_probs:
            raise ValueError(
                f"{path} needs the rollout engine's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true"
            )
        loss_mode = root.actor_rollout_ref.actor.policy_loss.loss_mode
        if self.rollout_is is not None and not self.bypass_mode and loss_mode not in IS_WEIGHTED_LOSSES:
            raise ValueError(
                f"{path}.rollout_is={self.rollout_is} with actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} "
                f"is not implemented; IS weights apply to the losses {', '.join(IS_WEIGHTED_LOSSES)}"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = {}
        if self.rollout_is is None:
            reason = f"{path}.rollout_is=null: no IS weights (metrics only)"
            out.update({f"{path}.{name}": reason for name in ("rollout_is_threshold", "rollout_is_batch_normalize")})
        if self.rollout_rs is None:
            out[f"{path}.rollout_rs_threshold"] = f"{path}.rollout_rs=null: no rejection"
        if not self.bypass_mode:
            out[f"{path}.loss_type"] = f"{path}.bypass_mode=false: the actor's policy_loss.loss_mode is used"
        else:
            out["actor_rollout_ref.actor.policy_loss.loss_mode"] = (
                f"{path}.bypass_mode=true: the loss is {path}.loss_type={self.loss_type} (as verl 0.9.1)"
            )
            old_pass = LOG_PROB_FIELDS.under(ROLLOUT)
            for name in (old_pass.micro, old_pass.global_micro, old_pass.dynamic, old_pass.max_token_len):
                out[name] = f"{path}.bypass_mode=true: no old-log-prob pass (π_old is the rollout's)"
        return out


# ───────────────────────────── PF-PPO ─────────────────────────────


REWEIGHT_METHODS = ("pow", "max_min", "max_random")


@dataclass
class PfPpoConfig(Section):
    reweight_method: str = key("pow", "pow (|score|^weight_pow) | max_min | max_random", choices=REWEIGHT_METHODS)
    weight_pow: float = key(2.0, "the power of the pow method")

    def inactive(self, path: str, root) -> dict[str, str]:
        if self.reweight_method == "pow":
            return {}
        return {f"{path}.weight_pow": f"{path}.reweight_method={self.reweight_method}: only pow uses a power"}


def pf_ppo_applies(algorithm) -> bool:
    """verl 0.9.1 resamples in its GAE branch only: `use_pf_ppo` has no effect with another estimator."""
    return bool(algorithm.use_pf_ppo) and algorithm.adv_estimator == "gae"
