"""RolloutWorker: a process of the standalone rollout pool (`trainer.v1.trainer_mode=separate_async`).

It holds only the rollout engine: no actor, no optimizer. With `actor_rollout_ref.rollout.tensor_model_parallel_size`
> 1 a replica is a TP group of consecutive processes of the pool, which runs its calls as the hybrid engine's TP
group does (`generate_in_tp_group`): the rows sent to the replica are gathered on every TP rank, generated under
one seed from TP rank 0 with the replica's index, and each rank returns its share. Its weights arrive from the training
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
cut come back `Stop.INTERRUPTED`, and `continue_sequences` later finishes them under the new weights. A tool agent's
trajectory is cut inside a turn (the same interrupt) or between turns (its next generation request finds the
interrupt set and generates nothing); it comes back with its state and continues from it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from rlframe.batch_plan import BatchPlan
from rlframe.config.checks import resolve_device
from rlframe.config.schema import read_only
from rlframe.distributed.parallel_dims import build_tp_group
from rlframe.models.builtin import copy_to_shm
from rlframe.protocol import DataProto
from rlframe.single_controller import Dispatch, register
from rlframe.utils.faults import DelayPoints
from rlframe.workers.profiler import ProfiledWorker, profiled
from rlframe.workers.rollout import generate_in_tp_group, run_in_tp_group
from rlframe.workers.rollout.base import TRAJECTORY_KEY, VERSIONS_KEY
from rlframe.workers.rollout.partial import continue_generation
from rlframe.workers.rollout.tp import group_rank_and_size

BOARD_POLL_S = 0.02  # how often a running generation asks the board whether newer weights were announced


class VersionBoard:
    """The newest policy version the driver has announced to the rollout pool (a Ray actor of its own)."""

    def __init__(self):
        self.version = 0

    def announce(self, version: int) -> None:
        self.version = max(self.version, int(version))

    def announced(self) -> int:
        return self.version


class RolloutWorker(ProfiledWorker):
    """One rollout-only process: `init_model`, `generate_sequences`, `load_weights`."""

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
        # a replica is a TP group of consecutive processes; the driver sends its rows to all of them
        self.tp_group = build_tp_group(self.device_type, self.world_size, int(cfg.rollout.tensor_model_parallel_size))
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
            self.tp_group,
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
        """Whether a version newer than the engine's was announced (the board asked at most every BOARD_POLL_S).

        With TP the engine asks at the same decoding steps on every TP rank (identical input), and all must stop at
        the same one or the next all-reduce hangs: TP rank 0 asks the board and broadcasts its answer."""
        import ray

        self.delay_points.hit("rollout.decode")  # tests: a slower decoding step, so that pushes land mid-generation
        rank, size = group_rank_and_size(self.tp_group)
        now = time.monotonic()
        if rank == 0 and now - self._asked_at >= BOARD_POLL_S:
            self._announced, self._asked_at = ray.get(self._board.announced.remote()), now
        moved_on = torch.tensor([int(self._announced > self.version)])
        if size > 1:
            dist.broadcast(moved_on, group_src=0, group=self.tp_group)
        return bool(moved_on.item())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, version: int, named_tensors: dict[str, torch.Tensor]) -> None:
        """Load the full actor tensors of policy version `version` (HF names) into the engine."""
        self.rollout.update_weights(named_tensors.items())
        self.version = int(version)
        self._idle_since = time.perf_counter()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("rollout_generate")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate this replica's share with the engine's policy version (`policy_version`): the rollout stamps each
        response token with it (`rollout_versions`) and reports why each row stopped (`stop_reason`; the rows a
        newer version cut are `Stop.INTERRUPTED`). The output's meta_info["idle_s"] is how long this process waited
        for work before the call (since its last call).

        The seeds: one draw of the process RNG, then the rows' sample seeds under it, exactly as
        `generate_in_tp_group` draws them; they stay in the rows (`sample_seed`) for a continuation."""
        idle = time.perf_counter() - self._idle_since
        self.kill_points.hit("rollout.generate")
        self.delay_points.hit("rollout.generate")
        prompts = prompts.to(self.device_type)
        prompts.meta_info["policy_version"] = self.version
        output = generate_in_tp_group(self.rollout, prompts, self.tp_group, keep_seeds=True).to("cpu")
        output.meta_info["idle_s"] = idle
        self._idle_since = time.perf_counter()
        return output

    def _continue(self, rows: DataProto) -> DataProto:
        if self.rollout.runs_trajectories:
            return self.rollout.continue_trajectories(rows, list(rows.non_tensor_batch[TRAJECTORY_KEY]))
        return continue_generation(self.engine, rows, self.version)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @profiled("rollout_continue")
    def continue_sequences(self, rows: DataProto) -> DataProto:
        """Finish rows a weight update cut: their new tokens carry this engine's version. A single-turn row goes on
        from its tokens (`rollout/partial.py`); a tool agent's trajectory from its state (`TRAJECTORY_KEY`,
        `multi_turn.py`), whose tool calls already ran are never run again."""
        from rlframe.workers.rollout.base import response_metrics

        idle = time.perf_counter() - self._idle_since
        self.kill_points.hit("rollout.continue")
        start = time.perf_counter()
        rows = rows.to(self.device_type)
        rows.meta_info["policy_version"] = self.version
        with torch.no_grad():
            _, output = run_in_tp_group(self._continue, rows, self.tp_group)  # its TP peers continue it too
        output = output.to("cpu")
        elapsed = time.perf_counter() - start
        eos_ids, _ = self.rollout.special_tokens_for(rows.meta_info)
        metrics = {**output.meta_info.get("metrics", {})}
        metrics.update(response_metrics(output.batch["response_mask"], output.batch["responses"], eos_ids))
        new_tokens = int((output.batch[VERSIONS_KEY] == self.version).sum())
        metrics.update({"timing_s/generate": elapsed, "perf/rollout_tokens_per_s": new_tokens / max(elapsed, 1e-9)})
        output.meta_info = {"metrics": metrics, "idle_s": idle}
        self._idle_since = time.perf_counter()
        return output
