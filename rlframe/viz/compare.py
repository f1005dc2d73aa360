"""`rlframe compare RUN_A RUN_B`: the config keys that differ, and the final and best metrics side by side.

"final" is the value at the last step that logged the metric, "last-10" the mean over the last ten
such steps (one noisy step decides less), "best" the maximum for scores and throughput and the
minimum for times; metrics with no better direction (entropy, KL, losses) have no "best".
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from rlframe.config.loader import leaves
from rlframe.viz.plot import split_patterns
from rlframe.viz.run import Run, finite, fmt, load_runs

# The metrics compared by default, each with the direction that makes it better (None: neither).
DEFAULT_METRICS = (
    ("critic/score/mean", max),
    ("val-core/*", max),
    ("response_length/mean", None),
    ("response_length/clip_ratio", None),
    ("actor/entropy", None),
    ("actor/pg_loss", None),
    ("actor/pg_clipfrac", None),
    ("actor/ppo_kl", None),
    ("actor/kl_loss", None),
    ("actor/grad_norm", None),
    ("critic/vf_loss", None),
    ("critic/vf_explained_var", max),
    ("timing_s/step", min),
    ("perf/throughput", max),
)
LAST_WINDOW = 10


def config_differences(a: Run, b: Run) -> list[tuple[str, object, object]]:
    """(key, value in a, value in b) for every config leaf that differs; '<absent>' where a run lacks it."""
    if a.config is None or b.config is None:
        missing = a if a.config is None else b
        raise ValueError(f"{missing.path!r} has no config.yaml; compare needs both runs' resolved configs")
    left, right = leaves(a.config), leaves(b.config)
    absent = "<absent>"
    return [
        (key, left.get(key, absent), right.get(key, absent))
        for key in sorted(set(left) | set(right))
        if left.get(key, absent) != right.get(key, absent)
    ]


def _direction(key: str, patterns: list[str] | None):
    for pattern, direction in DEFAULT_METRICS:
        if key == pattern or (pattern.endswith("*") and key.startswith(pattern[:-1])):
            return direction
    if patterns:  # a metric asked for by pattern: scores and rewards are better higher
        return max if any(word in key for word in ("score", "reward", "acc")) else None
    return None


def summary(run: Run, key: str, direction) -> dict:
    """final, last-10 mean and best (with its step) of one metric of one run; empty if it never logged it."""
    steps, values = run.series(key)
    ok = np.isfinite(values)
    if not ok.any():
        return {}
    steps, values = steps[ok], values[ok]
    out = {"final": float(values[-1]), "last": float(np.mean(values[-LAST_WINDOW:]))}
    if direction is not None:
        index = int(np.argmax(values) if direction is max else np.argmin(values))
        out["best"], out["best_step"] = float(values[index]), int(steps[index])
    return out


def compared_metrics(runs: list[Run], patterns: list[str] | None) -> list[str]:
    """The metric names in the table: those matching `patterns`, or the default list, as logged by either run."""
    wanted = patterns or [pattern for pattern, _ in DEFAULT_METRICS]
    keys: list[str] = []
    for pattern in wanted:
        for key in sorted({k for run in runs for k in run.matching(pattern)}):
            if key not in keys:
                keys.append(key)
    return keys


def _table(rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, numbers right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(line.rstrip() for line in lines)


def metrics_table(a: Run, b: Run, patterns: list[str] | None = None) -> str:
    """The final / last-10 / best table of the two runs, one row per metric."""
    keys = compared_metrics([a, b], patterns)
    if not keys:
        raise ValueError(f"no metric of {a.path!r} or {b.path!r} matches {', '.join(patterns or [])}")
    header = ["metric"]
    for tag in ("A", "B"):
        header += [f"{tag} final", f"{tag} last-{LAST_WINDOW}", f"{tag} best (step)"]
    rows = [header]
    for key in keys:
        direction = _direction(key, patterns)
        row = [key]
        for run in (a, b):
            s = summary(run, key, direction)
            best = f"{fmt(s['best'])} ({s['best_step']})" if "best" in s else "—"
            row += [fmt(s.get("final")), fmt(s.get("last")), best]
        rows.append(row)
    return _table(rows)


def compare(path_a: str, path_b: str, patterns: list[str] | None = None) -> str:
    """The whole `rlframe compare` text."""
    a, b = load_runs([path_a, path_b])
    diffs = config_differences(a, b)
    steps = {run.label: len(finite(run.series("timing_s/step")[1])) for run in (a, b)}
    lines = [f"A = {a.path}  ({steps[a.label]} training steps)", f"B = {b.path}  ({steps[b.label]} training steps)", ""]
    lines.append(f"config: {len(diffs)} key(s) differ" + (":" if diffs else ""))
    if diffs:
        lines.append(_table([["key", "A", "B"], *[[k, repr(va), repr(vb)] for k, va, vb in diffs]]))
    lines += ["", f"metrics (final = last logged step, last-{LAST_WINDOW} = mean of the last {LAST_WINDOW}):"]
    lines.append(metrics_table(a, b, patterns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry of `rlframe compare RUN_A RUN_B [--metrics PATTERN]`."""
    parser = argparse.ArgumentParser(
        prog="rlframe compare",
        description="Print the config keys two runs differ in, and their final, last-10 mean and best metrics.",
    )
    parser.add_argument("run_a", metavar="RUN_A", help="a run folder (trainer.default_local_dir)")
    parser.add_argument("run_b", metavar="RUN_B", help="another run folder")
    parser.add_argument(
        "--metrics",
        action="append",
        metavar="PATTERN",
        help="compare the metrics matching PATTERN (shell-style, e.g. 'actor/*'; comma-separated or repeated) "
        "instead of the default list",
    )
    args = parser.parse_args(argv)
    try:
        print(compare(args.run_a, args.run_b, split_patterns(args.metrics)))
    except ValueError as err:
        print(f"rlframe compare: error: {err}", file=sys.stderr)
        return 2
    return 0
