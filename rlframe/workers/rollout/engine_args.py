"""Helpers of the server engines (vLLM, SGLang) and their memory check: config dicts, max_model_len, passthrough."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlframe.config.keys import ROLLOUT


def plain_dict(value: Any) -> dict:
    """A config dict (DictConfig or dict) as plain Python containers, interpolations resolved."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else dict(value or {})


def engine_passthrough(config, engine: str, check: Callable[[dict], None]) -> dict:
    """`engine_kwargs.<engine>` of the rollout section `config` as plain containers without its null entries (verl
    drops them), passed through the engine's `check`."""
    given = plain_dict(getattr(config.engine_kwargs, engine))
    passthrough = {name: value for name, value in given.items() if value is not None}
    check(passthrough)
    return passthrough


def resolve_max_model_len(max_model_len: int | None, max_position_embeddings: int) -> int:
    """verl's rule: null means the model's max_position_embeddings, and more than that is refused."""
    if max_model_len is None:
        return max_position_embeddings
    if max_model_len > max_position_embeddings:
        raise ValueError(
            f"{ROLLOUT}.max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{max_position_embeddings}; set it to at most that, or null to use it"
        )
    return int(max_model_len)


def model_max_position_embeddings(
    model_path: str, trust_remote_code: bool = False, override_config: dict | None = None
) -> int:
    """The model's max_position_embeddings (override_config wins), what max_model_len=null stands for."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    value = (override_config or {}).get("max_position_embeddings")
    for source in (config, getattr(config, "text_config", None)):
        value = value if value is not None else getattr(source, "max_position_embeddings", None)
    if value is None:
        raise ValueError(f"{model_path}'s config has no max_position_embeddings; set {ROLLOUT}.max_model_len")
    return int(value)
