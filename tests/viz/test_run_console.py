"""The console of a training run, and `rlframe plot`/`report` on a real run folder.

One short real run (3 GRPO steps on the tiny model, validation before and after) is shared by the
slow tests; the flag handling and the worker environment are checked without Ray.
"""

import json
import os

import numpy as np
import pytest
from helpers.runs import run_main
from helpers.small_config import SMALL
from omegaconf import OmegaConf

from rlframe.single_controller.worker import Worker
from rlframe.trainer import launch, main_ppo
from rlframe.trainer.tracking import format_validation
from rlframe.viz.plot import make_figure, panel_axes
from rlframe.viz.report import report
from rlframe.viz.run import load_run

STEPS = 3


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, cache_dir):
    """(run folder, stdout, stderr) of a 3-step run with validation at steps 0 and 3 and rollout dumps."""
    folder = tmp_path_factory.mktemp("console_run")
    overrides = [
        *SMALL,
        f"trainer.default_local_dir={folder}",
        f"trainer.rollout_data_dir={folder}/rollouts",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=3",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cpu",
        "actor_rollout_ref.actor.skip_on_policy_old_log_prob=false",  # the step-time panel gets a pass to draw
    ]
    out = run_main(overrides, cache_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    return str(folder), out.stdout, out.stderr


def metrics_rows(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_the_console_is_quiet_and_shows_progress_and_validation(real_run):
    folder, stdout, stderr = real_run
    console = stdout + stderr
    # the config goes to the run folder, not to the screen
    assert f"resolved config saved to {folder}/config.yaml" in stdout
    saved = OmegaConf.load(os.path.join(folder, "config.yaml"))
    assert saved.trainer.total_training_steps == STEPS
    assert "ppo_mini_batch_size:" not in console
    # no Ray start-up messages, no worker loading bars
    assert "Started a local Ray instance" not in console
    assert "Loading weights" not in console
    assert "ColocatedWorker" not in console  # nothing at all came from the workers
    # one line per validation, with the value the run logged
    rows = metrics_rows(folder)
    key = "val-core/countdown_add/reward/mean@1"
    first, last = rows[0][key], rows[-1][key]
    assert f"validation at step 0: countdown_add/reward/mean@1 {first:.3f}\n" in console
    assert f"validation at step 3: countdown_add/reward/mean@1 {last:.3f} (step 0: {first:.3f})" in console
    # the bar's last state: all steps, ETA, the last step's reward and time
    final = rows[-1]
    assert (
        f"training {STEPS}/{STEPS} |██████████| [" in stderr
        and f"ETA 00:00, reward {final['critic/score/mean']:.3f}, step {final['timing_s/step']:.2f}s]" in stderr
    )


@pytest.mark.slow
def test_plot_and_report_read_a_real_run(real_run, tmp_path):
    folder = real_run[0]
    rows = [r for r in metrics_rows(folder) if "critic/score/mean" in r]
    fig = make_figure([load_run(folder)])
    train = next(line for line in panel_axes(fig, "reward").get_lines() if line.get_label() == "train score (mean)")
    np.testing.assert_allclose(train.get_ydata(), [r["critic/score/mean"] for r in rows])
    timing = {c.get_label() for c in panel_axes(fig, "step_time").collections}
    assert {"gen", "old_log_prob", "update_actor", "other"} <= timing
    assert panel_axes(fig, "balance").get_lines()  # trainer.balance_batch is on by default
    page = open(report(folder, str(tmp_path / "report.html"))).read()
    assert page.count('class="rollout-step"') == STEPS
    assert page.count('class="sample"') == STEPS * 8
    assert "What is" in page  # the built-in task's prompts


def test_flags_are_taken_out_of_the_overrides(monkeypatch):
    seen = {}
    monkeypatch.setattr(main_ppo, "prepare", lambda overrides: seen.setdefault("overrides", overrides))
    monkeypatch.setattr(main_ppo, "train", lambda run, **flags: seen.setdefault("flags", flags))
    main_ppo.main(["a.b=1", "--verbose", "c=2"])
    assert seen == {"overrides": ["a.b=1", "c=2"], "flags": {"verbose": True, "print_config": False}}
    seen.clear()
    main_ppo.main(["--print-config", "a.b=1"])
    assert seen["flags"] == {"verbose": False, "print_config": True}


def test_an_unknown_flag_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main_ppo.main(["--verbos", "a=1"])
    assert exit_info.value.code == 2
    assert "unknown option --verbos; the options are --verbose, --print-config" in capsys.readouterr().err


class StartedRay(Exception):
    pass


@pytest.mark.parametrize("verbose", [False, True])
def test_workers_are_quiet_unless_verbose(monkeypatch, verbose):
    import logging

    import rlframe.single_controller.ray as ray_controller

    calls = []

    def fake_init_ray(**kwargs):
        calls.append(kwargs)
        raise StartedRay  # nothing past Ray's start is needed here

    monkeypatch.setattr(ray_controller, "init_ray", fake_init_ray)
    cfg, _, _, plan = main_ppo.check_config([*SMALL, "trainer.device=cpu"], check_files=False)
    with pytest.raises(StartedRay):
        launch.create_worker_groups(cfg, plan, 3, verbose=verbose)
    env = calls[0]["runtime_env"]["env_vars"]
    assert env["TOKENIZERS_PARALLELISM"] == "false"  # the workers' own environment is always there
    if verbose:
        assert "HF_HUB_DISABLE_PROGRESS_BARS" not in env and calls[0]["logging_level"] == logging.INFO
    else:
        assert env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and env["TRANSFORMERS_VERBOSITY"] == "error"
        assert calls[0]["logging_level"] == logging.ERROR


def test_a_workers_output_is_prefixed_with_its_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert repr(Worker()) == "Worker rank 3"  # Ray prints "(Worker rank 3 pid=…)" before its lines


def test_validation_line():
    metrics = {"val-core/a/reward/mean@1": 0.25, "val-core/b/reward/mean@4": 0.5, "actor/entropy": 1.0}
    assert format_validation(metrics, 0) == "validation at step 0: a/reward/mean@1 0.250, b/reward/mean@4 0.500"
    first = {"val-core/a/reward/mean@1": (0, 0.125)}
    assert format_validation(metrics, 10, first).startswith("validation at step 10: a/reward/mean@1 0.250 (step 0:")
    assert format_validation({"actor/entropy": 1.0}, 3) is None


def test_console_logger_lines_are_written_above_the_bar(tmp_path, capsys):
    from rlframe.trainer.tracking import Tracking

    tracker = Tracking("p", "e", ["console"], str(tmp_path))
    tracker.log({"critic/score/mean": 0.25, "training/global_step": 3}, step=3)
    tracker.finish()
    assert capsys.readouterr().out == "step:3 - critic/score/mean:0.25 - training/global_step:3\n"
    assert json.loads(open(tmp_path / "metrics.jsonl").read())["critic/score/mean"] == 0.25
