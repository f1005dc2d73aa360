"""The FSDP worker processes: actor + rollout + reference in one process (hybrid engine), and critic.

Every data method is dispatched per worker (DP_COMPUTE_PROTO, each worker its own share); inside,
a Ulysses group all-gathers its members' shares so every SP peer runs the same sequences, and
chunks the result back on the way out (docs/architecture.md). Sizes come from the driver's batch plan; the
config is read once into plain settings and never mutated.
"""

from __future__ import annotations

import importlib
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from rlframe.algorithms.distillation import DistillationLoss
from rlframe.algorithms.update_mode import ActorUpdate
from rlframe.batch_plan import BatchPlan
from rlframe.config import trace
from rlframe.config.checks import resolve_device
from rlframe.config.schema import read_only
from rlframe.distributed.parallel_dims import ParallelDims, ParallelPlan
from rlframe.models.builtin import copy_to_shm
from rlframe.protocol import DataProto, all_gather_data_proto
from rlframe.single_controller import Dispatch, Execute, register
from rlframe.utils.flops import model_flops_info
from rlframe.workers import checkpoint as ckpt
from rlframe.workers import lora
from rlframe.workers.activation_offload import enable as enable_activation_offload
from rlframe.workers.actor import PPOActor
from rlframe.workers.config.distillation import teachers_of
from rlframe.workers.critic import PPOCritic
from rlframe.workers.dtypes import resolve_dtype
from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
from rlframe.workers.lr_schedule import build_lr_scheduler
from rlframe.workers.model_loading import ModelSpec, load_hf_model
from rlframe.workers.optimizer import build_optimizer, move_optimizer_state
from rlframe.workers.profiler import ProfiledWorker, profiled
from rlframe.workers.teachers import Teachers
from rlframe.workers.updater import ModelOptions, PPOUpdater, RoleModel
from rlframe.workers.versioned_rollout import VersionedRollout
from rlframe.workers.weight_push import WeightPushSender
from rlframe.workers.weight_sync import (
    AdapterWeights,
    copied_weights,
    drain_weights,
    iter_full_params_bucketed,
    rollout_weights,
    sync_lora_to_rollout,
)


def fsdp_spec(fsdp_cfg: DictConfig, strategy: str, device_type: str) -> FSDPSpec:
    """A role's fsdp_config as FSDP wrapping settings; mixed_precision as verl 0.9.1 reads it (auto: bf16 on GPU)."""
    mixed = fsdp_cfg.mixed_precision
    return FSDPSpec(
        strategy=strategy,
        param_dtype=resolve_dtype(str(mixed.param_dtype), device_type),
        reduce_dtype=resolve_dtype(str(mixed.reduce_dtype), device_type),
        param_offload=bool(fsdp_cfg.param_offload),
        reshard_after_forward=bool(fsdp_cfg.reshard_after_forward),
        forward_prefetch=bool(fsdp_cfg.forward_prefetch),
        buffer_dtype=resolve_dtype(str(mixed.buffer_dtype), device_type),
    )


class FSDPWorkerBase(ProfiledWorker):
    """Shared set-up: process group, meshes, FSDP-wrapped models, SP gather/scatter."""

    SECTIONS: tuple[str, ...]  # the top-level config sections this role reads (`schema.sections_of`)

    def __init__(self, sections: dict, plan: BatchPlan):
        """`sections`: this role's `SECTIONS` of the driver's typed tree (interpolations resolved), by key."""
        super().__init__()
        self.config = read_only(sections)
        self.plan = plan
        self.device_type = resolve_device(self.config.trainer.device)
        self.dims = ParallelDims.single()

    def _init_dist(self, parallel: ParallelPlan):
        """Join the default process group, then build every group of the role's layout (the plan's)."""
        self.init_process_group(timeout_s=float(self.config.actor_rollout_ref.nccl_timeout))
        torch.manual_seed(int(self.config.data.seed))  # fresh heads (critic) start equal on every rank
        self.dims = ParallelDims.build(parallel, self.device_type)

    def _load(self, model_cfg, role: str, use_remove_padding: bool, fsdp_cfg, freeze_vision_tower: bool = False):
        """The HF model on CPU in fsdp_config.model_dtype (FSDP's mixed precision casts for compute)."""
        if model_cfg.external_lib:  # registers custom model classes with transformers' Auto* factories
            importlib.import_module(model_cfg.external_lib)
        path = copy_to_shm(model_cfg.path) if model_cfg.use_shm else model_cfg.path
        return load_hf_model(
            ModelSpec(
                path=path,
                role=role,
                dtype=resolve_dtype(str(fsdp_cfg.model_dtype), self.device_type),
                use_remove_padding=use_remove_padding,
                gradient_checkpointing=bool(model_cfg.enable_gradient_checkpointing),
                trust_remote_code=bool(model_cfg.trust_remote_code),
                override_config=OmegaConf.to_container(model_cfg.override_config),
                freeze_vision_tower=freeze_vision_tower,
            )
        )

    def _wrap(self, model, fsdp_cfg, activation_offload: bool = False):
        module = wrap_fsdp(
            model,
            fsdp_spec(fsdp_cfg, self._strategy, self.device_type),
            self.dims.fsdp_mesh,
            self.device_type,
            self.shared_memory,  # the process's (Worker.shared_memory): one buffer for its models and weight sync
        )
        if activation_offload and self.device_type == "cuda":  # on CPU activations already are in host memory
            enable_activation_offload(module)
        return module

    def _offload_optimizer(self) -> None:
        """With the role's fsdp_config.optimizer_offload, optimizer state waits on the CPU between updates."""
        if self._optimizer_offload:
            move_optimizer_state(self.optimizer, "cpu")

    def _load_optimizer(self) -> None:
        if self._optimizer_offload and self.device_type == "cuda":
            move_optimizer_state(self.optimizer, torch.cuda.current_device())

    def _save_role(self, path: str, role: PPOUpdater, contents) -> None:
        """Write a role's model, optimizer, scheduler and RNG streams (checkpoint.save_contents) under `path`."""
        ckpt.save_checkpoint(
            path,
            role.module,
            role.optimizer,
            role.lr_scheduler,
            list(contents),
            self.tokenizer,
            role.generator,
            kill_points=self.kill_points,  # each file written is the kill point checkpoint.file
        )

    def _load_role(self, path: str, role: PPOUpdater) -> None:
        ckpt.load_checkpoint(path, role.module, role.optimizer, role.lr_scheduler, generator=role.generator)
        self._offload_optimizer()  # loading puts the optimizer state next to the parameters

    def _to_device(self, data: DataProto) -> DataProto:
        return data.to(self.device_type if self.device_type == "cpu" else torch.cuda.current_device())

    def _gather_sp(self, data: DataProto) -> DataProto:
        """Ulysses peers need the same sequences: concatenate the SP group's shares."""
        return data if self.dims.sp_group is None else all_gather_data_proto(data, self.dims.sp_group)

    def _scatter_sp(self, data: DataProto) -> DataProto:
        """Keep this rank's share of an SP-gathered result."""
        if self.dims.sp_group is None:
            return data
        return data.chunk(self.dims.sp_size)[self.dims.sp_rank]


class ActorRolloutRefWorker(FSDPWorkerBase, WeightPushSender):
    """Actor and rollout in one process (hybrid engine), plus the reference policy when `with_ref` and the
    distillation teacher with `distillation.enabled`."""

    # `algorithm`: the update's mode (ActorUpdate); `data`: the tokenizer and the seed; `distillation`: the teacher
    SECTIONS = ("actor_rollout_ref", "algorithm", "data", "trainer", "global_profiler", "distillation")

    def __init__(self, sections: dict, plan: BatchPlan, with_ref: bool):
        super().__init__(sections, plan)
        self.with_ref = with_ref
        self._strategy = str(self.config.actor_rollout_ref.actor.strategy)
        self._optimizer_offload = bool(self.config.actor_rollout_ref.actor.fsdp_config.optimizer_offload)
        self._weights_dirty = True
        # trainer.v1.trainer_mode=colocate_async: the engine generates the source's groups under a policy version
        # and a cut (`VersionedRollout`, built with the engine); else it generates each step's batch as it comes
        self.versioned: VersionedRollout | None = None
        # as verl's colocated worker: the actor's settings profile the process (rollout included); the
        # reference's own settings only choose whether its stage gets a trace of its own (discrete)
        self.profiler = self._profiler(self.config.actor_rollout_ref.actor.profiler, "actor_rollout_ref")
        self.ref_profiler = self._profiler(self.config.actor_rollout_ref.ref.profiler, "ref", stages_only=True)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int) -> None:
        from transformers import AutoTokenizer

        cfg = self.config.actor_rollout_ref
        self._init_dist(self.plan.actor_parallel)
        use_rmpad = bool(cfg.model.use_remove_padding)
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.config.data.tokenizer or cfg.model.path, trust_remote_code=bool(self.config.data.trust_remote_code)
        )
        model = self._load(cfg.model, "actor", use_rmpad, cfg.actor.fsdp_config, bool(cfg.actor.freeze_vision_tower))
        self.actor_flops = model_flops_info(model)  # read before sharding
        lora_spec = lora.LoraSpec.from_config(cfg.model)
        if lora_spec is not None:
            model = lora.apply_lora(model, lora_spec, use_shm=bool(cfg.model.use_shm))
        self.actor_module = self._wrap(model, cfg.actor.fsdp_config, bool(cfg.model.enable_activation_offload))
        self.optimizer = build_optimizer(self.actor_module, cfg.actor.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.actor.optim, total_training_steps)
        options = self._model_options(cfg.actor.use_torch_compile, cfg.actor.fsdp_config)
        actor_model = RoleModel(self.actor_module, options, self.optimizer, self.lr_scheduler)
        # the update's mode, rollout correction and scoring temperature: decided here, once
        update = ActorUpdate.from_config(cfg.actor, self.config.algorithm, cfg.rollout, self.config.distillation)
        seed = int(self.config.data.seed)
        self.actor = PPOActor(actor_model, cfg.actor, self.plan.actor, self.dims, seed=seed, update=update)
        self._offload_optimizer()
        if self.with_ref:
            if lora_spec is not None:  # verl's ref_in_actor: the actor with its adapter disabled
                ref_module = self.actor_module
            else:
                ref_model = self._load(cfg.model, "actor", use_rmpad, cfg.ref.fsdp_config)
                ref_module = self._wrap(ref_model, cfg.ref.fsdp_config)
                ref_module.requires_grad_(False)
            ref_model = RoleModel(ref_module, self._model_options(cfg.ref.use_torch_compile, cfg.actor.fsdp_config))
            self.ref = PPOActor(ref_model, cfg.actor, self.plan.actor, self.dims, log_prob=self.plan.ref, update=update)
        if update.distillation is not None:
            self.teachers = self._build_teachers(cfg, use_rmpad, update.distillation)
        self.kill_points.hit("worker.init")  # crash-consistency tests (docs/reliability.md)
        self._init_rollout(cfg)

    def _build_teachers(self, cfg, use_rmpad: bool, loss: DistillationLoss) -> Teachers:
        """The distillation teachers, by the routing key each scores (one teacher: every row, key None)."""
        distillation = self.config.distillation
        entries = teachers_of(distillation).values()
        routed = len(entries) > 1  # routes_rows
        models = {str(t.key) if routed else None: self._build_teacher(cfg, use_rmpad, t.model_path) for t in entries}
        return Teachers(models, str(distillation.teacher_key), loss.topk if loss.uses_topk else 0, self.dims.dp_group)

    def _build_teacher(self, cfg, use_rmpad: bool, path: str) -> PPOActor:
        """One distillation teacher: a frozen causal LM held as the reference is (its fsdp_config), scoring at T = 1.

        It loads with the actor's model settings but its own checkpoint and no override_config; its pass is cut
        into micro-batches as the old-log-prob pass is (actor_rollout_ref.rollout.log_prob_*). verl scores with the
        teacher at temperature 1 whatever the rollout's (its teacher_manager.py), and so does this. The driver
        checked that the teacher's tokenizer is the policy's (main_ppo.check_teacher_tokenizer).
        """
        model_cfg = OmegaConf.merge(cfg.model, {"path": str(path), "override_config": {}})
        model = self._load(model_cfg, "actor", use_rmpad, cfg.ref.fsdp_config)
        module = self._wrap(model, cfg.ref.fsdp_config)
        module.requires_grad_(False)
        options = self._model_options(cfg.ref.use_torch_compile, cfg.ref.fsdp_config)
        return PPOActor(RoleModel(module, options), cfg.actor, self.plan.actor, self.dims, update=ActorUpdate())

    def _model_options(self, use_torch_compile: bool, fsdp_cfg) -> ModelOptions:
        """How the actor's (or reference's) model runs: model keys, the pass's compile switch (CUDA only)."""
        model = self.config.actor_rollout_ref.model
        return ModelOptions(
            use_remove_padding=bool(model.use_remove_padding),
            use_fused_kernels=bool(model.use_fused_kernels),
            use_torch_compile=bool(use_torch_compile) and self.device_type == "cuda",
            reshard_after_forward=bool(fsdp_cfg.reshard_after_forward),
        )

    def _init_rollout(self, cfg) -> None:
        from rlframe.workers.rollout import ServedModel, build_rollout
        from rlframe.workers.rollout.pool import pools_generation
        from rlframe.workers.rollout.registry import engine_for

        self.rollout_engine = engine_for(str(cfg.rollout.name), str(cfg.rollout.mode))
        self.rollout = build_rollout(
            str(cfg.rollout.name),
            cfg.rollout,
            ServedModel(
                copy_to_shm(cfg.model.path) if cfg.model.use_shm else cfg.model.path,
                trust_remote_code=bool(cfg.model.trust_remote_code),
                override_config=OmegaConf.to_container(cfg.model.override_config),
                lora_rank=lora.lora_rank_of(self.actor_module),
            ),
            self.tokenizer,
            self.device_type,
            self.dims.tp_group,
            chat_template_kwargs=OmegaConf.to_container(self.config.data.apply_chat_template_kwargs),
        )
        if self.config.trainer.v1.trainer_mode == "colocate_async":  # cut and continued together by each TP group
            self.versioned = VersionedRollout(self.rollout, self.dims.tp_group)
        # rollout.pool_cpu_generation: the ranks of this machine generate on rank 0 (rollout/pool.py)
        self.generation_pool = None
        group = self.dims.pool_group  # the plan's: an engine that pools, on CPU, TP 1, more than one rank
        if group is not None and self.versioned is None:
            weight_bytes = sum(p.numel() * p.element_size() for p in self.actor_module.parameters())
            if pools_generation(cfg.rollout.pool_cpu_generation, weight_bytes, group, self.shared_memory):
                self.generation_pool = group

    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def flops_info(self) -> dict:
        """The actor's FLOP-count inputs and the device name, for perf/mfu/actor on the driver."""
        name = torch.cuda.get_device_name() if self.device_type == "cuda" else "cpu"
        return {**self.actor_flops, "device_name": name}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("rollout_generate")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sync the actor's current weights into the rollout engine, then generate (colocate_async, training
        rows: stamped with the policy version and cuttable, `VersionedRollout.generate`)."""
        from rlframe.workers.rollout import generate_in_tp_group
        from rlframe.workers.rollout.pool import generate_pooled

        sync_s = self._wake_rollout()
        self.kill_points.hit("worker.generate")  # crash-consistency tests (docs/reliability.md)
        # validation must not advance the training RNG stream, or resuming would diverge
        validate = prompts.meta_info.get("validate", False)
        devices = [torch.cuda.current_device()] if self.device_type == "cuda" else []
        rng = torch.random.fork_rng(devices=devices) if validate else nullcontext()
        with rng:
            # validation is never cut: it is queued after the step's weight sync, so no newer version is announced
            if self.versioned is not None and not validate:
                output = self.versioned.generate(self._to_device(prompts))
            elif self.generation_pool is not None:
                output = generate_pooled(self.rollout, self._to_device(prompts), self.generation_pool)
            else:
                output = generate_in_tp_group(self.rollout, self._to_device(prompts), self.dims.tp_group)
        self._sleep_rollout()
        output.meta_info.setdefault("metrics", {})["timing_s/weight_sync"] = sync_s
        return output.to("cpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_whole(self, prompts: DataProto) -> DataProto:
        """colocate_async: `generate_sequences` that the cut at a sample's end does not stop
        (`VersionedRollout.uncut`); the step trains once it is done."""
        with self.versioned.uncut():
            return self.generate_sequences(prompts)

    def _wake_rollout(self) -> float:
        """Resume the engine and give it the actor's weights if they changed since; the seconds it took."""
        start = time.perf_counter()
        generates_here = self.generation_pool is None or dist.get_rank(self.generation_pool) == 0
        if generates_here:
            self.rollout.resume()
        if self._weights_dirty:
            if not generates_here:  # pooled: its shards reach the rank that generates; its own replica stays idle
                for _ in iter_full_params_bucketed(self.actor_module):
                    pass
            elif lora.is_lora(self.actor_module):
                adapter = self.rollout_engine.capabilities.lora == "adapter"
                sync_lora_to_rollout(self.rollout, self.actor_module, adapter)
            else:
                self.rollout.update_weights(iter_full_params_bucketed(self.actor_module))
            self._weights_dirty = False
        return time.perf_counter() - start

    def _sleep_rollout(self) -> None:
        """With free_cache_engine, the engine's memory goes back to training (its weights then need a new sync)."""
        if self.rollout.config.free_cache_engine:
            self.rollout.release()
            self._weights_dirty = True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def watch_versions(self, board) -> None:
        """colocate_async: stop a generation once `board` (a VersionBoard actor) announces newer weights."""
        self.versioned.watch(board)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, version: int) -> None:
        """colocate_async: the engine takes the actor's weights as policy version `version` (verl's
        update_weights at a step's end); the generations after this call run on them."""
        self._wake_rollout()
        self.versioned.version = int(version)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def continue_sequences(self, rows: DataProto) -> DataProto:
        """colocate_async: finish rows a cut stopped, on the engine's current weights (`rollout/partial.py`)."""
        sync_s = self._wake_rollout()
        output = self.versioned.continue_rows(self._to_device(rows))
        self._sleep_rollout()
        output.meta_info["metrics"]["timing_s/weight_sync"] = sync_s
        return output

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def export_weights(self, with_base: bool = False) -> dict[str, torch.Tensor] | AdapterWeights | None:
        """What the rollout pool's engine takes of the actor (rank 0's answer is the result): its full tensors by HF
        name; a LoRA actor's merged weights, or for an "adapter" engine (vLLM) its `AdapterWeights`, with the base
        weights only `with_base` (`weight_sync.rollout_weights`).

        Every rank joins the gathers; rank 0 keeps a copy of each tensor, because the stream yields views of a
        buffer it reuses.
        """
        adapter = self.rollout_engine.capabilities.lora == "adapter"
        weights = rollout_weights(self.actor_module, adapter, with_base)
        if self.rank != 0:  # its shards reach rank 0 through the gathers
            drain_weights(weights)
            return None
        return copied_weights(weights)

    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def process_rng_state(self) -> torch.Tensor:
        """This process's torch RNG state: what `generate_in_tp_group` draws the next generation's seed from."""
        return torch.get_rng_state()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("actor_compute_log_prob")
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Old log-probs under the current actor (and their entropy, for the metrics)."""
        data = self._to_device(self._gather_sp(data))
        # Σπ² per token for the OTB estimators (advantage.OTB_ESTIMATORS; actor.calculate_sum_pi_squared)
        sum_pi_squared = bool(self.config.actor_rollout_ref.actor.calculate_sum_pi_squared)
        stats = self.actor.compute_token_stats(data, calculate_entropy=True, calculate_sum_pi_squared=sum_pi_squared)
        names = {"log_probs": "old_log_probs", "entropy": "entropys", "sum_pi_squared": "sum_pi_squared"}
        out = DataProto.from_dict({names[name]: value for name, value in stats.items()})
        return self._scatter_sp(out).to("cpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("ref_compute_log_prob", profiler="ref_profiler")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        data = self._to_device(self._gather_sp(data))
        with lora.adapter_disabled(self.ref.module):  # with LoRA the reference is the actor's base model
            log_probs, _ = self.ref.compute_log_prob(data)
        return self._scatter_sp(DataProto.from_dict({"ref_log_prob": log_probs})).to("cpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("teacher_compute_log_prob")
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """Each row's distillation teacher's log-probs of the sampled response tokens (temperature 1); for
        `forward_kl_topk`, its top-k log-probs and token ids in place of each response token instead."""
        data = self._to_device(self._gather_sp(data))
        out = self.teachers.score(data)
        return self._scatter_sp(DataProto.from_dict(out)).to("cpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("actor_update")
    def update_actor(self, data: DataProto) -> DataProto:
        data = self._to_device(self._gather_sp(data))
        self._load_optimizer()
        start = time.perf_counter()
        # in on-policy mode (no old-log-prob pass ran) the update hands back the old log-probs and entropy
        metrics, stats = self.actor.update_policy(data)
        self.kill_points.hit("worker.update")
        metrics["timing_s/update_actor_worker"] = [time.perf_counter() - start]
        self._offload_optimizer()
        self._weights_dirty = True
        if not stats:
            return DataProto(meta_info={"metrics": metrics})
        return self._scatter_sp(DataProto.from_dict(stats, meta_info={"metrics": metrics})).to("cpu")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self._save_role(path, self.actor, self.config.actor_rollout_ref.actor.checkpoint.save_contents)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self._load_role(path, self.actor)
        self._weights_dirty = True


class CriticWorker(FSDPWorkerBase):
    """The value model: compute_values and update_critic."""

    # `actor_rollout_ref`: nccl_timeout; `data`: the seed
    SECTIONS = ("critic", "actor_rollout_ref", "data", "trainer", "global_profiler")

    def __init__(self, sections: dict, plan: BatchPlan):
        super().__init__(sections, plan)
        self._strategy = str(self.config.critic.strategy)
        self._optimizer_offload = bool(self.config.critic.model.fsdp_config.optimizer_offload)
        self.profiler = self._profiler(self.config.critic.profiler, "critic")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int) -> None:
        from transformers import AutoTokenizer

        cfg = self.config.critic
        self._init_dist(self.plan.critic_parallel)
        self.tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.tokenizer_path, trust_remote_code=bool(cfg.model.trust_remote_code)
        )
        self.critic_module = self._wrap(
            self._load(cfg.model, "critic", bool(cfg.model.use_remove_padding), cfg.model.fsdp_config),
            cfg.model.fsdp_config,
            bool(cfg.model.enable_activation_offload),
        )
        self.optimizer = build_optimizer(self.critic_module, cfg.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optim, total_training_steps)
        options = ModelOptions(
            use_remove_padding=bool(cfg.model.use_remove_padding),
            reshard_after_forward=bool(cfg.model.fsdp_config.reshard_after_forward),
        )
        critic_model = RoleModel(self.critic_module, options, self.optimizer, self.lr_scheduler)
        self.critic = PPOCritic(critic_model, cfg, self.plan.critic, self.dims, seed=int(self.config.data.seed))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("critic_compute_values")
    def compute_values(self, data: DataProto) -> DataProto:
        data = self._to_device(self._gather_sp(data))
        values = self.critic.compute_values(data)
        return self._scatter_sp(DataProto.from_dict({"values": values})).to("cpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("critic_update")
    def update_critic(self, data: DataProto) -> DataProto:
        data = self._to_device(self._gather_sp(data))
        self._load_optimizer()
        metrics = self.critic.update_critic(data)
        self._offload_optimizer()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self._save_role(path, self.critic, self.config.critic.checkpoint.save_contents)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self._load_role(path, self.critic)


def worker_env() -> dict:
    """Environment every worker process needs (offline HF, quiet tokenizers, the config-read trace if on)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    if os.environ.get(trace.ENV):
        env[trace.ENV] = os.environ[trace.ENV]
    return env
