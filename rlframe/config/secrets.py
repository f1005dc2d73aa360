"""Secrets kept out of everything a run shows: folder names, console lines, errors, `config.yaml`, trackers.

What counts as a secret (docs/reliability.md):

- the value of a key interpolated from the environment (`${oc.env:NAME}`), whatever the variable's name,
  found by walking the composed config before it is resolved; and of every key that interpolates such a
  key (`trainer.default_local_dir` follows `trainer.experiment_name`). A variable whose name says it holds
  a place or a name (`HOME`, `USER`, `*_DIR`, `*_PATH`, `*_ROOT`, `SLURM_JOB_ID`: `place_variable`) is
  not a secret, so `${oc.env:HOME}/ckpt` stays usable as a folder;
- the value of a key named like a credential (`hf_token`, `api_key`, `password`, `auth`: `credential_key`;
  not `tokenizer`, `max_token_len`, `pad_token` or verl's column keys `prompt_key`, `image_key`);
- the value of an environment variable named like a credential (`WANDB_API_KEY`, `HF_TOKEN`, `OPENAI_KEY`,
  `AWS_ACCESS_KEY_ID`: `credential_variable`), wherever it appears, used by the config or not;
- the password of a URL (`postgres://user:password@host`).

Where the config is shown, a secret key's secret part is replaced by `***` (`run-***`; the whole value when
the part cannot be found, as for a number). In free text (errors, warnings) `key=value` of a secret key is
masked, and so is every secret value of 8 characters or more: a shorter one would mask ordinary words.
A folder the run creates is refused when its name would hold a secret.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlframe.config.loader import leaves

MASK = "***"
MIN_TEXT_LEN = 8
RUN_FOLDER_KEYS = ("trainer.default_local_dir", "trainer.rollout_data_dir", "global_profiler.save_path")

# a name holding any of these words holds a credential
_CREDENTIAL_WORDS = frozenset(
    {"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials", "auth", "authorization"}
)
# `key` is a credential only after one of these (`api_key`, `access_key_id`); verl's `*_key` name data columns
_KEY_KINDS = frozenset({"api", "access", "secret", "private", "auth", "client", "ssh", "signing", "encryption"})
# `token` is a credential unless it names a tokenizer's special token (`pad_token`, `eos_token`)
_TOKEN_ROLES = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "image", "video", "audio", "vision"})
_PLACE_VARIABLES = frozenset({"HOME", "PWD", "USER", "LOGNAME", "HOSTNAME", "TMPDIR", "TMP", "TEMP", "SCRATCH"})
_PLACE_SUFFIXES = ("_DIR", "_PATH", "_HOME", "_ROOT", "_NAME", "_ID")

_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")  # snake_case, kebab-case and camelCase words
_ENV_REFERENCE = re.compile(r"oc\.env:\s*['\"]?([A-Za-z_]\w*)")
_KEY_REFERENCE = re.compile(r"\$\{\s*(\.*[A-Za-z_][\w.\-]*)\s*\}")
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][\w+.\-]*://[^\s:/@]+:)([^\s@/]+)(@)")
_ASSIGNMENT = re.compile(r"([A-Za-z_][\w.\-]*)=(\$\{[^}]*\}|'[^']*'|\"[^\"]*\"|[^\s,;'\")\]}]+)")


def _words(name: str) -> list[str]:
    return [word.lower() for word in _WORD.findall(str(name))]


def credential_key(name: str) -> bool:
    """Whether a config key's own name says it holds a credential (`hf_token`, `api_key`, `password`)."""
    words = _words(name)
    if _CREDENTIAL_WORDS.intersection(words) or "apikey" in words:
        return True
    *head, last = words or [""]
    if last == "id" and head[-1:] == ["key"]:  # access_key_id
        *head, last = head
    before = head[-1] if head else ""
    if last == "token":
        return before not in _TOKEN_ROLES
    return last == "key" and before in _KEY_KINDS


def credential_variable(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential: a credential key's, or any `*_KEY`,
    `*_KEY_ID`, `*_TOKEN` (unlike a config key, a variable named `*_KEY` is a key, e.g. `OPENAI_KEY`)."""
    words = _words(name)
    return credential_key(name) or words[-1:] in (["key"], ["token"]) or words[-2:] == ["key", "id"]


def place_variable(name: str) -> bool:
    """Whether a variable's name says it holds a place or a name, not a secret (`HOME`, `DATA_DIR`, `SLURM_JOB_ID`)."""
    upper = name.upper()
    return not credential_variable(name) and (upper in _PLACE_VARIABLES or upper.endswith(_PLACE_SUFFIXES))


@dataclass(frozen=True)
class Held:
    """Why a config key's value is secret, and the secret strings in it (none known: the whole value is)."""

    why: str  # completes "<key> ...": "takes ${oc.env:WANDB_API_KEY}"
    values: tuple[str, ...] = ()


@dataclass(frozen=True)
class Secrets:
    """One run's secrets: the config keys that hold one, and the values masked wherever they appear."""

    keys: Mapping[str, Held] = field(default_factory=dict)
    values: tuple[str, ...] = ()  # longest first, each at least MIN_TEXT_LEN characters

    def shown(self, key: str, value: Any) -> Any:
        """`value` of the dotted config `key` as a run may show it: its secret part, or all of it, masked."""
        held = self.keys.get(key)
        if held is None and credential_key(key.rsplit(".", 1)[-1]):
            held = Held("is named like a credential")
        if held is None:
            return self.mask(value, key)
        if value is None or value == "":
            return value  # nothing to hide, and the reader sees the key is unset
        if isinstance(value, str):
            masked = value
            for secret in sorted(held.values, key=len, reverse=True):
                masked = masked.replace(secret, MASK)
            if masked != value:
                return self.scrub(masked)
        return MASK

    def mask(self, node: Any, path: str = "") -> Any:
        """A copy of a config container with every secret masked: `config.yaml`, the printed config, trackers."""
        if isinstance(node, dict):
            return {name: self.shown(f"{path}.{name}" if path else str(name), v) for name, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(self.mask(v, path) for v in node)
        if isinstance(node, str):
            return self.scrub(node)
        if isinstance(node, (int, float)) and not isinstance(node, bool) and str(node) in self.values:
            return MASK  # a secret of digits, come through a key typed as a number
        return node

    def scrub(self, text: str) -> str:
        """`text` (an error, a warning, a name) with every secret value, secret `key=value` and URL password masked."""
        for secret in self.values:
            text = text.replace(secret, MASK)
        text = _ASSIGNMENT.sub(self._masked_assignment, text)
        return _URL_PASSWORD.sub(rf"\g<1>{MASK}\g<3>", text)

    def _masked_assignment(self, match: re.Match) -> str:
        key, value = match.groups()
        secret = key in self.keys or credential_key(key.rsplit(".", 1)[-1])
        # an interpolation as written (`${oc.env:HF_TOKEN}`) names the variable, not its value
        return f"{key}={MASK}" if secret and not value.startswith("${") else match.group(0)

    def check_run_folders(self, cfg: DictConfig) -> None:
        """Refuse a folder the run would create whose name holds a secret, naming the key and why (not the value)."""
        resolved = _resolved_leaves(cfg)
        for key in RUN_FOLDER_KEYS:
            folder = resolved.get(key)
            if folder is None or (key not in self.keys and self.scrub(str(folder)) == str(folder)):
                continue
            why = self.keys[key].why if key in self.keys else "holds a secret value"
            raise ValueError(
                f"{key} {why}: rlframe does not put a secret into a folder's name, which shows in file listings, "
                f"logs and the console. Set {key} to a folder without it (environment variables named like a place "
                "or a name, HOME, USER, *_DIR, *_PATH, *_HOME, *_ROOT, *_NAME, *_ID, may be interpolated)"
            )

    @contextmanager
    def hidden_in_errors(self) -> Iterator[None]:
        """Re-raise an error whose message shows a secret with the secret masked, as its own type where that type
        takes a message alone (a RuntimeError otherwise); the original, secret and all, is not chained."""
        try:
            yield
        except Exception as err:
            text = str(err)
            shown = self.scrub(text)
            if shown == text:
                raise
            try:
                masked = type(err)(shown)
            except Exception:  # a constructor that wants more than a message
                masked = RuntimeError(shown)
            raise masked from None


def find_secrets(cfg: DictConfig | None = None, environ: Mapping[str, str] | None = None) -> Secrets:
    """The secrets of the environment and, given the composed config (interpolations intact), of its keys."""
    environ = os.environ if environ is None else environ
    found = {value for name, value in environ.items() if credential_variable(name)}
    keys: dict[str, Held] = {}
    if cfg is not None:
        raw, resolved = leaves(OmegaConf.to_container(cfg, resolve=False)), _resolved_leaves(cfg)
        for key, value in raw.items():
            names = [name for name in _ENV_REFERENCE.findall(str(value)) if not place_variable(name)]
            if names:
                carried = tuple(environ[name] for name in names if environ.get(name))
                keys[key] = Held(f"takes ${{oc.env:{names[0]}}}", carried)
            elif credential_key(key.rsplit(".", 1)[-1]) and value not in (None, ""):
                text = resolved.get(key)
                keys[key] = Held("is named like a credential", () if text is None else (str(text),))
        _add_followers(keys, raw)
        found.update(secret for held in keys.values() for secret in held.values)
    values = sorted((v for v in found if len(v) >= MIN_TEXT_LEN), key=len, reverse=True)
    return Secrets(keys, tuple(values))


def _resolved_leaves(cfg: DictConfig) -> dict[str, Any]:
    """Dotted key → resolved value, read from a plain copy (not a read of any key for `rlframe.config.trace`)."""
    try:
        return leaves(OmegaConf.to_container(cfg, resolve=True))
    except Exception:  # a broken interpolation: the config's own checks name it
        return {}


def _add_followers(keys: dict[str, Held], raw: dict[str, Any]) -> None:
    """Add the keys that interpolate a secret key (`${trainer.experiment_name}`): they hold its secret too."""
    changed = True
    while changed:
        changed = False
        for key, value in raw.items():
            if key in keys:
                continue
            targets = [_absolute(key, ref) for ref in _KEY_REFERENCE.findall(str(value))]
            sources = [s for s in keys for t in targets if s == t or s.startswith(t + ".")]
            if sources:
                carried = tuple(dict.fromkeys(v for s in sources for v in keys[s].values))
                keys[key] = Held(f"follows {sources[0]}, which {keys[sources[0]].why}", carried)
                changed = True


def _absolute(key: str, reference: str) -> str:
    """The dotted key an interpolation inside `key` names (`${.x}` is a sibling, `${..x}` the parent's)."""
    dots = len(reference) - len(reference.lstrip("."))
    if not dots:
        return reference
    parent = key.split(".")[:-1]
    return ".".join(parent[: len(parent) - (dots - 1)] + [reference[dots:]])
