"""Sharding a loaded model with FSDP2 (`fully_shard`) or FSDP1: the units, mixed precision, parameter offload.

`wrap_fsdp` shards every decoder layer, then the root. The same code runs with gloo on CPU and nccl on CUDA;
only the device type and the default dtype change.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlframe.config.checks import STRATEGIES
from rlframe.distributed.shm_gather import SharedMemoryGroups, use_shared_memory_comms
from rlframe.workers.lora import is_lora, trains_leaf_weight


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
