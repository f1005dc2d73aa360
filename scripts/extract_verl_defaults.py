"""Write rlframe/config/verl_defaults.json: every key of verl's PPO trainer config with its default.

    python scripts/extract_verl_defaults.py /path/to/verl-0.9.1-py3-none-any.whl

The wheel comes from PyPI (`pip download --no-deps verl==0.9.1`); the file read is its
`verl/trainer/config/_generated_ppo_trainer.yaml` (verl's own flattened defaults). rlframe uses the
result to honour or refuse every key a verl command line may set (`rlframe/config/verl_keys.py`).
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import yaml

GENERATED = "verl/trainer/config/_generated_ppo_trainer.yaml"
OUT = Path(__file__).resolve().parent.parent / "rlframe" / "config" / "verl_defaults.json"


def leaves(node, prefix: str = "") -> dict:
    """Dotted key -> default for every leaf (an empty dict is a leaf)."""
    if isinstance(node, dict) and node:
        out = {}
        for key, value in node.items():
            out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        config = yaml.safe_load(zf.read(GENERATED))
        version = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        version = next(
            line.split(":", 1)[1].strip()
            for line in zf.read(version).decode().splitlines()
            if line.startswith("Version:")
        )
    keys = {key: value for key, value in leaves(config).items() if not key.endswith("._target_")}
    OUT.write_text(
        json.dumps({"verl_version": version, "source": GENERATED, "defaults": keys}, indent=1, sort_keys=True) + "\n"
    )
    print(f"{len(keys)} keys of verl {version} -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
