"""Entry point: `python -m rlframe.trainer.main_ppo key=value ...` (or `rlframe train key=value ...`).

Everything that can be checked is checked before Ray starts: the config's arithmetic (the batch
plan), names of algorithms and engines, the model folder, the datasets (columns, prompt lengths).
Then the worker groups are created, and the trainer runs.
"""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlframe.batch_plan import BatchPlan, ModelShape, make_batch_plan, read_model_shape
from rlframe.config import trace
from rlframe.config.checks import check_model_path, resolve_device
from rlframe.config.key_status import warn_at_launch
from rlframe.config.loader import config_dir, overrides_from_config
from rlframe.config.secrets import find_secrets
from rlframe.data.builtin_tasks import resolve_data_files
from rlframe.data.dataloader import make_dataloader
from rlframe.data.dataset import RLHFDataset
from rlframe.models.builtin import resolve_model_path
from rlframe.models.reward_head import check_reward_checkpoint
from rlframe.models.vision import load_vision_processor
from rlframe.reward.manager import load_reward_manager
from rlframe.reward.scorers import check_builtin_scoring
from rlframe.single_controller.errors import WorkerDiedError, WorkerGroupError, WorkerTimeoutError
from rlframe.trainer.config import PPOTrainerConfig, compose, typed
from rlframe.trainer.launch import create_worker_groups
from rlframe.trainer.ray_trainer import PreparedRun, RayPPOTrainer
from rlframe.workers.config.distillation import TEACHERS, routes_rows, teacher_path_key, teachers_of
from rlframe.workers.rollout.registry import engine_for

# Keys that may name the built-in tiny model (directly or through an interpolation).
MODEL_PATH_KEYS = (
    "actor_rollout_ref.model.path",
    "critic.model.path",
    "critic.model.tokenizer_path",
    "reward_model.model.input_tokenizer",
    "data.tokenizer",
)


def normalize_config(cfg: DictConfig) -> DictConfig:
    """Resolve interpolations and built-in paths once: a read-only DictConfig of the typed sections
    (`PPOTrainerConfig`), so every value has its declared type and every read shows in the read trace."""
    container = OmegaConf.to_container(cfg, resolve=True)
    teachers = [teacher_path_key(name) for name in container["distillation"]["teacher_models"]]
    for key in (*MODEL_PATH_KEYS, *teachers):  # on the plain container: not a read (see rlframe.config.trace)
        *parents, name = key.split(".")
        node = container
        for part in parents:
            node = node[part]
        if isinstance(node[name], str):
            node[name] = resolve_model_path(node[name])
    out = OmegaConf.merge(OmegaConf.structured(PPOTrainerConfig), container)
    OmegaConf.set_readonly(out, True)
    return out


def check_environment(cfg: DictConfig) -> None:
    """What the config's own checks cannot see: model folders on disk (the reward model's head) and the device.
    Whether the vLLM engines fit the machine's memory is checked last, once the whole config has passed."""
    check_model_path(cfg.actor_rollout_ref.model.path)
    resolve_device(cfg.trainer.device)  # trainer.device=cuda without a visible GPU fails here
    if cfg.reward_model.enable:
        check_model_path(cfg.reward_model.model.path, key="reward_model.model.path")
        check_reward_checkpoint(cfg.reward_model.model.path)  # its trained head, or no run
    if cfg.distillation.enabled:
        for name, teacher in teachers_of(cfg.distillation).items():
            check_model_path(teacher.model_path, key=teacher_path_key(name))


def check_teacher_tokenizer(cfg: DictConfig, tokenizer) -> None:
    """A distillation teacher scores the policy's token ids: its tokenizer must be the policy's."""
    trust = cfg.actor_rollout_ref.model.trust_remote_code
    for name, entry in teachers_of(cfg.distillation).items():
        path = entry.model_path
        teacher = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
        if teacher.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                f"{teacher_path_key(name)}={path}: its tokenizer differs from the policy's ({len(teacher)} tokens, "
                f"the policy's {len(tokenizer)}, or the same count with other ids); the teacher scores the policy's "
                "token ids, so distillation needs one tokenizer for both"
            )


def check_teacher_routing(distillation: DictConfig, dataset) -> None:
    """With several teachers, every row's `teacher_key` field names one (verl fails on such a row mid-run)."""
    if not (distillation.enabled and routes_rows(distillation)):
        return
    field = distillation.teacher_key
    keys = {str(teacher.key): name for name, teacher in teachers_of(distillation).items()}
    for row, (path, row_number) in zip(dataset.rows, dataset.origins):
        if field not in row:
            raise ValueError(
                f"data file {path}, row {row_number}: no column {field!r} (distillation.teacher_key) to route the "
                f"row to a teacher; its columns: {', '.join(row)}"
            )
        if str(row[field]) not in keys:
            raise ValueError(
                f"data file {path}, row {row_number}, column {field!r}: {row[field]!r} routes to no teacher "
                f"({', '.join(f'{TEACHERS}.{name}.key={key!r}' for key, name in keys.items())}); add a teacher for it"
            )


def build_data(cfg: DictConfig, tokenizer):
    """Datasets and dataloaders; built before Ray so bad data fails fast."""
    data = cfg.data
    train_files = resolve_data_files(data.train_files, data.builtin_dir, data.seed, split="train")
    val_files = resolve_data_files(data.val_files, data.builtin_dir, data.seed, split="val")
    # a vision-language model's image processor (None for a text model): prompts then carry their images
    processor = load_vision_processor(cfg.actor_rollout_ref.model.path, tokenizer, data.trust_remote_code)
    train = RLHFDataset(train_files, tokenizer, data, processor)
    val = RLHFDataset(val_files, tokenizer, data, processor)
    # one loader batch is one generation round: gen_batch_size prompts with DAPO's dynamic sampling
    train_loader = make_dataloader(
        train, data.gen_batch_size or data.train_batch_size, shuffle=data.shuffle, seed=data.seed
    )
    val_batch = data.val_batch_size or len(val)
    val_loader = make_dataloader(val, val_batch, shuffle=False, seed=data.seed, drop_last=False)
    return train_loader, val_loader


def step_counts(cfg: DictConfig, train_loader) -> tuple[int, int]:
    """(steps the run takes, steps the lr schedule spans), as verl 0.9.1 counts them.

    The schedule spans trainer.total_training_steps when set, else total_epochs passes over the
    training set; the run stops at whichever ends first (verl loops over total_epochs and returns
    once total_training_steps is reached).
    """
    epochs_steps = len(train_loader) * cfg.trainer.total_epochs
    if cfg.trainer.total_training_steps is None:
        return epochs_steps, epochs_steps
    schedule = cfg.trainer.total_training_steps
    return min(schedule, epochs_steps), schedule


def check_config(
    overrides: list[str], check_files: bool = True
) -> tuple[DictConfig, DictConfig, ModelShape | None, BatchPlan]:
    """The config checks: (composed, normalized, model shape, plan). `check_files=False` skips the model folder
    and device checks (`rlframe explain --plan-only`)."""
    with find_secrets().hidden_in_errors():  # the environment's secrets, until the config is composed
        composed = compose(overrides)  # unknown keys and wrong types fail here
    secrets = find_secrets(composed)
    with secrets.hidden_in_errors():  # a check's message names the value: never a secret one
        typed(composed)  # every key's and section's check: names, choices, cross-key rules
        cfg = normalize_config(composed)
        secrets.check_run_folders(cfg)
        if check_files:
            check_environment(cfg)
        model_shape = read_model_shape(cfg.actor_rollout_ref.model.path)
        engine = engine_for(cfg.actor_rollout_ref.rollout.name, cfg.actor_rollout_ref.rollout.mode)
        capabilities = engine.capabilities
        plan = make_batch_plan(cfg, model_shape, capabilities.micro_batches, capabilities.pools_cpu_generation)
        if check_files and engine.check_machine is not None:
            engine.check_machine(cfg)  # the machine, after the config: a config error is named first
        return composed, cfg, model_shape, plan


def load_data_and_rewards(cfg: DictConfig) -> tuple:
    """Tokenizer, dataloaders and reward functions: data errors (columns, prompt lengths) surface here."""
    tokenizer = AutoTokenizer.from_pretrained(
        cfg.data.tokenizer or cfg.actor_rollout_ref.model.path, trust_remote_code=cfg.data.trust_remote_code
    )
    if cfg.distillation.enabled:
        check_teacher_tokenizer(cfg, tokenizer)
    train_loader, val_loader = build_data(cfg, tokenizer)
    check_teacher_routing(cfg.distillation, train_loader.dataset)  # validation rows are never distilled
    reward_fn = load_reward_manager(cfg, tokenizer, num_examine=0)
    if reward_fn.compute_score is None and not cfg.reward_model.enable:  # the built-in scorers give the reward
        for dataset in (train_loader.dataset, val_loader.dataset):
            check_builtin_scoring(dataset.rows, dataset.origins, cfg.data.reward_fn_key)
    val_reward_fn = load_reward_manager(
        cfg, tokenizer, num_examine=cfg.trainer.log_val_generations, compute_score=reward_fn.compute_score
    )  # the user's file runs once
    return tokenizer, train_loader, val_loader, reward_fn, val_reward_fn


def prepare(overrides: list[str]) -> PreparedRun:
    """Compose the config from `overrides` and check everything that can fail before Ray starts.

    `rlframe explain` runs the same checks (`check_config`, then `load_data_and_rewards`), so the two
    give the same verdict on any config.
    """
    composed, cfg, model_shape, plan = check_config(overrides)
    secrets = find_secrets(composed)
    with secrets.hidden_in_errors():
        warn_at_launch(composed, overrides)
        tokenizer, train_loader, val_loader, reward_fn, val_reward_fn = load_data_and_rewards(cfg)
    steps, schedule_steps = step_counts(cfg, train_loader)
    return PreparedRun(
        cfg=cfg,
        plan=plan,
        tokenizer=tokenizer,
        train_loader=train_loader,
        val_loader=val_loader,
        total_steps=steps,
        schedule_steps=schedule_steps,
        hidden_size=model_shape.hidden_size,  # check_environment made sure config.json exists
        reward_fn=reward_fn,
        val_reward_fn=val_reward_fn,
        secrets=secrets,
    )


def train(run: PreparedRun, verbose: bool = False, print_config: bool = False) -> dict:
    """Save the resolved config (print it too with `print_config`), create the worker groups and run the trainer.

    `verbose` lets Ray's start-up messages and the workers' loading bars through (`docs/seeing_a_run.md`).
    """
    cfg = run.cfg
    os.makedirs(cfg.trainer.default_local_dir, exist_ok=True)
    config_path = os.path.join(cfg.trainer.default_local_dir, "config.yaml")
    shown_cfg = OmegaConf.create(run.secrets.mask(OmegaConf.to_container(cfg)))  # no secret in the dump or console
    OmegaConf.save(shown_cfg, config_path)
    shown = print_config or verbose
    if shown:
        print(OmegaConf.to_yaml(shown_cfg), flush=True)
    hint = "" if shown else " (--print-config shows it here)"
    print(f"[rlframe] resolved config saved to {config_path}{hint}", flush=True)
    for name, loader in (("train", run.train_loader), ("val", run.val_loader)):
        dataset = loader.dataset
        print(
            f"[rlframe] {name}: {len(dataset)} prompts"
            f" ({dataset.num_filtered} longer than data.max_prompt_length={cfg.data.max_prompt_length} filtered out)",
            flush=True,
        )
    print(f"[rlframe] {run.total_steps} training steps; run folder {cfg.trainer.default_local_dir}", flush=True)
    return train_with_restarts(run, verbose)


def train_with_restarts(run: PreparedRun, verbose: bool = False) -> dict:
    """Create the worker groups and train; after a lost worker, up to trainer.max_restarts times, tear them
    down, recreate them and resume from this run's latest complete checkpoint (docs/reliability.md)."""
    cfg = run.cfg
    max_restarts = cfg.trainer.max_restarts
    # a restart waits for a lost node's replacement to join; the first launch fails at once
    restart_node_wait_s = cfg.trainer.restart_node_wait_s
    fresh_loader_state = run.train_loader.state_dict()  # where a restart with no checkpoint starts over
    resume_from = None
    for restart in range(max_restarts + 1):
        node_wait_s = restart_node_wait_s if restart else 0.0
        groups = trainer = None
        try:  # a worker lost while the groups start (building its models) restarts like one lost later
            groups = create_worker_groups(cfg, run.plan, run.schedule_steps, verbose=verbose, node_wait_s=node_wait_s)
            trainer = RayPPOTrainer(run, groups)
            trainer.num_restarts = restart
            if resume_from is not None:  # else: as trainer.resume_mode says, like the first attempt
                trainer.checkpointer.restart_from(resume_from)
            return trainer.fit()
        except Exception as error:
            lost = lost_worker(error)
            if lost is None or restart == max_restarts:
                raise
            if getattr(trainer, "tracker", None) is not None:
                trainer.tracker.finish()  # the next attempt appends to the same metrics
            if trainer is not None and trainer.checkpointer.last_complete is not None:
                resume_from = trainer.checkpointer.last_complete
            if resume_from is None:
                run.train_loader.load_state_dict(fresh_loader_state)
            print(
                f"[rlframe] {lost}; restart {restart + 1} of trainer.max_restarts={max_restarts}: recreating the "
                f"workers and resuming from {resume_from or 'where this run started (no checkpoint saved yet)'}",
                file=sys.stderr,
                flush=True,
            )
        finally:
            if groups is not None:
                groups.shutdown()
    raise AssertionError("unreachable: the last attempt returns or raises")


def lost_worker(error: BaseException) -> WorkerGroupError | None:
    """The dead (or hung) worker behind `error`, following its causes; None when no worker was lost."""
    seen = error
    while seen is not None:
        if isinstance(seen, (WorkerDiedError, WorkerTimeoutError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def run_ppo(overrides) -> dict:
    """Check, launch and train; returns the last step's metrics.

    `overrides`: `key=value` strings, or a config mapping as `rlframe.train` takes (`rlframe.trainer.entry`,
    which also returns the run folder).
    """
    return train(prepare(overrides_from_config(overrides)))


def configure_logging() -> None:
    """rlframe's INFO messages (e.g. trainer.log_val_generations samples) go to stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[rlframe] %(message)s"))
    logger = logging.getLogger("rlframe")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


CONSOLE_FLAGS = ("--verbose", "--print-config")


def main(argv: list[str] | None = None) -> None:
    """Hydra-style `key=value` overrides on the command line, plus the console flags."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ("-h", "--help") for arg in args):
        print(
            "usage: python -m rlframe.trainer.main_ppo [--verbose] [--print-config] KEY=VALUE ...\n"
            "       (or: rlframe train ...)\n"
            f"keys and their defaults: {os.path.join(config_dir(), 'ppo_trainer.yaml')}\n"
            "to see how a config's batch flows to each GPU: rlframe explain KEY=VALUE ...\n"
            "  --print-config  print the resolved config (it is always saved to the run folder's config.yaml)\n"
            "  --verbose       also Ray's start-up messages and the workers' loading bars (implies --print-config)"
        )
        return
    overrides = [arg for arg in args if arg not in CONSOLE_FLAGS]
    unknown = [arg for arg in overrides if arg.startswith("--")]
    if unknown:
        print(
            f"rlframe: error: unknown option {unknown[0]}; the options are {', '.join(CONSOLE_FLAGS)}", file=sys.stderr
        )
        sys.exit(2)
    configure_logging()
    with trace.from_env():  # the config keys this run reads, when RLFRAME_TRACE_CONFIG_READS asks
        try:
            run = prepare(overrides)
        except ValueError as err:  # config and data errors: one clear message, before any work starts
            print(f"rlframe: error: {err}", file=sys.stderr)
            sys.exit(2)
        train(run, verbose="--verbose" in args, print_config="--print-config" in args)


if __name__ == "__main__":
    main()
