"""Learning regression: the built-in GRPO run's smoothed curves stay in the band of the recorded runs.

The baseline (tests/assets/learning/grpo_add_digits_tiny.json, written by
scripts/record_learning_baseline.py) holds the per-step curves of one run per `data.seed`. The
test repeats the reference seed's run and compares window means: on the recording machine the run
is bitwise the same as the recorded one, elsewhere float noise sends it down another, equally
valid trajectory, so the band is built from the spread across seeds (docs/learning_baseline.md).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_recorder():
    """scripts/record_learning_baseline.py: the one place the baseline config and the curve reader live."""
    path = os.path.join(ROOT, "scripts", "record_learning_baseline.py")
    spec = importlib.util.spec_from_file_location("record_learning_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recorder = _load_recorder()

# Each window's band is the recorded seeds' range widened on both sides by ENVELOPE_MARGIN times its
# width (at least MIN_MARGIN). On the earlier baseline (countdown_add, 12 seeds) margin 2 held 8
# held-out seeds while broken configs failed; the add_digits runs spread more (docs/learning_baseline.md).
ENVELOPE_MARGIN = 2.0
# Floors where every seed agrees closely (the first window, before trajectories diverge).
MIN_MARGIN = {
    "critic/score/mean": 0.02,
    "reward/acc/mean": 0.02,
    "actor/pg_loss": 0.01,
    "actor/grad_norm": 0.1,
    "actor/entropy": 0.1,
    "response_length/mean": 0.25,
}
RANDOM_POLICY_REWARD = 0.009  # untrained tiny-quickstart model, scripts/measure_random_baseline.py (README)
# The recorded seeds gain 0.18-0.21 from the first 25-step window to the sixth; a run that does not
# learn stays near the random policy's reward (docs/learning_baseline.md).
MIN_REWARD_GAIN = 0.05


def load_baseline() -> dict:
    """The recorded baseline file (tests/assets/learning/grpo_add_digits_tiny.json)."""
    with open(recorder.BASELINE_PATH) as f:
        return json.load(f)


def seed_bands(runs: dict, metric: str, window: int) -> list[tuple[float, float]]:
    """Per window: the recorded seeds' range of window means, widened by ENVELOPE_MARGIN × its width."""
    per_seed = [recorder.window_means(curves[metric], window) for curves in runs.values()]
    bands = []
    for column in zip(*per_seed):
        margin = max(ENVELOPE_MARGIN * (max(column) - min(column)), MIN_MARGIN[metric])
        bands.append((min(column) - margin, max(column) + margin))
    return bands


def comparison(metric: str, window: int, run: list[float], reference: list[float], bands) -> str:
    """Window means of this run and of the recorded reference run side by side, with the band."""
    lines = [f"{metric} (means over {window} steps)", "  steps      this run   reference   band"]
    for i, (mine, ref, (low, high)) in enumerate(zip(run, reference, bands)):
        flag = "" if low <= mine <= high else "   <-- outside the band"
        lines.append(
            f"  {i * window + 1:3d}-{(i + 1) * window:<3d}  {mine:10.4f}  {ref:10.4f}   [{low:.4f}, {high:.4f}]{flag}"
        )
    return "\n".join(lines)


def test_seed_bands_widen_the_seed_range():
    runs = {"1": {"actor/pg_loss": [0.0, 0.2, 1.0, 1.0]}, "2": {"actor/pg_loss": [0.1, 0.1, 1.0, 1.0]}}
    # windows of 2: seed 1 -> [0.1, 1.0], seed 2 -> [0.1, 1.0]; first window: range 0 -> the floor
    assert seed_bands(runs, "actor/pg_loss", 2) == [(0.1 - 0.01, 0.1 + 0.01), (1.0 - 0.01, 1.0 + 0.01)]
    runs["2"]["actor/pg_loss"] = [0.3, 0.3, 1.0, 1.0]
    low, high = seed_bands(runs, "actor/pg_loss", 2)[0]
    assert low == pytest.approx(0.1 - 2 * 0.2) and high == pytest.approx(0.3 + 2 * 0.2)


def test_baseline_file_matches_the_recording_config():
    baseline = load_baseline()
    fix = "re-record it: python scripts/record_learning_baseline.py (docs/learning_baseline.md)"
    assert baseline["overrides"] == recorder.OVERRIDES, (
        f"{recorder.BASELINE_PATH} was recorded with another config; {fix}"
    )
    assert baseline["reference_seed"] == recorder.REFERENCE_SEED, fix
    assert baseline["window"] == recorder.WINDOW and baseline["num_steps"] == recorder.NUM_STEPS, fix
    assert str(recorder.REFERENCE_SEED) in baseline["runs"] and len(baseline["runs"]) >= 4, (
        f"the band needs the reference seed and at least 3 more; {fix}"
    )
    for seed, curves in baseline["runs"].items():
        assert sorted(curves) == sorted(recorder.CURVE_METRICS), (seed, fix)
        assert all(len(values) == recorder.NUM_STEPS for values in curves.values()), (seed, fix)


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory) -> dict[str, list[float]]:
    """The reference seed's run of the baseline config, with its own model and data cache."""
    tmp = tmp_path_factory.mktemp("learning_baseline")
    result = recorder.run_config(
        str(tmp / "run"),
        recorder.REFERENCE_SEED,
        env={"RLFRAME_CACHE": str(tmp / "cache"), "RAY_DEDUP_LOGS": "0"},
        timeout_s=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return recorder.read_curves(str(tmp / "run"))


@pytest.mark.slow
def test_grpo_learning_curves_stay_in_the_baseline_band(baseline_run):
    baseline = load_baseline()
    window, runs = baseline["window"], baseline["runs"]
    reference = runs[str(baseline["reference_seed"])]
    failures = []
    for metric in recorder.CURVE_METRICS:
        bands = seed_bands(runs, metric, window)
        mine = recorder.window_means(baseline_run[metric], window)
        if any(not low <= value <= high for value, (low, high) in zip(mine, bands)):
            failures.append(comparison(metric, window, mine, recorder.window_means(reference[metric], window), bands))
    if failures:
        pytest.fail(
            "the run's smoothed curves left the band of the recorded seeds; if the change is meant to alter "
            "learning, re-record with `python scripts/record_learning_baseline.py` "
            f"(docs/learning_baseline.md)\nrecorded with {baseline['versions']}; this run bitwise equal to "
            f"the recorded reference run: {baseline_run == reference}\n" + "\n".join(failures),
            pytrace=False,
        )


@pytest.mark.slow
def test_grpo_learns_beyond_the_random_policy(baseline_run):
    baseline = load_baseline()
    window, metric = baseline["window"], "critic/score/mean"
    reward = recorder.window_means(baseline_run[metric], window)
    reference = recorder.window_means(baseline["runs"][str(baseline["reference_seed"])][metric], window)
    table = comparison(metric, window, reward, reference, seed_bands(baseline["runs"], metric, window))
    assert reward[-1] >= reward[0] + MIN_REWARD_GAIN, f"reward gained less than {MIN_REWARD_GAIN}:\n{table}"
    assert reward[-1] >= RANDOM_POLICY_REWARD + MIN_REWARD_GAIN, (
        f"last-window reward not clearly above the random policy's {RANDOM_POLICY_REWARD}:\n{table}"
    )


def test_readme_shows_the_recorded_quickstart_run():
    with open(recorder.QUICKSTART_RUN_PATH) as f:
        run = json.load(f)
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = recorder.quickstart_table(run)
    assert table in readme, f"README.md's quickstart table is not the recorded run's; it should read:\n{table}"
    # what the README says of that run: exact answers from none to most, sampled and greedy
    window = recorder.QUICKSTART_WINDOW
    assert recorder.window_means(run["acc"], window)[0] <= 0.01 and recorder.window_means(run["acc"], window)[-1] >= 0.8
    assert run["validation"]["0"] <= 0.05 and run["validation"][str(len(run["acc"]))] >= 0.8
