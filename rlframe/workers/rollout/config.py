"""The `actor_rollout_ref.rollout` section: the engine, sampling, and the old-log-prob pass's sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlframe.config.checks import ROLLOUT_ENGINES
from rlframe.config.keys import ACTOR_KEYS, micro_batch_inactive
from rlframe.config.schema import Section, key, section

ACTOR = "actor_rollout_ref.actor"
VLLM_ONLY_KEYS = ("gpu_memory_utilization", "max_num_batched_tokens", "enforce_eager")


@dataclass
class ValKwargsConfig(Section):
    temperature: float = key(0.0, "validation sampling temperature")
    top_k: int = key(-1, "validation top-k")
    top_p: float = key(1.0, "validation top-p")
    do_sample: bool = key(False, "greedy validation by default")
    n: int = key(1, "responses per validation prompt")


@dataclass
class RolloutConfig(Section):
    name: str = key("hf", "hf (CPU and GPU) | vllm (GPU, extra 'gpu')", choices=tuple(ROLLOUT_ENGINES))
    temperature: float = key(1.0, "sampling temperature")
    top_k: int = key(-1, "-1 = off")
    top_p: float = key(1.0, "nucleus sampling")
    do_sample: bool = key(True, "false = greedy")
    n: int = key(4, "responses per prompt (GRPO group size)")
    prompt_length: int = key("${data.max_prompt_length}", "max prompt tokens")
    response_length: int = key("${data.max_response_length}", "max generated tokens")
    dtype: str = key("auto", "generation dtype: auto = bf16 on GPU, fp32 on CPU")
    micro_batch_size: int = key(32, "hf: sequences generated together (bounds memory)")
    tensor_model_parallel_size: int = key(1, "rollout TP degree")
    gpu_memory_utilization: float = key(0.5, "vllm: fraction of GPU memory for weights + KV cache")
    max_num_batched_tokens: int = key(8192, "vllm: scheduler token budget")
    enforce_eager: bool = key(True, "vllm: disable CUDA graphs")
    free_cache_engine: bool = key(True, "release the engine's memory (vllm: sleep) during training")
    log_prob_micro_batch_size_per_gpu: int = key(4, "sequences per old-log-prob forward (static)")
    log_prob_use_dynamic_bsz: bool = key(f"${{{ACTOR}.use_dynamic_bsz}}", "token-budget micro-batches")
    log_prob_max_token_len_per_gpu: int = key(f"${{{ACTOR}.ppo_max_token_len_per_gpu}}", "token budget (dynamic)")
    calculate_log_probs: bool = key(False, "return rollout_log_probs from the engine")
    val_kwargs: ValKwargsConfig = section(ValKwargsConfig)

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = micro_batch_inactive(root, ACTOR_KEYS.forward, "old log-prob")
        if self.name == "hf":
            out.update({f"{path}.{name}": f"{path}.name=hf: a vLLM setting" for name in VLLM_ONLY_KEYS})
        else:
            out[f"{path}.micro_batch_size"] = f"{path}.name={self.name}: the engine batches by max_num_batched_tokens"
        return out
