"""Locate the packaged Hydra configs and compose a config from key=value overrides."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

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
