"""LoRA on the actor with PEFT, under verl 0.9.1's keys (`actor_rollout_ref.model.lora_rank` & co.).

With `lora_rank > 0` the actor is a PEFT `PeftModelForCausalLM`: the base weights are frozen and only
the adapter (`lora_A`, `lora_B` of each targeted linear) trains, so the optimizer holds state for the
adapter alone. Around the model:

- **Reference policy**: the actor's own base model with the adapter switched off (`adapter_disabled`),
  as verl's `ref_in_actor`: no second copy of the model is loaded.
- **FSDP**: FSDP2 shards per parameter, frozen and trainable alike; FSDP1 additionally wraps every leaf
  module whose weight trains (the adapter's linears) as its own unit, so each flat parameter is all
  frozen or all trainable and gradients are kept for the adapter only (verl's LoRA wrap policy).
- **Rollout**: the HF engine receives merged weights `W + scaling · B @ A`, computed out of place while
  the weights stream (the trained adapter and the base weights are never modified); vLLM receives the
  base weights once and then the adapter (a LoRA request) after every update. The stream is
  `weight_sync.sync_lora_to_rollout`; this module gives it the names, the merge and the adapter files.
- **Checkpoints** hold the adapter and its optimizer state (the base is re-read from `model.path`);
  the HF export writes the merged model and, in `lora_adapter/`, the adapter as PEFT saves it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlframe.utils.safe_files import replace_folder

ADAPTER = "default"  # PEFT's name of the one adapter rlframe trains
ADAPTER_DIR = "lora_adapter"  # the adapter's folder inside an HF export
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA settings of `actor_rollout_ref.model`, read once."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    adapter_path: str | None = None

    @classmethod
    def from_config(cls, model_cfg) -> LoraSpec | None:
        """None when LoRA is off (`lora_rank: 0`, verl's default)."""
        if int(model_cfg.lora_rank) <= 0:
            return None
        return cls(
            rank=int(model_cfg.lora_rank),
            alpha=float(model_cfg.lora_alpha),
            target_modules=_names(model_cfg.target_modules),
            exclude_modules=_names(model_cfg.exclude_modules),
            adapter_path=model_cfg.lora_adapter_path,
        )


def configured_lora_rank(model_cfg) -> int:
    """The actor's adapter rank before its model is built: a loaded adapter's own (`lora_adapter_path`), else
    `lora_rank`; 0 without LoRA (a process that serves the adapter without training it, the rollout pool's)."""
    spec = LoraSpec.from_config(model_cfg)
    if spec is None or spec.adapter_path is None:
        return 0 if spec is None else spec.rank
    from peft import PeftConfig

    return int(PeftConfig.from_pretrained(spec.adapter_path).r)


def _names(value: Any) -> str | tuple[str, ...] | None:
    """A module-name key as PEFT takes it: one string (a regex or `all-linear`) or a list of names."""
    if value is None or isinstance(value, str):
        return value
    return tuple(str(v) for v in value)


# ---------------------------------------------------------------- building the PEFT model
def apply_lora(model: nn.Module, spec: LoraSpec, use_shm: bool = False) -> nn.Module:
    """Wrap a causal LM with a trainable LoRA adapter: a fresh one, or the one at `spec.adapter_path`.

    A fresh adapter starts as PEFT initializes it (A random, B zero: the model starts as the base
    model); every rank draws the same A because every worker seeds torch with `data.seed` first.
    """
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model

    if spec.adapter_path is not None:
        path = spec.adapter_path
        if use_shm:
            from rlframe.models.builtin import copy_to_shm

            path = copy_to_shm(path)
        model = PeftModel.from_pretrained(model, path, adapter_name=ADAPTER, is_trainable=True)
        check_plain_lora(model.peft_config[ADAPTER], spec.adapter_path)
        return model
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.target_modules) if isinstance(spec.target_modules, tuple) else spec.target_modules,
        exclude_modules=list(spec.exclude_modules) if isinstance(spec.exclude_modules, tuple) else spec.exclude_modules,
        bias="none",
    )
    return get_peft_model(model, config, adapter_name=ADAPTER)


def check_plain_lora(config, where: str) -> None:
    """The merge and the vLLM path implement plain LoRA (`W + scaling · B @ A`); refuse PEFT's variants."""
    from peft import PeftType

    variants = {
        "peft_type": config.peft_type != PeftType.LORA,
        "use_dora": bool(getattr(config, "use_dora", False)),
        "lora_bias": bool(getattr(config, "lora_bias", False)),
        "fan_in_fan_out": bool(getattr(config, "fan_in_fan_out", False)),
        "target_parameters": bool(getattr(config, "target_parameters", None)),
    }
    used = [name for name, on in variants.items() if on]
    if used:
        raise ValueError(
            f"actor_rollout_ref.model.lora_adapter_path={where}: the adapter uses {', '.join(used)} "
            f"(peft_type {config.peft_type}); rlframe trains plain LoRA adapters only (no DoRA, LoRA bias, "
            "fan_in_fan_out or target_parameters). Use a plain LoRA adapter or start a fresh one (lora_rank > 0)."
        )


def peft_model_of(model: nn.Module) -> nn.Module | None:
    """The PeftModel inside `model` (FSDP1 wraps it; FSDP2 is the module itself), or None without LoRA."""
    inner = getattr(model, "_fsdp_wrapped_module", model)
    return inner if hasattr(inner, "peft_config") else None


def is_lora(model: nn.Module) -> bool:
    return peft_model_of(model) is not None


def lora_rank_of(model: nn.Module) -> int:
    """The adapter's rank (from its PEFT config: a loaded adapter brings its own), 0 without LoRA."""
    peft_model = peft_model_of(model)
    return 0 if peft_model is None else int(peft_model.peft_config[ADAPTER].r)


def adapter_disabled(model: nn.Module):
    """Context in which `model` computes as its base model (the reference policy); a no-op without LoRA."""
    peft_model = peft_model_of(model)
    return nullcontext() if peft_model is None else peft_model.disable_adapter()


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer steps: every parameter of a full model, the adapter's of a LoRA model."""
    return [p for p in model.parameters() if p.requires_grad]


def trains_leaf_weight(module: nn.Module) -> bool:
    """FSDP1's extra LoRA wrap unit: a leaf module whose weight trains (an adapter's lora_A/lora_B)."""
    weight = getattr(module, "weight", None)
    return next(module.children(), None) is None and weight is not None and weight.requires_grad


def checkpoint_options(model: nn.Module):
    """DCP state-dict options: a LoRA model's checkpoint holds its adapter alone (the base is re-read from
    model.path); loading then fills exactly the adapter, so the frozen keys are not required."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = is_lora(model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


# ---------------------------------------------------------------- names and merged weights
def base_name(name: str) -> str:
    """A PEFT state-dict name as the base model spells it (`base_model.model.` and `.base_layer` dropped)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def is_adapter_tensor(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """{PEFT module name: alpha / r (or alpha / sqrt(r) with rsLoRA)} of every adapted linear."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.scaling:
            for prefix in _WRAPPER_PREFIXES:
                name = name.replace(prefix, "")
            out[name] = module.scaling[ADAPTER]
    return out


def merged_params(
    named_tensors: Iterable[tuple[str, torch.Tensor]], scalings: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The PEFT model's full tensors as the base model's, each adapted weight merged: W + scaling · (B @ A).

    Out of place, in PEFT's order of operations (so the result is bitwise PEFT's `merge`), holding at
    most one adapted linear's three tensors at a time; adapter tensors themselves are not yielded.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        module, _, leaf = name.rpartition(".")
        if is_adapter_tensor(name):  # <module>.lora_A.default.weight
            owner, part = module.rsplit(".", 2)[0], module.split(".")[-2]
        elif module.endswith(".base_layer") and leaf == "weight" and module[: -len(".base_layer")] in scalings:
            owner, part = module[: -len(".base_layer")], "W"
        else:
            yield base_name(name), tensor
            continue
        parts = pending.setdefault(owner, {})
        parts[part] = tensor
        if len(parts) == 3:
            del pending[owner]
            delta = (parts["lora_B"] @ parts["lora_A"]) * scalings[owner]
            yield base_name(owner) + ".weight", parts["W"] + delta
    assert not pending, f"adapted linears with missing tensors: {sorted(pending)}"


def full_adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's full tensors (PEFT names, on every rank): a collective under FSDP, gathering the adapter only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    return {name: tensor.detach() for name, tensor in get_model_state_dict(model, options=options).items()}


def peft_adapter_files(model: nn.Module, adapter_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors named as PEFT saves them (`adapter_model.safetensors`: no adapter name)."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model_of(model), state_dict=adapter_state, adapter_name=ADAPTER)


def write_adapter_folder(folder: str, tensors: dict[str, torch.Tensor], peft_config) -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors`: what `PeftModel.from_pretrained` and vLLM read."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    peft_config.save_pretrained(folder)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})


def save_adapter(folder: str, model: nn.Module, adapter_state: dict[str, torch.Tensor]) -> None:
    """The adapter of `model` (its full tensors in `adapter_state`) as a PEFT adapter folder."""
    write_adapter_folder(folder, peft_adapter_files(model, adapter_state), peft_model_of(model).peft_config[ADAPTER])


# ---------------------------------------------------------------- vLLM's side (pure: tested without vLLM)
# vLLM's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks, read when vLLM is installed)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int, allowed: tuple[int, ...] = VLLM_LORA_RANKS) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of rank `rank`."""
    fits = [r for r in sorted(allowed) if r >= rank]
    if not fits:
        raise ValueError(
            f"actor_rollout_ref.model.lora_rank={rank}: vLLM serves LoRA adapters up to rank {max(allowed)}; "
            "lower lora_rank or use actor_rollout_ref.rollout.name=hf (merged weights)"
        )
    return fits[0]


def vllm_lora_engine_kwargs(rank: int) -> dict:
    """vLLM engine arguments for serving one LoRA adapter of rank `rank` (none when 0)."""
    if rank <= 0:
        return {}
    try:
        from typing import get_args

        from vllm.config.lora import MaxLoRARanks

        allowed = tuple(get_args(MaxLoRARanks)) or VLLM_LORA_RANKS
    except ImportError:
        allowed = VLLM_LORA_RANKS
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_max_lora_rank(rank, allowed)}


def vllm_adapter_config(peft_config):
    """A copy of the adapter's config for vLLM: target modules as leaf names (`q_proj`, ...).

    PEFT expands `all-linear` into full module paths, which some vLLM versions refuse as unknown modules;
    vLLM applies an adapter where its tensors are, so leaf names mean the same adapter.
    """
    import copy

    config = copy.deepcopy(peft_config)
    if not isinstance(config.target_modules, str):
        config.target_modules = sorted({name.rsplit(".", 1)[-1] for name in config.target_modules})
    config.exclude_modules = None
    return config


# ---------------------------------------------------------------- Hugging Face export
def save_adapter_config(role_dir: str, model: nn.Module) -> None:
    """A LoRA checkpoint's `lora_adapter/adapter_config.json` (rank, alpha, targets): with the adapter tensors
    in `model/`, what an offline merge (`rlframe merge`) needs to rebuild the adapter on the base model."""
    peft_model_of(model).peft_config[ADAPTER].save_pretrained(os.path.join(role_dir, ADAPTER_DIR))


def export_lora_hf(
    out_dir: str, model: nn.Module, state: dict[str, torch.Tensor], tokenizer=None, dtype: torch.dtype | None = None
) -> None:
    """Rank 0's part of a LoRA export: the merged model + tokenizer in `out_dir`, the adapter in `lora_adapter/`.

    `state` is the full PEFT state dict (already gathered by every rank); the merge runs in its dtype and
    `dtype`, if given, converts what is written. Written to a temp dir, then renamed.
    """
    peft_model = peft_model_of(model)
    merged = dict(merged_params(state.items(), lora_scalings(model)))
    adapter = {name: tensor for name, tensor in state.items() if is_adapter_tensor(name)}
    if dtype is not None:
        merged, adapter = ({k: v.to(dtype) for k, v in part.items()} for part in (merged, adapter))

    def fill(tmp: str) -> None:
        peft_model.get_base_model().save_pretrained(tmp, state_dict=merged)
        save_adapter(os.path.join(tmp, ADAPTER_DIR), model, adapter)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    replace_folder(out_dir, fill)


def merge_lora_checkpoint(
    role_dir: str, adapter_tensors: dict[str, torch.Tensor], source: str, out_dir: str, dtype=None
) -> None:
    """Offline: the adapter of a LoRA checkpoint (tensors of `model/` + `lora_adapter/adapter_config.json`) on
    the base model at `source`, written as an HF export (merged model + tokenizer, adapter in `lora_adapter/`)."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_dir = os.path.join(role_dir, ADAPTER_DIR)
    if not os.path.isfile(os.path.join(config_dir, "adapter_config.json")):
        raise ValueError(
            f"{role_dir}/model holds LoRA adapter tensors but {config_dir}/adapter_config.json is missing "
            "(its rank, alpha and target modules); the checkpoint was not written by a LoRA run of rlframe"
        )
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model = PeftModel(base, LoraConfig.from_pretrained(config_dir), adapter_name=ADAPTER)
    state = model.state_dict()
    expected = {name for name in state if is_adapter_tensor(name)}
    if set(adapter_tensors) != expected:
        extra, lacking = sorted(set(adapter_tensors) - expected), sorted(expected - set(adapter_tensors))
        raise ValueError(
            f"{role_dir}/model does not fit its adapter config on {source}: "
            f"unexpected {extra[:5]}, missing {lacking[:5]}"
        )
    state.update(adapter_tensors)
    export_lora_hf(
        out_dir, model, state, AutoTokenizer.from_pretrained(source), getattr(torch, dtype) if dtype else None
    )
