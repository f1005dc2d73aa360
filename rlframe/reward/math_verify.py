"""Math answers checked by Hugging Face's `math-verify` (symbolic equivalence, not string rules).

As verl 0.9.1's `verl.utils.reward_score.math_verify.compute_score`: the ground truth is read as
`\\boxed{ground_truth}` (LaTeX), the response as LaTeX or a plain expression, and the score is 1.0
when any parsed answer of the response is equivalent to any parsed form of the ground truth
(`1/2`, `0.5`, `\\frac{2}{4}` all match `\\frac{1}{2}`), else 0.0 — also when nothing parses or
the check times out. Choose it with `custom_reward_function.path=builtin://math_verify` (it then
scores every data source); the string rules of `rlframe.reward.scorers` stay the default.

math-verify bounds each parse and comparison with `signal.alarm` (5 s), which works only in a
process's main thread; elsewhere those bounds are off and `custom_reward_function.timeout_s`
bounds a batch's scoring instead.
"""

from __future__ import annotations

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

BUILTIN_PATH = "builtin://math_verify"
TIMEOUT_S = 5  # math-verify's default, per parse and per comparison


def math_verify_score(solution_str: str, ground_truth) -> float:
    """1.0 if the response's answer is mathematically equivalent to `ground_truth`, else 0.0."""
    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{ground_truth}}}", (LatexExtractionConfig(),), parsing_timeout=timeout)
    predicted = parse(solution_str, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=timeout)
    if not gold or not predicted:
        return 0.0
    return 1.0 if any(verify(g, p, timeout_seconds=timeout) for g in gold for p in predicted) else 0.0


def compute_score(data_source=None, solution_str=None, ground_truth=None, extra_info=None, **batch):
    """`custom_reward_function` form of `math_verify_score`, every data source scored alike: per sample
    (naive manager), or per batch given `solution_strs=` and `ground_truths=` (batch manager).
    """
    if batch:
        return [math_verify_score(s, g) for s, g in zip(batch["solution_strs"], batch["ground_truths"])]
    return math_verify_score(solution_str, ground_truth)
