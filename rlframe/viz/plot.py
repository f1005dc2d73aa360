"""`rlframe plot RUN_DIR [RUN_DIR ...]`: the standard panels of one or more runs, overlaid, in one PNG.

Each panel draws metrics under verl's names from the runs' `metrics.jsonl`. With one run every
line has its own colour; with several, a run keeps one colour in every panel and a metric keeps
one line style, so "which run" is the colour and "which metric" the style. A metric a run did not
log is left out of that run's lines; a panel no run has data for says so instead of staying blank.
Figures are built with matplotlib's object API (no pyplot state), so tests can read them back.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass

import numpy as np
from matplotlib.lines import Line2D

from rlframe.viz.run import Run, load_runs

# Step phases of `timing_s/*`, stacked bottom to top; "other" is the rest of timing_s/step
# (balance, reward, advantages: driver work) so the stack's top is the step time.
TIME_PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")
STYLES = ("-", "--", ":", "-.")
# phases get their own palette: run colours are C0, C1, ... and must not be mistaken for a phase
PHASE_COLORS = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#b3b3b3")


@dataclass(frozen=True)
class Line:
    """One metric (or a glob of metrics) drawn in a panel; `label` may use `{0}` for the first `*`."""

    pattern: str
    label: str
    right: bool = False  # on the panel's second y axis
    smooth: bool = True  # sparse series (validation) are drawn as points, never smoothed
    marker: str | None = None


@dataclass(frozen=True)
class Panel:
    """A subplot: a name (its id in reports), a title, axis labels and what it draws."""

    name: str
    title: str
    ylabel: str
    lines: tuple[Line, ...] = ()
    right_label: str | None = None
    kind: str = "lines"  # "lines" | "step_time" | "balance"
    note: str = ""  # said when no run has data for the panel

    def keys(self) -> list[str]:
        """The metric names (or globs) this panel reads."""
        if self.kind == "step_time":
            return ["timing_s/step", *(f"timing_s/{p}" for p in TIME_PHASES)]
        return [line.pattern for line in self.lines]


BALANCE_LINES = (
    Line("global_seqlen/max", "before: max"),
    Line("global_seqlen/min", "before: min"),
    Line("global_seqlen/balanced_max", "after: max"),
    Line("global_seqlen/balanced_min", "after: min"),
    Line("actor/micro_batch/utilization", "actor micro-batch utilization", right=True),
    Line("critic/micro_batch/utilization", "critic micro-batch utilization", right=True),
)

PANELS = (
    Panel(
        "reward",
        "training reward and validation score",
        "score",
        (
            Line("critic/score/mean", "train score (mean)"),
            Line("val-core/*/reward/mean@*", "validation {0} (mean@{1})", smooth=False, marker="o"),
        ),
    ),
    Panel(
        "response_length",
        "response length",
        "tokens",
        (Line("response_length/mean", "mean length"), Line("response_length/clip_ratio", "clip ratio", right=True)),
        right_label="share at max length",
    ),
    Panel("entropy", "entropy", "nats per token", (Line("actor/entropy", "actor entropy"),)),
    Panel(
        "kl",
        "KL",
        "KL",
        (
            Line("actor/kl_loss", "kl_loss (vs reference)"),
            Line("actor/reward_kl_penalty", "KL penalty in reward"),
            Line("actor/ppo_kl", "ppo_kl (vs rollout policy)"),
        ),
    ),
    Panel(
        "policy_loss",
        "policy loss and clip fraction",
        "pg_loss",
        (Line("actor/pg_loss", "pg_loss"), Line("actor/pg_clipfrac", "clip fraction", right=True)),
        right_label="clip fraction",
    ),
    Panel(
        "grad_norm",
        "gradient norm (before clipping)",
        "norm",
        (Line("actor/grad_norm", "actor"), Line("critic/grad_norm", "critic")),
    ),
    Panel("step_time", "step time by phase", "seconds", kind="step_time"),
    Panel(
        "balance",
        "tokens per DP rank before/after balancing",
        "tokens per rank",
        BALANCE_LINES,
        right_label="micro-batch utilization",
        kind="balance",
        note="needs trainer.balance_batch=true",
    ),
)
UTILIZATION_NOTE = "micro-batch utilization: only with use_dynamic_bsz=true"


# ───────────────────────────── drawing ─────────────────────────────


def smoothed(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` finite points (fewer at the start); non-finite points stay gaps."""
    out = np.full(values.shape, np.nan)
    ok = np.isfinite(values)
    kept = values[ok]
    if window <= 1 or kept.size == 0:
        return np.where(ok, values, np.nan)
    sums = np.cumsum(np.concatenate([[0.0], kept]))
    idx = np.arange(1, kept.size + 1)
    start = np.maximum(idx - window, 0)
    out[ok] = (sums[idx] - sums[start]) / (idx - start)
    return out


def _glob_groups(pattern: str, key: str) -> tuple[str, ...]:
    regex = "".join("(.*?)" if ch == "*" else re.escape(ch) for ch in pattern)
    match = re.fullmatch(regex, key)
    return match.groups() if match else ()


def _expand(line: Line, run: Run) -> list[tuple[str, str]]:
    """(metric name, legend label) for each metric of `run` the line names."""
    if "*" not in line.pattern:
        return [(line.pattern, line.label)] if run.has(line.pattern) else []
    return [(key, line.label.format(*_glob_groups(line.pattern, key))) for key in run.matching(line.pattern)]


def _color(run_index: int, line_index: int, num_runs: int) -> str:
    return f"C{(line_index if num_runs == 1 else run_index) % 10}"


def _style(line_index: int, num_runs: int) -> str:
    return "-" if num_runs == 1 else STYLES[line_index % len(STYLES)]


def _label(run: Run, label: str, num_runs: int) -> str:
    return label if num_runs == 1 else f"{run.label}: {label}"


def _draw_series(ax, steps, values, *, label, color, style, marker, smooth: int) -> None:
    values = np.where(np.isfinite(values), values, np.nan)
    if smooth > 1 and marker is None:
        ax.plot(steps, values, color=color, linestyle=style, alpha=0.25, linewidth=1, label="_raw " + label)
        values = smoothed(values, smooth)
    ax.plot(steps, values, color=color, linestyle=style, marker=marker, markersize=4, linewidth=1.5, label=label)


def _draw_lines(ax, panel: Panel, runs: list[Run], smooth: int) -> tuple[int, object]:
    """Every line of every run; returns (how many series were drawn, the second y axis or None)."""
    right = None
    drawn = 0
    for r, run in enumerate(runs):
        for i, line in enumerate(panel.lines):
            target = ax
            if line.right and run.has_any(line.pattern):
                if right is None:
                    right = ax.twinx()
                    right.set_gid(panel.name + ":right")
                target = right
            for key, label in _expand(line, run):
                steps, values = run.series(key)
                _draw_series(
                    target,
                    steps,
                    values,
                    label=_label(run, label, len(runs)),
                    color=_color(r, i, len(runs)),
                    style=_style(i, len(runs)),
                    marker=line.marker,
                    smooth=smooth if line.smooth else 1,
                )
                drawn += 1
    if right is not None:
        right.set_ylabel(panel.right_label or "")
    return drawn, right


def _phase_series(run: Run) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(steps, {phase: seconds}) of the run's training steps, with "other" making up timing_s/step."""
    steps, total = run.series("timing_s/step")
    index = {int(s): i for i, s in enumerate(steps)}
    phases: dict[str, np.ndarray] = {}
    for phase in TIME_PHASES:
        if not run.has(f"timing_s/{phase}"):
            continue
        values = np.zeros(len(steps))
        for s, v in zip(*run.series(f"timing_s/{phase}")):
            if int(s) in index:
                values[index[int(s)]] = v
        phases[phase] = values
    phases["other"] = np.maximum(total - sum(phases.values(), np.zeros(len(steps))), 0.0)
    return steps, phases


def _phase_color(phase: str) -> str:
    return PHASE_COLORS[(*TIME_PHASES, "other").index(phase)]


def _draw_step_time(ax, runs: list[Run], smooth: int) -> int:
    """One run: phases stacked over steps. Several: one stacked bar per run (median seconds per phase)."""
    timed = [run for run in runs if run.has("timing_s/step")]
    if len(runs) == 1 and timed:
        steps, phases = _phase_series(timed[0])
        stacks = [smoothed(v, smooth) for v in phases.values()]
        ax.stackplot(steps, *stacks, labels=list(phases), colors=[_phase_color(p) for p in phases], alpha=0.8)
        return len(phases)
    names = [p for p in (*TIME_PHASES, "other") if any(p in _phase_series(run)[1] for run in timed)]
    bottoms = np.zeros(len(timed))
    for phase in names:
        heights = np.array([float(np.median(_phase_series(run)[1].get(phase, [0.0]))) for run in timed])
        ax.bar([run.label for run in timed], heights, bottom=bottoms, label=phase, color=_phase_color(phase))
        bottoms += heights
    if timed:
        ax.set_ylabel("median seconds per step")
        ax.tick_params(axis="x", labelrotation=15)
    return len(names) if timed else 0


def _draw_balance(ax, panel: Panel, runs: list[Run], smooth: int) -> tuple[int, object]:
    drawn, right = _draw_lines(ax, panel, runs, smooth)
    if right is None:
        ax.text(0.02, 0.02, UTILIZATION_NOTE, transform=ax.transAxes, fontsize=7, color="0.4")
    return drawn, right


def draw_panel(ax, panel: Panel, runs: list[Run], smooth: int = 1) -> int:
    """Draw `panel` for `runs` on `ax`; returns the number of series (0: a 'no data' note is drawn)."""
    right = None
    if panel.kind == "step_time":
        drawn = _draw_step_time(ax, runs, smooth)
    elif panel.kind == "balance":
        drawn, right = _draw_balance(ax, panel, runs, smooth)
    else:
        drawn, right = _draw_lines(ax, panel, runs, smooth)
    ax.set_title(panel.title, fontsize=10)
    if panel.kind != "step_time" or len(runs) == 1:
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if drawn == 0:
        reason = f"no data: {', '.join(panel.keys())}" + (f"\n({panel.note})" if panel.note else "")
        ax.text(0.5, 0.5, reason, transform=ax.transAxes, ha="center", va="center", fontsize=7, wrap=True)
    else:
        _legend(ax, right, runs)
    return drawn


def _legend(ax, right, runs: list[Run]) -> None:
    """One legend per panel, with the second y axis's lines; with several runs it names metrics only
    (drawn in grey in their line style), the figure's legend names the runs by colour."""
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if len(runs) > 1 and all(isinstance(h, Line2D) for h in handles):
        by_metric: dict[str, Line2D] = {}
        for handle, label in zip(handles, labels):
            metric = label.split(": ", 1)[1] if ": " in label else label
            if metric not in by_metric:
                by_metric[metric] = Line2D(
                    [], [], color="0.3", linestyle=handle.get_linestyle(), marker=handle.get_marker()
                )
        handles, labels = list(by_metric.values()), list(by_metric)
    ax.legend(handles, labels, fontsize=7, loc="best")


def _runs_legend(fig, runs: list[Run]) -> None:
    """With several runs: which colour is which run, once for the whole figure."""
    handles = [Line2D([], [], color=_color(r, 0, len(runs)), linewidth=3) for r in range(len(runs))]
    fig.legend(handles, [run.label for run in runs], loc="outside lower center", ncols=min(len(runs), 4))


def metric_panels(runs: list[Run], patterns: list[str]) -> tuple[Panel, ...]:
    """One panel per metric any run logged that matches one of `patterns` (shell-style globs)."""
    keys = sorted({k for run in runs for p in patterns for k in run.matching(p)})
    if not keys:
        known = sorted({k for run in runs for k in run.keys()})
        raise ValueError(
            f"--metrics {','.join(patterns)} matches no metric of these runs; they log e.g. "
            f"{', '.join(known[:12])}{', …' if len(known) > 12 else ''} (shell-style patterns: actor/*, *loss*)"
        )
    return tuple(Panel(key, key, key.rsplit("/", 1)[-1], (Line(key, key),)) for key in keys)


def make_figure(runs: list[Run], smooth: int = 1, patterns: list[str] | None = None, panels=None):
    """The figure of `panels` (the standard ones, or one per metric matching `patterns`) for `runs`."""
    from matplotlib.figure import Figure

    if smooth < 1:
        raise ValueError(f"--smooth {smooth}: give a window of 1 (no smoothing) or more steps")
    panels = panels or (metric_panels(runs, patterns) if patterns else PANELS)
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(5.4 * cols, 3.8 * rows), layout="constrained")
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.set_gid(panel.name)  # lets tests and reports find a panel by name
        draw_panel(ax, panel, runs, smooth)
    title = run_title(runs)
    fig.suptitle(title + (f"   (trailing mean over {smooth} steps)" if smooth > 1 else ""), fontsize=11)
    if len(runs) > 1:
        _runs_legend(fig, runs)
    return fig


def run_title(runs: list[Run]) -> str:
    """The figure's title: the run's label, or how many runs are compared."""
    return runs[0].label if len(runs) == 1 else f"{len(runs)} runs"


def panel_axes(fig, name: str):
    """The main axes of the panel called `name` in a figure from `make_figure`."""
    return next(ax for ax in fig.axes if ax.get_gid() == name)


def plot(paths: list[str], out: str, smooth: int = 1, patterns=None, labels=None) -> str:
    """Write the PNG of runs `paths` to `out`; returns the path written."""
    runs = load_runs(paths, labels)
    fig = make_figure(runs, smooth, patterns)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def split_patterns(values: list[str] | None) -> list[str] | None:
    """`--metrics a,b --metrics c` → [a, b, c]."""
    if not values:
        return None
    return [p.strip() for value in values for p in value.split(",") if p.strip()]


def main(argv: list[str] | None = None) -> int:
    """Entry of `rlframe plot RUN_DIR [RUN_DIR ...] [-o OUT.png] [--smooth N] [--metrics PATTERN]`."""
    parser = argparse.ArgumentParser(
        prog="rlframe plot",
        description="Plot the standard panels (reward and validation, response length, entropy, KL, policy loss "
        "and clip fraction, grad norm, step time by phase, balancing) of one or more run folders, overlaid.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (trainer.default_local_dir)")
    parser.add_argument("-o", "--out", help="PNG to write (default: RUN_DIR/curves.png of the first run)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N", help="trailing mean over N steps (default 1)")
    parser.add_argument(
        "--metrics",
        action="append",
        metavar="PATTERN",
        help="instead of the standard panels, one panel per metric matching PATTERN (shell-style, e.g. 'actor/*'; "
        "comma-separated or repeated)",
    )
    parser.add_argument("--labels", help="comma-separated legend names, one per run (default: folder names)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.runs[0], "curves.png")
    labels = args.labels.split(",") if args.labels else None
    try:
        written = plot(args.runs, out, args.smooth, split_patterns(args.metrics), labels)
    except ValueError as err:
        print(f"rlframe plot: error: {err}", file=sys.stderr)
        return 2
    print(f"curves written to {written}")
    return 0
