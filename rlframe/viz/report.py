"""`rlframe report RUN_DIR`: one self-contained HTML page about a run, readable offline.

The page holds the standard panels (each a PNG inlined as base64), the resolved config with its
differences from rlframe's defaults, the batch plan `rlframe explain` prints for that config, and
the rollout samples (prompt, response, score) of each step dumped under `trainer.rollout_data_dir`.
CSS is inline and there is no script, so the file opens the same from a mail attachment or an
air-gapped cluster.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import os
import re
import sys
import time

import numpy as np
from omegaconf import OmegaConf

from rlframe.config.loader import leaves
from rlframe.viz.plot import PANELS, Panel, draw_panel
from rlframe.viz.run import Run, finite, fmt, load_run, read_rollouts

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; margin-top: 2em; }
.panels { display: grid; grid-template-columns: repeat(auto-fill, minmax(370px, 1fr)); gap: 12px; }
figure.panel { margin: 0; border: 1px solid #ddd; padding: 4px; }
figure.panel img { width: 100%; } figcaption { font-size: 0.8em; color: #555; }
table { border-collapse: collapse; font-size: 0.85em; } td, th { border: 1px solid #ddd; padding: 3px 6px; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 0.8em; }
td.text { white-space: pre-wrap; font-family: monospace; font-size: 0.85em; max-width: 480px; }
details { margin: 4px 0; } summary { cursor: pointer; }
.note { color: #666; font-size: 0.9em; }
"""
# C0 controls (but tab and newline) and DEL: shown as \\xNN so an untrained model's bytes stay visible
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _e(value) -> str:
    text = CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))
    return html.escape(text)


def panel_png(panel: Panel, run: Run) -> str:
    """One panel of `run` as a base64 PNG."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.4, 3.8), layout="constrained")
    draw_panel(fig.add_subplot(1, 1, 1), panel, [run])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def panels_html(run: Run) -> str:
    """Every standard panel as a figure with its title and the metrics it draws."""
    figures = []
    for panel in PANELS:
        drawn = [key for key in panel.keys() if run.has_any(key)]
        caption = f"{_e(panel.title)}: " + (", ".join(_e(k) for k in drawn) if drawn else "no data")
        figures.append(
            f'<figure class="panel" id="panel-{panel.name}" data-metrics="{len(drawn)}">'
            f'<img alt="{_e(panel.title)}" src="data:image/png;base64,{panel_png(panel, run)}">'
            f"<figcaption>{caption}</figcaption></figure>"
        )
    return '<div class="panels">' + "".join(figures) + "</div>"


def default_config() -> tuple[dict, dict]:
    """rlframe's defaults as (raw leaves, resolved leaves): raw keeps `${...}` for keys that follow another."""
    from rlframe.trainer.config import compose

    cfg = compose([])
    return leaves(OmegaConf.to_container(cfg, resolve=False)), leaves(OmegaConf.to_container(cfg, resolve=True))


def config_differences(config: dict) -> list[tuple[str, str, object]]:
    """(key, default as written, run's value) for every leaf that differs from the default's resolved value."""
    raw, default = default_config()
    absent = "<not in this rlframe>"
    out = []
    for key, value in leaves(config).items():
        if default.get(key, absent) == value:
            continue
        shown = raw.get(key, absent)
        if isinstance(shown, str) and shown.startswith("${"):
            shown = f"{shown} = {default[key]!r}"
        else:
            shown = repr(shown) if key in raw else shown
        out.append((key, shown, value))
    return out


def config_html(run: Run) -> str:
    """The differences from the defaults as a table, and the whole resolved config folded."""
    if run.config is None:
        return f'<p class="note">no config.yaml in {_e(run.path)}</p>'
    rows = "".join(
        f"<tr><td>{_e(key)}</td><td>{_e(default)}</td><td>{_e(repr(value))}</td></tr>"
        for key, default, value in config_differences(run.config)
    )
    full = OmegaConf.to_yaml(OmegaConf.create(run.config))
    return (
        '<table id="config-diff"><tr><th>key</th><th>default</th><th>this run</th></tr>'
        + rows
        + "</table>"
        + f"<details><summary>the whole resolved config</summary><pre id='config-yaml'>{_e(full)}</pre></details>"
    )


def plan_text(run: Run) -> str:
    """The batch plan `rlframe explain` prints for the run's config (or why it cannot be computed)."""
    from rlframe.batch_plan import make_batch_plan, read_model_shape
    from rlframe.explain.formatting import format_plan
    from rlframe.workers.rollout.registry import find_engine

    if run.config is None:
        return "no config.yaml: no batch plan"
    cfg = OmegaConf.create(run.config)
    try:
        engine = find_engine(OmegaConf.select(cfg, "actor_rollout_ref.rollout.name"))
        micro_batches = engine is not None and engine.capabilities.micro_batches
        pools = engine is not None and engine.capabilities.pools_cpu_generation
        shape = read_model_shape(run.setting("actor_rollout_ref.model.path"))
        plan = make_batch_plan(cfg, shape, micro_batches, pools)
    except ValueError as err:
        return f"the batch plan of this config fails its checks: {err}"
    return format_plan(plan)


def pick(rows: list[dict], count: int) -> list[dict]:
    """`count` samples spread evenly over a step's dump (all of them when fewer)."""
    if len(rows) <= count:
        return rows
    return [rows[i] for i in np.linspace(0, len(rows) - 1, count).round().astype(int)]


def rollouts_html(run: Run, folder: str | None, per_step: int) -> str:
    """One folded section per step: its mean score, and a table of `per_step` samples."""
    if folder is None:
        configured = run.setting("trainer.rollout_data_dir")
        why = (
            f"trainer.rollout_data_dir={configured!r} is not found from here (give --rollouts DIR)"
            if configured
            else "the run did not set trainer.rollout_data_dir, so no rollouts were dumped"
        )
        return f'<p class="note" id="no-rollouts">{_e(why)}</p>'
    steps = read_rollouts(folder)
    if not steps:
        return f'<p class="note" id="no-rollouts">no rollout dumps (STEP.jsonl) in {_e(folder)}</p>'
    sections = []
    for i, (step, rows) in enumerate(steps.items()):
        scores = [float(r["score"]) for r in rows]
        body = "".join(
            f'<tr class="sample"><td class="text">{_e(r["prompt"])}</td><td class="text">{_e(r["response"])}</td>'
            f'<td class="num">{fmt(float(r["score"]))}</td></tr>'
            for r in pick(rows, per_step)
        )
        sections.append(
            f'<details class="rollout-step" data-step="{step}"{" open" if i == len(steps) - 1 else ""}>'
            f"<summary>step {step}: {len(rows)} samples, mean score {fmt(float(np.mean(scores)))}"
            f" (showing {min(per_step, len(rows))})</summary>"
            "<table><tr><th>prompt</th><th>response</th><th>score</th></tr>" + body + "</table></details>"
        )
    return f'<p class="note">from {_e(folder)}</p>' + "".join(sections)


def summary_html(run: Run) -> str:
    """The few numbers a reader looks for first."""
    steps, scores = run.series("critic/score/mean")
    items = [f"<li>{len(steps)} training steps logged</li>"]
    if len(finite(scores)):
        window = max(1, min(10, len(scores) // 4))
        items.append(
            f"<li>mean training score, first {window} steps {fmt(float(np.nanmean(scores[:window])))}, "
            f"last {window} steps {fmt(float(np.nanmean(scores[-window:])))}</li>"
        )
    for key in run.matching("val-core/*"):
        val_steps, values = run.series(key)
        items.append(
            f"<li>{_e(key)}: {fmt(values[0])} at step {val_steps[0]} → {fmt(values[-1])} at step {val_steps[-1]}</li>"
        )
    times = finite(run.series("timing_s/step")[1])
    if len(times):
        items.append(f"<li>median step time {float(np.median(times)):.3g} s</li>")
    return "<ul id='summary'>" + "".join(items) + "</ul>"


def render(run: Run, rollout_folder: str | None, per_step: int = 8) -> str:
    """The report's HTML."""
    title = f"rlframe run {run.label}"
    sections = [
        ("summary", "Summary", summary_html(run)),
        ("curves", "Curves", panels_html(run)),
        ("config", "Config: differences from the defaults", config_html(run)),
        ("plan", "Batch plan (rlframe explain)", f"<pre id='batch-plan'>{_e(plan_text(run))}</pre>"),
        ("rollouts", "Rollout samples per step", rollouts_html(run, rollout_folder, per_step)),
    ]
    body = "".join(f'<section id="{sid}"><h2>{_e(head)}</h2>{content}</section>' for sid, head, content in sections)
    made = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{CSS}</style></head><body><h1>{_e(title)}</h1>"
        f'<p class="note">{_e(os.path.abspath(run.path))} · report made {made}</p>{body}</body></html>'
    )


def report(path: str, out: str, rollouts: str | None = None, per_step: int = 8) -> str:
    """Write the HTML report of the run folder `path` to `out`; returns the path written."""
    if per_step < 1:
        raise ValueError(f"--samples-per-step {per_step}: give 1 or more")
    run = load_run(path)
    if rollouts is not None and not os.path.isdir(rollouts):
        raise ValueError(f"--rollouts {rollouts!r} is not a folder")
    page = render(run, rollouts or run.rollout_dir(), per_step)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry of `rlframe report RUN_DIR [-o OUT.html] [--rollouts DIR] [--samples-per-step N]`."""
    parser = argparse.ArgumentParser(
        prog="rlframe report",
        description="Write one self-contained HTML page about a run: curves, config and its differences from the "
        "defaults, the batch plan, and rollout samples per step (from trainer.rollout_data_dir).",
    )
    parser.add_argument("run", metavar="RUN_DIR", help="a run folder (trainer.default_local_dir)")
    parser.add_argument("-o", "--out", help="HTML to write (default: RUN_DIR/report.html)")
    parser.add_argument("--rollouts", metavar="DIR", help="the rollout dumps (default: the run's rollout_data_dir)")
    parser.add_argument("--samples-per-step", type=int, default=8, metavar="N", help="samples shown per step (8)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.run, "report.html")
    try:
        written = report(args.run, out, args.rollouts, args.samples_per_step)
    except ValueError as err:
        print(f"rlframe report: error: {err}", file=sys.stderr)
        return 2
    print(f"report written to {written}")
    return 0
