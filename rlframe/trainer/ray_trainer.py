"""RayPPOTrainer: the driver's training loop, one short named step after another.

`fit` reads top to bottom: the rollout stage's next scored batch (`rollout_stage.py`: generate and reward, on the
training processes' engine or on a rollout pool) → balance across DP ranks → old log-probs → reference → the
distillation teacher → values → advantages → critic update → actor update → the source's turn (a pool's weight
push) → validate → checkpoint → log. Heavy work runs on the worker groups; the driver only does O(batch) math.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlframe.algorithms.advantage import (
    ALGORITHM_KEYS,
    OTB_ESTIMATORS,
    compute_advantage,
    gdpo_metrics,
)
from rlframe.algorithms.config import RolloutCorrection, pf_ppo_applies
from rlframe.algorithms.kl import apply_kl_penalty, make_kl_controller
from rlframe.algorithms.masked import masked_mean
from rlframe.algorithms.pf_ppo import pf_ppo_resample_index
from rlframe.algorithms.rollout_correction import probs_diff_metrics, rollout_correction
from rlframe.algorithms.update_mode import UpdateMode, update_mode
from rlframe.batch_plan import BatchPlan
from rlframe.config.checks import resolve_device
from rlframe.config.secrets import Secrets
from rlframe.protocol import DataProto
from rlframe.reward.manager import group_index
from rlframe.seqpack import balance_dp_partitions, packing_metrics
from rlframe.trainer.checkpointing import TrainerCheckpointer
from rlframe.trainer.finished_groups import STATE_KEY as FINISHED_KEY
from rlframe.trainer.finished_groups import plain_groups, saved_groups
from rlframe.trainer.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    reduce_metrics,
)
from rlframe.trainer.pending_prompts import STATE_KEY as PENDING_KEY
from rlframe.trainer.pending_prompts import PendingPrompts, plain_rows
from rlframe.trainer.profiling import StepProfiler
from rlframe.trainer.rollout_stage import BatchSource, ColocatedSource, Scorer, SourceInputs, generate, timer
from rlframe.trainer.tracking import ProgressBar, Tracking
from rlframe.utils.faults import KillPoints
from rlframe.utils.flops import device_peak_tflops, train_flops

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlframe.reward.manager import RewardManager
    from rlframe.trainer.launch import WorkerGroups


@dataclass(frozen=True)
class PreparedRun:
    """Everything built and checked before Ray starts (`main_ppo.prepare`): the trainer's inputs."""

    cfg: DictConfig  # resolved and read-only
    plan: BatchPlan  # every batch size, from the config's arithmetic
    tokenizer: PreTrainedTokenizerBase
    train_loader: Any  # resumable (state_dict / load_state_dict), one batch of prompts per step
    val_loader: Any
    total_steps: int  # steps this run takes: total_training_steps capped by total_epochs passes (as verl)
    schedule_steps: int  # steps the lr schedule spans: total_training_steps, or total_epochs passes
    hidden_size: int  # the model's, for the DP balancing workload
    reward_fn: RewardManager
    val_reward_fn: RewardManager
    secrets: Secrets  # masked wherever the run shows its config: config.yaml, console, trackers
    kill_points: KillPoints = field(default_factory=KillPoints)  # the driver's, over every restart of the run


class RayPPOTrainer:
    """Drives PPO/GRPO: owns the data, the reward function and the worker groups.

    `fit()` runs the loop: per step generate → reward → (old log-probs, reference, teacher, values) → advantages →
    critic and actor updates → validation, checkpoint and one row of metrics (docs/trainer.md lists them);
    it returns the last step's metrics. The trainer gets everything built and checked before Ray starts
    (`PreparedRun`, from `main_ppo.prepare`) and the started worker groups (`launch.create_worker_groups`).
    `rlframe.train(config)` does all of this (with worker restarts) and is the entry to use; build the
    trainer yourself to subclass it or to drive the worker groups between runs. Two GRPO steps with the
    built-in tiny model on CPU:

    ```python
    from rlframe.config.loader import overrides_from_config
    from rlframe.trainer.launch import create_worker_groups
    from rlframe.trainer.main_ppo import prepare
    from rlframe.trainer.ray_trainer import RayPPOTrainer

    overrides = overrides_from_config({
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.model.path": "builtin://tiny",
        "data.max_prompt_length": 64, "data.max_response_length": 16, "data.filter_overlong_prompts": True,
        "data.train_batch_size": 8, "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.model.enable_gradient_checkpointing": False,
        "trainer.device": "cpu", "trainer.n_gpus_per_node": 2, "trainer.total_training_steps": 2,
        "trainer.val_before_train": False, "trainer.resume_mode": "disable",
        "trainer.default_local_dir": "checkpoints/rlframe/tiny_trainer",
    })
    run = prepare(overrides)  # compose, type and check the config; tokenizer, data, reward functions
    groups = create_worker_groups(run.cfg, run.plan, run.schedule_steps)  # starts Ray and the workers
    try:
        metrics = RayPPOTrainer(run, groups).fit()
    finally:
        groups.shutdown()
    print(metrics["training/global_step"], metrics["critic/score/mean"])  # 2 and the last step's mean score
    ```
    """

    def __init__(self, run: PreparedRun, groups: WorkerGroups):
        config, plan = run.cfg, run.plan
        self.config, self.plan, self.tokenizer = config, plan, run.tokenizer
        self.train_dataloader, self.val_dataloader = run.train_loader, run.val_loader
        self.val_reward_fn = run.val_reward_fn
        self.secrets = run.secrets
        self.actor_rollout_wg = groups.actor_rollout
        self.critic_wg = groups.critic
        # the processes that generate ahead of the driver take their profiler calls in their queue: separate_async's
        # rollout pool, and under colocate_async the training processes themselves (their engines generate ahead)
        waited, queued = [self.actor_rollout_wg, self.critic_wg], [groups.rollout]
        if config.trainer.v1.trainer_mode == "colocate_async":
            waited, queued = [], waited
        self.step_profiler = StepProfiler(config.global_profiler, waited, queued_groups=queued)
        self.use_critic = plan.critic is not None
        self.use_reference = plan.ref is not None
        self.use_teacher = bool(config.distillation.enabled)
        # where the actor's update takes π_old from; the actor decides the same from the same sections
        self.update_mode = update_mode(config.actor_rollout_ref.actor, config.algorithm)
        self.correction = RolloutCorrection.parse(config.algorithm.rollout_correction)
        self.total_training_steps = run.total_steps
        self.num_devices = groups.num_devices
        self.hidden_size = run.hidden_size
        algo = config.algorithm
        self.kl_ctrl = make_kl_controller(
            algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon
        )
        self.checkpointer = TrainerCheckpointer(config.trainer, run.kill_points)
        self.pending = PendingPrompts()  # prompts handed out by the loader and not trained yet (a checkpoint's)
        self.scorer = Scorer(config, run.reward_fn, groups.reward_model)
        self.source = self._batch_source(groups)
        self.global_step = 0
        self.num_restarts = 0  # workers recreated before this attempt (main_ppo.train_with_restarts)
        self.flops_info, self.peak_tflops = None, None
        if resolve_device(config.trainer.device) == "cuda":  # MFU is a GPU metric
            self.flops_info = self.actor_rollout_wg.flops_info()
            self.peak_tflops, _ = device_peak_tflops(self.flops_info["device_name"])

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train until total_training_steps (or the data's end); returns the last step's metrics."""
        progress, validation = self._start()
        if validation is not None:  # trainer.val_only: the validation was the run
            return validation
        self.source.start(self.global_step)
        last_metrics: dict = {}
        while self.global_step < self.total_training_steps:
            self.step_profiler.begin(self.global_step + 1)  # the step the next batch is for
            ready = self.source.next_batch(self.global_step + 1)
            if ready is None:  # the data ran out first (dynamic sampling spends several loader batches a step)
                break
            self.global_step += 1
            last_metrics = self._train_step(ready.batch, ready.metrics, ready.timings, ready.start)
            self.source.after_update(self.global_step, last_metrics)
            self._end_step(last_metrics, progress, self.global_step >= self.total_training_steps)
        self.source.close()
        self.step_profiler.close()
        progress.close()
        self.tracker.finish()
        return last_metrics

    def _batch_source(self, groups: WorkerGroups) -> BatchSource:
        """The rollout stage of this trainer mode: the training processes' engine, one batch at a time (sync), or
        the asynchronous schedule on a rollout pool of its own (separate_async) or on those engines (colocate_async)."""
        inputs = SourceInputs(self.config, self.plan, self.train_dataloader, self.pending, self.scorer)
        mode = self.config.trainer.v1.trainer_mode
        if mode == "sync":
            return ColocatedSource(inputs, groups.actor_rollout)
        from rlframe.trainer.pooled_source import PooledSource
        from rlframe.trainer.replicas import HybridReplicas, PoolReplicas

        if mode == "separate_async":
            replicas = PoolReplicas(groups, self.config.actor_rollout_ref.rollout)
        else:
            replicas = HybridReplicas(groups)
        return PooledSource(inputs, replicas, self.total_training_steps)

    def _start(self) -> tuple[ProgressBar, dict | None]:
        """Open the trackers, resume, validate before training: (the progress bar, the validation if val_only)."""
        cfg = self.config.trainer
        self.tracker = Tracking(  # no secret in the trackers' project, run name or config
            self.secrets.shown("trainer.project_name", cfg.project_name),
            self.secrets.shown("trainer.experiment_name", cfg.experiment_name),
            list(cfg.logger),
            cfg.default_local_dir,
            self.secrets.mask(OmegaConf.to_container(self.config)),
        )
        driver_state = self.checkpointer.maybe_resume(
            self.actor_rollout_wg, self.critic_wg, self.train_dataloader, check_driver=self.source.check_resumable
        )
        if driver_state is not None:
            self._restore_driver_state(driver_state)
        # the lines an earlier run logged past this run's start: after the resumed checkpoint (a killed run's), or
        # all of them in a run started afresh in the same folder (val_only trains nothing: it keeps every line)
        start = self.global_step if driver_state is not None else -1
        dropped = 0 if cfg.val_only else self.tracker.drop_steps_after(start)
        if dropped:
            which = f"for steps after the resumed step {start}" if start >= 0 else "(this run starts afresh)"
            print(f"[rlframe] {self.tracker.jsonl_path}: dropped {dropped} line(s) of an earlier run {which}")
        progress = ProgressBar(self.total_training_steps, self.global_step)
        # verl validates before training at any resumed step; rlframe only at step 0, unless val_only asks
        # for the resumed policy's numbers
        if self.val_reward_fn is not None and cfg.val_before_train and (self.global_step == 0 or cfg.val_only):
            validation = self._validate()
            progress.validation(validation, self.global_step)
            self.tracker.log(validation, step=self.global_step)
            if cfg.val_only:
                progress.close()
                self.tracker.finish()
                return progress, validation
        return progress, None

    def _end_step(self, metrics: dict, progress: ProgressBar, is_last: bool) -> None:
        """After a step's update: validation, checkpoint, one row of metrics, the profiler and the progress bar."""
        cfg = self.config.trainer
        # as verl: validation during training only with test_freq > 0 (then also after the last step)
        if self.val_reward_fn is not None and cfg.test_freq > 0 and (is_last or self.global_step % cfg.test_freq == 0):
            validation = self._validate()
            progress.validation(validation, self.global_step)
            metrics.update(validation)
        if cfg.save_freq > 0 and (is_last or self.global_step % cfg.save_freq == 0):
            start = time.perf_counter()

            def log_the_step():  # the checkpoint's files are written; it counts as complete only after this line
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
                self.tracker.log(metrics, step=self.global_step)

            self.checkpointer.save(
                self.global_step,
                self.actor_rollout_wg,
                self.critic_wg,
                self.train_dataloader,
                self._driver_state(),
                before_complete=log_the_step,
            )
        else:
            self.tracker.log(metrics, step=self.global_step)
        self.step_profiler.end(self.global_step, is_last)
        progress.update(metrics)

    def _train_step(self, batch: DataProto, metrics: dict, timings: dict, step_start: float) -> dict:
        if self.plan.balance_batch:
            with timer("balance", timings):
                self._balance_batch(batch, metrics)
        if self.config.trainer.rollout_data_dir:
            self._dump_rollouts(batch, str(self.config.trainer.rollout_data_dir))
        on_policy = self._skips_old_log_prob()
        if self.update_mode is UpdateMode.BYPASS:  # verl: π_old := π_rollout, no pass; the actor corrects
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        elif not on_policy:  # on-policy: the update's own forward gives the old log-probs
            with timer("old_log_prob", timings):
                old = self.actor_rollout_wg.compute_log_prob(batch)
                entropy = old.pop(batch_keys=["entropys"]).batch["entropys"]
                metrics["actor/entropy"] = float(masked_mean(entropy, batch.batch["response_mask"]))
                batch = batch.union(old)
        if self.use_reference:
            with timer("ref", timings):
                batch = batch.union(self.actor_rollout_wg.compute_ref_log_prob(batch))
        if self.use_teacher:
            with timer("teacher", timings):
                batch = batch.union(self.actor_rollout_wg.compute_teacher_log_prob(batch))
        if self.use_critic:
            with timer("values", timings):
                batch = batch.union(self.critic_wg.compute_values(batch))
        with timer("adv", timings):
            self._compute_advantage(batch, metrics)
            if pf_ppo_applies(self.config.algorithm):
                batch = self._pf_ppo_resample(batch)
        if self.use_critic:
            with timer("update_critic", timings):
                out = self.critic_wg.update_critic(batch)
                metrics.update(reduce_metrics(out.meta_info["metrics"]))
        if self.global_step > self.config.trainer.critic_warmup:
            with timer("update_actor", timings):
                out = self.actor_rollout_wg.update_actor(batch)
                metrics.update(reduce_metrics(out.meta_info["metrics"]))
            if on_policy:
                self._on_policy_metrics(batch, out, metrics)
        timings["step"] = time.perf_counter() - step_start
        metrics.update(compute_data_metrics(batch, self.use_critic))
        num_tokens = int(batch.batch["attention_mask"].sum())
        metrics.update(
            compute_timing_metrics(
                timings, {"gen": int(batch.batch["response_mask"].sum()), "update_actor": num_tokens}
            )
        )
        metrics.update(compute_throughput_metrics(num_tokens, timings["step"], self.num_devices))
        if self.peak_tflops and "update_actor" in timings:
            metrics["perf/mfu/actor"] = self._actor_mfu(batch, timings["update_actor"])
        metrics["training/global_step"] = self.global_step
        metrics["training/num_restarts"] = self.num_restarts
        return metrics

    def _skips_old_log_prob(self) -> bool:
        """The actor updates in this step and computes the old log-probs itself: no separate old-log-prob pass."""
        return self.update_mode is UpdateMode.ON_POLICY and self.global_step > self.config.trainer.critic_warmup

    def _on_policy_metrics(self, batch: DataProto, out: DataProto, metrics: dict) -> None:
        """What the old-log-prob pass feeds, from the on-policy update's old log-probs and entropy:
        actor/entropy and, with rollout log-probs, the (metrics-only) rollout-correction diagnostics."""
        batch.batch["old_log_probs"] = out.batch["old_log_probs"]
        metrics["actor/entropy"] = float(masked_mean(out.batch["entropys"], batch.batch["response_mask"]))
        if "rollout_log_probs" in batch.batch.keys():
            self._rollout_correction(batch, metrics)

    def _actor_mfu(self, batch: DataProto, seconds: float) -> float:
        """Model FLOPs of the actor update (ppo_epochs passes) per second, over the devices' bf16 peak."""
        info = self.flops_info
        seqlens = batch.batch["attention_mask"].sum(-1).tolist()
        flops = train_flops(info["matmul_params"], info["num_layers"], info["attn_width"], seqlens)
        flops *= self.plan.actor.ppo_epochs
        return flops / (seconds * self.num_devices * self.peak_tflops * 1e12)

    def _driver_state(self) -> dict:
        """What the checkpoint keeps of the driver: the step, the KL coefficient, and what was handed out and not
        trained: the finished groups whole, the other prompts as prompts (`finished_groups.py`)."""
        finished, unsaved = plain_groups(self.source.finished_groups(), self.plan.n)
        pending = plain_rows(unsaved + self.source.untrained_prompts())
        state = {"global_step": self.global_step, "kl_coef": self.kl_ctrl.value, PENDING_KEY: pending}
        return {**state, FINISHED_KEY: finished}

    def _restore_driver_state(self, state: dict) -> None:
        self.global_step, self.kl_ctrl.value = state["global_step"], state["kl_coef"]
        self.pending.restore(state)  # an asynchronous run's untrained prompts come first
        self.source.restore_finished(saved_groups(state))  # then its finished groups (sync: their prompts, first)

    # ------------------------------------------------------------------ the steps
    def _balance_batch(self, batch: DataProto, metrics: dict) -> None:
        """Reorder so each DP rank's share of the step costs about the same (Karmarkar–Karp, equal sizes).

        The workload of a sequence grows with its length plus an attention term in length², with the
        linear coefficient taken from the model's hidden size.
        """
        k = self.plan.balance_partitions
        seqlens = batch.batch["attention_mask"].sum(-1).tolist()
        partitions = balance_dp_partitions(seqlens, k, hidden_size=self.hidden_size)
        order = [i for part in partitions for i in part]
        # each DP rank's tokens before (contiguous shares) and after balancing
        share = len(seqlens) // k
        before = [sum(seqlens[r * share : (r + 1) * share]) for r in range(k)]
        after = [sum(seqlens[i] for i in part) for part in partitions]
        batch.reorder(torch.tensor(order))
        metrics.update(
            {
                "global_seqlen/min": min(before),
                "global_seqlen/max": max(before),
                "global_seqlen/minmax_diff": max(before) - min(before),
                "global_seqlen/balanced_min": min(after),
                "global_seqlen/balanced_max": max(after),
                "global_seqlen/mean": float(np.mean(after)),
            }
        )
        balanced = packing_metrics(after)
        metrics.update(
            {
                f"global_seqlen/balanced_{name}": balanced[name]
                for name in ("imbalance_ratio", "std", "cv", "max_over_mean")
            }
        )

    def _dump_rollouts(self, batch: DataProto, folder: str) -> None:
        """One jsonl file per step: prompt, response, score and uid of every sample."""
        os.makedirs(folder, exist_ok=True)
        response_length = batch.batch["responses"].shape[-1]
        prompts = self.tokenizer.batch_decode(
            [
                ids[mask.bool()]
                for ids, mask in zip(
                    batch.batch["input_ids"][:, :-response_length], batch.batch["attention_mask"][:, :-response_length]
                )
            ]
        )
        responses = self.tokenizer.batch_decode(
            # the whole response: a multi-turn trajectory's tool turns (response_mask 0) are part of what happened
            [
                ids[mask.bool()]
                for ids, mask in zip(batch.batch["responses"], batch.batch["attention_mask"][:, -response_length:])
            ]
        )
        scores = batch.batch["token_level_scores"].sum(-1).tolist()
        with open(os.path.join(folder, f"{self.global_step}.jsonl"), "w") as f:
            rows = zip(prompts, responses, scores, batch.non_tensor_batch["uid"], batch.non_tensor_batch["index"])
            for prompt, response, score, uid, index in rows:  # index: the prompt's row in the dataset
                f.write(
                    json.dumps(
                        {
                            "step": self.global_step,
                            "uid": uid,
                            "index": index if isinstance(index, str) else int(index),  # int(): numpy ints
                            "prompt": prompt,
                            "response": response,
                            "score": score,
                        }
                    )
                    + "\n"
                )

    def _compute_advantage(self, batch: DataProto, metrics: dict) -> None:
        algo = self.config.algorithm
        response_mask = batch.batch["response_mask"]
        if algo.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(
                batch.batch["token_level_scores"],
                batch.batch["old_log_probs"],
                batch.batch["ref_log_prob"],
                response_mask,
                self.kl_ctrl,
                algo.kl_penalty,
            )
            batch.batch["token_level_rewards"] = rewards
            metrics.update(kl_metrics)
        else:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        # decoupled mode; an on-policy step gets its old log-probs from the update (then _on_policy_metrics)
        has_old = "old_log_probs" in batch.batch.keys()
        if has_old and "rollout_log_probs" in batch.batch.keys() and self.update_mode is not UpdateMode.BYPASS:
            response_mask = self._rollout_correction(batch, metrics)
        inputs = {
            "token_level_rewards": batch.batch["token_level_rewards"],
            "response_mask": response_mask,
            "index": group_index(batch),
            **{name: getattr(algo, name) for name in ALGORITHM_KEYS},
        }
        if self.use_critic:
            inputs["values"] = batch.batch["values"]
        if algo.adv_estimator == "remax":
            inputs["reward_baselines"] = batch.batch["reward_baselines"]
        if algo.adv_estimator == "gdpo":
            inputs["gdpo_scores"] = batch.batch["gdpo_scores"]
            inputs["gdpo_reward_weights"] = algo.gdpo_reward_weights
            metrics.update(gdpo_metrics(batch.batch["gdpo_scores"], algo.gdpo_reward_keys))
        if algo.adv_estimator in OTB_ESTIMATORS:  # π_t and Σπ² of the old-log-prob pass
            inputs["old_log_probs"] = batch.batch["old_log_probs"]
            inputs["sum_pi_squared"] = batch.batch["sum_pi_squared"]
            if "rollout_is_weights" in batch.batch.keys():  # verl: W_t scaled by ρ̄² under decoupled IS
                inputs["rollout_is_weights"] = batch.batch["rollout_is_weights"]
        advantages, returns = compute_advantage(algo.adv_estimator, **inputs)
        batch.batch["advantages"], batch.batch["returns"] = advantages, returns

    def _pf_ppo_resample(self, batch: DataProto) -> DataProto:
        """PF-PPO: the batch resampled with replacement by score (rlframe.algorithms.pf_ppo), seeded per step."""
        pf_ppo = self.config.algorithm.pf_ppo
        generator = torch.Generator().manual_seed(self.config.data.seed * 1_000_003 + self.global_step)
        index = pf_ppo_resample_index(
            batch.batch["token_level_scores"], pf_ppo.reweight_method, float(pf_ppo.weight_pow), generator
        )
        return batch[index.numpy()]

    def _rollout_correction(self, batch: DataProto, metrics: dict) -> torch.Tensor:
        """verl's decoupled mode: IS weights and rejection between π_rollout and π_old over the whole batch.

        Rejection narrows `response_mask` (for the advantages and the losses); the weights go to the
        actor as `rollout_is_weights`. Returns the new response mask.
        """
        metrics.update(
            probs_diff_metrics(
                batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"]
            )
        )
        weights, mask, corr_metrics = rollout_correction(
            batch.batch["old_log_probs"],
            batch.batch["rollout_log_probs"],
            batch.batch["response_mask"],
            self.correction,
        )
        batch.batch["response_mask"] = mask
        if weights is not None:
            batch.batch["rollout_is_weights"] = weights
        metrics.update(corr_metrics)
        return mask

    def _validate(self) -> dict:
        """Greedy (val_kwargs) generation on the validation set; mean reward per data source."""
        scores: dict[str, list[float]] = {}
        n = self.config.actor_rollout_ref.rollout.val_kwargs.n
        for batch_dict in self.val_dataloader:
            batch = DataProto.from_single_dict(batch_dict).repeat(n, interleave=True)
            batch, _ = generate(self.actor_rollout_wg, batch, self.config.actor_rollout_ref.rollout, validate=True)
            result = self.val_reward_fn(batch, return_dict=True)
            sources = batch.non_tensor_batch[self.config.data.reward_fn_key]
            for source, score, dropped in zip(sources, result["reward_tensor"].sum(-1).tolist(), result["dropped"]):
                if not dropped:  # custom_reward_function.on_scorer_error=drop: no score to average
                    scores.setdefault(str(source), []).append(score)
        return {f"val-core/{source}/reward/mean@{n}": float(np.mean(v)) for source, v in scores.items()}
