"""How one call samples: the training or validation sampling the rollout section asks for, checked by key."""

from __future__ import annotations

from dataclasses import dataclass

from rlframe.config.keys import ROLLOUT as KEY


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one call's responses; `greedy` when do_sample is off or temperature is 0."""

    temperature: float
    top_p: float
    top_k: int  # -1 (or 0) = off
    n: int  # responses per prompt; repetition happens on the driver, engines see n copies
    do_sample: bool
    response_length: int  # max generated tokens

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_config(cls, rollout_cfg, validate: bool = False) -> SamplingParams:
        """Training sampling from `rollout.*`, or validation sampling from `rollout.val_kwargs.*`."""
        source, prefix = (rollout_cfg.val_kwargs, f"{KEY}.val_kwargs") if validate else (rollout_cfg, KEY)
        params = cls(
            temperature=float(source.temperature),
            top_p=float(source.top_p),
            top_k=int(source.top_k),
            n=int(source.n),
            do_sample=bool(source.do_sample),
            response_length=int(rollout_cfg.response_length),
        )
        params.check(prefix)
        return params

    def check(self, prefix: str = KEY) -> None:
        """Raise a ValueError naming the key for any value an engine cannot use."""
        if self.n < 1:
            raise ValueError(f"{prefix}.n={self.n}: the number of responses per prompt must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"{prefix}.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{prefix}.top_p={self.top_p}: must be in (0, 1] (1 = off)")
        if self.top_k < -1:
            raise ValueError(f"{prefix}.top_k={self.top_k}: must be -1 or 0 (off) or a positive int")
        if self.response_length < 1:
            raise ValueError(f"{KEY}.response_length={self.response_length}: must be >= 1")
