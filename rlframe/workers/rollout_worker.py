"""RolloutWorker: a process of the standalone rollout pool (`trainer.v1.trainer_mode=separate_async`).

It holds only the rollout engine (hf, TP 1): no actor, no optimizer. Its weights arrive from the training
pool (`ActorRolloutRefWorker.export_weights` → the driver → `load_weights`), each push tagged with the policy
version it holds: the number of training steps behind those weights (0 = the initial model). Every generated
response token is stamped with that version (`rollout_versions`, -1 on padding), so the driver can tell how
stale a sample is when it trains on it.

Sampling seeds: a hybrid worker draws one seed per generate call from its process RNG
(`generate_in_tp_group`). That RNG is seeded with data.seed and then advanced by whatever the roles' set-up
draws (a critic's fresh value head), so `init_model` receives the training processes' state once every role is
built (`ActorRolloutRefWorker.process_rng_state`). The rollout pool then draws the seeds the hybrid engine would
have drawn for the same sequence of calls: a synchronous schedule on two pools samples the tokens of a
synchronous run on one.
"""

from __future__ import annotations

import time

import torch
from omegaconf import OmegaConf

from rlframe.batch_plan import BatchPlan
from rlframe.config.checks import resolve_device
from rlframe.models.builtin import copy_to_shm
from rlframe.protocol import DataProto
from rlframe.single_controller import Dispatch, Worker, register
from rlframe.utils.faults import DelayPoints

VERSIONS_KEY = "rollout_versions"


class RolloutWorker(Worker):
    """One rollout-only process: `init_model`, `generate_sequences`, `load_weights`."""

    def __init__(self, config, plan: BatchPlan):
        """`config`: the whole typed config (`PPOTrainerConfig`); only its rollout, model and data keys are read."""
        super().__init__()
        self.config = OmegaConf.structured(config)
        OmegaConf.set_readonly(self.config, True)
        self.plan = plan
        self.device_type = resolve_device(self.config.trainer.device)
        self.version = 0
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
        tokenizer = AutoTokenizer.from_pretrained(
            self.config.data.tokenizer or cfg.model.path, trust_remote_code=bool(self.config.data.trust_remote_code)
        )
        served = ServedModel(
            copy_to_shm(cfg.model.path) if cfg.model.use_shm else cfg.model.path,
            trust_remote_code=bool(cfg.model.trust_remote_code),
            override_config=OmegaConf.to_container(cfg.model.override_config),
        )
        self.rollout = build_rollout(
            str(cfg.rollout.name),
            cfg.rollout,
            served,
            tokenizer,
            self.device_type,
            None,
            chat_template_kwargs=OmegaConf.to_container(self.config.data.apply_chat_template_kwargs),
        )
        torch.set_rng_state(rng_state)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, version: int, named_tensors: dict[str, torch.Tensor]) -> None:
        """Load the full actor tensors of policy version `version` (HF names) into the engine."""
        self.rollout.update_weights(named_tensors.items())
        self.version = int(version)
        self._idle_since = time.perf_counter()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate this replica's share; stamp the response tokens with the engine's policy version. The output's
        meta_info["idle_s"] is how long this process waited for work before the call (since its last call)."""
        from rlframe.workers.rollout import generate_in_tp_group

        idle = time.perf_counter() - self._idle_since
        self.kill_points.hit("rollout.generate")
        self.delay_points.hit("rollout.generate")
        output = generate_in_tp_group(self.rollout, prompts.to(self.device_type), None).to("cpu")
        mask = output.batch["response_mask"]
        versions = torch.full(mask.shape, self.version, dtype=torch.int32)
        output.batch[VERSIONS_KEY] = versions.masked_fill(mask == 0, -1)
        output.meta_info["idle_s"] = idle
        self._idle_since = time.perf_counter()
        return output
