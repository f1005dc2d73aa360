"""Tensor parallelism for the HF rollout replica: torch DTensor plans over the TP sub-mesh.

Megatron-style: q/k/v and gate/up are split by output features (each rank owns whole attention
heads and a slice of the MLP), o_proj and down_proj by input features, with one all-reduce after
each. Embeddings and lm_head stay replicated, so every TP rank computes the same logits and samples
the same token from the same RNG state. Works with gloo on CPU and nccl on GPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def tp_mesh_from_group(tp_group, device_type: str):
    """A 1-D DeviceMesh over an existing TP process group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(tp_group, device_type, mesh_dim_names=("tp",))


def check_tp_shapes(config, tp_size: int) -> None:
    """Every rank must own whole heads and an equal MLP slice; say which size does not divide."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp_size}
    if bad:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size} must divide the model's "
            f"{', '.join(f'{k}={v}' for k, v in bad.items())} for the hf rollout; pick a TP size that "
            "divides them (KV heads are not replicated across TP ranks)"
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """Shard the attention and MLP projections of every decoder layer over `tp_mesh` (in place)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_tp_shapes(model.config, tp_mesh.size())
    plan = {}
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLWISE:
            plan[name] = ColwiseParallel()
        elif leaf in ROWWISE:
            plan[name] = RowwiseParallel()
    if not plan:
        raise ValueError(
            f"no {COLWISE + ROWWISE} projections found in {type(model).__name__}; the hf rollout's "
            "tensor parallel plan covers Llama/Qwen-style decoders only (use tensor_model_parallel_size=1)"
        )
    parallelize_module(model, tp_mesh, plan)
    return model


@torch.no_grad()
def load_full_tensors(targets: dict[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy full tensors into `targets` (plain or DTensor parameters), each rank keeping its own shard.

    Returns the names loaded. Unknown names raise, listing a few known ones, so a naming mismatch
    between the training model and the replica cannot silently leave stale weights.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    loaded = set()
    for name, full in named_tensors:
        target = targets.get(name)
        if target is None:
            known = ", ".join(list(targets)[:4])
            raise KeyError(
                f"rollout update_weights: no parameter named {name!r} in the rollout model (it has e.g. {known}, ...)"
            )
        if isinstance(target, DTensor):
            local = target.to_local()
            full = full.to(local.device, local.dtype)
            # src_data_rank=None: every rank already holds the full tensor; cut locally, no communication
            shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
            local.copy_(shard)
        else:
            if tuple(full.shape) != tuple(target.shape):
                raise ValueError(
                    f"rollout update_weights: {name} has shape {tuple(full.shape)}, "
                    f"the rollout model expects {tuple(target.shape)}"
                )
            target.copy_(full.to(target.device, target.dtype))
        loaded.add(name)
    return loaded


def group_rank_and_size(group) -> tuple[int, int]:
    """(rank in group, group size); (0, 1) without a group or without torch.distributed."""
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
