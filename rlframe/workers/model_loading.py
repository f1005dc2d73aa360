"""Loading a Hugging Face model for a role: a causal LM (actor, reference) or a value model (critic), on CPU.

`load_hf_model` is the first step of a worker's model recipe; `fsdp_wrap.wrap_fsdp` is the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """What to load and how: plain values read once from the config."""

    path: str
    role: str  # "actor" (causal LM) or "critic" (scalar value head)
    dtype: torch.dtype
    use_remove_padding: bool
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    override_config: dict | None = None
    freeze_vision_tower: bool = False  # a vision-language actor's tower keeps its weights (verl freezes model.visual)


def load_hf_model(spec: ModelSpec) -> nn.Module:
    """Load a causal LM (actor/ref) or a token-classification value model (critic) on CPU.

    A config with a `vision_config` is a vision-language model (Qwen2-VL family, `rlframe.models.vision`): the
    actor and reference load it as `AutoModelForImageTextToText` (its `architectures`' class, tower included);
    a value model of one is refused. A tensor holding NaN/inf is refused, naming its file and name.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    from rlframe.distributed.attention import register_varlen_attention
    from rlframe.models.vision import causal_lm_class, check_vision_model, is_vision_model
    from rlframe.models.weight_check import check_pretrained_weights

    config = AutoConfig.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    for key, value in (spec.override_config or {}).items():
        setattr(config, key, value)
    attn = register_varlen_attention() if spec.use_remove_padding else "sdpa"
    kwargs = dict(config=config, dtype=spec.dtype, attn_implementation=attn, trust_remote_code=spec.trust_remote_code)
    vision = is_vision_model(config)
    if vision and spec.role == "critic":
        raise ValueError(
            f"critic.model.path={spec.path} is a vision-language model (its config has a vision_config); a value "
            "model of one is not implemented: give critic.model.path a text model, or train without a critic "
            "(algorithm.adv_estimator=grpo)"
        )
    if spec.freeze_vision_tower and not vision:
        raise ValueError(
            f"actor_rollout_ref.actor.freeze_vision_tower=true, but {spec.path} has no vision tower (no vision_config "
            "in its config): set it false for a text model"
        )
    if vision:
        check_vision_model(config.model_type, spec.path)
        model = causal_lm_class(config).from_pretrained(spec.path, **kwargs)
        if spec.freeze_vision_tower:
            freeze_vision_tower(model)
    elif spec.role == "critic":
        config.num_labels = 1
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(spec.path, **kwargs)
    else:
        model = causal_lm_class(config).from_pretrained(spec.path, **kwargs)
    check_pretrained_weights(model, spec.path)
    model.config.use_cache = False
    if spec.gradient_checkpointing:
        # transformers 5 renamed gradient_checkpointing_enable; accept both
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def freeze_vision_tower(model: nn.Module) -> None:
    """`actor_rollout_ref.actor.freeze_vision_tower`: the tower's parameters take no gradient and no optimizer step
    (`build_optimizer` steps the parameters that require one). The merger, the projection into the language
    model's width, is part of the tower (`visual`) in transformers' Qwen2-VL and is frozen with it, as in verl."""
    from rlframe.workers.multimodal import vision_tower

    tower = vision_tower(model)
    if tower is None:
        raise ValueError("actor_rollout_ref.actor.freeze_vision_tower=true, but the model has no vision tower (visual)")
    tower.requires_grad_(False)
