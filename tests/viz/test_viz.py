"""`rlframe plot`, `report` and `compare` on synthetic run folders whose every number is known.

The figures are read back (panel titles, line labels, data points), the report's HTML is parsed,
and one test renders the report in headless Chromium. `test_run_console.py` checks them on a real run.
"""

import base64
import html.parser
import io
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.image import imread
from omegaconf import OmegaConf

from rlframe.trainer.config import compose
from rlframe.viz import compare, plot, report
from rlframe.viz.plot import PANELS, make_figure, panel_axes, smoothed
from rlframe.viz.run import load_run, load_runs

STEPS = 20
PHASES = {"gen": 0.1, "old_log_prob": 0.05, "update_actor": 0.2}


def score(step: int, offset: float) -> float:
    return offset + step / 100


def write_run(folder, offset=0.0, lr="3e-3", balance=True, dynamic=False, rollouts=True):
    """A run folder as the trainer writes it: metrics.jsonl, config.yaml, rollout dumps."""
    os.makedirs(folder, exist_ok=True)
    rollout_dir = os.path.join(folder, "rollouts")
    overrides = [
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "trainer.n_gpus_per_node=2",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"trainer.default_local_dir={folder}",
        f"trainer.rollout_data_dir={rollout_dir if rollouts else 'null'}",
    ]
    config = OmegaConf.to_container(compose(overrides), resolve=True)
    OmegaConf.save(OmegaConf.create(config), os.path.join(folder, "config.yaml"))
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "time": 0.0, "val-core/countdown_add/reward/mean@1": offset}) + "\n")
        for step in range(1, STEPS + 1):
            row = {
                "step": step,
                "critic/score/mean": score(step, offset),
                "response_length/mean": 10.0 + step,
                "response_length/clip_ratio": 0.5 - step / 100,
                "actor/entropy": 6.0 - step / 10,
                "actor/ppo_kl": 0.001 * step,
                "actor/pg_loss": -0.01 * step,
                "actor/pg_clipfrac": 0.02,
                "actor/grad_norm": 1.0 + (step % 3),
                "timing_s/step": 0.4,
                **{f"timing_s/{p}": s for p, s in PHASES.items()},
                "perf/throughput": 1000.0 + step,
            }
            if balance:
                row.update(
                    {
                        "global_seqlen/min": 700 - step,
                        "global_seqlen/max": 800 + step,
                        "global_seqlen/balanced_min": 749,
                        "global_seqlen/balanced_max": 751,
                    }
                )
            if dynamic:
                row["actor/micro_batch/utilization"] = 0.9
            if step % 10 == 0:
                row["val-core/countdown_add/reward/mean@1"] = offset + step / 50
            f.write(json.dumps(row) + "\n")
    if rollouts:
        os.makedirs(rollout_dir)
        for step in (1, 2, 3):
            with open(os.path.join(rollout_dir, f"{step}.jsonl"), "w") as f:
                for i in range(12):
                    sample = {
                        "step": step,
                        "prompt": f"What is {i} + {step}?",
                        "response": f"answer {i + step}\x03<b>",
                        "score": float(i % 2),
                    }
                    f.write(json.dumps(sample) + "\n")
    return str(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return (
        write_run(root / "base"),
        write_run(root / "faster", offset=0.1, lr="1e-3", dynamic=True),
        write_run(root / "plain", balance=False, rollouts=False),
    )


def lines_by_label(ax):
    return {line.get_label(): line for line in ax.get_lines()}


# ───────────────────────────── plot ─────────────────────────────


def test_standard_panels_hold_the_runs_metrics(runs):
    fig = make_figure([load_run(runs[0])])
    assert [ax.get_title() for ax in fig.axes if ax.get_gid() and ":" not in ax.get_gid()] == [p.title for p in PANELS]
    reward = lines_by_label(panel_axes(fig, "reward"))
    train = reward["train score (mean)"]
    assert list(train.get_xdata()) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(train.get_ydata(), [score(s, 0.0) for s in range(1, STEPS + 1)])
    val = reward["validation countdown_add (mean@1)"]
    assert list(val.get_xdata()) == [0, 10, 20] and list(val.get_ydata()) == [0.0, 0.2, 0.4]
    assert panel_axes(fig, "reward").get_xlabel() == "step"
    # the clip ratio is on the response-length panel's second axis
    right = next(ax for ax in fig.axes if ax.get_gid() == "response_length:right")
    np.testing.assert_allclose(
        lines_by_label(right)["clip ratio"].get_ydata(), [0.5 - s / 100 for s in range(1, STEPS + 1)]
    )
    assert set(lines_by_label(panel_axes(fig, "kl"))) == {"ppo_kl (vs rollout policy)"}
    assert set(lines_by_label(panel_axes(fig, "policy_loss"))) == {"pg_loss"}
    balance = lines_by_label(panel_axes(fig, "balance"))
    assert list(balance["before: max"].get_ydata()) == [800 + s for s in range(1, STEPS + 1)]
    assert list(balance["after: min"].get_ydata()) == [749] * STEPS
    notes = [t.get_text() for t in panel_axes(fig, "balance").texts]
    assert any("only with use_dynamic_bsz=true" in n for n in notes)  # this run packed statically


def test_step_time_is_stacked_by_phase_up_to_the_step_time(runs):
    fig = make_figure([load_run(runs[0])])
    ax = panel_axes(fig, "step_time")
    stacks = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert [c.get_label() for c in stacks] == ["gen", "old_log_prob", "update_actor", "other"]
    top = stacks[-1].get_paths()[0].vertices
    for step in range(1, STEPS + 1):
        assert top[np.isclose(top[:, 0], step), 1].max() == pytest.approx(0.4)  # 0.1 + 0.05 + 0.2 + other 0.05
    bottom = stacks[0].get_paths()[0].vertices
    assert bottom[np.isclose(bottom[:, 0], 5), 1].max() == pytest.approx(PHASES["gen"])


def test_several_runs_are_overlaid_in_one_colour_each_and_labelled(runs):
    fig = make_figure(load_runs(list(runs[:2]), labels=["base", "faster"]))
    reward = lines_by_label(panel_axes(fig, "reward"))
    base, faster = reward["base: train score (mean)"], reward["faster: train score (mean)"]
    assert base.get_color() != faster.get_color()
    assert reward["base: validation countdown_add (mean@1)"].get_color() == base.get_color()
    np.testing.assert_allclose(faster.get_ydata(), [score(s, 0.1) for s in range(1, STEPS + 1)])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["base", "faster"]
    # the panel legend names metrics, once each
    legend = [t.get_text() for t in panel_axes(fig, "reward").get_legend().get_texts()]
    assert legend == ["train score (mean)", "validation countdown_add (mean@1)"]
    # step time: one stacked bar per run
    bars = panel_axes(fig, "step_time").patches
    # phase by phase (gen, old_log_prob, update_actor, other), one bar per run
    assert [b.get_height() for b in bars] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.2, 0.2, 0.05, 0.05])
    assert [t.get_text() for t in panel_axes(fig, "step_time").get_xticklabels()] == ["base", "faster"]
    # micro-batch utilization only for the run that packed dynamically
    right = next(ax for ax in fig.axes if ax.get_gid() == "balance:right")
    assert list(lines_by_label(right)) == ["faster: actor micro-batch utilization"]


def test_smoothing_draws_the_trailing_mean_over_the_raw_points(runs):
    fig = make_figure([load_run(runs[0])], smooth=4)
    grad = lines_by_label(panel_axes(fig, "grad_norm"))
    raw = np.array([1.0 + (s % 3) for s in range(1, STEPS + 1)])
    np.testing.assert_allclose(grad["_raw actor"].get_ydata(), raw)
    expected = [raw[max(0, i - 3) : i + 1].mean() for i in range(STEPS)]
    np.testing.assert_allclose(grad["actor"].get_ydata(), expected)
    val = lines_by_label(panel_axes(fig, "reward"))["validation countdown_add (mean@1)"]
    assert list(val.get_ydata()) == [0.0, 0.2, 0.4]  # sparse validation points are never smoothed
    assert "trailing mean over 4 steps" in fig.get_suptitle()
    np.testing.assert_allclose(smoothed(np.array([1.0, np.nan, 3.0, 5.0]), 2), [1.0, np.nan, 2.0, 4.0])


def test_metric_patterns_choose_the_panels(runs):
    fig = make_figure([load_run(runs[0])], patterns=["actor/pg_*", "perf/*"])
    names = [ax.get_title() for ax in fig.axes]
    assert names == ["actor/pg_clipfrac", "actor/pg_loss", "perf/throughput"]
    np.testing.assert_allclose(lines_by_label(fig.axes[2])["perf/throughput"].get_ydata()[:2], [1001.0, 1002.0])
    with pytest.raises(ValueError, match=r"--metrics nope/\* matches no metric.*actor/entropy"):
        make_figure([load_run(runs[0])], patterns=["nope/*"])


def test_a_panel_without_data_says_which_metrics_it_needs(runs):
    fig = make_figure([load_run(runs[2])])
    texts = [t.get_text() for t in panel_axes(fig, "balance").texts]
    assert any("no data: global_seqlen/max" in t and "trainer.balance_batch=true" in t for t in texts)
    assert not panel_axes(fig, "balance").get_lines()


def test_plot_command_writes_the_png_and_says_where(runs, tmp_path, capsys):
    out = tmp_path / "curves" / "both.png"
    assert plot.main([runs[0], runs[1], "-o", str(out), "--smooth", "3"]) == 0
    assert capsys.readouterr().out.strip() == f"curves written to {out}"
    image = imread(out)
    assert image.shape[:2] == (3 * 380, 3 * 540)  # 3x3 panels of 5.4 x 3.8 inches at 100 dpi
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 50  # drawn, not blank
    assert plot.main([runs[0]]) == 0
    assert os.path.isfile(os.path.join(runs[0], "curves.png"))


def test_a_folder_without_metrics_is_refused_by_name(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{str(tmp_path)!r} is not a run folder (no metrics.jsonl in it)" in err


def test_a_resumed_run_keeps_the_last_write_of_a_step_and_a_partial_last_line_is_skipped(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write('{"step": 1, "actor/entropy": 5.0, "x": 1}\n{"step": 2, "actor/entropy": 4.0}\n')
        f.write('{"step": 2, "actor/entropy": 3.0}\n{"step": 3, "actor/entropy": "nan"}\n{"step": 4, "act')
    run = load_run(str(tmp_path))
    steps, values = run.series("actor/entropy")
    assert list(steps) == [1, 2, 3] and values[:2].tolist() == [5.0, 3.0] and np.isnan(values[2])
    assert run.config is None


# ───────────────────────────── compare ─────────────────────────────


def test_compare_prints_the_differing_keys_and_final_and_best_metrics(runs, capsys):
    assert compare.main([runs[0], runs[1]]) == 0
    out = capsys.readouterr().out
    config_part, metrics_part = out.split("metrics (final")
    diff_lines = [line.split()[0] for line in config_part.splitlines()[5:] if line.strip()]
    assert diff_lines == [
        "actor_rollout_ref.actor.optim.lr",
        "trainer.default_local_dir",
        "trainer.rollout_data_dir",
    ]
    assert "3 key(s) differ" in config_part
    rows = {line.split()[0]: line.split() for line in metrics_part.splitlines()[2:]}
    # A final, A last-10, A best (step), B final, B last-10, B best (step)
    assert rows["critic/score/mean"][1:] == ["0.2", "0.155", "0.2", "(20)", "0.3", "0.255", "0.3", "(20)"]
    assert rows["val-core/countdown_add/reward/mean@1"][1] == "0.4"
    assert rows["actor/entropy"][3] == "—"  # entropy has no better direction
    assert rows["timing_s/step"][3:5] == ["0.4", "(1)"]  # the first of equal minima
    assert "actor/kl_loss" not in rows  # neither run logged it


def test_compare_with_metric_patterns(runs):
    text = compare.compare(runs[0], runs[1], ["actor/pg_*"])
    metric_rows = text.split("metrics (final")[1].splitlines()[2:]
    assert [row.split()[0] for row in metric_rows] == ["actor/pg_clipfrac", "actor/pg_loss"]


# ───────────────────────────── report ─────────────────────────────


class DomIndex(html.parser.HTMLParser):
    """Elements by id and class, the text under each id, and every image source."""

    def __init__(self):
        super().__init__()
        self.ids, self.classes, self.images, self.text = {}, {}, [], {}
        self.stack = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids[attrs["id"]] = attrs
        for name in (attrs.get("class") or "").split():
            self.classes.setdefault(name, []).append(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        if tag not in ("img", "meta", "br"):
            self.stack.append(attrs.get("id"))

    def handle_endtag(self, tag):
        if tag not in ("img", "meta", "br") and self.stack:
            self.stack.pop()

    def handle_data(self, data):
        for element_id in filter(None, self.stack):
            self.text[element_id] = self.text.get(element_id, "") + data


def parse(page: str) -> DomIndex:
    dom = DomIndex()
    dom.feed(page)
    return dom


def check_report_dom(page: str) -> None:
    """What a report of runs[0] must hold, whether parsed from the file or dumped by a browser."""
    dom = parse(page)
    assert [f"panel-{p.name}" for p in PANELS] == [i for i in dom.ids if i.startswith("panel-")]
    assert len(dom.images) == len(PANELS)
    for src in dom.images:
        assert src.startswith("data:image/png;base64,")
        png = imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")
        assert png.shape[:2] == (342, 486)  # 5.4 x 3.8 inches at 90 dpi
    assert dom.ids["panel-reward"]["data-metrics"] == "2"
    assert "critic/score/mean" in dom.text["panel-reward"]
    assert "actor_rollout_ref.actor.optim.lr1e-060.003" in dom.text["config-diff"].replace(" ", "")
    assert "${actor_rollout_ref.actor.ppo_mini_batch_size} = 256" in dom.text["config-diff"]
    assert "train_batch_size 8 prompts × n 4 = 32 sequences" in dom.text["batch-plan"]
    steps = dom.classes["rollout-step"]
    assert [s["data-step"] for s in steps] == ["1", "2", "3"] and "open" in steps[-1]
    assert len(dom.classes["sample"]) == 3 * 8  # 8 of the 12 samples of each step
    rollouts = dom.text["rollouts"]
    assert "step 2: 12 samples, mean score 0.5 (showing 8)" in rollouts
    assert "What is 0 + 1?" in rollouts and "What is 11 + 3?" in rollouts  # the first and last are shown
    assert "answer 4\\x03<b>" in rollouts  # control bytes shown as escapes, markup as text
    assert "val-core/countdown_add/reward/mean@1: 0 at step 0 → 0.4 at step 20" in dom.text["summary"]


def test_report_holds_panels_config_plan_and_samples(runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert report.main([runs[0], "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"report written to {out}"
    page = out.read_text()
    check_report_dom(page)
    assert "http://" not in page and "https://" not in page and "<script" not in page  # nothing fetched
    assert "answer 4\\x03&lt;b&gt;" in page  # a response's markup is escaped, not rendered


def test_report_says_why_there_are_no_samples(runs, tmp_path):
    out = tmp_path / "plain.html"
    assert report.main([runs[2], "-o", str(out)]) == 0
    dom = parse(out.read_text())
    assert "did not set trainer.rollout_data_dir" in dom.text["no-rollouts"]
    assert dom.ids["panel-balance"]["data-metrics"] == "0"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install chromium)")
def test_report_renders_in_headless_chromium(runs, tmp_path):
    page = tmp_path / "report.html"
    assert report.main([runs[0], "-o", str(page)]) == 0
    screenshot = tmp_path / "report.png"
    # a copy with a load hook records each image's decoded width (the report itself has no script)
    probe = tmp_path / "probe.html"
    hook = (
        "<script>window.addEventListener('load', () => document.querySelectorAll('img')"
        ".forEach(i => i.setAttribute('data-decoded-width', i.naturalWidth)));</script>"
    )
    probe.write_text(page.read_text().replace("</body>", hook + "</body>"))
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,2400"]
    shot = subprocess.run(
        [*flags, f"--screenshot={screenshot}", page.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert shot.returncode == 0, shot.stderr
    dumped = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert dumped.returncode == 0, dumped.stderr
    check_report_dom(dumped.stdout)
    widths = [a.get("data-decoded-width") for a in parse(dumped.stdout).classes.get("panel", [])]
    assert dumped.stdout.count('data-decoded-width="486"') == len(PANELS), widths
    image = imread(screenshot)
    assert image.shape[:2] == (2400, 1280)
    pixels = image[..., :3].reshape(-1, 3)
    assert (pixels < 0.9).any(axis=1).mean() > 0.05  # a fair share of the page is drawn on
    assert len(np.unique((pixels * 255).astype(np.uint8), axis=0)) > 200  # the panels' colours, not one flat fill
    print(f"screenshot: {screenshot}")


def test_the_rlframe_command_dispatches_the_three_commands(runs, tmp_path, capsys):
    from rlframe import cli

    assert cli.main(["compare", runs[0], runs[1], "--metrics", "actor/entropy"]) == 0
    assert "actor/entropy" in capsys.readouterr().out
    assert cli.main(["plot", runs[0], "-o", str(tmp_path / "c.png")]) == 0
    assert cli.main(["report", runs[0], "-o", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0 and "panel-balance" in (tmp_path / "r.html").read_text()
    capsys.readouterr()
    cli.main(["--help"])
    usage = capsys.readouterr().out
    assert all(f"\n  {name} RUN_" in usage for name in ("plot", "report", "compare"))


def test_a_relative_rollout_dir_is_found_from_where_the_run_started(tmp_path, monkeypatch):
    run_dir = tmp_path / "checkpoints" / "exp"
    os.makedirs(run_dir / "rollouts")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    OmegaConf.save(
        OmegaConf.create(
            {"trainer": {"default_local_dir": "checkpoints/exp", "rollout_data_dir": "checkpoints/exp/rollouts"}}
        ),
        run_dir / "config.yaml",
    )
    monkeypatch.chdir(tmp_path)  # where the run started
    assert load_run("checkpoints/exp").rollout_dir() == "checkpoints/exp/rollouts"
    monkeypatch.chdir(run_dir)  # elsewhere: found through the run folder's path
    assert load_run(str(run_dir)).rollout_dir() == os.path.join(str(tmp_path) + os.sep, "checkpoints/exp/rollouts")
