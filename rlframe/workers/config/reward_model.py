"""The reward model's sections (`reward_model`): the model, its FSDP, the reward manager and verl's server keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlframe.config.schema import Section, key, section
from rlframe.reward.config import RewardKwargsConfig
from rlframe.reward.manager import get_reward_manager_cls


@dataclass
class RewardModelFSDPConfig(Section):
    param_offload: bool = key(False, "keep reward-model parameters on CPU between uses")
    reshard_after_forward: bool = key(True, "free gathered params after forward")
    fsdp_size: int = key(-1, "shard group size; -1 = all ranks, else HSDP (shard within groups of this size)")
    forward_prefetch: bool = key(False, "all-gather the next layer during this one's forward (FSDP1; FSDP2 depth 1)")


@dataclass
class RewardModelModelConfig(Section):
    path: Optional[str] = key(None, "sequence-classification model dir")
    input_tokenizer: str = key("${actor_rollout_ref.model.path}", "tokenizer of the policy (to decode responses)")
    use_remove_padding: bool = key(False, "score packed sequences (cu_seqlens, no pad compute); same scores")
    fsdp_config: RewardModelFSDPConfig = section(RewardModelFSDPConfig)


# verl 0.9.1 serves a reward model from an inference engine in its reward loop; these are that engine's
# settings (verl's legacy `reward_model.rollout.*` spelling, null = verl's reward.reward_model.rollout value).
# rlframe scores the same text with its FSDP reward worker inside the training processes, so none of them
# changes a score: each is reported without effect when set.
_RM_SERVER = "rlframe scores the reward model with its FSDP reward worker, not an inference server"


@dataclass
class RewardModelRolloutConfig(Section):
    name: Optional[str] = key(None, "verl's reward-model server: vllm | sglang", choices=(None, "vllm", "sglang"))
    dtype: Optional[str] = key(None, "server dtype (the FSDP worker computes in bf16 on GPU, fp32 on CPU)")
    gpu_memory_utilization: Optional[float] = key(None, "server memory fraction")
    enforce_eager: Optional[bool] = key(None, "server CUDA graphs off")
    cudagraph_capture_sizes: Optional[Any] = key(None, "server CUDA graph batch sizes")
    free_cache_engine: Optional[bool] = key(None, "server sleeps between uses")
    data_parallel_size: Optional[int] = key(None, "server replicas' DP size")
    expert_parallel_size: Optional[int] = key(None, "server EP size")
    tensor_model_parallel_size: Optional[int] = key(None, "server TP size")
    max_num_batched_tokens: Optional[int] = key(None, "server tokens per scheduler step")
    max_model_len: Optional[int] = key(None, "server context length")
    max_num_seqs: Optional[int] = key(None, "server sequences per scheduler step")
    load_format: Optional[str] = key(None, "server weight loading")
    engine_kwargs: Optional[Any] = key(None, "more server engine arguments")
    limit_images: Optional[int] = key(None, "server images per prompt (multimodal)")
    enable_chunked_prefill: Optional[bool] = key(None, "server chunked prefill")
    enable_prefix_caching: Optional[bool] = key(None, "server prefix caching")
    disable_log_stats: Optional[bool] = key(None, "server statistics logging")
    skip_tokenizer_init: Optional[bool] = key(None, "server without a tokenizer (verl requires false)")
    prompt_length: Optional[int] = key(None, "generative reward models' prompt budget")
    response_length: Optional[int] = key(None, "generative reward models' response budget")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        why = _RM_SERVER if root.reward_model.enable else "reward_model.enable=false"
        return {f"{path}.{field}": why for field in self.__dataclass_fields__}


@dataclass
class RewardModelConfig(Section):
    enable: bool = key(False, "score with a reward model: its score is the reward (rules: reward/rule_score/mean)")
    use_reward_loop: bool = key(
        True,
        "verl 0.8's switch, always on in 0.9.1: score the text verl's reward loop sends its server (the raw chat "
        "+ the decoded response, in the reward model's chat template); false = verl 0.8's legacy FSDP worker inputs",
    )
    num_workers: Optional[int] = key(None, "verl's reward-loop workers (scoring concurrency); no effect here")
    rollout: RewardModelRolloutConfig = section(RewardModelRolloutConfig, "verl's reward-model server settings")
    model: RewardModelModelConfig = section(RewardModelModelConfig)
    micro_batch_size_per_gpu: int = key(4, "sequences per reward model forward")
    reward_manager: str = key(
        "naive",
        "naive (one call per sample) | batch (one call per batch) | dapo (naive + overlong penalty)",
        check=get_reward_manager_cls,
    )
    reward_kwargs: RewardKwargsConfig = section(RewardKwargsConfig)

    def check(self, path: str, root: Any) -> None:
        if self.enable and not self.model.path:
            raise ValueError(
                "reward_model.enable=true needs reward_model.model.path (a sequence-classification model folder)"
            )
        if self.enable and self.use_reward_loop and root.custom_reward_function.path:
            raise ValueError(
                "reward_model.enable=true with custom_reward_function.path and reward_model.use_reward_loop=true: "
                "verl 0.9.1's reward loop then scores with the custom function alone, which reaches the reward model "
                "through the loop's server (reward_router_address), and rlframe runs no such server. Keep one of "
                "the two, or set reward_model.use_reward_loop=false (verl 0.8's legacy worker: the reward model's "
                "score is the reward)"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        # verl's count of reward-loop actors scoring concurrently; rlframe's reward manager scores on the driver
        # and its reward worker on every training rank: the scores do not depend on it
        out = {f"{path}.num_workers": "rlframe scores on the driver (rules) and on every training rank (model)"}
        if self.enable:
            return out
        out.update({f"{path}.{name}": "reward_model.enable=false" for name in ("model", "micro_batch_size_per_gpu")})
        # without a reward model, verl's reward loop runs the same reward manager on the same scorers
        out[f"{path}.use_reward_loop"] = (
            "reward_model.enable=false: the rewards come from the reward manager either way (verl's reward loop "
            "runs the same manager and scorers)"
        )
        return out
