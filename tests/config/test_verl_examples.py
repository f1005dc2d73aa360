"""verl's example command lines through rlframe's launch checks (issue 11's measure).

The corpus (tests/assets/verl_examples, README there) holds the overrides of verl's 96 FSDP PPO/GRPO
example scripts. `scripts/verl_compat_report.py` runs each through `rlframe explain` and classifies
every key use. The whole corpus takes minutes on two cores, so the floor test runs a fixed subset
that covers the kinds issue 11 names; the script reports the whole corpus.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "assets" / "verl_examples"

# GRPO, PPO with a critic, sequence balance, Ulysses, split placement, GSPO, DAPO-style, LoRA, sglang
# rollout, multi-turn, a reward model served by verl's reward loop, a string logger, a vision-language model.
SUBSET = [
    "grpo_trainer__run_qwen2-7b",
    "grpo_trainer__run_qwen3-8b",
    "grpo_trainer__run_deepseek7b_llm",
    "grpo_trainer__run_deepseek7b_llm_seq_balance",
    "ppo_trainer__run_gemma",
    "ppo_trainer__run_deepseek7b_llm",
    "ppo_trainer__run_deepseek7b_llm_sp2",
    "split_placement__run_deepseek7b_llm",
    "gspo_trainer__test_gspo_3b_math",
    "gmpo_trainer__test_dapo_7b_math",
    "grpo_trainer__run_qwen2_5-3b_gsm8k_grpo_lora",
    "ppo_trainer__run_qwen2-7b_sglang_seq_balance",
    "sglang_multiturn__run_qwen2.5-3b_gsm8k_multiturn",
    "grpo_trainer__run_seed_oss_36b",
    "ppo_trainer__run_qwen2-7b_rm",
    "grpo_trainer__run_qwen2_5_vl-7b_freeze_vision",  # vision-language: data.image_key, freeze_vision_tower
]

# Floors: every script of SUBSET is taken whole and every key use taken (7 of 14 and 0.982 when the floor was
# first set). Issue 11's bar, on the whole corpus: 70 of 96 scripts taken whole and 0.95 of key uses taken;
# the whole corpus now: 75/96 taken whole, 0.986 taken, 0.002 refused as unknown
# (`python scripts/verl_compat_report.py OUT.json`, docs/verl_compatibility.md).
SUBSET_TAKEN_WHOLE = len(SUBSET)
SUBSET_TAKEN_FRACTION = 1.0


def load_report():
    """scripts/verl_compat_report.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("verl_compat_report", ROOT / "scripts" / "verl_compat_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_corpus_has_the_96_scripts_with_source_and_no_leftover_markers():
    files = sorted(CORPUS.glob("*.txt"))
    assert len(files) == 96
    for path in files:
        text = path.read_text()
        assert re.search(r"^# source: examples/\S+\.sh$", text, re.M), path.name
        assert re.search(r"^# verl commit: [0-9a-f]{40} ", text, re.M), path.name
        overrides = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert len(overrides) >= 3, path.name  # run_deepseek7b_llm_pfppo.sh passes 3 (README)
        assert not any("@ENV:" in line or "/tmp/" in line or line == "$@" for line in overrides), path.name


def test_each_key_use_is_classified_by_what_explain_says():
    report = load_report()
    base = report.read_corpus(CORPUS, ["grpo_trainer__run_qwen2-7b"])[0]  # taken whole (the floor's subset)
    bad = [
        "actor_rollout_ref.actor.ppo_mini_batch_sizee=4",  # a typo
        "actor_rollout_ref.rollout.name=nope",  # a value no engine has
        "+no_such.section.key=1",
    ]  # a key nothing reads, added with +
    example = report.Example("synthetic", base.source, "", base.overrides + bad)
    results, summary = report.report([example])
    status = {use.override: use.status for use in results[0].key_uses}
    assert all(status[o] in ("accepted", "warned") for o in base.overrides)
    assert status[bad[0]] == "unknown"
    assert status[bad[1]] == "refused_by_value"
    assert status[bad[2]] in ("unknown", "added_unread")  # never silently "accepted"
    assert results[0].verdict == "refused" and "ppo_mini_batch_sizee" in results[0].first_message
    assert summary["key_uses"] == len(base.overrides) + 3
    assert summary["taken_fraction"] == pytest.approx((len(base.overrides) + 1) / (len(base.overrides) + 3))


@pytest.mark.slow
def test_verl_examples_subset_floor():
    report = load_report()
    results, summary = report.report(report.read_corpus(CORPUS, SUBSET))
    assert len(results) == len(SUBSET)
    not_taken = {r.name: r.first_message.splitlines()[0] for r in results if not r.taken_whole}
    assert summary["taken_whole"] >= SUBSET_TAKEN_WHOLE, not_taken
    assert summary["taken_fraction"] >= SUBSET_TAKEN_FRACTION, summary["top_refused_keys"]
