"""What the asynchronous trainer modes run on and hold: the pools, η and L, the batches in flight.

`make_async_plan` computes, before Ray starts, what the asynchronous rollout stage (`PooledSource`) will do with a
config: the training and rollout pools (under `colocate_async` the rollout is the training processes' own engines),
the staleness bound η and the lookahead L (`staleness_bound`, `lookahead`:
the numbers the trainer runs with), the sequences that can be in flight and the bytes of their rollout tensors, the
weight copy each push puts in Ray's object store, and which objective the update optimizes on stale samples.
`rlframe explain` prints it (docs/async.md shows an example).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from rlframe.batch_plan import BatchPlan
from rlframe.trainer.config import lookahead, staleness_bound
from rlframe.workers.config.model import DTYPES
from rlframe.workers.rollout.registry import find_engine

# The tensors of one generated sequence as the driver keeps them (`build_rollout_output` and `mark_rollout_state` in
# rlframe/workers/rollout/base.py; the 1-byte stop reason is dropped as a call returns, and a cut tool-agent
# trajectory's state goes back to the pool):
# (name, dtype, bytes per prompt token, bytes per response token). Prompts are padded to data.max_prompt_length
# and responses to data.max_response_length.
ROLLOUT_TENSORS = (
    ("prompts", "int64", 8, 0),
    ("responses", "int64", 0, 8),
    ("input_ids", "int64", 8, 8),
    ("attention_mask", "int64", 8, 8),
    ("position_ids", "int64", 8, 8),
    ("response_mask", "int64", 0, 8),
    ("rollout_log_probs", "fp32", 0, 4),  # with actor_rollout_ref.rollout.calculate_log_probs
    ("rollout_versions", "int32", 0, 4),
)
LOG_PROBS = "rollout_log_probs"
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class AsyncPlan:
    """The pools, the staleness bound and what it holds in memory, for one separate_async or colocate_async config."""

    mode: str  # trainer.v1.trainer_mode
    training_nnodes: int
    training_n_gpus_per_node: int
    training_roles: tuple[str, ...]  # the roles each training process hosts
    rollout_nnodes: int
    rollout_n_gpus_per_node: int
    rollout_engine: str
    rollout_tp: int
    rollout_replicas: int
    max_off_policy_threshold: int
    max_off_policy_strategy: str
    partial_rollout: bool  # a push (colocate: a step's sampled batch) cuts the generations it finds running
    staleness_bound: int  # η
    num_warmup_batches: int
    lookahead: int  # L
    train_batch_size: int  # B: groups per step
    in_flight_groups: int  # (L + 1) · B: AReaL's admission bound
    groups_per_call: int  # ⌈B / rollout replicas⌉: what one generate call on one replica takes
    sequences_per_batch: int
    in_flight_sequences: int
    max_prompt_length: int
    max_response_length: int
    rollout_tensors: tuple[str, ...]  # what bytes_per_sequence counts
    bytes_per_prompt_token: int
    bytes_per_response_token: int
    bytes_per_sequence: (
        int  # bytes_per_prompt_token × max_prompt_length + bytes_per_response_token × max_response_length
    )
    in_flight_bytes: int
    weight_dtype: str  # actor_rollout_ref.actor.fsdp_config.model_dtype: the dtype export_weights sends
    weight_element_bytes: int
    weight_parameters: int | None  # elements of the actor's state dict; None when its config is not readable
    weight_push_bytes: int | None  # None under colocate_async: the engines take the weights in place
    weight_form: str  # full | lora_merged | lora_adapter: what each push holds (weight_sync.rollout_weights)
    push_backend: str  # naive | nccl over gloo | nccl over nccl: checkpoint_engine.backend and its transport
    push_bucket_megabytes: int  # rollout.checkpoint_engine.update_weights_bucket_megabytes (the collective's)
    objective: str  # on_policy | decoupled | bypass | uncorrected

    @property
    def training_processes(self) -> int:
        return self.training_nnodes * self.training_n_gpus_per_node

    @property
    def rollout_processes(self) -> int:
        return self.rollout_nnodes * self.rollout_n_gpus_per_node

    def to_dict(self) -> dict:
        return asdict(self)


def training_roles(cfg: Any, plan: BatchPlan) -> tuple[str, ...]:
    """The roles of each training process, as `create_worker_groups` colocates them."""
    roles = ["actor", "rollout (validation)"]
    if plan.ref is not None:
        roles.append("ref")
    if plan.critic is not None:
        roles.append("critic")
    if cfg.reward_model.enable:
        roles.append("reward_model")
    return tuple(roles)


def objective(cfg: Any) -> str:
    """What the update optimizes on the samples it trains (docs/async.md: the objective with stale samples)."""
    if lookahead(cfg.trainer.v1) == 0:
        return "on_policy"
    correction = cfg.algorithm.rollout_correction
    if correction.bypass_mode:
        return "bypass"
    if correction.rollout_is is not None or correction.rollout_rs is not None:
        return "decoupled"
    return "uncorrected"


def push_backend(cfg: Any) -> str:
    """actor_rollout_ref.rollout.checkpoint_engine.backend, with the collective's transport on the planned device."""
    from rlframe.config.checks import planned_device

    backend = str(cfg.actor_rollout_ref.rollout.checkpoint_engine.backend)
    if backend == "naive":
        return backend
    return f"{backend} over {'nccl' if planned_device(cfg.trainer.device) == 'cuda' else 'gloo'}"


def weight_form(cfg: Any) -> str:
    """What each push holds: the full weights, a LoRA actor's merged ones, or its adapter (vLLM serves adapters)."""
    if cfg.actor_rollout_ref.model.lora_rank <= 0:
        return "full"
    engine = find_engine(cfg.actor_rollout_ref.rollout.name)
    return "lora_adapter" if engine is not None and engine.capabilities.lora == "adapter" else "lora_merged"


def exported_parameters(path: str | None, trust_remote_code: bool = False) -> int | None:
    """Elements of the actor's state dict, what `export_weights` sends (a tied embedding counts twice, as it is
    sent twice), from the model built on the meta device; None when `<path>/config.json` is not there."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):  # no weights are allocated or read
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, ImportError, KeyError):  # an architecture transformers cannot build here
        return None
    return sum(tensor.numel() for tensor in model.state_dict().values())


def make_async_plan(cfg: Any, plan: BatchPlan) -> AsyncPlan | None:
    """The async plan of a normalized config (None under trainer.v1.trainer_mode=sync).

    colocate_async generates on the training processes' engines: its rollout "pool" is the training pool, one
    replica (each call splits its rows over the processes), partial rollout always on, and no weight copy."""
    v1 = cfg.trainer.v1
    if v1.trainer_mode == "sync":
        return None
    colocate = v1.trainer_mode == "colocate_async"
    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    nnodes = plan.nnodes if colocate else rollout.nnodes
    per_node = plan.n_gpus_per_node if colocate else rollout.n_gpus_per_node
    eta, ahead = staleness_bound(v1), lookahead(v1)
    tensors = [t for t in ROLLOUT_TENSORS if t[0] != LOG_PROBS or rollout.calculate_log_probs]
    per_prompt_token, per_response_token = sum(t[2] for t in tensors), sum(t[3] for t in tensors)
    per_sequence = per_prompt_token * plan.max_prompt_length + per_response_token * plan.max_response_length
    in_flight = (1 + ahead) * plan.sequences_per_step
    replicas = 1 if colocate else nnodes * per_node // rollout.tensor_model_parallel_size
    dtype = cfg.actor_rollout_ref.actor.fsdp_config.model_dtype
    element_bytes = ELEMENT_BYTES[DTYPES[dtype]]
    parameters = None if colocate else exported_parameters(model.path, bool(model.trust_remote_code))
    return AsyncPlan(
        mode=v1.trainer_mode,
        training_nnodes=plan.nnodes,
        training_n_gpus_per_node=plan.n_gpus_per_node,
        training_roles=training_roles(cfg, plan),
        rollout_nnodes=nnodes,
        rollout_n_gpus_per_node=per_node,
        rollout_engine=rollout.name,
        rollout_tp=rollout.tensor_model_parallel_size,
        rollout_replicas=replicas,
        max_off_policy_threshold=v1.sampler.max_off_policy_threshold,
        max_off_policy_strategy=v1.sampler.max_off_policy_strategy,
        partial_rollout=colocate or bool(rollout.partial_rollout),
        staleness_bound=eta,
        num_warmup_batches=getattr(v1, v1.trainer_mode).num_warmup_batches,
        lookahead=ahead,
        train_batch_size=plan.train_batch_size,
        in_flight_groups=(1 + ahead) * plan.train_batch_size,
        groups_per_call=math.ceil(plan.train_batch_size / replicas),
        sequences_per_batch=plan.sequences_per_step,
        in_flight_sequences=in_flight,
        max_prompt_length=plan.max_prompt_length,
        max_response_length=plan.max_response_length,
        rollout_tensors=tuple(t[0] for t in tensors),
        bytes_per_prompt_token=per_prompt_token,
        bytes_per_response_token=per_response_token,
        bytes_per_sequence=per_sequence,
        in_flight_bytes=in_flight * per_sequence,
        weight_dtype=dtype,
        weight_element_bytes=element_bytes,
        weight_parameters=parameters,
        weight_push_bytes=None if parameters is None else parameters * element_bytes,
        weight_form=weight_form(cfg),
        push_backend=push_backend(cfg),
        push_bucket_megabytes=int(rollout.checkpoint_engine.update_weights_bucket_megabytes),
        objective=objective(cfg),
    )
