"""verl 0.9.1's config keys that rlframe does not declare: each is taken at verl's default or refused.

A verl command line may set any of the ~830 keys of verl's PPO trainer config
(`verl_defaults.json`, extracted from verl's own generated YAML by `scripts/extract_verl_defaults.py`).
rlframe declares the ones it implements in its typed sections. For every other verl key:

- set to verl's default value, it is taken: the command means the same run as without it, and
  rlframe behaves as verl does at that default (where it does not, `docs/verl_compatibility.md` lists
  the difference: none of them changes the math or the number of samples);
- set to anything else, it is refused before Ray starts, with the key, the value, verl's default and
  why rlframe does not implement it (`UNSUPPORTED`, longest matching prefix first).

A key neither rlframe nor verl knows is a typo: the typed schema refuses it with the closest keys.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

DEFAULTS_FILE = Path(__file__).with_name("verl_defaults.json")

_PROFILE_HOOKS = (
    "finish hooks and moving nsys reports are not implemented: traces are written into global_profiler.save_path"
)
_NPU = "Ascend NPU profiling needs Ascend NPUs, which rlframe does not run on; profile with global_profiler.tool=torch"
_ROLE_FOLLOWS = "a role profiles with global_profiler's tool and settings; set them under global_profiler"
_ROLLOUT_TRACE = (
    "tracing rollouts to weave or mlflow is not implemented; trainer.rollout_data_dir writes every sample of "
    "every step (prompt, response, score) as jsonl"
)
_PROFILED_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout", "critic")
_MULTIMODAL = "videos and audio are not supported; images are (data.image_key, docs/multimodal.md)"
_MEGATRON_LORA = (
    "model.lora.* configures verl's Megatron-backend LoRA; with FSDP (rlframe's, and verl's) LoRA is "
    "actor_rollout_ref.model.lora_rank, lora_alpha, target_modules, exclude_modules, lora_adapter_path"
)
_CRITIC_LORA = "LoRA for the critic is not implemented; the actor's is actor_rollout_ref.model.lora_rank (docs/lora.md)"
_AGENT = (
    "rlframe reads tools from actor_rollout_ref.rollout.multi_turn.tool_config_path / function_tool_path "
    "(the rollout renders their schemas into the prompt); dataset-side tool settings are not implemented"
)
_REWARD_SECTION = (
    "this part of verl 0.9.1's reward.* section is not implemented (rlframe reads the reward function, manager, "
    "kwargs and a sequence-classification reward model from custom_reward_function.*, reward_model.*, and their "
    "reward.* spellings)"
)
_REWARD_LOOP = (
    "custom reward-loop classes are not supported; use reward_model.reward_manager (naive, batch, dapo) or a "
    "custom_reward_function"
)
_QUANT = "quantized training and rollout are not supported"

_HOOK_KEYS = ("relocate_results", "finish_hook_cmd", "finish_hook_all_ranks", "finish_hook_ranks")
_ROLE_FOLLOWING = ("tool", "save_path", "tool_config.nsys", "tool_config.torch_memory")

# prefix -> why rlframe does not implement it; the longest prefix that matches a key wins.
UNSUPPORTED = {
    **{f"global_profiler.{name}": _PROFILE_HOOKS for name in _HOOK_KEYS},
    **{f"{role}.profiler.{name}": _PROFILE_HOOKS for role in _PROFILED_ROLES for name in _HOOK_KEYS},
    **{f"{role}.profiler.{name}": _ROLE_FOLLOWS for role in _PROFILED_ROLES for name in _ROLE_FOLLOWING},
    **{f"{role}.profiler.tool_config.npu": _NPU for role in _PROFILED_ROLES},
    **{f"{role}.profiler.tool_config.precision_debugger": _NPU for role in _PROFILED_ROLES},
    **{
        f"{role}.profiler.tool_config.torch.{name}": "torch.profiler schedules over update mini-batches are not "
        "implemented: a profiled step is traced whole (or per stage with tool_config.torch.discrete)"
        for role in _PROFILED_ROLES
        for name in ("schedule", "profile_token_start", "profile_token_end")
    },
    "global_profiler.global_tool_config.precision_debugger": _NPU,
    "global_profiler.global_tool_config.nsys.controller_nsight_options": "rlframe's driver is the process you "
    "launch, not a Ray actor: to trace it, run it under nsys yourself (nsys profile rlframe train ...)",
    "global_profiler.global_tool_config.torch_memory.stack_depth": "torch's memory history has no stack-depth "
    "setting (rlframe passes context, stacks and trace_alloc_max_entries)",
    "global_profiler.global_tool_config.torch_memory.kw_args": "extra arguments of the memory history are not "
    "passed; rlframe passes context, stacks and trace_alloc_max_entries",
    "actor_rollout_ref.rollout.trace": _ROLLOUT_TRACE,
    "actor_rollout_ref.rollout.prometheus": "Prometheus metrics of a rollout server are not implemented",
    "actor_rollout_ref.model.lora": _MEGATRON_LORA,
    "critic.model.lora": _MEGATRON_LORA,
    "critic.model.lora_rank": _CRITIC_LORA,
    "critic.model.lora_alpha": _CRITIC_LORA,
    "critic.model.lora_adapter_path": _CRITIC_LORA,
    "critic.model.target_modules": _CRITIC_LORA,
    "critic.model.exclude_modules": _CRITIC_LORA,
    "actor_rollout_ref.rollout.agent.custom_async_server": "custom rollout servers are not implemented: the agent "
    "loop drives rlframe's own engines",
    "data.tool_config_path": _AGENT,
    "data.function_tool_path": _AGENT,
    "data.return_full_prompt": _AGENT,
    "algorithm.filter_groups.max_inflight_gen_batches": "a knob of verl's streaming (V1) replay buffer; rlframe "
    "generates one data.gen_batch_size batch at a time and checks its groups before the next",
    "actor_rollout_ref.actor.loss_scale_factor": "a constant loss scale is not implemented; rlframe normalizes "
    "seq-mean-token-sum-norm by the max response length",
    "critic.loss_scale_factor": "a constant loss scale is not implemented",
    "distillation.teacher_models.teacher_model.inference": "the teacher is not served by an inference engine: it "
    "scores the samples with an FSDP forward in the training processes (docs/distillation.md)",
    "distillation.teacher_models.teacher_model.num_replicas": "the teacher is not served by inference replicas: it "
    "scores the samples in the training processes (docs/distillation.md)",
    "transfer_queue": "verl's transfer queue is not used: rlframe moves batches through Ray's object store",
    "trainer.use_v1": "verl's legacy (non-V1) trainer is not a separate path: rlframe's trainer runs V1's modes "
    "(trainer.v1.trainer_mode)",
    "trainer.v1.sync": "verl's sync-mode options are empty in 0.9.1; rlframe's sync mode has none",
    "trainer.v1.separate_async.hybrid_rollout": "lending idle training replicas to generation is not implemented",
    "trainer.v1.sampler.custom_sampler": "custom samplers (replay buffers) are not supported",
    "trainer.v1.sampler.sampler_kwargs": "custom samplers (replay buffers) are not supported",
    "trainer.v1.sampler.sync_refill_failed_groups": "refilling failed groups is not implemented: rlframe's "
    "separate_async never drops a group",
    "skip": "skipping rollouts from dumps is not supported",
    "reward": _REWARD_SECTION,
    "reward.reward_manager.source": _REWARD_LOOP,
    "reward.reward_manager.module": _REWARD_LOOP,
    "reward_model.reward_loop_source": _REWARD_LOOP,
    "reward_model.reward_loop_module_path": _REWARD_LOOP,
    "reward_model.reward_loop_class_name": _REWARD_LOOP,
    "reward_model.enable_resource_pool": "the reward model shares the training workers' processes",
    "reward_model.nnodes": "the reward model shares the training workers' processes",
    "reward_model.n_gpus_per_node": "the reward model shares the training workers' processes",
    "sandbox_fusion": "the code-execution sandbox scorer is not supported; use a custom_reward_function",
    "actor_rollout_ref.model.mtp": "multi-token prediction is not supported",
    "critic.model.mtp": "multi-token prediction is not supported",
    "actor_rollout_ref.rollout.mtp": "multi-token prediction is not supported",
    "actor_rollout_ref.actor.qat": _QUANT,
    "actor_rollout_ref.actor.fsdp_config.qat": _QUANT,
    "actor_rollout_ref.ref.fsdp_config.qat": _QUANT,
    "critic.fsdp.qat": _QUANT,
    "actor_rollout_ref.rollout.qat": _QUANT,
    "actor_rollout_ref.rollout.quantization": _QUANT,
    "actor_rollout_ref.rollout.quantization_config_file": _QUANT,
    "data.video_key": _MULTIMODAL,
    "data.audio_key": _MULTIMODAL,
    "data.image_patch_size": "images are resized by the checkpoint's own image processor "
    "(preprocessor_config.json: patch size, min_pixels, max_pixels)",
    "data.return_multi_modal_inputs": "rlframe always keeps each row's processed images in the batch (verl's "
    "default true): the training forward reads them",
    "data.mm_processor_kwargs": "images are processed with the checkpoint's preprocessor_config.json as saved",
    "trainer.default_hdfs_dir": "HDFS upload is not supported; checkpoints go to trainer.default_local_dir",
    "actor_rollout_ref.rollout.disaggregation": "disaggregated prefill/decode is not supported",
    "actor_rollout_ref.actor.fsdp_config.turbo_config": "verl's FSDP turbo engine is not used",
    "actor_rollout_ref.ref.fsdp_config.turbo_config": "verl's FSDP turbo engine is not used",
    "critic.fsdp.turbo_config": "verl's FSDP turbo engine is not used",
    "critic.model.use_fused_kernels": "a value model has no vocabulary head to fuse (the actor's switch is "
    "actor_rollout_ref.model.use_fused_kernels)",
    "critic.model.fused_kernel_options": "a value model has no vocabulary head to fuse",
}

GENERIC = "rlframe does not implement this verl 0.9.1 setting"

# Keys that verl 0.9.1 does not have either, though users write them: what they mean to set, and where.
NOT_IN_VERL = {
    "actor_rollout_ref.model.torch_dtype": "verl 0.9.1 has no such key either: its FSDP engine loads the model "
    "in fsdp_config.model_dtype; set actor_rollout_ref.actor.fsdp_config.model_dtype (and ref's, critic's)",
}

# verl 0.9.1's legacy reward_model.rollout.* keys (its legacy_reward_impl.yaml), declared by rlframe's
# RewardModelRolloutConfig; the reward.reward_model.rollout.* spelling of each reaches the same key.
REWARD_MODEL_ROLLOUT_KEYS = (
    "name",
    "dtype",
    "gpu_memory_utilization",
    "enforce_eager",
    "cudagraph_capture_sizes",
    "free_cache_engine",
    "data_parallel_size",
    "expert_parallel_size",
    "tensor_model_parallel_size",
    "max_num_batched_tokens",
    "max_model_len",
    "max_num_seqs",
    "load_format",
    "engine_kwargs",
    "limit_images",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "disable_log_stats",
    "skip_tokenizer_init",
    "prompt_length",
    "response_length",
)

# verl 0.9.1's newer spellings of keys rlframe keeps at their older place: both reach the same key.
# The critic's FSDP settings moved from critic.model.fsdp_config.* (beside the actor's, in rlframe) to
# critic.fsdp.*; the reward function and manager to reward.*; Ray's init arguments to ray_kwargs.*.
ALIASES = {
    **{
        f"critic.fsdp.{name}": f"critic.model.fsdp_config.{name}"
        for name in (
            "param_offload",
            "optimizer_offload",
            "reshard_after_forward",
            "fsdp_size",
            "model_dtype",
            "mixed_precision.param_dtype",
            "mixed_precision.reduce_dtype",
            "mixed_precision.buffer_dtype",
        )
    },
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.reward_manager.name": "reward_model.reward_manager",
    **{
        f"reward.reward_kwargs.{name}": f"reward_model.reward_kwargs.{name}"
        for name in (
            "max_resp_len",
            "overlong_buffer_cfg.enable",
            "overlong_buffer_cfg.len",
            "overlong_buffer_cfg.penalty_factor",
            "overlong_buffer_cfg.log",
        )
    },
    "ray_kwargs.ray_init.num_cpus": "trainer.ray_init.num_cpus",
    # verl 0.9.1 migrates its legacy reward_model.* keys into reward.* (migrate_legacy_reward_impl)
    "reward.num_workers": "reward_model.num_workers",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    **{f"reward.reward_model.rollout.{name}": f"reward_model.rollout.{name}" for name in REWARD_MODEL_ROLLOUT_KEYS},
}


@lru_cache(maxsize=1)
def verl_defaults() -> dict[str, Any]:
    """Dotted verl key -> verl 0.9.1's default."""
    return json.loads(DEFAULTS_FILE.read_text())["defaults"]


def reason_for(key: str) -> str:
    """Why rlframe does not implement `key` (the longest matching prefix of UNSUPPORTED, else GENERIC)."""
    matches = [prefix for prefix in UNSUPPORTED if key == prefix or key.startswith(prefix + ".")]
    return UNSUPPORTED[max(matches, key=len)] if matches else GENERIC


def verl_key_under(key: str) -> bool:
    """True when `key` is a verl key or a section holding verl keys (e.g. `algorithm.rollout_correction`)."""
    defaults = verl_defaults()
    return key in defaults or any(k.startswith(key + ".") for k in defaults)


def parse_value(text: str) -> Any:
    """An override's value as Hydra reads the common cases: YAML scalars and flow lists/dicts."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def same_value(value: Any, default: Any) -> bool:
    """Equal as config values: 1 == 1.0, True != 1, "1e-6" == 1e-06, [] == {} is False."""
    if isinstance(default, str) and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            default = float(default)
        except ValueError:
            return False
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return math.isclose(float(value), float(default), rel_tol=0, abs_tol=0)
    if isinstance(value, str) and isinstance(default, (int, float)):
        try:
            return float(value) == float(default)
        except ValueError:
            return False
    return value == default


def followed_key(key: str) -> tuple[str, Any] | None:
    """(the key it follows, verl's fallback) when `key`'s verl default is an interpolation, else None."""
    default = verl_defaults().get(key)
    match = re.fullmatch(r"\$\{(?:oc\.select:)?([\w.]+)(?:,(.*))?\}", default) if isinstance(default, str) else None
    if match is None:
        return None
    target, fallback = match.group(1), parse_value(match.group(2)) if match.group(2) is not None else None
    if target.startswith("."):  # relative to the key's own section
        target = key.rsplit(".", 1)[0] + target
    return target, fallback


def check_verl_override(key: str, text: str, followed_value: Any = None, shown: str | None = None) -> str | None:
    """For a verl key rlframe does not declare: None when `text` is verl's default, else the refusal message.

    A key whose default follows another key is taken at that key's value in this config (`followed_value`).
    The message names `shown` when given (a named teacher's key, looked up as `teacher_model`'s).
    """
    defaults = verl_defaults()
    value = parse_value(text)
    if key in defaults:
        default = defaults[key]
        if isinstance(default, str) and "${" in default:
            if followed_value is not None and same_value(value, followed_value):
                return None
            default_shown = f"follows {default}" + ("" if followed_value is None else f", here {followed_value!r}")
        else:
            if same_value(value, default) or (isinstance(default, str) and text.strip("'\"") == default):
                return None
            default_shown = json.dumps(default)
    else:  # a whole section (`key={...}`) or an entry under a dict-valued key
        default_shown = "its default"
    return (
        f"{shown or key}={text}: {reason_for(key)}. rlframe takes this verl key only at verl 0.9.1's default "
        f"({default_shown}); remove it from the command line, or set it to the default."
    )
