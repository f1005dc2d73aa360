"""The README's first command keeps its promise: the quickstart (`scripts/quickstart.sh`, which runs
`examples/grpo_tiny_cpu.sh`) ends by drawing its curves and printing where the PNG is.

The slow test runs the example itself, cut to 2 steps, into a temporary run folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_tiny_cpu.sh"


def default_run_dir() -> str:
    match = re.search(r'RUN_DIR="\$\{RUN_DIR:-([^}]+)\}"', EXAMPLE.read_text())
    assert match, "examples/grpo_tiny_cpu.sh should default RUN_DIR"
    return match.group(1)


def test_the_readme_names_the_png_the_example_writes():
    readme = (ROOT / "README.md").read_text()
    promised = f"{default_run_dir()}/curves.png"
    assert re.search(r"quickstart ends by drawing its curves\s+and printing where they are", readme)
    assert f"`{promised}`" in readme
    assert 'plot "$RUN_DIR" -o "$RUN_DIR/curves.png"' in EXAMPLE.read_text()
    assert 'exec bash "$ROOT/examples/grpo_tiny_cpu.sh"' in (ROOT / "scripts" / "quickstart.sh").read_text()


@pytest.mark.slow
def test_the_example_ends_with_its_curves_and_their_path(tmp_path):
    run_dir = tmp_path / "tiny_grpo"
    env = {**os.environ, "RUN_DIR": str(run_dir), "PYTHON": sys.executable, "TOKENIZERS_PARALLELISM": "false"}
    # 2 steps (validation before training and after the last step, as in the full run)
    done = subprocess.run(
        ["bash", str(EXAMPLE), "trainer.total_training_steps=2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    png = run_dir / "curves.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = done.stdout.strip().splitlines()
    assert f"curves written to {png}" in lines[-2:]  # the end of the output says where the PNG is
    assert "steps: 2" in done.stdout  # the reward summary before it
