"""Declaring config keys once: a typed field per key, with its default, its help line and its check.

Every config section is a dataclass deriving from `Section`, declared in the `config.py` of the package
whose code reads it, or in a `config/` package with one file per role (`rlframe/data/config.py`,
`rlframe/workers/config/actor.py`, `rlframe/workers/rollout/config.py`, `rlframe/trainer/config.py`, ...).
A key is declared with `key(default, help, choices=..., check=...)`, a nested section with `section(cls)`, and a map
of named sections of one kind (verl's `distillation.teacher_models.NAME`) with `named_sections`; from those come

- the YAML of defaults with its one-line comment per key (`render_yaml`; `configs/ppo_trainer.yaml`
  is generated from it and a test keeps the two equal),
- type checks and unknown-key errors (OmegaConf merges the composed config into the schema),
- value checks with the full key in the message (`validate`: `choices`, `check`, `Section.check`),
- which keys have no effect in a given config (`Section.inactive`, collected by `inactive_keys`),
- settings that run but are likely not what the user meant (`Section.warnings`, collected by `section_warnings`).

OmegaConf needs `typing.Optional`/`List`/`Dict` annotations, so sections use those, not `X | None`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

Check = Callable[[Any], None]  # raises ValueError (its message is prefixed with "key=value: ")


def key(default: Any, help: str, *, choices: tuple | dict | Callable | None = None, check: Check | None = None) -> Any:
    """One config key: its default, its one-line help (the YAML comment) and its accepted values.

    `default` may be an OmegaConf interpolation (`"${actor_rollout_ref.actor.ppo_epochs}"`): the key then
    follows another one unless set. `choices` lists the accepted values (or returns them, when a registry that
    grows holds them); `check` raises ValueError
    for a bad value (for checks that need code, e.g. a name looked up in a registry).
    """
    if choices is not None and not callable(choices):  # a callable gives the choices when the value is checked
        choices = tuple(choices)
    metadata = {"help": help, "choices": choices, "check": check}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def each_of(valid: tuple) -> Check:
    """A `check` for a list key: every entry must be one of `valid`."""

    def check(values: list) -> None:
        unknown = [v for v in values if v not in valid]
        if unknown:
            raise ValueError(f"unknown entries {unknown}; valid: {', '.join(valid)}")

    return check


def section(cls: type, help: str = "") -> Any:
    """A nested section (a `Section` dataclass) with its defaults."""
    return dataclasses.field(default_factory=cls, metadata={"help": help, "choices": None, "check": None})


def named_sections(cls: type, names: tuple[str, ...], help: str = "") -> Any:
    """A mapping of named sections of one kind (annotate it `Dict[str, cls]`), holding `names` at their defaults
    unless set. A command line adds an entry with `+path.NAME.key=value` (verl's `teacher_models`)."""
    return dataclasses.field(
        default_factory=lambda: {name: cls() for name in names}, metadata={"help": help, "choices": None, "check": None}
    )


def is_section_map(value: Any) -> bool:
    """True for a `named_sections` value: a non-empty dict whose entries are sections."""
    return isinstance(value, dict) and bool(value) and all(isinstance(v, Section) for v in value.values())


class Section:
    """Base of every config section: hooks for cross-key checks and for keys that have no effect."""

    def check(self, path: str, root: Any) -> None:
        """Raise ValueError naming the keys when keys of this section contradict each other."""

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        """{dotted key or section: reason} for keys of this section with no effect in this config.

        `path` is this section's dotted key (keys are returned in full: `f"{path}.name"`).
        """
        return {}

    def warnings(self, path: str, root: Any) -> list[str]:
        """Launch warnings for settings of this section that run but are likely not what the user meant.

        Each names the keys, their values and the fix; `rlframe.config.key_status.launch_warnings` prefixes them.
        """
        return []


def fields_of(node: Any) -> Iterator[dataclasses.Field]:
    """The declared keys of a section, in declaration order."""
    return iter(dataclasses.fields(node))


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any, dataclasses.Field | None]]:
    """(dotted key, value, field) for every section and key below `node`, parents before children."""
    for field in fields_of(node):
        key_path = f"{path}.{field.name}" if path else field.name
        value = getattr(node, field.name)
        yield key_path, value, field
        if dataclasses.is_dataclass(value):
            yield from walk(value, key_path)
        elif is_section_map(value):
            for name, entry in value.items():
                yield f"{key_path}.{name}", entry, field
                yield from walk(entry, f"{key_path}.{name}")


def validate(root: Any) -> None:
    """Run every key's `choices`/`check` and every section's `check`; the first failure raises ValueError."""
    if isinstance(root, Section):
        root.check("", root)
    for key_path, value, field in walk(root):
        if isinstance(value, Section):
            value.check(key_path, root)
            continue
        choices, check = field.metadata.get("choices"), field.metadata.get("check")
        choices = choices() if callable(choices) else choices
        if choices is not None and value not in choices:
            raise ValueError(f"{key_path}={value!r} is not one of {', '.join(map(str, choices))}")
        if check is not None:
            try:
                check(value)
            except ValueError as err:
                raise ValueError(f"{key_path}={value!r}: {err}") from None


def inactive_keys(root: Any) -> dict[str, str]:
    """{dotted key or section: reason} for everything that has no effect in this config."""
    out = dict(root.inactive("", root)) if isinstance(root, Section) else {}
    for key_path, value, _ in walk(root):
        if isinstance(value, Section):
            out.update(value.inactive(key_path, root))
    return out


def section_warnings(root: Any) -> list[str]:
    """Every section's `warnings` for this config, parents before children."""
    out = list(root.warnings("", root)) if isinstance(root, Section) else []
    for key_path, value, _ in walk(root):
        if isinstance(value, Section):
            out += value.warnings(key_path, root)
    return out


def field_help(root: Any, dotted: str) -> str:
    """The help line declared for a dotted key."""
    *parents, name = dotted.split(".")
    node = root
    for part in parents:
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return next(f.metadata.get("help", "") for f in fields_of(node) if f.name == name)


def sections_of(tree: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The top-level sections `names` of a config tree, by key: what the driver hands one worker."""
    return {name: getattr(tree, name) for name in names}


def read_only(sections: dict[str, Any]) -> Any:
    """A worker's sections as one typed, read-only DictConfig under their own keys.

    Each section keeps its key, so a read names the full key (`actor_rollout_ref.actor.clip_ratio`) in errors and
    in the config-read trace (`rlframe.config.trace`), which wraps OmegaConf's reads.
    """
    from omegaconf import OmegaConf

    out = OmegaConf.structured(sections)
    OmegaConf.set_readonly(out, True)
    return out


# ───────────────────────────── the YAML of defaults ─────────────────────────────

COMMENT_COLUMN = 39


def _yaml_scalar(value: Any) -> str:
    import yaml

    if isinstance(value, float):  # YAML 1.1 reads "1e-06" as a string: the mantissa needs a dot
        mantissa, _, exponent = repr(value).partition("e")
        mantissa = mantissa if "." in mantissa else mantissa + ".0"
        return mantissa + (f"e{exponent}" if exponent else "")
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _lines(cls: type, indent: int) -> list[str]:
    lines = []
    for field in dataclasses.fields(cls):
        pad = "  " * indent
        help_text = field.metadata.get("help", "")
        if field.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(field.default_factory):
            lines += [""] if indent == 0 else []  # a blank line before each top-level section
            lines.append(f"{pad}{field.name}:" + (f"  # {help_text}" if help_text else ""))
            lines += _lines(field.default_factory, indent + 1)
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if is_section_map(default):
            lines.append(f"{pad}{field.name}:" + (f"  # {help_text}" if help_text else ""))
            for name, entry in default.items():
                lines.append(f"{pad}  {name}:")
                lines += _lines(type(entry), indent + 2)
            continue
        text = f"{pad}{field.name}: {_yaml_scalar(default)}"
        lines.append(f"{text.ljust(COMMENT_COLUMN - 1)} # {help_text}" if help_text else text)
    return lines


def render_yaml(root_cls: type, header: str) -> str:
    """The YAML of every default with its help line as a comment, sections in declaration order."""
    return header.rstrip("\n") + "\n" + "\n".join(_lines(root_cls, 0)) + "\n"
