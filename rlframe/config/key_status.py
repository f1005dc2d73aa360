"""Which config keys take effect in a given config, and why the others do not.

`key_statuses` lists the batch-relevant keys in effect and every key or section with no effect, with
a reason; `ignored_key_warnings` picks the ones the user set on the command line, for the launch
warnings and `rlframe explain`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import TextIO

from omegaconf import DictConfig, OmegaConf

from rlframe.config.keys import (ACTOR, ACTOR_KEYS, CRITIC_KEYS, REF, REF_KEYS, ROLLOUT, ForwardKeys, UpdateKeys,
                                 critic_enabled, get, get_bool, ref_enabled)
from rlframe.config.loader import leaves

VLLM_ONLY_KEYS = ("gpu_memory_utilization", "max_num_batched_tokens", "enforce_eager", "free_cache_engine")


@dataclass(frozen=True)
class KeyStatus:
    """Whether a config key (or a whole section, e.g. `critic`) takes effect in this config, and why."""

    key: str
    in_effect: bool
    reason: str


def _micro_rows(cfg: DictConfig, keys: ForwardKeys | UpdateKeys, what: str) -> list[KeyStatus]:
    """Static micro size vs token budget: exactly one of the two applies."""
    if get_bool(cfg, keys.dynamic):
        because = f"{keys.dynamic}=true: {what} micro-batches are cut by {keys.max_token_len}"
        return [KeyStatus(keys.micro, False, because),
                KeyStatus(keys.max_token_len, True, f"token budget per {what} micro-batch (× sp)"),
                KeyStatus(keys.packing, True, f"packs {what} micro-batches")]
    because = f"{keys.dynamic}=false: {what} micro-batches are cut by {keys.micro}"
    return [KeyStatus(keys.micro, True, f"sequences per {what} micro-batch"),
            KeyStatus(keys.max_token_len, False, because), KeyStatus(keys.packing, False, because)]


def _optim_rows(cfg: DictConfig, prefix: str) -> list[KeyStatus]:
    rows = [KeyStatus(f"{prefix}.total_training_steps", False,
                      "filled in by the trainer from the data; set trainer.total_training_steps instead")]
    steps = get(cfg, f"{prefix}.lr_warmup_steps")
    if steps >= 0:
        rows.append(KeyStatus(f"{prefix}.lr_warmup_steps_ratio", False,
                              f"{prefix}.lr_warmup_steps={steps} (>= 0) takes precedence"))
    style = get(cfg, f"{prefix}.warmup_style")
    if style != "cosine":
        rows.append(KeyStatus(f"{prefix}.min_lr_ratio", False, f"{prefix}.warmup_style={style}: only cosine decays"))
    return rows


def _rules(cfg: DictConfig) -> list[KeyStatus]:
    """Every rule of the form 'key K applies / has no effect because ...', in display order."""
    rows = [KeyStatus("trainer.nnodes", True, "world_size = nnodes × n_gpus_per_node"),
            KeyStatus("trainer.n_gpus_per_node", True, "world_size = nnodes × n_gpus_per_node"),
            KeyStatus("data.train_batch_size", True, "prompts per step"),
            KeyStatus(f"{ROLLOUT}.n", True, "samples per prompt"),
            KeyStatus("data.max_prompt_length", True, "longest prompt"),
            KeyStatus("data.max_response_length", True, "longest response"),
            KeyStatus(ACTOR_KEYS.mini, True, "prompts per actor optimizer step"),
            KeyStatus(ACTOR_KEYS.epochs, True, "passes over each batch"),
            KeyStatus(ACTOR_KEYS.dynamic, True, "static (sequence count) or dynamic (token budget) micro-batches"),
            *_micro_rows(cfg, ACTOR_KEYS, "actor update"),
            KeyStatus(ACTOR_KEYS.sp, True, "Ulysses degree of actor (and old log-prob) forward/backward"),
            KeyStatus(ACTOR_KEYS.remove_padding, True, "packed sequences (required by Ulysses)"),
            KeyStatus(ACTOR_KEYS.forward.dynamic, True, "old log-prob micro-batching mode"),
            *_micro_rows(cfg, ACTOR_KEYS.forward, "old log-prob")]

    name = get(cfg, f"{ROLLOUT}.name")
    if name == "hf":
        rows.append(KeyStatus(f"{ROLLOUT}.micro_batch_size", True, "sequences per hf generate call"))
        rows.append(KeyStatus(f"{ROLLOUT}.tensor_model_parallel_size", False,
                              f"{ROLLOUT}.name=hf generates with every worker's FSDP model (tp = 1)"))
        rows += [KeyStatus(f"{ROLLOUT}.{key}", False, f"{ROLLOUT}.name=hf: a vLLM setting") for key in VLLM_ONLY_KEYS]
    else:
        rows.append(KeyStatus(f"{ROLLOUT}.tensor_model_parallel_size", True, "vLLM tensor-parallel degree"))
        rows.append(KeyStatus(f"{ROLLOUT}.micro_batch_size", False,
                              f"{ROLLOUT}.name={name}: the engine batches by max_num_batched_tokens"))

    if ref_enabled(cfg):
        rows += [KeyStatus(REF_KEYS.sp, True, "Ulysses degree of the ref forward"),
                 KeyStatus(REF_KEYS.dynamic, True, "ref log-prob micro-batching mode"),
                 *_micro_rows(cfg, REF_KEYS, "ref log-prob")]
    else:
        rows.append(KeyStatus(REF, False, f"no reference model: {ACTOR}.use_kl_loss=false and "
                                          "algorithm.use_kl_in_reward=false"))
    if not get_bool(cfg, f"{ACTOR}.use_kl_loss"):
        rows += [KeyStatus(f"{ACTOR}.{key}", False, f"{ACTOR}.use_kl_loss=false")
                 for key in ("kl_loss_coef", "kl_loss_type")]
    if not get_bool(cfg, "algorithm.use_kl_in_reward"):
        rows += [KeyStatus(f"algorithm.{key}", False, "algorithm.use_kl_in_reward=false")
                 for key in ("kl_penalty", "kl_ctrl")]
    elif get(cfg, "algorithm.kl_ctrl.type") != "adaptive":
        rows += [KeyStatus(f"algorithm.kl_ctrl.{key}", False, "algorithm.kl_ctrl.type=fixed")
                 for key in ("horizon", "target_kl")]

    estimator = get(cfg, "algorithm.adv_estimator")
    if critic_enabled(cfg):
        rows += [KeyStatus(CRITIC_KEYS.mini, True, "prompts per critic optimizer step"),
                 KeyStatus(CRITIC_KEYS.dynamic, True, "critic micro-batching mode"),
                 *_micro_rows(cfg, CRITIC_KEYS, "critic update"),
                 *[row for row in _micro_rows(cfg, CRITIC_KEYS.forward, "value") if row.key != CRITIC_KEYS.packing],
                 KeyStatus(CRITIC_KEYS.sp, True, "Ulysses degree of the critic"),
                 *_optim_rows(cfg, "critic.optim")]
    else:
        rows.append(KeyStatus("critic", False, f"algorithm.adv_estimator={estimator}: only gae trains a critic"))
        rows.append(KeyStatus("algorithm.lam", False, f"algorithm.adv_estimator={estimator}: only gae uses lambda"))
    if estimator != "grpo":
        rows.append(KeyStatus("algorithm.norm_adv_by_std_in_grpo", False, f"algorithm.adv_estimator={estimator}"))
    if not get_bool(cfg, "reward_model.enable"):
        rows += [KeyStatus(f"reward_model.{key}", False, "reward_model.enable=false")
                 for key in ("model", "micro_batch_size_per_gpu")]
    rows += _optim_rows(cfg, f"{ACTOR}.optim")
    if get(cfg, "trainer.resume_mode") != "resume_path":
        rows.append(KeyStatus("trainer.resume_from_path", False,
                              f"trainer.resume_mode={get(cfg, 'trainer.resume_mode')} (only resume_path reads it)"))
    rows.append(KeyStatus("trainer.balance_batch", True, "Karmarkar–Karp balance across actor DP ranks"))
    # A key shared by two passes (packing_algorithm, the actor's token budget) is in effect if either uses it.
    live = {row.key for row in rows if row.in_effect}
    seen: set[str] = set()
    out = []
    for row in rows:
        if row.key not in seen and (row.in_effect or row.key not in live):
            seen.add(row.key)
            out.append(row)
    return out


_INTERPOLATION = re.compile(r"\$\{([\w.]+)\}")


def _under(key: str, section: str) -> bool:
    return key == section or key.startswith(section + ".")


def _dead_leaves(cfg: DictConfig, rows: list[KeyStatus]) -> tuple[dict[str, str], dict[str, str]]:
    """Leaves with no effect (→ reason), and ignored leaves that still feed a live one (→ consumer).

    A key that is ignored by its own rule can still matter through `${...}`: the critic's token
    budget interpolates the actor's, so with a static actor and a dynamic critic the actor key is live.
    """
    raw = leaves(OmegaConf.to_container(cfg, resolve=False))
    ignored = [row for row in rows if not row.in_effect]

    def covering(leaf: str) -> KeyStatus | None:
        return next((row for row in ignored if _under(leaf, row.key)), None)

    live = [leaf for leaf in raw if covering(leaf) is None]
    feeds: dict[str, str] = {}
    seen = set(live)
    while live:
        consumer = live.pop()
        for target in _INTERPOLATION.findall(str(raw[consumer])):
            for leaf in raw:
                if _under(leaf, target) and leaf not in seen:
                    seen.add(leaf)
                    live.append(leaf)
                    feeds[leaf] = consumer
    dead = {leaf: covering(leaf).reason for leaf in raw if leaf not in seen}
    return dead, feeds


def key_statuses(cfg: DictConfig) -> list[KeyStatus]:
    """The batch-relevant keys in effect and every key or section with no effect, with reasons.

    Pass the composed config (interpolations intact) so that a key feeding another through
    `${...}` counts as in effect.
    """
    rows = _rules(cfg)
    _, feeds = _dead_leaves(cfg, rows)
    out = []
    for row in rows:
        feeding = sorted(leaf for leaf in feeds if _under(leaf, row.key))
        if not row.in_effect and feeding:
            row = KeyStatus(row.key, True, f"feeds {feeds[feeding[0]]} through ${{{feeding[0]}}}")
        out.append(row)
    return out


def override_key(override: str) -> str | None:
    """The key a Hydra override sets (`a.b=1`, `+a.b=1`, `++a.b=1`); None for deletions (`~a.b`)."""
    text = override.strip()
    if not text or text.startswith("~") or "=" not in text:
        return None
    return text.split("=", 1)[0].lstrip("+").split("@", 1)[0]


def ignored_keys(cfg: DictConfig, overrides: list[str]) -> list[tuple[str, str]]:
    """(key, reason) for each key set in `overrides` that has no effect in this config."""
    dead, _ = _dead_leaves(cfg, _rules(cfg))
    all_leaves = leaves(OmegaConf.to_container(cfg, resolve=False))
    out = []
    for override in overrides:
        key = override_key(override)
        if key is None:
            continue
        under = [leaf for leaf in all_leaves if _under(leaf, key)] or [key]
        reasons = [dead.get(leaf) for leaf in under]
        if all(reasons):
            out.append((key, reasons[0]))
    return out


def ignored_key_warnings(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """One line per user-set key that has no effect, as printed at launch."""
    values = {override_key(o): o.split("=", 1)[1] for o in overrides if override_key(o)}
    return [f"rlframe: warning: {key}={values[key]} has no effect: {reason}"
            for key, reason in ignored_keys(cfg, overrides)]


def warn_ignored_keys(cfg: DictConfig, overrides: list[str], stream: TextIO | None = None) -> list[str]:
    """Print `ignored_key_warnings` (to stderr by default) and return them."""
    lines = ignored_key_warnings(cfg, overrides)
    for line in lines:
        print(line, file=stream or sys.stderr)
    return lines
