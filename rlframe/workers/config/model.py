"""What several roles share: the model, optimizer, FSDP, mixed-precision and checkpoint sections."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from rlframe.config.checks import SAVE_CONTENTS, planned_device
from rlframe.config.keys import REF, ref_enabled
from rlframe.config.schema import Section, each_of, key, section
from rlframe.utils.shm import shm_dir

# the dtype names the keys accept, and the torch dtype each names (`workers.dtypes.resolve_dtype` resolves them)
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
DTYPE_NAMES = ("auto", *DTYPES)
WARMUP_STYLES = ("constant", "cosine")


def log_prob_pass_switches(path: str, root: Any) -> dict[str, str]:
    """The verl switches of a log-prob pass (actor or ref) that have no effect here, with why."""
    # rlframe always computes entropy a chunk of tokens at a time and recomputes each chunk in backward:
    # the same numbers as verl with either switch, in less memory than verl with both off
    reason = "rlframe always computes entropy in chunks and recomputes them in backward (same values, less memory)"
    out = {f"{path}.{name}": reason for name in ("entropy_from_logits_with_chunking", "entropy_checkpointing")}
    if planned_device(root.trainer.device) != "cuda":
        out[f"{path}.use_torch_compile"] = "torch.compile is applied on CUDA only (the device here is cpu)"
    return out


def check_shm(path: str, use_shm: bool) -> None:
    """use_shm needs the shared-memory mount the model folder is copied to."""
    if use_shm and not os.path.isdir(shm_dir()):
        raise ValueError(
            f"{path}.use_shm=true needs {shm_dir()} (a Linux shared-memory mount, or the folder RLFRAME_SHM_DIR "
            "names); set it to false"
        )


def _check_impl_backend(name: str) -> None:
    if name in ("triton", "liger"):
        raise ValueError(
            f"verl's {name} kernel (a CUDA GPU kernel) is not implemented in rlframe; impl_backend=torch gives the "
            "same log-probs and entropy from a chunked computation (docs/fsdp_engine.md)"
        )
    if name != "torch":
        raise ValueError("verl 0.9.1's backends are torch, triton and liger; rlframe implements torch")


@dataclass
class FusedKernelOptions(Section):
    impl_backend: str = key(
        "torch", "torch (chunked fused head); verl's triton and liger kernels are refused", check=_check_impl_backend
    )


def offload_inactive(path: str, enabled: bool, root: Any) -> dict[str, str]:
    """enable_activation_offload has nothing to move when the activations already live in host memory."""
    if enabled and planned_device(root.trainer.device) != "cuda":
        return {f"{path}.enable_activation_offload": "the device here is cpu: activations already live in host memory"}
    return {}


@dataclass
class ModelConfig(Section):
    path: str = key("builtin://tiny", "local HF model dir; builtin://tiny = tiny random Qwen2 built offline")
    external_lib: Optional[str] = key(None, "python module imported in workers before loading (custom models)")
    override_config: Dict[str, Any] = key({}, "fields merged into the model's HF config")
    enable_gradient_checkpointing: bool = key(True, "recompute activations in backward (saves memory)")
    use_remove_padding: bool = key(True, "pack sequences into one row with cu_seqlens (no pad compute)")
    trust_remote_code: bool = key(False, "passed to from_pretrained")
    use_shm: bool = key(False, "copy the model folder to /dev/shm once per node and load from there")
    enable_activation_offload: bool = key(
        False, "keep saved activations in host memory from forward to backward (CUDA; docs/fsdp_engine.md)"
    )
    use_fused_kernels: bool = key(
        False, "log-probs and entropy from the last hidden states a chunk at a time, never the full logits"
    )
    fused_kernel_options: FusedKernelOptions = section(FusedKernelOptions)
    lora_rank: int = key(0, "LoRA rank; 0 = train the full model, > 0 = train a PEFT LoRA adapter (docs/lora.md)")
    lora_alpha: int = key(16, "LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank")
    target_modules: Any = key("all-linear", "modules given an adapter: all-linear, a regex, or a list of names")
    exclude_modules: Any = key(None, "modules never given an adapter: null, a regex, or a list of names")
    lora_adapter_path: Optional[str] = key(None, "PEFT adapter folder to continue training (needs lora_rank > 0)")

    def check(self, path: str, root: Any) -> None:
        check_shm(path, self.use_shm)
        _check_lora(path, self)
        if self.use_fused_kernels and root.actor_rollout_ref.actor.calculate_sum_pi_squared:
            raise ValueError(
                f"{path}.use_fused_kernels=true with actor_rollout_ref.actor.calculate_sum_pi_squared=true: "
                "Σπ² needs the full logits, which the fused head never builds (as in verl 0.9.1); turn one off"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = offload_inactive(path, self.enable_activation_offload, root)
        if not self.use_fused_kernels:
            out[f"{path}.fused_kernel_options"] = f"{path}.use_fused_kernels=false"
        shaping = ("lora_alpha", "target_modules", "exclude_modules")
        if self.lora_rank == 0:
            out.update({f"{path}.{name}": f"{path}.lora_rank=0 (LoRA off)" for name in (*shaping, "lora_adapter_path")})
            return out
        if self.lora_adapter_path is not None:
            reason = f"{path}.lora_adapter_path is set: the adapter's adapter_config.json decides"
            out.update({f"{path}.{name}": reason for name in shaping})
        if ref_enabled(root):
            out[f"{REF}.fsdp_config"] = (
                f"{path}.lora_rank > 0: the reference policy is the actor's base model with the adapter "
                "disabled (verl's ref_in_actor); no separate reference model is built"
            )
        return out


def _check_lora(path: str, model: ModelConfig) -> None:
    """LoRA keys: types PEFT accepts, and an adapter folder only together with lora_rank > 0."""
    if model.lora_rank < 0:
        raise ValueError(f"{path}.lora_rank={model.lora_rank} must be >= 0 (0 turns LoRA off)")
    for name in ("target_modules", "exclude_modules"):
        value = getattr(model, name)
        if name == "exclude_modules" and value is None:
            continue
        names = isinstance(value, Sequence) and all(isinstance(v, str) for v in value)
        if not isinstance(value, str) and not names:
            raise ValueError(
                f"{path}.{name}={value!r} must be a string (all-linear or a regex) or a list of module names"
            )
    adapter = model.lora_adapter_path
    if adapter is None:
        return
    if model.lora_rank == 0:
        raise ValueError(
            f"{path}.lora_adapter_path={adapter} needs {path}.lora_rank > 0 (as in verl 0.9.1's FSDP engine, "
            "LoRA is on only with a positive rank; the adapter's own rank is used)"
        )
    if not os.path.isfile(os.path.join(os.path.expanduser(adapter), "adapter_config.json")):
        raise ValueError(
            f"{path}.lora_adapter_path={adapter} is not a PEFT adapter folder (no adapter_config.json there)"
        )


@dataclass
class OptimConfig(Section):
    lr: float = key(1.0e-6, "peak learning rate")
    lr_warmup_steps: int = key(-1, "warmup steps; <= 0 = use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = key(0.0, "warmup as a fraction of total training steps")
    lr_scheduler_type: str = key("constant", "schedule after warmup: constant | cosine", choices=WARMUP_STYLES)
    warmup_style: Optional[str] = key(
        None, "deprecated (verl 0.9.1) name of lr_scheduler_type; set, it wins", choices=(None, *WARMUP_STYLES)
    )
    min_lr_ratio: float = key(0.0, "cosine floor as a fraction of lr")
    weight_decay: float = key(0.01, "AdamW weight decay")
    clip_grad: float = key(1.0, "max global grad norm (verl 0.9.1's clipping key); a non-finite norm skips the step")
    betas: List[float] = key([0.9, 0.999], "AdamW betas")
    total_training_steps: int = key(-1, "filled in by the trainer from the data; do not set")

    def check(self, path: str, root: Any) -> None:
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"{path}.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] (the cosine floor as a fraction of lr)"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = {
            f"{path}.total_training_steps": "filled in by the trainer from the data; set "
            "trainer.total_training_steps instead"
        }
        if self.lr_warmup_steps > 0:  # as in verl, 0 or -1 defers to the ratio
            out[f"{path}.lr_warmup_steps_ratio"] = (
                f"{path}.lr_warmup_steps={self.lr_warmup_steps} (> 0) takes precedence"
            )
        if self.warmup_style is not None:
            out[f"{path}.lr_scheduler_type"] = f"{path}.warmup_style={self.warmup_style} (deprecated) replaces it"
        style = self.warmup_style or self.lr_scheduler_type
        if style != "cosine":
            out[f"{path}.min_lr_ratio"] = f"the schedule is {style}: only cosine decays"
        return out


@dataclass
class MixedPrecisionConfig(Section):
    param_dtype: str = key(
        "auto", "FSDP computes in this dtype; auto = bf16 on GPU (verl's), fp32 on CPU", choices=DTYPE_NAMES
    )
    reduce_dtype: str = key("fp32", "gradients are reduced across ranks in this dtype", choices=DTYPE_NAMES)
    buffer_dtype: str = key(
        "fp32", "buffers (rotary inv_freq) in this dtype (FSDP1; FSDP2 keeps them as loaded)", choices=DTYPE_NAMES
    )


def _check_trained_dtypes(path: str, model_dtype: str, mixed: MixedPrecisionConfig) -> None:
    """fp16 training needs loss scaling (verl's ShardedGradScaler), which rlframe does not implement."""
    for name, value in (("model_dtype", model_dtype), ("mixed_precision.param_dtype", mixed.param_dtype)):
        if value in ("fp16", "float16"):
            raise ValueError(
                f"{path}.{name}={value}: fp16 training needs loss scaling, which rlframe does not implement; "
                "use bf16 or fp32"
            )


@dataclass
class FSDPConfig(Section):
    param_offload: bool = key(False, "keep parameters on CPU between uses")
    optimizer_offload: bool = key(False, "keep optimizer state on CPU between steps")
    reshard_after_forward: bool = key(True, "free gathered params after forward (ZeRO-3 style)")
    fsdp_size: int = key(-1, "shard group size; -1 = all ranks, else HSDP (shard within groups of this size)")
    model_dtype: str = key(
        "fp32",
        "dtype the HF model is loaded in, so the dtype FSDP holds (and steps) parameters in",
        choices=DTYPE_NAMES[1:],
    )
    mixed_precision: MixedPrecisionConfig = section(MixedPrecisionConfig)
    forward_prefetch: bool = key(False, "all-gather the next layer during this one's forward (FSDP1; FSDP2 depth 1)")

    def check(self, path: str, root: Any) -> None:
        _check_trained_dtypes(path, self.model_dtype, self.mixed_precision)


@dataclass
class CheckpointConfig(Section):
    save_contents: List[str] = key(
        ["model", "optimizer", "extra"],
        "what a checkpoint holds; add hf_model for an HF export",
        check=each_of(SAVE_CONTENTS),
    )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if root.trainer.save_freq > 0:
            return {}
        return {f"{path}.save_contents": f"trainer.save_freq={root.trainer.save_freq}: the run saves no checkpoint"}
