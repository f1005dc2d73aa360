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
synchronous run on one. Each row's seed comes back with it (`sample_seed`), for its continuation.

Partial rollout (`actor_rollout_ref.rollout.partial_rollout`, `rollout/partial.py`): the driver announces each new
version on a `VersionBoard` before it queues the weights. A generation running on older weights sees the
announcement at its next decoding step (the board is asked at most every `BOARD_POLL_S`) and stops; the rows it
cut come back `interrupted`, and `continue_sequences` later finishes them under the new weights.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from rlframe.batch_plan import BatchPlan
from rlframe.config.checks import resolve_device
from rlframe.config.schema import read_only
from rlframe.models.builtin import copy_to_shm
from rlframe.protocol import DataProto
from rlframe.single_controller import Dispatch, Worker, register
from rlframe.utils.faults import DelayPoints
from rlframe.workers.lora import configured_lora_rank
from rlframe.workers.rollout.base import SEED_KEY, call_seed, seeded
from rlframe.workers.rollout.partial import INTERRUPTED_KEY, VERSIONS_KEY, continue_generation, interrupted_rows
from rlframe.workers.weight_sync import AdapterWeights, load_rollout_weights

BOARD_POLL_S = 0.02  # how often a running generation asks the board whether newer weights were announced


class VersionBoard:
    """The newest policy version the driver has announced to the rollout pool (a Ray actor of its own)."""

    def __init__(self):
        self.version = 0

    def announce(self, version: int) -> None:
        self.version = max(self.version, int(version))

    def announced(self) -> int:
        return self.version


class RolloutWorker(Worker):
    """One rollout-only process: `init_model`, `generate_sequences`, `load_weights`."""

    SECTIONS = ("actor_rollout_ref", "data", "trainer")  # the rollout, the model, the tokenizer and the device

    def __init__(self, sections: dict, plan: BatchPlan):
        """`sections`: its `SECTIONS` of the driver's typed tree (interpolations resolved), by key."""
        super().__init__()
        self.config = read_only(sections)
        self.plan = plan
        self.device_type = resolve_device(self.config.trainer.device)
        self.version = 0
        self.delay_points = DelayPoints()  # tests: RLFRAME_DELAY_AT=rollout.generate|rollout.decode:… (utils/faults.py)
        self._idle_since = time.perf_counter()  # the end of this process's last call (its idle time starts)
        self._board = None  # partial rollout: the driver's VersionBoard
        self._announced, self._asked_at = 0, 0.0

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
            lora_rank=configured_lora_rank(cfg.model),
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
        self.engine = self.rollout.unwrapped  # the engine, under rollout.mode=async's agent loops
        torch.set_rng_state(rng_state)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def watch_versions(self, board) -> None:
        """Partial rollout: stop a generation once `board` (a VersionBoard actor) announces newer weights."""
        self._board = board
        self.engine.interrupt = self._weights_moved_on

    def _weights_moved_on(self) -> bool:
        """Whether a version newer than the engine's was announced (the board asked at most every BOARD_POLL_S)."""
        import ray

        self.delay_points.hit("rollout.decode")  # tests: a slower decoding step, so that pushes land mid-generation
        now = time.monotonic()
        if now - self._asked_at >= BOARD_POLL_S:
            self._announced, self._asked_at = ray.get(self._board.announced.remote()), now
        return self._announced > self.version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def needs_base_weights(self) -> bool:
        """Whether the engine waits for the actor's weights before it may generate (vLLM's load_format=dummy)."""
        return self.rollout.needs_base_weights

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, version: int, weights: dict[str, torch.Tensor] | AdapterWeights) -> None:
        """Load policy version `version` into the engine: the actor's full tensors by HF name, or a LoRA actor's
        adapter (after its base, the first time) for an engine that serves adapters (`export_weights`)."""
        load_rollout_weights(self.rollout, weights)
        self.version = int(version)
        self._idle_since = time.perf_counter()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate this replica's share; stamp the response tokens with the engine's policy version and mark the
        rows a newer version cut (`interrupted`). The output's meta_info["idle_s"] is how long this process waited
        for work before the call (since its last call).

        The seeds: one draw of the process RNG, then the rows' sample seeds under it, exactly as
        `generate_in_tp_group` draws them with TP 1; they stay in the rows (`sample_seed`) for a continuation."""
        idle = time.perf_counter() - self._idle_since
        self.kill_points.hit("rollout.generate")
        self.delay_points.hit("rollout.generate")
        prompts = prompts.to(self.device_type)
        with seeded(call_seed(dist.get_rank())):
            prompts.non_tensor_batch[SEED_KEY] = np.array(self.rollout.sample_seeds(len(prompts)), dtype=object)
            output = self.rollout.generate_sequences(prompts).to("cpu")
        mask = output.batch["response_mask"]
        versions = torch.full(mask.shape, self.version, dtype=torch.int32)
        output.batch[VERSIONS_KEY] = versions.masked_fill(mask == 0, -1)
        params = self.rollout.sampling_for(prompts.meta_info)
        eos_ids, _ = self.rollout.special_tokens_for(prompts.meta_info)
        output.batch[INTERRUPTED_KEY] = interrupted_rows(output, params.response_length, eos_ids)
        output.meta_info["idle_s"] = idle
        self._idle_since = time.perf_counter()
        return output

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_whole(self, prompts: DataProto) -> DataProto:
        """`generate_sequences` that no push cuts: every token comes from the weights loaded now (ReMax's greedy
        baselines, generated by their group's admission version; `PooledSource._remax_baselines`)."""
        interrupt, self.engine.interrupt = self.engine.interrupt, None
        try:
            return self.generate_sequences(prompts)
        finally:
            self.engine.interrupt = interrupt

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def continue_sequences(self, rows: DataProto) -> DataProto:
        """Finish rows a weight update cut (`rollout/partial.py`): their new tokens carry this engine's version."""
        from rlframe.workers.rollout.base import response_metrics

        idle = time.perf_counter() - self._idle_since
        self.kill_points.hit("rollout.continue")
        start = time.perf_counter()
        with torch.no_grad():
            output = continue_generation(self.engine, rows.to(self.device_type), self.version).to("cpu")
        elapsed = time.perf_counter() - start
        eos_ids, _ = self.rollout.special_tokens_for(rows.meta_info)
        metrics = response_metrics(output.batch["response_mask"], output.batch["responses"], eos_ids)
        new_tokens = int((output.batch[VERSIONS_KEY] == self.version).sum())
        metrics.update({"timing_s/generate": elapsed, "perf/rollout_tokens_per_s": new_tokens / max(elapsed, 1e-9)})
        output.meta_info = {"metrics": metrics, "idle_s": idle}
        self._idle_since = time.perf_counter()
        return output
