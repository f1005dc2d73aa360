"""FSDP plumbing: devices, meshes, loading HF models, wrapping (FSDP2/FSDP1), offload, state dicts.

The recipe reads top to bottom: `load_hf_model` loads the HF model and optionally turns on
gradient checkpointing, then `wrap_fsdp` shards every decoder layer, then the root. The same code runs with gloo
on CPU and nccl on CUDA; only the device type and the default dtype change.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlframe.config.checks import STRATEGIES
from rlframe.distributed.shm_gather import SharedMemoryGroups, use_shared_memory_comms
from rlframe.workers.config.model import DTYPES
from rlframe.workers.lora import is_lora, trainable_parameters, trains_leaf_weight

TORCH_DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPES.items()}


def resolve_dtype(name: str, device_type: str) -> torch.dtype:
    """`param_dtype: auto` means bf16 on GPU and fp32 on CPU (CPU bf16 matmuls are slow and inexact)."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


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


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, the unit each FSDP shard gathers at a time: a vision-language model's vision blocks
    and decoder layers alike (both are in transformers' `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # fall back to the conventional HF location
        inner = getattr(model, "model", model)
        layers = list(getattr(inner, "layers", []))
    return layers


@dataclass(frozen=True)
class FSDPSpec:
    strategy: str  # fsdp2 | fsdp
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    param_offload: bool
    reshard_after_forward: bool
    forward_prefetch: bool = False  # overlap the next layer's all-gather with this layer's forward
    buffer_dtype: torch.dtype = torch.float32  # FSDP1 casts buffers to it; FSDP2 has no buffer dtype (as verl)

    def casts(self, model_dtype: torch.dtype, strategy: str) -> bool:
        """Whether mixed precision changes anything for a model loaded in `model_dtype` (else it is left off)."""
        dtypes = {self.param_dtype, self.reduce_dtype} | ({self.buffer_dtype} if strategy == "fsdp" else set())
        return dtypes != {model_dtype}


def wrap_fsdp(
    model: nn.Module, spec: FSDPSpec, mesh, device_type: str, shared_memory: SharedMemoryGroups | None = None
) -> nn.Module:
    """Shard `model` over the 1-D `mesh` with FSDP2 (`fully_shard`) or FSDP1.

    FSDP2 on CPU ranks of one machine gathers through `shared_memory` (the worker's: one buffer per group
    for all its models and the weight sync; without it, one of the model's own), kept as
    `model._rlframe_shared_memory` for the weight sync (`rlframe.workers.weight_sync`)."""
    if spec.strategy not in STRATEGIES:
        raise ValueError(
            f"strategy={spec.strategy!r} is not one of {', '.join(STRATEGIES)} "
            "(actor_rollout_ref.actor.strategy / critic.strategy)"
        )
    if spec.strategy == "fsdp2":
        return _wrap_fsdp2(model, spec, mesh, device_type, shared_memory)
    return _wrap_fsdp1(model, spec, mesh, device_type)


def _wrap_fsdp2(model, spec, mesh, device_type, shared_memory):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # HF heads return views (e.g. token-classification logits); rlframe only reads model outputs
    # out of place, which the equivalence tests check gradient by gradient, so the warning is noise.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    kwargs = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward}
    if spec.casts(_loaded_dtype(model), "fsdp2"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype, cast_forward_inputs=True
        )
    if spec.param_offload:
        # pin_memory needs a GPU; on CPU the policy still keeps the gathered copies off the "device"
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    # The model stays where it was loaded (CPU): each fully_shard call moves the states it manages to
    # the mesh's device before sharding them (torch/distributed/fsdp/_fully_shard/_fsdp_init.py,
    # `_move_states_to_device`), so the peak is one layer unsharded, not the whole fp32 model per GPU.
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if spec.forward_prefetch:  # one layer ahead, as FSDP1's forward_prefetch (its limit is 1)
        for layer, following in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([following])
    model._rlframe_shared_memory = shared_memory if shared_memory is not None else SharedMemoryGroups()
    if device_type == "cpu" and dist.is_initialized():
        # every rank on this machine: parameters and gradients cross through /dev/shm, not gloo's sockets
        use_shared_memory_comms(model, dist.group.WORLD, model._rlframe_shared_memory)
    return model


def _wrap_fsdp1(model, spec, mesh, device_type):
    import functools

    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    layer_types = {type(layer) for layer in decoder_layers(model)}
    # With LoRA, each adapter linear is its own unit too, so every flat parameter is all frozen or all
    # trainable and gradients are allocated for the adapter only (verl's LoRA wrap policy)
    lora = is_lora(model)  # not any frozen parameter: a frozen vision tower is no adapter
    policy = functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: type(m) in layer_types or (lora and trains_leaf_weight(m))
    )
    mixed = None
    if spec.casts(_loaded_dtype(model), "fsdp"):
        mixed = MixedPrecision(
            param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype, buffer_dtype=spec.buffer_dtype
        )
    # On a CPU host the parameters already live in host memory, and FSDP1's offload path asks for an
    # accelerator: offloading is a no-op there, so it is not requested.
    offload = spec.param_offload and device_type == "cuda"
    if mesh.ndim == 2:  # hybrid: shard within a group, replicate across groups
        groups = {"device_mesh": mesh}
        strategy = ShardingStrategy.HYBRID_SHARD if spec.reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
    else:
        groups = {"process_group": mesh.get_group()}
        strategy = ShardingStrategy.FULL_SHARD if spec.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
    return FSDP(
        model,
        **groups,
        auto_wrap_policy=policy,
        mixed_precision=mixed,
        cpu_offload=CPUOffload(offload_params=offload),
        sharding_strategy=strategy,
        device_id=torch.cuda.current_device() if device_type == "cuda" else torch.device("cpu"),
        use_orig_params=True,
        sync_module_states=False,
        forward_prefetch=spec.forward_prefetch,
    )


def _loaded_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model's floating-point parameters were loaded in (fsdp_config.model_dtype)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global grad norm across shards, clipped in place; returns the norm before clipping."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        return model.clip_grad_norm_(max_norm)
    params = [p for p in model.parameters() if p.grad is not None]
    # FSDP2: the norm of sharded grads is a DTensor whose reduction runs on the mesh's backend; under
    # param_offload the grads (and so the norm) live on the CPU, which nccl does not take.
    norm = on_mesh_device(torch.nn.utils.get_total_norm([p.grad for p in params]))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def on_mesh_device(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor moved to its mesh's device type when its local shard is elsewhere; anything else as is.

    FSDP2's CPUOffloadPolicy keeps shards on the CPU while the mesh (and its nccl group) is CUDA: a
    collective on such a DTensor (`full_tensor`, a norm's reduction) must run on a CUDA copy.
    """
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None or tensor.device.type == mesh.device_type:
        return tensor
    return tensor.to(mesh.device_type)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the unsharded parameters (every rank calls; every rank gets them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized() or not _is_fsdp(model):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    # FSDP1's CPU-offload gather crashes on CPU (docs/fsdp_engine.md): gather first, then move.
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=options).items()}


def iter_full_params(model: nn.Module):
    """(name, full tensor) one parameter at a time, on the model's device: the weight-sync stream.

    Under FSDP2 each DTensor is all-gathered on its own (every rank walks the same state-dict order),
    so at most one unsharded tensor is alive at a time, instead of a full CPU copy of the model.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):  # FSDP1 has no per-tensor gather: fall back to the full state dict
        yield from full_state_dict(model).items()
        return
    for name, tensor in model.state_dict().items():
        yield name, (on_mesh_device(tensor).full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(model, FSDP) or any(hasattr(p, "device_mesh") for p in model.parameters())


def optimizer_state_device(param: torch.Tensor, target: str | int | torch.device) -> torch.device:
    """Where one parameter's optimizer state goes when it is moved to `target` (optimizer_offload).

    Adam's step runs where the parameter and its grad are: a parameter kept on the CPU by param_offload
    keeps its state on the CPU too, or the step would mix devices.
    """
    target = torch.device("cuda", target) if isinstance(target, int) else torch.device(target)
    return param.device if target.type != "cpu" and param.device.type == "cpu" else target


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str | int | torch.device) -> None:
    """Move optimizer state tensors (optimizer_offload): to CPU after a step, back before the next.

    A device-to-host copy with non_blocking returns before the data has arrived, so the offload waits
    for it: a checkpoint may read the state right after.
    """
    copied_from_cuda = False
    for param, state in optimizer.state.items():
        target = optimizer_state_device(param, device)
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step" and value.device != target:
                copied_from_cuda |= value.is_cuda and target.type == "cpu"
                state[key] = value.to(target, non_blocking=True)
    if copied_from_cuda:
        torch.cuda.synchronize()


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (with LoRA: the adapter only, so state is kept for it alone).

    `foreach=True` on every device (torch picks it by default on CUDA only): one multi-tensor op per
    update term instead of one op per parameter, the same numbers bitwise (tests/workers/test_optimizer.py).
    Under FSDP2 every parameter is a DTensor and each op pays DTensor's dispatch, so the per-parameter loop
    cost the tiny model's update a quarter of its time on CPU (docs/benchmarks.md).
    """
    return torch.optim.AdamW(
        trainable_parameters(model),
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        weight_decay=optim_cfg.weight_decay,
        foreach=True,
    )


def cosine_lr_factor(step: int, warmup: int, total_steps: int, min_lr_ratio: float) -> float:
    """verl's cosine schedule (num_cycles 0.5): lr / base lr at scheduler step `step`, 0-indexed."""
    import math

    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total_steps - warmup)
    # Evaluated as verl does, not as transformers' cosine helpers do (0.5·(1+cos)·(1−m) + m): the
    # same number mathematically, but it differs in the last bit for about a third of the steps.
    return max(min_lr_ratio, math.cos(math.pi * progress) * ((1 - min_lr_ratio) * 0.5) + (1 + min_lr_ratio) * 0.5)


def scheduler_type(optim_cfg) -> str:
    """`lr_scheduler_type`, unless the deprecated `warmup_style` is set (verl 0.9.1 copies it over)."""
    return optim_cfg.warmup_style or optim_cfg.lr_scheduler_type


def build_lr_scheduler(optimizer, optim_cfg, total_steps: int):
    """verl 0.9.1's schedules: linear warmup from 0, then constant or cosine down to min_lr_ratio · lr."""
    from functools import partial

    from transformers.optimization import get_constant_schedule_with_warmup

    warmup = optim_cfg.lr_warmup_steps
    if warmup is None or warmup <= 0:  # verl: 0 warmup steps also defers to the ratio
        warmup = int(optim_cfg.lr_warmup_steps_ratio * max(total_steps, 0))
    style = scheduler_type(optim_cfg)
    if style == "constant":  # transformers' helper computes verl's values exactly: step / warmup, then 1
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    if style != "cosine":
        raise ValueError(f"optim.lr_scheduler_type={style!r} is not one of constant, cosine")
    min_ratio = optim_cfg.min_lr_ratio
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio={min_ratio} must be in [0, 1] (the cosine floor as a fraction of lr)")
    factor = partial(cosine_lr_factor, warmup=warmup, total_steps=total_steps, min_lr_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
