"""The reference policy's sections (`actor_rollout_ref.ref`): its log-prob pass and its FSDP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlframe.config.keys import ACTOR, LOG_PROB_FIELDS, micro_batch_inactive
from rlframe.config.schema import Section, key, section
from rlframe.workers.config.model import DTYPE_NAMES, MixedPrecisionConfig, log_prob_pass_switches
from rlframe.workers.config.profiler import RoleProfilerConfig


@dataclass
class RefFSDPConfig(Section):
    param_offload: bool = key(False, "keep ref parameters on CPU between uses")
    reshard_after_forward: bool = key(True, "free gathered params after forward")
    model_dtype: str = key("fp32", "dtype the reference model is loaded in (FSDP holds it so)", choices=DTYPE_NAMES[1:])
    mixed_precision: MixedPrecisionConfig = section(MixedPrecisionConfig)
    forward_prefetch: bool = key(False, "all-gather the next layer during this one's forward (FSDP1; FSDP2 depth 1)")


@dataclass
class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: Optional[int] = key(None, "sequences per ref forward on one GPU (static)")
    log_prob_micro_batch_size: Optional[int] = key(None, "deprecated (verl) global form: per GPU = this // dp")
    log_prob_use_dynamic_bsz: bool = key(f"${{{ACTOR}.use_dynamic_bsz}}", "token-budget micro-batches")
    log_prob_max_token_len_per_gpu: int = key(f"${{{ACTOR}.ppo_max_token_len_per_gpu}}", "token budget (dynamic)")
    ulysses_sequence_parallel_size: int = key(f"${{{ACTOR}.ulysses_sequence_parallel_size}}", "SP degree")
    use_torch_compile: bool = key(f"${{{ACTOR}.use_torch_compile}}", "torch.compile the log-prob kernels (CUDA)")
    entropy_from_logits_with_chunking: bool = key(False, "verl's memory switch; no effect: rlframe always chunks")
    entropy_checkpointing: bool = key(False, "verl's memory switch; no effect: rlframe always recomputes")
    fsdp_config: RefFSDPConfig = section(RefFSDPConfig)
    profiler: RoleProfilerConfig = section(RoleProfilerConfig, "profiling on global_profiler.steps (docs/profiling.md)")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = micro_batch_inactive(self, path, LOG_PROB_FIELDS, "ref log-prob")
        out.update(log_prob_pass_switches(path, root))
        return out
