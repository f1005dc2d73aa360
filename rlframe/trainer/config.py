"""The trainer's sections (`algorithm`, `trainer`) and the root config that assembles every section.

`configs/ppo_trainer.yaml` is generated from `PPOTrainerConfig` (`python -m rlframe.trainer.config`);
`tests/config/test_config_schema.py` keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from rlframe.algorithms.advantage import (
    ADV_ESTIMATORS,
    ALGORITHM_KEYS,
    adv_estimator_help,
    algorithm_keys,
    get_adv_estimator_fn,
)
from rlframe.algorithms.config import PfPpoConfig, RolloutCorrectionConfig, pf_ppo_applies
from rlframe.algorithms.kl import get_kl_penalty_fn
from rlframe.config.key_status import raw_override_key
from rlframe.config.keys import critic_enabled, ref_enabled
from rlframe.config.loader import load_config
from rlframe.config.schema import Section, is_section_map, key, render_yaml, section, validate, walk
from rlframe.config.verl_keys import ALIASES, NOT_IN_VERL, check_verl_override, followed_key, verl_key_under
from rlframe.data.config import DataConfig
from rlframe.reward.config import CustomRewardFunctionConfig
from rlframe.trainer.staleness import STRATEGIES
from rlframe.trainer.tracking import check_backends
from rlframe.workers.config.actor import ActorConfig
from rlframe.workers.config.critic import CriticConfig
from rlframe.workers.config.distillation import DistillationConfig
from rlframe.workers.config.model import ModelConfig
from rlframe.workers.config.profiler import GlobalProfilerConfig
from rlframe.workers.config.ref import RefConfig
from rlframe.workers.config.reward_model import RewardModelConfig
from rlframe.workers.rollout.config import RolloutConfig
from rlframe.workers.rollout.registry import find_engine

RESUME_MODES = ("auto", "disable", "resume_path")
HEADER = """\
# rlframe PPO/GRPO trainer config. Key paths follow verl's so verl command lines port as they are.
# GENERATED from the typed sections (rlframe/trainer/config.py and the sections it assembles):
# edit those, then run `python -m rlframe.trainer.config > configs/ppo_trainer.yaml`.
# Batch sizes are global and counted in prompts unless the key ends in _per_gpu.
# `rlframe explain key=value ...` shows what they become.
"""


@dataclass
class ActorRolloutRefConfig(Section):
    hybrid_engine: bool = key(True, "actor, rollout and ref share the same worker processes (the only mode)")
    nccl_timeout: int = key(600, "seconds a collective of the workers' default process group may wait")
    model: ModelConfig = section(ModelConfig)
    actor: ActorConfig = section(ActorConfig)
    ref: RefConfig = section(RefConfig)
    rollout: RolloutConfig = section(RolloutConfig)

    def check(self, path: str, root: Any) -> None:
        if not self.hybrid_engine:
            raise ValueError(
                "actor_rollout_ref.hybrid_engine=false: rlframe always runs actor, rollout and reference "
                "in the same worker processes; set it to true (or leave it out)"
            )


@dataclass
class KLCtrlConfig(Section):
    type: str = key("fixed", "fixed | adaptive", choices=("fixed", "adaptive"))
    kl_coef: float = key(0.001, "(initial) KL coefficient")
    horizon: int = key(10000, "adaptive controller horizon")
    target_kl: float = key(0.1, "adaptive controller target")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if self.type == "adaptive":
            return {}
        return {f"{path}.{name}": f"{path}.type=fixed" for name in ("horizon", "target_kl")}


@dataclass
class FilterGroupsConfig(Section):
    enable: bool = key(False, "DAPO dynamic sampling: drop prompt groups whose metric has zero spread")
    metric: Any = key(
        "reward", "reward | seq_reward | seq_final_reward (summed scores) | a reward extra-info field (acc, score, ...)"
    )
    max_num_gen_batches: int = key(0, "generation rounds allowed per step before an error; 0 = unlimited")

    def check(self, path: str, root: Any) -> None:
        if not self.enable:
            return
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"{path}.metric={self.metric!r}: name the per-sample metric whose spread a group needs")
        if self.metric == "seq_final_reward" and root.algorithm.use_kl_in_reward:
            raise ValueError(
                f"{path}.metric=seq_final_reward with algorithm.use_kl_in_reward=true is not implemented: the "
                "KL penalty is applied after the groups are chosen. Use metric=seq_reward (the scores before KL)."
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if self.enable:
            return {}
        reason = f"{path}.enable=false"
        return {f"{path}.metric": reason, f"{path}.max_num_gen_batches": reason, "data.gen_batch_size": reason}


@dataclass
class AlgorithmConfig(Section):
    gamma: float = key(1.0, "discount")
    lam: float = key(1.0, "GAE lambda")
    adv_estimator: str = key("gae", adv_estimator_help(), check=get_adv_estimator_fn)
    norm_adv_by_std_in_grpo: bool = key(True, "false = Dr.GRPO (no std normalization)")
    use_kl_in_reward: bool = key(False, "subtract a KL penalty from the rewards")
    kl_penalty: str = key(
        "kl",
        "kl|k1|abs|mse|k2|low_var_kl|k3 (used in reward; a + suffix, k3+, gives the same value)",
        check=get_kl_penalty_fn,
    )
    kl_ctrl: KLCtrlConfig = section(KLCtrlConfig)
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "DAPO's dynamic sampling")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "IS weights and rejection between the rollout engine's and the trainer's policy"
    )
    use_pf_ppo: bool = key(False, "PF-PPO: after GAE, resample the batch with replacement by score (algorithm.pf_ppo)")
    pf_ppo: PfPpoConfig = section(PfPpoConfig, "PF-PPO's resampling weights (docs/algorithms.md)")
    gdpo_reward_keys: Optional[list[str]] = key(
        None, "gdpo: the reward components, entries of compute_score's dict, each normalized in its groups on its own"
    )
    gdpo_reward_weights: Optional[list[float]] = key(
        None, "gdpo: one weight per gdpo_reward_keys entry (null = 1 each)"
    )

    def check(self, path: str, root: Any) -> None:
        if self.adv_estimator != "gdpo":
            return
        keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
        if not keys:
            raise ValueError(
                f"{path}.adv_estimator=gdpo needs {path}.gdpo_reward_keys={keys!r} to name the reward components "
                "(entries of compute_score's returned dict), e.g. [format_reward,accuracy_reward] (as verl 0.9.1)"
            )
        if weights is not None and len(weights) != len(keys):
            raise ValueError(
                f"{path}.gdpo_reward_weights={list(weights)}: give one weight per gdpo_reward_keys entry "
                f"({len(keys)}: {list(keys)}), or null for 1 each"
            )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = {}
        if not self.use_kl_in_reward:
            out.update({f"{path}.{name}": f"{path}.use_kl_in_reward=false" for name in ("kl_penalty", "kl_ctrl")})
        for name in ALGORITHM_KEYS:  # each estimator reads the keys its signature names
            readers = [estimator for estimator in ADV_ESTIMATORS if name in algorithm_keys(estimator)]
            if self.adv_estimator not in readers:
                verb = "reads" if len(readers) == 1 else "read"
                out[f"{path}.{name}"] = (
                    f"{path}.adv_estimator={self.adv_estimator}: only {' and '.join(readers)} {verb} it"
                )
        if self.adv_estimator != "gdpo":
            why = f"{path}.adv_estimator={self.adv_estimator}: only gdpo reads it"
            out.update({f"{path}.{name}": why for name in ("gdpo_reward_keys", "gdpo_reward_weights")})
        if not pf_ppo_applies(self):
            why = f"{path}.use_pf_ppo=false" if not self.use_pf_ppo else f"{path}.adv_estimator={self.adv_estimator}"
            out[f"{path}.pf_ppo"] = why
            if self.use_pf_ppo:  # as verl 0.9.1, which reweights in its GAE branch only
                out[f"{path}.use_pf_ppo"] = f"{why}: PF-PPO resamples after GAE only (as in verl 0.9.1)"
        return out


@dataclass
class RayInitConfig(Section):
    address: Optional[str] = key(None, 'null = start a local Ray; "auto" or host:port = join a cluster')
    num_cpus: Optional[int] = key(None, "CPUs for a local Ray (null = all)")
    dashboard_host: Optional[str] = key(
        None,
        "rlframe: a local Ray's dashboard: null = not started; 127.0.0.1 = this machine only; "
        "0.0.0.0 = every interface",
    )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if self.address is None:
            return {}
        return {f"{path}.dashboard_host": f"{path}.address is set: the cluster's own dashboard settings apply"}


def _non_negative(value: int) -> None:
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")


TRAINER_MODES = ("sync", "separate_async", "colocate_async")
V1 = "trainer.v1"
SEPARATE = "trainer.v1.trainer_mode=separate_async"
ASYNC_MODES = ("separate_async", "colocate_async")


def _at_least_one(value: int) -> None:
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")


@dataclass
class SamplerConfig(Section):
    max_off_policy_threshold: int = key(
        8,
        "the most policy versions a trajectory may span from its submission to its training (verl V1): "
        "threshold - 1 is the staleness bound η, so 1 = synchronous; the async modes only",
        check=_at_least_one,
    )
    max_off_policy_strategy: str = key(
        "drop",
        "a finished group past the bound: drop (verl: never trained) | regenerate (rlframe: its prompt generated "
        "again at the current version, so each prompt is trained once) | wait (verl: the step waits for older "
        "running groups instead, so none goes past the bound)",
        choices=STRATEGIES,
    )


@dataclass
class SeparateAsyncConfig(Section):
    num_warmup_batches: int = key(
        1,
        "batches generated ahead of training (verl V1); rlframe's lookahead is min(this, "
        "trainer.v1.sampler.max_off_policy_threshold - 1), so generation never runs past the staleness bound",
        check=_non_negative,
    )
    parameter_sync_step: int = key(
        4,
        "PPO mini-batches per weight push (verl V1): data.train_batch_size must equal this × "
        "actor_rollout_ref.actor.ppo_mini_batch_size, as in verl (one push per training step)",
        check=_at_least_one,
    )

    def check(self, path: str, root: Any) -> None:
        if root.trainer.v1.trainer_mode != "separate_async":
            return
        batch, mini = root.data.train_batch_size, root.actor_rollout_ref.actor.ppo_mini_batch_size
        if batch != self.parameter_sync_step * mini:
            fix = f"set {path}.parameter_sync_step={batch // mini}" if batch % mini == 0 else "change them"
            raise ValueError(
                f"{path}.parameter_sync_step={self.parameter_sync_step} with data.train_batch_size={batch} and "
                f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}: under {SEPARATE} the weights are pushed once "
                f"per training step, so train_batch_size must equal parameter_sync_step × ppo_mini_batch_size (as "
                f"verl asserts); {fix}"
            )


@dataclass
class ColocateAsyncConfig(Section):
    num_warmup_batches: int = key(
        1,
        "batches generated ahead of training (verl V1); rlframe's lookahead is min(this, "
        "trainer.v1.sampler.max_off_policy_threshold - 1), so generation never runs past the staleness bound",
        check=_non_negative,
    )


# What the async modes do not implement yet: (is it set?, the key and value, why). docs/async.md lists them.
def _separate_async_refusals(root: Any) -> list[tuple[bool, str, str]]:
    rollout = root.actor_rollout_ref.rollout
    engine = find_engine(rollout.name)
    cuts = bool(rollout.partial_rollout) or root.trainer.v1.trainer_mode == "colocate_async"  # which always cuts
    return [
        (
            engine is None or (cuts and not engine.capabilities.partial_rollout),
            f"actor_rollout_ref.rollout.name={rollout.name}"
            + (" with actor_rollout_ref.rollout.partial_rollout=true" if rollout.partial_rollout else ""),
            "this engine cannot stop a running generation at a decoding step and keep its tokens (SGLang's offline "
            "engine generates a batch in one blocking call), so a push cannot cut it; the hf and vllm engines can. "
            "Under separate_async set actor_rollout_ref.rollout.partial_rollout=false: each generation then finishes "
            "on the weights it started with (colocate_async always cuts)",
        ),
        (
            cuts and rollout.tensor_model_parallel_size != 1 and engine is not None and not engine.capabilities.tp_cut,
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} with "
            f"actor_rollout_ref.rollout.name={rollout.name}",
            "this engine's TP ranks would not stop at the same step when a push cuts them; TP replicas on the "
            "rollout pool run the hf and vllm engines",
        ),
        (
            rollout.agent.default_agent_loop == "openai_agent"
            and rollout.partial_rollout
            and rollout.checkpoint_engine.backend != "naive",
            "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent with "
            "actor_rollout_ref.rollout.partial_rollout=true and "
            f"actor_rollout_ref.rollout.checkpoint_engine.backend={rollout.checkpoint_engine.backend}",
            "a push cuts an OpenAI agent's request and the replica continues it on weights it loads itself from the "
            "object store, where only the naive push puts them; set checkpoint_engine.backend=naive or "
            "partial_rollout=false",
        ),
    ]


# What separate_async runs and colocate_async does not yet: (is it set?, the key and value, why). docs/async.md.
def _colocate_async_refusals(root: Any) -> list[tuple[bool, str, str]]:
    rollout = root.actor_rollout_ref.rollout
    return [
        (
            rollout.agent.default_agent_loop == "openai_agent",
            "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
            "colocate_async always cuts what generates ahead, and a cut cannot move your agent's episode (it lives in "
            "your coroutine); separate_async runs it with partial_rollout=false",
        ),
    ]


def staleness_bound(v1: Any) -> int:
    """η = trainer.v1.sampler.max_off_policy_threshold − 1: the most versions a trained sample may lag behind."""
    return int(v1.sampler.max_off_policy_threshold) - 1


def lookahead(v1: Any) -> int:
    """L = min(trainer.v1.<the async mode>.num_warmup_batches, η): the batches generated ahead of training."""
    section = v1.colocate_async if v1.trainer_mode == "colocate_async" else v1.separate_async
    return min(int(section.num_warmup_batches), staleness_bound(v1))


@dataclass
class TrainerV1Config(Section):
    trainer_mode: str = key(
        "sync",
        "sync: generate, then train, on the same worker processes | separate_async: a "
        "rollout pool of its own (actor_rollout_ref.rollout.nnodes × n_gpus_per_node) generates the next batches "
        "while the training pool trains (docs/async.md) | colocate_async: the same schedule on the training "
        "processes' own engines, whose generation ahead is cut when a step's batch is sampled and continues on the "
        "new weights after the step",
        choices=TRAINER_MODES,
    )
    sampler: SamplerConfig = section(SamplerConfig, "the staleness bound of the async modes")
    colocate_async: ColocateAsyncConfig = section(ColocateAsyncConfig, "trainer_mode=colocate_async's settings")
    separate_async: SeparateAsyncConfig = section(SeparateAsyncConfig, "trainer_mode=separate_async's settings")

    def check(self, path: str, root: Any) -> None:
        if self.trainer_mode not in ASYNC_MODES:
            return
        mode = f"{path}.trainer_mode={self.trainer_mode}"
        rollout = root.actor_rollout_ref.rollout
        if self.trainer_mode == "separate_async" and rollout.nnodes < 1:
            raise ValueError(
                f"actor_rollout_ref.rollout.nnodes={rollout.nnodes} with {SEPARATE}: the rollout pool needs nodes; "
                "set actor_rollout_ref.rollout.nnodes>=1 (and actor_rollout_ref.rollout.n_gpus_per_node)"
            )
        if self.trainer_mode == "colocate_async" and rollout.pool_cpu_generation:
            raise ValueError(
                f"actor_rollout_ref.rollout.pool_cpu_generation=true with {mode}: every training process's engine "
                "generates its own share (a replica each, cut and continued on its own), not pooled on rank 0; set "
                "it to null or false"
            )
        if self.trainer_mode == "separate_async":
            processes, tp = rollout.nnodes * rollout.n_gpus_per_node, rollout.tensor_model_parallel_size
            if processes % tp:
                raise ValueError(
                    f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} with {SEPARATE}: a rollout replica is "
                    f"a TP group of the rollout pool's actor_rollout_ref.rollout.nnodes × n_gpus_per_node = "
                    f"{processes} processes; pick a TP size that divides {processes}"
                )
        refusals = _separate_async_refusals(root)
        if self.trainer_mode == "colocate_async":
            refusals += _colocate_async_refusals(root)
        for refused, setting, why in refusals:
            if refused:
                raise ValueError(f"{setting} with {mode}: {why} (docs/async.md: what is refused)")

    def warnings(self, path: str, root: Any) -> list[str]:
        if self.trainer_mode not in ASYNC_MODES or lookahead(self) < 1:
            return []
        correction = root.algorithm.rollout_correction
        if correction.rollout_is is not None or correction.rollout_rs is not None or correction.bypass_mode:
            return []
        rc = "algorithm.rollout_correction"
        needs_log_probs = (
            ""
            if root.actor_rollout_ref.rollout.calculate_log_probs
            else " with actor_rollout_ref.rollout.calculate_log_probs=true"
        )
        mode = self.trainer_mode
        return [
            f"{path}.trainer_mode={mode} trains samples up to L = min({path}.{mode}.num_warmup_batches="
            f"{getattr(self, mode).num_warmup_batches}, η = {path}.sampler.max_off_policy_threshold − 1 = "
            f"{staleness_bound(self)}) = {lookahead(self)} policy version(s) older than the weights their step starts "
            f"from, with no behaviour correction ({rc}.rollout_is=null, {rc}.rollout_rs=null, {rc}.bypass_mode=false): "
            f"the update is PPO around π_prox on samples drawn from older weights, which is biased; set "
            f"{rc}.rollout_is=token{needs_log_probs} (verl's decoupled mode, docs/async.md), or {rc}.rollout_rs for "
            "rejection"
        ]

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        mode = f"{path}.trainer_mode={self.trainer_mode}"
        rollout = "actor_rollout_ref.rollout"
        if self.trainer_mode == "separate_async":
            return {f"{path}.colocate_async": f"{mode}: only colocate_async reads it"}
        pool = f"{mode}: only separate_async reads it"
        cut = "; colocate_async always cuts what generates ahead once a step's batch is sampled (verl)"
        out = {
            f"{path}.separate_async": pool,
            f"{rollout}.nnodes": pool,
            f"{rollout}.n_gpus_per_node": pool,
            f"{rollout}.partial_rollout": pool + (cut if self.trainer_mode == "colocate_async" else ""),
        }
        if self.trainer_mode == "sync":
            why = f"{mode}: only the async modes read it"
            out.update({f"{path}.sampler": why, f"{path}.colocate_async": why})
        return out


@dataclass
class TrainerConfig(Section):
    device: str = key("auto", "auto | cpu | cuda", choices=("auto", "cpu", "cuda"))
    nnodes: int = key(1, "nodes in the Ray cluster")
    n_gpus_per_node: int = key(2, "devices per node (on CPU: worker processes per node)")
    balance_batch: bool = key(True, "Karmarkar-Karp balance sequences across DP ranks each step")
    total_epochs: int = key(30, "passes over the training set")
    total_training_steps: Optional[int] = key(
        None, "lr-schedule length and step limit; the run also stops after total_epochs (null = epochs decide)"
    )
    project_name: str = key("rlframe", "tracking project")
    experiment_name: str = key("tiny_grpo", "tracking run name")
    logger: List[str] = key(
        ["console", "jsonl"],
        "console | jsonl | tensorboard | wandb | mlflow (jsonl is always on; docs/seeing_a_run.md)",
        check=check_backends,
    )
    log_val_generations: int = key(0, "validation samples to log as text")
    val_before_train: bool = key(True, "run validation before the first step")
    val_only: bool = key(False, "validate the policy (after any resume), then stop; needs val_before_train")
    test_freq: int = key(-1, "validate every N steps and after the last (<= 0: never during training)")
    save_freq: int = key(-1, "checkpoint every N steps (-1 = never)")
    critic_warmup: int = key(0, "steps before the actor starts updating")
    resume_mode: str = key("auto", "auto | disable | resume_path", choices=RESUME_MODES)
    resume_from_path: Optional[str] = key(None, "checkpoint dir for resume_mode=resume_path")
    default_local_dir: str = key("checkpoints/${trainer.project_name}/${trainer.experiment_name}", "checkpoint root")
    max_actor_ckpt_to_keep: Optional[int] = key(None, "keep this many actor checkpoints (null = all)")
    max_critic_ckpt_to_keep: Optional[int] = key(None, "keep this many critic checkpoints (null = all)")
    rollout_data_dir: Optional[str] = key(None, "dump rollouts (jsonl) here each step")
    worker_timeout_s: float = key(1800, "a worker call that takes longer is reported as a failure")
    max_restarts: int = key(
        0,
        "rlframe: when a worker dies (or hangs past worker_timeout_s), recreate the workers and resume from "
        "this run's latest checkpoint, at most this many times; 0 = stop, naming the dead rank",
        check=_non_negative,
    )
    restart_node_wait_s: float = key(
        300,
        "rlframe: on a restart, how long to wait for the Ray cluster to hold nnodes × n_gpus_per_node workers "
        "again (a lost node replaced) before failing, naming the nodes it has",
        check=_non_negative,
    )
    use_legacy_worker_impl: str = key(
        "auto",
        "verl < 0.9.1's worker-implementation switch (removed in 0.9.1): no effect, rlframe has one",
        choices=("auto", "enable", "disable"),
    )
    ray_init: RayInitConfig = section(RayInitConfig)
    v1: TrainerV1Config = section(TrainerV1Config, "verl V1's trainer modes: sync, or async with a staleness bound")

    def check(self, path: str, root: Any) -> None:
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<dir>/global_step_N")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = {}
        if self.resume_mode != "resume_path":
            out[f"{path}.resume_from_path"] = f"{path}.resume_mode={self.resume_mode} (only resume_path reads it)"
        # verl 0.8's scripts set it; it chose between two worker implementations of the same math
        out[f"{path}.use_legacy_worker_impl"] = "a verl < 0.9.1 switch between worker implementations; rlframe has one"
        if self.max_restarts == 0:
            out[f"{path}.restart_node_wait_s"] = f"{path}.max_restarts=0: the run never restarts"
        if not self.val_before_train:  # as verl 0.9.1, which stops after the validation before training only
            out[f"{path}.val_only"] = f"{path}.val_before_train=false: no validation to stop after; the run trains"
        return out


@dataclass
class PPOTrainerConfig(Section):
    data: DataConfig = section(DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = section(ActorRolloutRefConfig)
    critic: CriticConfig = section(CriticConfig)
    reward_model: RewardModelConfig = section(RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = section(CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    trainer: TrainerConfig = section(TrainerConfig)
    global_profiler: GlobalProfilerConfig = section(GlobalProfilerConfig, "profile the workers on chosen steps")
    distillation: DistillationConfig = section(DistillationConfig, "on-policy distillation (docs/distillation.md)")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = {}
        if not ref_enabled(self):
            out["actor_rollout_ref.ref"] = (
                "no reference model: actor_rollout_ref.actor.use_kl_loss=false and algorithm.use_kl_in_reward=false"
            )
        if not critic_enabled(self):
            out["critic"] = f"algorithm.adv_estimator={self.algorithm.adv_estimator}: only gae trains a critic"
        return out


def compose(overrides: list[str]) -> DictConfig:
    """Compose the YAML and `overrides`, checked against the typed sections: unknown keys and bad types fail.

    Interpolations stay intact (key statuses follow them); `typed` resolves and validates.
    """
    kept, following = taken_overrides(overrides)
    raw = load_config(kept)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(PPOTrainerConfig), raw)
    except ConfigKeyError as err:
        raise ValueError(_unknown_key_message(err.full_key, overrides)) from None
    except ValidationError as err:
        value = OmegaConf.select(raw, err.full_key)
        reason = str(err).splitlines()[0]
        raise ValueError(f"{err.full_key}={value!r} has the wrong type: {reason}") from None
    for verl_key, text, (target, fallback), shown in following:  # verl keys whose default follows another key
        value = OmegaConf.select(merged, target, default=fallback)
        refusal = check_verl_override(verl_key, text, followed_value=value, shown=shown)
        if refusal is not None:
            raise ValueError(refusal)
    return merged


def taken_overrides(overrides: list[str]) -> tuple[list[str], list[tuple]]:
    """(the overrides to compose, the verl keys to check once composed).

    verl's newer spellings become the keys they reach; a list key takes a single value. A verl key
    rlframe does not declare is dropped at verl's default (the same run) or refused with its reason;
    one whose default follows another key waits for the composed config. Any other key rlframe does
    not declare is passed on as an addition (`+key`), for the typed schema to refuse by name.
    """
    declared, dict_keys, list_keys, maps = _declared_keys()
    kept, following = [], []
    for override in overrides:
        key = raw_override_key(override)
        if key is None or key.startswith("hydra."):  # deletions, and Hydra's own settings
            kept.append(override)
            continue
        spelled, text = override.split("=", 1)
        if key in ALIASES:
            spelled, key = spelled.replace(key, ALIASES[key], 1), ALIASES[key]
        if key in list_keys and not text.lstrip().startswith("["):
            text = f"[{text}]"  # verl takes `trainer.logger=console`
        entry = as_first_entry(key, maps)  # a named teacher's key, as verl's tables spell it
        if key in declared:  # verl's scripts add (`+key`) what verl's YAML lacks and rlframe declares
            kept.append(f"{spelled.lstrip('+')}={text}")
        elif entry in declared:  # an entry the YAML lacks (`+distillation.teacher_models.NAME.model_path=...`)
            kept.append(f"+{spelled.lstrip('+')}={text}")
        elif any(key.startswith(d + ".") for d in dict_keys):
            kept.append(f"{spelled}={text}")
        elif not verl_key_under(entry):
            kept.append(f"+{spelled.lstrip('+')}={text}")
        elif (followed := followed_key(entry)) is not None:
            following.append((entry, text, followed, key))
        elif (refusal := check_verl_override(entry, text, shown=key)) is not None:
            raise ValueError(refusal)
    return kept, following


def _entry_of(key: str, maps: dict[str, str]) -> tuple[str, str] | None:
    """For a key under a map of named sections (`distillation.teacher_models.NAME.model_path`): its entry's prefix
    as spelled and as the map's default entry (`….teacher_model.`), whose keys rlframe declares and verl's tables
    know. None for any other key."""
    for path, first in maps.items():
        name, dot, _ = key.removeprefix(path + ".").partition(".")
        if key.startswith(path + ".") and dot:
            return f"{path}.{name}.", f"{path}.{first}."
    return None


def as_first_entry(key: str, maps: dict[str, str]) -> str:
    """`key` spelled under its map's default entry (other keys unchanged)."""
    entry = _entry_of(key, maps)
    return key if entry is None else entry[1] + key[len(entry[0]) :]


@lru_cache(maxsize=1)
def _declared_keys() -> tuple[frozenset, tuple, frozenset, dict[str, str]]:
    """Every rlframe key and section, the keys holding a free-form dict (override_config), the list keys, and the
    maps of named sections (`distillation.teacher_models`) with their first default entry."""
    paths, dicts, lists, maps = set(), [], set(), {}
    for path, value, _ in walk(PPOTrainerConfig()):
        paths.add(path)
        if is_section_map(value):
            maps[path] = next(iter(value))
        elif isinstance(value, dict):
            dicts.append(path)
        if isinstance(value, list):
            lists.add(path)
    return frozenset(paths), tuple(dicts), frozenset(lists), maps


def typed(cfg: DictConfig) -> PPOTrainerConfig:
    """The resolved config as typed sections, with every key's and section's check run."""
    root = OmegaConf.to_object(cfg)
    validate(root)
    return root


def _unknown_key_message(full_key: str, overrides: list[str]) -> str:
    import difflib

    known = [path for path, value, _ in walk(PPOTrainerConfig()) if not isinstance(value, Section)]
    maps = _declared_keys()[3]
    close = difflib.get_close_matches(as_first_entry(full_key, maps), known, n=3, cutoff=0.6)
    if (entry := _entry_of(full_key, maps)) is not None:  # a named teacher's typo: suggest its own keys
        spelled, first = entry
        close = [spelled + match[len(first) :] for match in close if match.startswith(first)]
    source = next((o for o in overrides if full_key in o.split("=", 1)[0]), None)
    if full_key in NOT_IN_VERL:
        close = []
    return (
        f"unknown config key {full_key!r}"
        + (f" (from the override {source!r})" if source else "")
        + ": no rlframe component reads it"
        + (f". Did you mean {' or '.join(close)}?" if close else ".")
        + (f" {NOT_IN_VERL[full_key]}." if full_key in NOT_IN_VERL else "")
        + " configs/ppo_trainer.yaml documents every key."
    )


def default_yaml() -> str:
    """configs/ppo_trainer.yaml as generated from the typed sections."""
    return render_yaml(PPOTrainerConfig, HEADER)


if __name__ == "__main__":
    print(default_yaml(), end="")
