"""The Python entry (`rlframe.train`) and the runnable examples in its and RayPPOTrainer's docstrings.

The examples are run as written (the code block of each docstring, in a temporary folder), so a
docstring that stops working fails here. The config-to-overrides translation is checked on its own
(fast): a mapping means exactly what the same keys on the command line mean.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlframe.config.loader import load_config, override_value, overrides_from_config


def docstring_example(obj) -> str:
    """The ```python block of `obj`'s docstring, dedented."""
    blocks = re.findall(r"```python\n(.*?)```", obj.__doc__, flags=re.S)
    assert len(blocks) == 1, f"{obj.__qualname__}'s docstring should hold one python example"
    return textwrap.dedent(blocks[0])


# ------------------------------------------------------------------ fast: the translation


def test_rlframe_exports_train_lazily():
    import subprocess
    import sys

    code = "import sys, rlframe; assert 'torch' not in sys.modules; print(rlframe.train.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "rlframe.trainer.entry"


def test_nested_and_dotted_mappings_give_the_command_line_overrides():
    nested = {"trainer": {"total_training_steps": 2, "logger": ["jsonl"]}, "algorithm": {"adv_estimator": "grpo"}}
    dotted = {"trainer.total_training_steps": 2, "trainer.logger": ["jsonl"], "algorithm.adv_estimator": "grpo"}
    expected = ["trainer.total_training_steps=2", "trainer.logger=[jsonl]", "algorithm.adv_estimator=grpo"]
    assert overrides_from_config(nested) == expected
    assert overrides_from_config(dotted) == expected
    assert overrides_from_config(OmegaConf.create(nested)) == expected
    assert overrides_from_config(expected) == expected  # a list of key=value strings passes through
    assert overrides_from_config(None) == []


def test_a_whole_config_gives_only_what_differs_from_the_defaults():
    cfg = load_config(["trainer.total_training_steps=3", "data.train_batch_size=8"])
    assert sorted(overrides_from_config(cfg)) == ["data.train_batch_size=8", "trainer.total_training_steps=3"]
    assert overrides_from_config(load_config([])) == []  # interpolations compared as written: none differ


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        3e-4,
        "builtin://tiny",
        "a b",
        "it's",
        "back\\",
        "${trainer.project_name}",
        "",
        ["a,b", "c"],
        {"k": "v w", "n": [1, "2"]},
    ],
)
def test_values_read_back_as_themselves(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_override(f"k={override_value(value)}").value()
    assert parsed == value


def test_a_mapping_composes_to_the_config_the_command_line_gives():
    from rlframe.trainer.config import compose

    mapping = {"data": {"train_files": "/data/my train.parquet"}, "actor_rollout_ref.actor.optim.lr": 3e-4}
    from_mapping = compose(overrides_from_config(mapping))
    from_cli = compose(["data.train_files='/data/my train.parquet'", "actor_rollout_ref.actor.optim.lr=3e-4"])
    assert OmegaConf.to_container(from_mapping) == OmegaConf.to_container(from_cli)


def test_a_bad_key_fails_before_ray_with_the_command_lines_message():
    import rlframe

    with pytest.raises(ValueError, match="trainer.total_training_step"):
        rlframe.train({"trainer.total_training_step": 2})


# ------------------------------------------------------------------ slow: the docstrings' examples, run


@pytest.mark.slow
def test_the_train_docstring_example_runs(tmp_path, monkeypatch, capsys):
    import rlframe

    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(docstring_example(rlframe.train), "rlframe.train example", "exec"), scope)
    result = scope["result"]
    assert result.run_dir == str(tmp_path / "checkpoints/rlframe/tiny_python")
    assert os.path.isfile(os.path.join(result.run_dir, "config.yaml"))
    assert result.metrics["training/global_step"] == 2
    assert 0.0 <= result.metrics["critic/score/mean"] <= 1.0
    history = result.history()
    assert [row["step"] for row in history] == [1, 2]
    assert history[-1]["actor/pg_loss"] == pytest.approx(result.metrics["actor/pg_loss"])
    assert result.config.trainer.total_training_steps == 2
    assert "trainer.device=cpu" in result.overrides
    assert result.run_dir in capsys.readouterr().out  # the example prints where the run is


@pytest.mark.slow
def test_the_ray_trainer_docstring_example_runs(tmp_path, monkeypatch):
    from rlframe.trainer.ray_trainer import RayPPOTrainer

    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(docstring_example(RayPPOTrainer), "RayPPOTrainer example", "exec"), scope)
    assert scope["metrics"]["training/global_step"] == 2
    with open(tmp_path / "checkpoints/rlframe/tiny_trainer/metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]


def test_the_readme_example_is_python_that_composes():
    from rlframe.trainer.config import compose

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### From Python") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    calls = []

    def train(config):  # records the config instead of training
        calls.append(config)
        return type("Result", (), {"run_dir": "", "metrics": {"critic/score/mean": 0.0}})

    fake = type("rlframe", (), {"train": staticmethod(train)})
    scope = {"__builtins__": __builtins__, "print": lambda *args: None}
    exec(compile(code.replace("import rlframe\n", ""), "README example", "exec"), {**scope, "rlframe": fake})
    (config,) = calls
    compose(overrides_from_config(config))  # every key exists and has the right type
