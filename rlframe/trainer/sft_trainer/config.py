"""The SFT trainer's config: verl 0.9.1's `sft_trainer_engine.yaml` keys and defaults, each honoured or refused.

Every key of verl's SFT config is declared here with verl's default. A key rlframe implements is read by the SFT
trainer (`rlframe.trainer.sft_trainer`); a key it does not implement is declared with `verl_only`: verl's default is
taken (the same run), any other value is refused before work starts, naming the key, the value and why. A key that
runs but has no effect here is reported by `inactive` (printed at the start of a run, and by
`python -m rlframe.trainer.sft_trainer --explain`). A key
verl does not have either is a typo: the typed schema refuses it with the closest keys.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from rlframe.config.checks import SAVE_CONTENTS
from rlframe.config.schema import Section, each_of, key, section, validate, walk
from rlframe.data.sft_dataset import PAD_MODES, SFT_TRUNCATION_MODES
from rlframe.workers.config.model import DTYPE_NAMES, OptimConfig


def verl_only(default: Any, reason: str) -> Any:
    """A verl key rlframe's SFT does not implement: its default is taken, any other value refused with `reason`."""

    def check(value: Any) -> None:
        plain = OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
        if plain == default:
            return
        if isinstance(default, dict) and isinstance(plain, dict):  # name the entries that differ, not the whole dict
            changed = {name: plain.get(name) for name in {*default, *plain} if plain.get(name) != default.get(name)}
            raise ValueError(
                f"not implemented in rlframe's SFT trainer: {reason}; set {changed} where verl's default is "
                f"{ {name: default.get(name) for name in changed} }"
            )
        raise ValueError(f"not implemented in rlframe's SFT trainer: {reason}; only verl's default {default!r} runs")

    return key(default, f"verl's; not implemented: {reason}", check=check)


_MEGATRON = "a Megatron-backend setting (rlframe trains with FSDP)"


@dataclass
class CustomClsConfig(Section):
    path: Optional[str] = verl_only(None, "custom dataset classes; rows go through rlframe's SFTDataset")
    name: Optional[str] = verl_only(None, "custom dataset classes; rows go through rlframe's SFTDataset")


@dataclass
class SFTDataConfig(Section):
    train_batch_size: int = key(256, "rows per optimizer step, over all ranks")
    micro_batch_size_per_gpu: int = key(4, "rows per forward/backward without use_dynamic_bsz (also validation's)")
    max_token_len_per_gpu: int = key(8192, "tokens per micro-batch with use_dynamic_bsz (× ulysses size)")
    use_dynamic_bsz: bool = key(True, "pack micro-batches up to max_token_len_per_gpu tokens")
    train_files: Any = key("~/data/gsm8k/train.parquet", "parquet file(s) of SFT rows")
    val_files: Any = key(None, "parquet file(s) for the validation loss; null: none")
    train_max_samples: int = key(-1, "first N training rows; -1: all")
    val_max_samples: int = key(-1, "first N validation rows; -1: all")
    messages_key: str = key("messages", "column of the conversation (a list of messages)")
    tools_key: str = key("tools", "column of the tool schemas given to the chat template")
    enable_thinking_key: str = key("enable_thinking", "column of a row's enable_thinking flag")
    enable_thinking_default: Optional[bool] = key(None, "enable_thinking of a row without the column; null: unset")
    pad_mode: str = key("no_padding", "no_padding (rows as they are) | right (padded to max_length)", choices=PAD_MODES)
    max_length: int = key(1024, "longest row in tokens")
    truncation: str = key("error", "a longer row: error | left (keep its end) | right", choices=SFT_TRUNCATION_MODES)
    balance_dp_token: bool = verl_only(False, "balancing rows by tokens across ranks (verl: 'to be implemented')")
    custom_cls: CustomClsConfig = section(CustomClsConfig)
    use_shm: bool = verl_only(False, "copying data to shared memory")
    apply_chat_template_kwargs: Dict[str, Any] = key({}, "extra keyword arguments of the chat template")
    num_workers: int = key(8, "dataloader workers (no effect: rows are tokenized up front)")
    ignore_input_ids_mismatch: bool = key(False, "take turn-by-turn ids that differ from the whole rendering")

    def check(self, path: str, root: Any) -> None:
        for name in ("train_batch_size", "micro_batch_size_per_gpu", "max_token_len_per_gpu", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{path}.{name}={getattr(self, name)} must be at least 1")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = {f"{path}.num_workers": "rows are tokenized up front, before the first step"}
        if self.use_dynamic_bsz:
            out[f"{path}.micro_batch_size_per_gpu"] = f"{path}.use_dynamic_bsz=true cuts by max_token_len_per_gpu"
        else:
            out[f"{path}.max_token_len_per_gpu"] = f"{path}.use_dynamic_bsz=false cuts by micro_batch_size_per_gpu"
        return out


@dataclass
class SFTModelConfig(Section):
    path: str = key("~/models/deepseek-llm-7b-chat", "Hugging Face folder or builtin://NAME")
    hf_config_path: Optional[str] = verl_only(None, "a config from another folder; the model's own is read")
    tokenizer_path: Optional[str] = key(None, "tokenizer folder; null: model.path")
    use_shm: bool = verl_only(False, "copying the model to shared memory")
    trust_remote_code: bool = key(False, "allow the model's and tokenizer's own code")
    custom_chat_template: Optional[str] = key(None, "a chat template replacing the tokenizer's")
    external_lib: Optional[str] = key(None, "module imported first (registers custom model classes)")
    override_config: Dict[str, Any] = key({}, "model config attributes to override")
    enable_gradient_checkpointing: bool = key(True, "recompute activations in backward")
    enable_activation_offload: bool = verl_only(False, "activation offload in the SFT trainer")
    use_remove_padding: bool = key(True, "pack rows without padding (varlen attention); needed for Ulysses")
    lora_rank: int = key(0, "LoRA rank; 0: train every weight")
    lora_alpha: int = key(16, "LoRA alpha")
    target_modules: Any = key("all-linear", "LoRA target modules: all-linear, a regex or a list")
    exclude_modules: Any = key(None, "modules LoRA leaves alone")
    lora_adapter_path: Optional[str] = key(None, "start from this PEFT adapter")
    use_liger: bool = verl_only(False, "Liger kernels")
    use_fused_kernels: bool = key(False, "score from hidden states a chunk at a time (no full logits)")
    fused_kernel_options: Dict[str, Any] = verl_only({"impl_backend": "torch"}, "a fused-kernel backend choice")
    tiled_mlp: Dict[str, Any] = verl_only({"enabled": False, "num_shards": 4}, "tiled MLP")
    mtp: Dict[str, Any] = verl_only(
        {
            "enable": False,
            "enable_train": False,
            "enable_rollout": False,
            "detach_encoder": False,
            "mtp_loss_scaling_factor": 0.1,
            "speculative_algorithm": "EAGLE",
            "speculative_num_steps": 3,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4,
            "method": "mtp",
            "num_speculative_tokens": 1,
        },
        "multi-token prediction",
    )
    lora: Dict[str, Any] = verl_only(
        {
            "type": "lora",
            "merge": False,
            "rank": 0,
            "alpha": 32,
            "dropout": 0.0,
            "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            "exclude_modules": [],
            "dropout_position": "pre",
            "lora_A_init_method": "xavier",
            "lora_B_init_method": "zero",
            "a2a_experimental": False,
            "dtype": None,
            "adapter_path": None,
            "freeze_vision_model": True,
            "freeze_vision_projection": True,
            "freeze_language_model": True,
        },
        f"{_MEGATRON}; FSDP LoRA is model.lora_rank, lora_alpha, target_modules",
    )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if self.lora_rank > 0:
            return {}
        off = f"{path}.lora_rank=0"
        return {f"{path}.{name}": off for name in ("lora_alpha", "target_modules", "exclude_modules")}


@dataclass
class SFTEngineConfig(Section):
    wrap_policy: Dict[str, Any] = verl_only(
        {"min_num_params": 0}, "a size-based wrap policy (each decoder layer is one unit)"
    )
    param_offload: bool = key(False, "keep parameters on the CPU between uses")
    optimizer_offload: bool = verl_only(False, "optimizer offload in the SFT trainer")
    offload_policy: bool = verl_only(False, "FSDP2's CPU offload policy")
    reshard_after_forward: bool = key(True, "free gathered parameters after each forward")
    fsdp_size: int = key(-1, "ranks one copy of the parameters is sharded over; -1: all (else HSDP)")
    forward_prefetch: bool = key(False, "gather the next layer during this layer's forward")
    model_dtype: str = key("fp32", "dtype the parameters are loaded and kept in", choices=DTYPE_NAMES)
    use_orig_params: bool = verl_only(False, "FSDP1's use_orig_params")
    seed: int = key(42, "torch seed of the model's initialization")
    full_determinism: bool = verl_only(False, "deterministic kernels")
    ulysses_sequence_parallel_size: int = key(1, "Ulysses sequence parallel size (needs use_remove_padding)")
    entropy_from_logits_with_chunking: bool = key(False, "no effect: SFT computes no entropy")
    entropy_from_logits_chunk_size: int = key(2048, "no effect: SFT computes no entropy")
    use_torch_compile: bool = key(True, "compile the log-prob kernels (CUDA only)")
    entropy_checkpointing: bool = key(False, "no effect: SFT computes no entropy")
    use_no_sync_for_gradient_accumulation: bool = verl_only(False, "skipping gradient sync between micro-batches")
    pad_to_length: bool = verl_only(False, "padding packed rows to a fixed length")
    pad_to_length_bucket: int = verl_only(1024, "padding packed rows to a fixed length")
    forward_only: bool = verl_only(False, "a forward-only engine (the SFT trainer trains)")
    strategy: str = key("fsdp", "fsdp (FSDP1) | fsdp2", choices=("fsdp", "fsdp2"))
    dtype: str = key("bfloat16", "FSDP's compute dtype on GPU (on CPU: fp32)", choices=DTYPE_NAMES)
    qat: Dict[str, Any] = verl_only(
        {
            "enable": False,
            "mode": "w4a16",
            "group_size": 16,
            "ignore_patterns": ["lm_head", "embed_tokens", "re:.*mlp.gate$"],
            "activation_observer": "static_minmax",
            "quantization_config_path": None,
        },
        "quantization-aware training",
    )
    turbo_config: Dict[str, Any] = verl_only(
        {
            "distributed": {
                "fully_shard_parallel_size": 16,
                "tensor_parallel_size": 1,
                "expert_parallel_size": 1,
                "expert_fully_shard_parallel_size": 1,
                "ulysses_parallel_size": 1,
                "fsdp_plan": {
                    "param_dtype": "bf16",
                    "reduce_dtype": "fp32",
                    "output_dtype": "bf16",
                    "fsdp_implementation": "native",
                    "num_to_forward_prefetch": 1,
                    "num_to_backward_prefetch": 1,
                },
            }
        },
        "the TorchTitan-turbo engine",
    )

    def check(self, path: str, root: Any) -> None:
        sp = self.ulysses_sequence_parallel_size
        if sp < 1:
            raise ValueError(f"{path}.ulysses_sequence_parallel_size={sp} must be at least 1")
        if sp > 1 and not root.model.use_remove_padding:
            raise ValueError(
                f"{path}.ulysses_sequence_parallel_size={sp} needs model.use_remove_padding=true "
                "(Ulysses splits packed rows)"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        none = "SFT computes no entropy"
        out = {
            f"{path}.{name}": none for name in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size")
        }
        out[f"{path}.entropy_checkpointing"] = none
        if root.trainer.device != "cuda":
            out[f"{path}.use_torch_compile"] = "torch.compile is applied on CUDA only"
            out[f"{path}.dtype"] = "on CPU FSDP computes in fp32"
        return out


@dataclass
class SFTOptimConfig(OptimConfig):
    optimizer: str = key("AdamW", "the optimizer", choices=("AdamW",))
    optimizer_impl: str = key("torch.optim", "the optimizer's module", choices=("torch.optim",))
    lr: float = key(1.0e-3, "peak learning rate")
    num_cycles: float = verl_only(0.5, "a cosine of other than half a cycle")
    zero_indexed_step: bool = verl_only(True, "one-indexed scheduler steps")
    override_optimizer_config: Optional[Dict[str, Any]] = verl_only(None, "extra optimizer arguments")


@dataclass
class SFTCheckpointConfig(Section):
    save_contents: List[str] = key(
        ["model", "optimizer", "extra"],
        "what a checkpoint holds; add hf_model for a Hugging Face folder (huggingface/) PPO can start from",
        check=each_of(SAVE_CONTENTS),
    )
    load_contents: List[str] = key("${checkpoint.save_contents}", "what resuming loads", check=each_of(SAVE_CONTENTS))


@dataclass
class SFTTrainerSection(Section):
    default_local_dir: str = key("checkpoints/${trainer.project_name}/${trainer.experiment_name}", "run folder")
    default_hdfs_dir: Optional[str] = verl_only(None, "copying checkpoints to HDFS")
    project_name: str = key("gsm8k-sft", "project name (loggers)")
    experiment_name: str = key("test", "experiment name (loggers)")
    total_epochs: int = key(4, "passes over the training rows")
    total_training_steps: Optional[int] = key(None, "stop after this many steps; null: total_epochs' worth")
    logger: List[str] = key(["console", "wandb"], "console | jsonl | tensorboard | wandb | mlflow")
    seed: int = key(1, "seed of the row shuffle")
    save_freq: int = key(-1, "save every N steps (and at the last); -1: at the last only")
    test_freq: int = key(-1, "validation loss every N steps (and at the last); -1: at the last only")
    max_ckpt_to_keep: Optional[int] = key(None, "keep the newest N checkpoints; null: all")
    balance_batch: bool = verl_only(True, "turning off the balancing of rows across ranks (always on here)")
    resume_mode: str = key("auto", "auto | disable | resume_path", choices=("auto", "disable", "resume_path"))
    resume_from_path: Optional[str] = key(
        None, "checkpoint folder (global_step_N) to resume from (auto: before the latest)"
    )
    device: str = key("cuda", "cuda | cpu", choices=("cuda", "cpu"))
    nnodes: int = key(1, "nodes (launch with torchrun; checked against its world size)")
    n_gpus_per_node: int = key(1, "processes per node (checked against torchrun's world size)")
    profile_interval: List[int] = verl_only([-1, -1], "profiling SFT steps")

    def check(self, path: str, root: Any) -> None:
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError(f"{path}.resume_mode=resume_path needs {path}.resume_from_path (a global_step_N folder)")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if self.resume_mode != "disable":
            return {}
        return {f"{path}.resume_from_path": f"{path}.resume_mode=disable"}


@dataclass
class SFTTrainerConfig(Section):
    data: SFTDataConfig = section(SFTDataConfig)
    model: SFTModelConfig = section(SFTModelConfig)
    engine: SFTEngineConfig = section(SFTEngineConfig)
    optim: SFTOptimConfig = section(SFTOptimConfig)
    checkpoint: SFTCheckpointConfig = section(SFTCheckpointConfig)
    trainer: SFTTrainerSection = section(SFTTrainerSection)
    profiler: Dict[str, Any] = verl_only({}, "profiling the SFT trainer")


def sft_config(overrides: list[str]) -> SFTTrainerConfig:
    """verl's SFT defaults with `key=value` overrides, typed, resolved and checked; a bad key or value raises."""
    try:
        raw = OmegaConf.from_dotlist([override.lstrip("+") for override in overrides])
        merged = OmegaConf.merge(OmegaConf.structured(SFTTrainerConfig), raw)
    except ConfigKeyError as err:
        raise ValueError(_unknown_key_message(err.full_key)) from None
    except ValidationError as err:
        raise ValueError(f"{err.full_key} has the wrong type: {str(err).splitlines()[0]}") from None
    root = OmegaConf.to_object(merged)
    validate(root)
    return root


def _unknown_key_message(full_key: str) -> str:
    known = [path for path, value, _ in walk(SFTTrainerConfig()) if not isinstance(value, Section)]
    close = difflib.get_close_matches(full_key, known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return (
        f"unknown SFT config key {full_key!r}: neither verl 0.9.1's sft_trainer_engine.yaml nor rlframe has it." + hint
    )
