"""The `actor_rollout_ref.rollout.checkpoint_engine` section: how `separate_async` pushes weights to the rollout pool.

verl 0.9.1's keys with its meanings: `backend` is the transport of the trainer's weights to the standalone rollout
(`naive`, its default: rlframe's push through Ray's object store; `nccl`: a collective of its own, gloo on CPU,
`rlframe/workers/weight_push.py`), `update_weights_bucket_megabytes` the size of the buckets it moves.
verl's `engine_kwargs` (arguments of a backend's transfer engine) and `custom_backend_module` (a backend of your own)
have nothing to configure in rlframe: only their defaults are taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from rlframe.config.keys import ROLLOUT
from rlframe.config.schema import Section, key

BACKENDS = ("naive", "nccl")
PATH = f"{ROLLOUT}.checkpoint_engine"


def _check_positive(value: int) -> None:
    if value < 1:
        raise ValueError("must be >= 1 (megabytes per bucket)")


def _check_no_engine_kwargs(value: dict) -> None:
    if value:
        raise ValueError(
            "rlframe's backends take no engine arguments (verl passes these to nixl's or mooncake's transfer engine); "
            "leave it {}"
        )


def _check_no_custom_backend(value: Optional[str]) -> None:
    if value is not None:
        raise ValueError(
            f"custom checkpoint-engine backends are not supported; leave it null and set {PATH}.backend to "
            f"{' or '.join(BACKENDS)}"
        )


@dataclass
class CheckpointEngineConfig(Section):
    backend: str = key(
        "naive",
        "trainer.v1.trainer_mode=separate_async's weight push: naive = through Ray's object store | nccl = broadcast "
        "over a process group of the training pool's rank 0 and the rollout pool (gloo on CPU, nccl on CUDA)",
        choices=BACKENDS,
    )
    update_weights_bucket_megabytes: int = key(2048, "nccl: megabytes per broadcast bucket", check=_check_positive)
    engine_kwargs: Dict[str, Any] = key({}, "verl's transfer-engine arguments: only {}", check=_check_no_engine_kwargs)
    custom_backend_module: Optional[str] = key(None, "verl's custom backend: only null", check=_check_no_custom_backend)

    def check(self, path: str, root: Any) -> None:
        mode = root.trainer.v1.trainer_mode
        if self.backend != "naive" and mode != "separate_async":
            raise ValueError(
                f"{path}.backend={self.backend} with trainer.v1.trainer_mode={mode}: the rollout shares the training "
                "processes, which sync its weights in place, so there is nothing to push; set "
                f"trainer.v1.trainer_mode=separate_async (a rollout pool of its own) or {path}.backend=naive"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if root.trainer.v1.trainer_mode != "separate_async":
            mode = f"trainer.v1.trainer_mode={root.trainer.v1.trainer_mode}"
            return {path: f"{mode}: only separate_async pushes weights (the others sync them in place)"}
        out = {
            f"{path}.engine_kwargs": "only {}: rlframe's backends take no transfer-engine arguments",
            f"{path}.custom_backend_module": "only null: custom backends are not supported",
        }
        if self.backend == "naive":
            out[f"{path}.update_weights_bucket_megabytes"] = f"{path}.backend=naive sends whole tensors"
        return out
