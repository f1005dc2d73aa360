"""Which config keys take effect in a given config, and why the others do not.

`key_statuses` lists the batch-relevant keys in effect and every key or section with no effect, with
a reason; `ignored_key_warnings` picks the ones the user set on the command line. `launch_warnings` adds the
sections' own warnings (`Section.warnings`: settings that run but are likely not what the user meant); they
are what `rlframe train` prints at launch and `rlframe explain` shows.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import TextIO

from omegaconf import DictConfig, OmegaConf

from rlframe.config.keys import ACTOR, CRITIC, LOG_PROB_FIELDS, MODEL, REF, ROLLOUT, UPDATE_FIELDS, VALUE_FIELDS
from rlframe.config.loader import leaves
from rlframe.config.schema import field_help, inactive_keys, section_warnings
from rlframe.config.secrets import find_secrets
from rlframe.config.verl_keys import ALIASES

# Batch-relevant keys, shown "in effect" (with their declared help) unless a rule says otherwise.
BATCH_KEYS = (
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "data.train_batch_size",
    f"{ROLLOUT}.n",
    "data.max_prompt_length",
    "data.max_response_length",
    f"{ACTOR}.ppo_mini_batch_size",
    f"{ACTOR}.ppo_epochs",
    f"{ACTOR}.{UPDATE_FIELDS.dynamic}",
    f"{ACTOR}.{UPDATE_FIELDS.micro}",
    f"{ACTOR}.{UPDATE_FIELDS.max_token_len}",
    f"{ACTOR}.packing_algorithm",
    f"{ACTOR}.ulysses_sequence_parallel_size",
    f"{MODEL}.use_remove_padding",
    f"{ROLLOUT}.{LOG_PROB_FIELDS.dynamic}",
    f"{ROLLOUT}.{LOG_PROB_FIELDS.micro}",
    f"{ROLLOUT}.{LOG_PROB_FIELDS.max_token_len}",
    f"{ROLLOUT}.micro_batch_size",
    f"{ROLLOUT}.tensor_model_parallel_size",
    f"{REF}.{LOG_PROB_FIELDS.dynamic}",
    f"{REF}.{LOG_PROB_FIELDS.micro}",
    f"{REF}.{LOG_PROB_FIELDS.max_token_len}",
    f"{REF}.ulysses_sequence_parallel_size",
    f"{CRITIC}.ppo_mini_batch_size",
    f"{CRITIC}.{UPDATE_FIELDS.dynamic}",
    f"{CRITIC}.{UPDATE_FIELDS.micro}",
    f"{CRITIC}.{UPDATE_FIELDS.max_token_len}",
    f"{CRITIC}.{VALUE_FIELDS.micro}",
    f"{CRITIC}.{VALUE_FIELDS.max_token_len}",
    f"{CRITIC}.packing_algorithm",
    f"{CRITIC}.ulysses_sequence_parallel_size",
    "trainer.balance_batch",
)


@dataclass(frozen=True)
class KeyStatus:
    """Whether a config key (or a whole section, e.g. `critic`) takes effect in this config, and why."""

    key: str
    in_effect: bool
    reason: str


def _rules(cfg: DictConfig) -> list[KeyStatus]:
    """The batch keys in effect, then every key or section with no effect, from the sections' declarations.

    `cfg` is a config composed against the typed schema (`rlframe.trainer.config.compose`), so
    `OmegaConf.to_object` gives the typed sections whose `inactive` rules decide.
    """
    root = OmegaConf.to_object(cfg)
    inactive = inactive_keys(root)
    outermost = {
        key: reason
        for key, reason in inactive.items()
        if not any(_under(key, other) and key != other for other in inactive)
    }
    rows = [
        KeyStatus(key, True, field_help(root, key))
        for key in BATCH_KEYS
        if not any(_under(key, dead) for dead in outermost)
    ]
    return rows + [KeyStatus(key, False, reason) for key, reason in outermost.items()]


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


def raw_override_key(override: str) -> str | None:
    """The key as an override spells it (`a.b=1`, `+a.b=1`, `++a.b=1`); None for deletions (`~a.b`)."""
    text = override.strip()
    if not text or text.startswith("~") or "=" not in text:
        return None
    return text.split("=", 1)[0].lstrip("+").split("@", 1)[0]


def override_key(override: str) -> str | None:
    """The key an override sets: verl's newer spelling of a key names the key it reaches."""
    key = raw_override_key(override)
    return ALIASES.get(key, key)


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
    return [
        f"rlframe: warning: {key}={values[key]} has no effect: {reason}" for key, reason in ignored_keys(cfg, overrides)
    ]


def launch_warnings(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """The ignored-key lines, then one line per section warning (`Section.warnings`) of this config."""
    root = OmegaConf.to_object(cfg)
    return ignored_key_warnings(cfg, overrides) + [f"rlframe: warning: {line}" for line in section_warnings(root)]


def warn_at_launch(cfg: DictConfig, overrides: list[str], stream: TextIO | None = None) -> list[str]:
    """Print `launch_warnings` (to stderr by default) and return them; a warning names values, never a secret."""
    secrets = find_secrets(cfg)
    lines = [secrets.scrub(line) for line in launch_warnings(cfg, overrides)]
    for line in lines:
        print(line, file=stream or sys.stderr)
    return lines
