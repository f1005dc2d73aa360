"""RolloutWorker: a process of the standalone rollout pool (`trainer.v1.trainer_mode=separate_async`).

It holds only the rollout engine (a TP group of consecutive processes is one replica): no actor, no optimizer. Its
weights arrive from the training pool (`ActorRolloutRefWorker.export_weights` → the driver → `load_weights`, or
over a process group of their own with checkpoint_engine.backend=nccl: `weight_push.py`), each
push tagged with the policy version it holds: the number of training steps behind those weights (0 = the initial
model). Every generated response token is stamped with that version (`rollout_versions`, -1 on padding), so the
driver can tell how stale a sample is when it trains on it.

The version, the sampling seeds and the cut of a running generation by newer weights (partial rollout) are
`VersionedRollout`'s (`rlframe/workers/versioned_rollout.py`), shared with the hybrid engine of `colocate_async`.
The seeds follow the hybrid engine's: a hybrid worker draws one seed per generate call from its process RNG, which
is seeded with data.seed and then advanced by whatever the roles' set-up draws (a critic's fresh value head), so
`init_model` receives the training processes' state once every role is built
(`ActorRolloutRefWorker.process_rng_state`): a synchronous schedule on two pools samples the tokens of a
synchronous run on one.
"""

from __future__ import annotations

import time

import torch
from omegaconf import OmegaConf

from rlframe.batch_plan import BatchPlan
from rlframe.config.checks import resolve_device
from rlframe.config.schema import read_only
from rlframe.distributed.parallel_dims import build_tp_group
from rlframe.models.builtin import copy_to_shm
from rlframe.protocol import DataProto
from rlframe.single_controller import Dispatch, register
from rlframe.utils.faults import DelayPoints
from rlframe.workers.lora import configured_lora_rank
from rlframe.workers.profiler import ProfiledWorker, profiled
from rlframe.workers.versioned_rollout import VersionedRollout
from rlframe.workers.weight_push import WeightPushReceiver
from rlframe.workers.weight_sync import AdapterWeights, load_rollout_weights


class RolloutWorker(ProfiledWorker, WeightPushReceiver):
    """One rollout-only process: `init_model`, `generate_sequences`, `load_weights` (or, with
    checkpoint_engine.backend=nccl, `join_weight_push` and `receive_weights`: `rlframe/workers/weight_push.py`)."""

    # the rollout, the model, the tokenizer, the device and the profiler
    SECTIONS = ("actor_rollout_ref", "data", "trainer", "global_profiler")

    def __init__(self, sections: dict, plan: BatchPlan):
        """`sections`: its `SECTIONS` of the driver's typed tree (interpolations resolved), by key."""
        super().__init__()
        self.config = read_only(sections)
        self.plan = plan
        self.device_type = resolve_device(self.config.trainer.device)
        # global_profiler.steps: the pool's generate and continue calls, traced per actor_rollout_ref.rollout.profiler
        self.profiler = self._profiler(self.config.actor_rollout_ref.rollout.profiler, "rollout")
        self.delay_points = DelayPoints()  # tests: RLFRAME_DELAY_AT=rollout.generate:… (utils/faults.py)
        self._idle_since = time.perf_counter()  # the end of this process's last call (its idle time starts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, rng_state: torch.Tensor) -> None:
        """Join the rollout pool's process group, build the engine from the model path, adopt `rng_state`.

        The pool's process group gives each replica its index, which `generate_in_tp_group` mixes into the
        seed: without it every replica would sample with the same random stream.
        """
        from transformers import AutoTokenizer

        from rlframe.workers.rollout import ServedModel, build_rollout

        self.init_process_group(timeout_s=float(self.config.actor_rollout_ref.nccl_timeout))
        cfg = self.config.actor_rollout_ref
        # a replica is a TP group of consecutive processes; the driver sends its rows to all of them
        self.tp_group = build_tp_group(self.device_type, self.world_size, int(cfg.rollout.tensor_model_parallel_size))
        tokenizer = AutoTokenizer.from_pretrained(
            self.config.data.tokenizer or cfg.model.path, trust_remote_code=bool(self.config.data.trust_remote_code)
        )
        served = ServedModel(
            copy_to_shm(cfg.model.path) if cfg.model.use_shm else cfg.model.path,
            trust_remote_code=bool(cfg.model.trust_remote_code),
            override_config=OmegaConf.to_container(cfg.model.override_config),
            lora_rank=configured_lora_rank(cfg.model),
        )
        self.rollout = build_rollout(
            str(cfg.rollout.name),
            cfg.rollout,
            served,
            tokenizer,
            self.device_type,
            self.tp_group,
            chat_template_kwargs=OmegaConf.to_container(self.config.data.apply_chat_template_kwargs),
        )
        self.engine = self.rollout.unwrapped  # the engine, under rollout.mode=async's agent loops
        self.versioned = VersionedRollout(self.rollout, self.tp_group)
        torch.set_rng_state(rng_state)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def watch_versions(self, board) -> None:
        """Partial rollout: stop a generation once `board` (a VersionBoard actor) announces newer weights; the OpenAI
        endpoint's requests continue on them in the same call (`VersionedRollout.catch_up`)."""
        self.versioned.watch(board)
        self.engine.catch_up = self.versioned.catch_up

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def needs_base_weights(self) -> bool:
        """Whether the engine waits for the actor's weights before it may generate (vLLM's load_format=dummy)."""
        return self.rollout.needs_base_weights

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, version: int, weights: dict[str, torch.Tensor] | AdapterWeights) -> None:
        """Load policy version `version` into the engine: the actor's full tensors by HF name, or a LoRA actor's
        adapter (after its base, the first time) for an engine that serves adapters (`export_weights`). Weights the
        engine already caught up to in its last call (the OpenAI endpoint's cut requests) are not loaded again."""
        if self.versioned.caught_up >= int(version):
            self._idle_since = time.perf_counter()
            return
        load_rollout_weights(self.rollout, weights)
        self.versioned.version = int(version)
        self._idle_since = time.perf_counter()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("rollout_generate")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate this replica's share with the engine's policy version: the rollout stamps the response tokens with
        it and reports why each row stopped (`stop_reason`; the rows a newer version cut are `Stop.INTERRUPTED`).
        The output's meta_info["idle_s"] is how long this process waited for work before the call (since its last
        call). The seeds are `VersionedRollout.generate`'s."""
        idle = time.perf_counter() - self._idle_since
        self.kill_points.hit("rollout.generate")
        self.delay_points.hit("rollout.generate")
        output = self.versioned.generate(prompts.to(self.device_type))
        output.meta_info["idle_s"] = idle
        self._idle_since = time.perf_counter()
        return output

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_whole(self, prompts: DataProto) -> DataProto:
        """`generate_sequences` that no push cuts (`VersionedRollout.uncut`)."""
        with self.versioned.uncut():
            return self.generate_sequences(prompts)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("rollout_continue")
    def continue_sequences(self, rows: DataProto) -> DataProto:
        """Finish rows a weight update cut: their new tokens carry this engine's version. A single-turn row goes on
        from its tokens (`rollout/partial.py`); a tool agent's trajectory from its state (`TRAJECTORY_KEY`,
        `multi_turn.py`), whose tool calls already ran are never run again."""
        idle = time.perf_counter() - self._idle_since
        self.kill_points.hit("rollout.continue")
        output = self.versioned.continue_rows(rows.to(self.device_type))
        output.meta_info["idle_s"] = idle
        self._idle_since = time.perf_counter()
        return output
