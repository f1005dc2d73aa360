"""Locate the packaged Hydra configs and compose a config from key=value overrides."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

CONFIG_NAME = "ppo_trainer"


def config_dir() -> str:
    """The folder holding ppo_trainer.yaml: inside the wheel, or the source tree's configs/."""
    package_dir = Path(__file__).resolve().parent.parent
    for candidate in (package_dir / "configs", package_dir.parent / "configs"):
        if (candidate / f"{CONFIG_NAME}.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"{CONFIG_NAME}.yaml not found next to the rlframe package ({package_dir}); "
        "reinstall rlframe so that its configs are included"
    )


def load_config(overrides: list[str] | None = None, config_name: str = CONFIG_NAME) -> DictConfig:
    """Compose the trainer config exactly as the Hydra entry would, without starting a run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base=None):
        try:
            return compose(config_name=config_name, overrides=list(overrides or []))
        except ConfigCompositionException as err:  # unknown keys are named by the typed schema, not here
            raise ValueError(f"bad override: {err}") from None


def leaves(node, prefix: str = "") -> dict:
    """Dotted key → value for every leaf of a config container (an empty dict counts as a leaf)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out or {prefix: node}
    return {prefix: node}


def resolved(cfg: DictConfig) -> DictConfig:
    """A resolved, read-only copy: interpolations evaluated once, nothing mutated afterwards."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_readonly(out, True)
    return out


def overrides_from_config(config) -> list[str]:
    """The `key=value` overrides that turn the default config into `config`, for the command line's path.

    `config` is a mapping (a nested dict, a dict of dotted keys, or an OmegaConf config: a partial one or a
    whole composed config) or already a list of `key=value` strings (returned as it is). Only the leaves that
    differ from the defaults become overrides (interpolations compared as written), so a whole config passed
    back in sets the same keys a command line would, and the config's checks and ignored-key warnings see
    exactly what was changed.
    """
    if config is None:
        return []
    if isinstance(config, (list, tuple)):
        return [str(item) for item in config]
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=False)
    if not isinstance(config, dict):
        raise TypeError(f"a config is a mapping or a list of key=value strings, not {type(config).__name__}")
    defaults = leaves(OmegaConf.to_container(load_config([]), resolve=False))
    missing = object()
    out = []
    for name, value in leaves(_plain(config)).items():
        if defaults.get(name, missing) != value:
            out.append(f"{name}={override_value(value)}")
    return out


def _plain(node):
    """Containers as plain dicts and lists (an OmegaConf node inside a dict included), values as they are."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
    if isinstance(node, dict):
        return {str(key): _plain(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(value) for value in node]
    return node


def override_value(value) -> str:
    """`value` in Hydra's override grammar, such that parsing it gives `value` back (strings quoted when needed)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    text = _override_text(value)
    parsed = OverridesParser.create().parse_override(f"k={text}").value()
    if parsed != value and not (isinstance(value, tuple) and parsed == list(value)):
        raise ValueError(f"cannot write {value!r} as a command-line override (it reads back as {parsed!r})")
    return text


def _override_text(value, inside: str = "{}") -> str:
    """`inside` is how the value is wrapped when its plain spelling is checked: "{}" alone, "[{}]" in a list."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_text(item, "[{}]") for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{_override_text(item, '{{a:{}}}')}" for key, item in value.items()) + "}"
    text = str(value)
    try:
        parsed = OverridesParser.create().parse_override("k=" + inside.format(text)).value()
        if parsed in (text, [text], {"a": text}):
            return text  # a plain token (paths, names, builtin://...) stays as a command line writes it
    except Exception:
        pass
    # quoted: a quote, and backslashes before a quote or at the end, are escaped (Hydra's grammar)
    escaped = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text).replace("'", "\\'")
    return f"'{escaped}'"
