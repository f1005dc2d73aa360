"""The critic's sections (`critic`): the value model, its optimizer and its update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from rlframe.algorithms.loss import LOSS_AGG_MODES
from rlframe.config.checks import STRATEGIES
from rlframe.config.keys import ACTOR, UPDATE_FIELDS, VALUE_FIELDS, micro_batch_inactive
from rlframe.config.schema import Section, key, section
from rlframe.seqpack import ALLOCATE_FNS
from rlframe.workers.config.model import CheckpointConfig, FSDPConfig, OptimConfig, check_shm, offload_inactive
from rlframe.workers.config.profiler import RoleProfilerConfig


@dataclass
class CriticOptimConfig(OptimConfig):
    lr: float = key(1.0e-5, "peak learning rate")


@dataclass
class CriticModelConfig(Section):
    path: str = key("${actor_rollout_ref.model.path}", "value model init (backbone + scalar head)")
    tokenizer_path: str = key("${actor_rollout_ref.model.path}", "tokenizer for the critic")
    override_config: Dict[str, Any] = key({}, "fields merged into the critic's HF config")
    external_lib: Optional[str] = key("${actor_rollout_ref.model.external_lib}", "module imported before loading")
    enable_gradient_checkpointing: bool = key(True, "recompute activations in backward")
    use_remove_padding: bool = key("${actor_rollout_ref.model.use_remove_padding}", "packed sequences")
    trust_remote_code: bool = key(False, "passed to from_pretrained")
    use_shm: bool = key(False, "copy the model folder to /dev/shm once per node and load from there")
    enable_activation_offload: bool = key(
        False, "keep saved activations in host memory from forward to backward (CUDA; docs/fsdp_engine.md)"
    )
    fsdp_config: FSDPConfig = section(FSDPConfig)

    def check(self, path: str, root: Any) -> None:
        check_shm(path, self.use_shm)

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        return offload_inactive(path, self.enable_activation_offload, root)


@dataclass
class CriticConfig(Section):
    strategy: str = key(f"${{{ACTOR}.strategy}}", "fsdp2 | fsdp", choices=STRATEGIES)
    model: CriticModelConfig = section(CriticModelConfig)
    optim: CriticOptimConfig = section(CriticOptimConfig)
    ppo_mini_batch_size: int = key(f"${{{ACTOR}.ppo_mini_batch_size}}", "prompts per critic optimizer step")
    ppo_micro_batch_size_per_gpu: Optional[int] = key(None, "sequences per critic forward/backward on one GPU")
    ppo_micro_batch_size: Optional[int] = key(None, "deprecated (verl) global form: per GPU = this // dp")
    forward_micro_batch_size_per_gpu: Optional[int] = key(
        "${critic.ppo_micro_batch_size_per_gpu}", "sequences per value forward on one GPU"
    )
    forward_micro_batch_size: Optional[int] = key(
        "${critic.ppo_micro_batch_size}", "deprecated (verl) global form: per GPU = this // dp"
    )
    use_dynamic_bsz: bool = key(f"${{{ACTOR}.use_dynamic_bsz}}", "token-budget micro-batches")
    ppo_max_token_len_per_gpu: int = key(32768, "token budget per micro-batch per GPU (dynamic)")
    forward_max_token_len_per_gpu: int = key("${critic.ppo_max_token_len_per_gpu}", "token budget for value forward")
    packing_algorithm: str = key(f"${{{ACTOR}.packing_algorithm}}", "kk | ffd", choices=tuple(ALLOCATE_FNS))
    ulysses_sequence_parallel_size: int = key(1, "Ulysses SP degree for the critic")
    ppo_epochs: int = key(f"${{{ACTOR}.ppo_epochs}}", "passes over each batch")
    shuffle: bool = key(f"${{{ACTOR}.shuffle}}", "shuffle before mini-batches")
    grad_clip: float = key(1.0, "verl's old clipping key; no effect: verl 0.9.1 and rlframe clip by optim.clip_grad")
    cliprange_value: float = key(0.5, "value clipping range")
    loss_agg_mode: str = key(f"${{{ACTOR}.loss_agg_mode}}", "aggregation of the value loss", choices=LOSS_AGG_MODES)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    profiler: RoleProfilerConfig = section(RoleProfilerConfig, "profiling on global_profiler.steps (docs/profiling.md)")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = micro_batch_inactive(self, path, UPDATE_FIELDS, "critic update")
        out[f"{path}.grad_clip"] = f"verl 0.9.1 clips by {path}.optim.clip_grad (as rlframe does)"
        out.update(micro_batch_inactive(self, path, VALUE_FIELDS, "value"))
        if not self.use_dynamic_bsz:
            out[f"{path}.packing_algorithm"] = f"{path}.use_dynamic_bsz=false: no critic pass packs by tokens"
        return out
