"""docs/trainer.md's "Logged metrics" keeps up with the code: every metric name a run logs is listed there.

Three sources of names, cheapest first: the recorded golden runs (`tests/assets/golden/`: GRPO with KL and
entropy losses and dynamic micro-batches, PPO with a critic, bypass rollout correction), the metric-name
literals and step timers in rlframe's source, and (slow) a short run with a critic, the losses, KL in the
reward, dynamic micro-batches, validation and a checkpoint, whose every logged name must be in the list.
In the list, `a/{x,y}` stands for `a/x` and `a/y`, and `<part>` for any one path segment.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.small_config import SMALL

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "trainer.md"
PREFIXES = (
    "actor",
    "critic",
    "reward",
    "response_length",
    "prompt_length",
    "num_turns",
    "global_seqlen",
    "training",
    "rollout_corr",
    "rollout",
    "multi_turn",
    "train",
    "timing_s",
    "timing_per_token_ms",
    "perf",
    "val-core",
    "gdpo",
)
NAME = re.compile(rf"^(?:{'|'.join(re.escape(p) for p in PREFIXES)})/[A-Za-z0-9_@<>{{}},/.\-]+$")
ROW_FIELDS = {"step", "time"}  # every jsonl row's own fields, not metrics


def documented_section() -> str:
    text = DOC.read_text()
    start = text.index("## Logged metrics")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def pattern_of(name: str) -> str:
    """`a/{x,y}_<z>` → a regex: braces are alternatives, `<...>` one path segment (or part of one)."""
    out, i = "", 0
    while i < len(name):
        if name[i] == "{":
            j = name.index("}", i)
            out += "(?:" + "|".join(re.escape(alt) for alt in name[i + 1 : j].split(",")) + ")"
            i = j + 1
        elif name[i] == "<":
            j = name.index(">", i)
            out += "[^/]+"
            i = j + 1
        else:
            out += re.escape(name[i])
            i += 1
    return out


def documented_patterns() -> list[re.Pattern]:
    names = [token for token in re.findall(r"`([^`\s]+)`", documented_section()) if NAME.match(token)]
    assert len(names) > 50, "the Logged metrics section should list the metrics in backticks"
    return [re.compile(pattern_of(name)) for name in names]


def undocumented(names) -> list[str]:
    patterns = documented_patterns()
    return sorted(n for n in set(names) - ROW_FIELDS if not any(p.fullmatch(n) for p in patterns))


def test_the_golden_runs_metrics_are_documented():
    names = set()
    for path in glob.glob(str(ROOT / "tests" / "assets" / "golden" / "*.json")):
        with open(path) as f:
            for row in json.load(f):
                names |= set(row)
    assert len(names) > 50
    assert undocumented(names) == []


def source_metric_names() -> set[str]:
    """Metric-name string literals in rlframe's source, `timing_s/<name>` of every `timer("<name>", ...)`, and
    `<prefix>/{mean,max,min}` of every `_stats("<prefix>", ...)`; prefixes of f-strings (ending in `_`) left out."""
    literals, prefixes = set(), set()
    for path in (ROOT / "rlframe").rglob("*.py"):
        if "viz" in path.parts:  # the plots read metrics; they produce none
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.match(node.value):
                literals.add(node.value)
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                called = getattr(node.func, "id", None)
                if called == "timer":
                    literals.add(f"timing_s/{node.args[0].value}")
                elif called == "_stats":
                    prefixes.add(node.args[0].value)
    stats = {f"{prefix}/{stat}" for prefix in prefixes for stat in ("mean", "max", "min")}
    return {name for name in literals - prefixes if not name.endswith(("/", "_"))} | stats


def test_every_metric_name_in_the_source_is_documented():
    names = source_metric_names()
    scanned = {"timing_s/gen", "rollout/server_tokens_per_s", "multi_turn/truncated_ratio", "critic/values/min"}
    assert scanned <= names  # the scan finds literals, timers and _stats families
    assert undocumented(names) == []


def test_the_patterns_mean_what_the_doc_says():
    assert re.fullmatch(pattern_of("critic/score/{mean,max,min}"), "critic/score/min")
    assert not re.fullmatch(pattern_of("critic/score/{mean,max,min}"), "critic/score/std")
    assert re.fullmatch(pattern_of("val-core/<data_source>/reward/mean@<n>"), "val-core/gsm8k/reward/mean@1")
    assert not re.fullmatch(pattern_of("reward/<name>/mean"), "reward/a/b/mean")


@pytest.mark.slow
def test_a_short_runs_metrics_are_documented(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        *SMALL,
        "algorithm.adv_estimator=gae",  # a critic: values, value loss
        "algorithm.use_kl_in_reward=true",  # the reference, the old-log-prob pass, the reward KL penalty
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.001",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",  # micro-batch metrics
        "critic.use_dynamic_bsz=true",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=true",
        "trainer.test_freq=1",
        "trainer.save_freq=1",
        "trainer.resume_mode=disable",
        "trainer.total_training_steps=1",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        f"trainer.default_local_dir={run_dir}",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "rlframe.trainer.main_ppo", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    names = set().union(*rows)
    # the run reached what it was set up for
    assert {"critic/vf_loss", "actor/kl_loss", "actor/reward_kl_penalty", "actor/micro_batch/utilization"} <= names
    assert {"timing_s/save_checkpoint", "timing_s/old_log_prob", "timing_s/ref"} <= names
    assert any(name.startswith("val-core/") for name in names)
    assert undocumented(names) == []
