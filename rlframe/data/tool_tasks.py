"""Built-in tasks where calling a tool pays: the multi-turn tool agent's proving ground.

`calc_multiply`: "What is 347 * 29?" — a product of a three-digit and a two-digit number, which a small model
cannot work out in its head (a random policy of SmolLM2-135M scores ~0) but can get exactly right by calling
the calculator (`rlframe.workers.rollout.tools.CalculatorTool`) and copying its result. The prompt shows one
worked exchange (a call in hermes format, the tool's answer, the final `#### <number>`), because chat templates
of small models render no tool schemas. Rows run the tool agent (`agent_name: tool_agent`, verl's column) and
are scored by the GSM8K scorer, strict: the number after the last `####`.
"""

from __future__ import annotations

import json
import random

SYSTEM = (
    "You can use a calculator. To use it, write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call> '
    "and wait for its answer. Finish with #### followed by the final number."
)


def _call(expression: str) -> str:
    payload = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(payload)}</tool_call>"


EXAMPLE = [
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": _call("12 * 7")},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": "#### 84"},
]


def calc_multiply_rows(split: str, num_samples: int, seed: int) -> list[dict]:
    """Rows of `calc_multiply`: a * b with a in [100, 999], b in [11, 99]."""
    rng = random.Random(f"calc_multiply/{split}/{seed}")
    rows = []
    for index in range(num_samples):
        a, b = rng.randint(100, 999), rng.randint(11, 99)
        rows.append(
            {
                "data_source": "calc_multiply",
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    *EXAMPLE,
                    {"role": "user", "content": f"What is {a} * {b}?"},
                ],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                "agent_name": "tool_agent",
                "extra_info": {"split": split, "index": index, "a": a, "b": b},
            }
        )
    return rows
