"""Built-in synthetic tasks, addressed as `builtin://NAME` in `data.train_files` / `data.val_files`.

They exist so that `rlframe` trains end to end with no download: the tiny random model of
`rlframe.models.tiny` gets a little reward by chance and visibly more after a few dozen
GRPO steps. Each task writes parquet files in verl's schema, so everything downstream (dataset,
reward managers) treats them exactly like a user's data.

`countdown_add`: "What is 3 + 4? Answer with the number only." -> "7". Answers are single digits,
uniform over 0..9 (no constant answer beats 10%). The scorer (`rlframe.reward.scorers`) gives
partial credit on a ladder a random policy climbs one rung at a time; see docs/data_and_rewards.md.

`add_digits`: "3+4=" -> "7", the same sums with a short prompt and a reward of 1 only
for exactly the answer (0.5 for starting with it): the quickstart's task, which the quickstart's
model (`builtin://tiny-quickstart`) learns from scratch.

`gsm8k_arith`: one-step arithmetic word problems in GSM8K's format: the reference solution ends
with `#### <number>`, the ground truth is that number (as examples/data_preprocess/gsm8k.py writes
GSM8K), and GSM8K's scorer grades responses (data source `gsm8k_arith`, strict: the number after `####`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

from rlframe.data.image_tasks import colour_vl_rows, count_vl_rows
from rlframe.data.tool_tasks import calc_multiply_rows
from rlframe.utils.cache import cache_dir

# Bump when a generator's output changes, so cached parquet files are regenerated, not reused.
GENERATOR_VERSION = 2  # 2: gsm8k_arith's prompt has a worked example
SPLIT_SIZES = {"train": 1024, "val": 64}
BUILTIN_PREFIX = "builtin://"


def _digit_sum_rows(
    name: str, prompt: Callable[[int, int], str], split: str, num_samples: int, seed: int
) -> list[dict]:
    """Rows of a task adding two digits whose sum is a digit (answers uniform over 0..9), asked by `prompt(a, b)`."""
    rng = random.Random(f"{name}/{split}/{seed}")  # str seeds are stable across runs
    rows = []
    for index in range(num_samples):
        answer = rng.randint(0, 9)
        a = rng.randint(0, answer)
        b = answer - a
        rows.append(
            {
                "data_source": name,
                "prompt": [{"role": "user", "content": prompt(a, b)}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": index, "a": a, "b": b},
            }
        )
    return rows


def countdown_add_rows(split: str, num_samples: int, seed: int) -> list[dict]:
    """Rows of the `countdown_add` task: "What is a + b? Answer with the number only."."""
    return _digit_sum_rows(
        "countdown_add", lambda a, b: f"What is {a} + {b}? Answer with the number only.", split, num_samples, seed
    )


def add_digits_rows(split: str, num_samples: int, seed: int) -> list[dict]:
    """Rows of the `add_digits` task: "a+b=" (the quickstart's)."""
    return _digit_sum_rows("add_digits", lambda a, b: f"{a}+{b}=", split, num_samples, seed)


# examples/data_preprocess/gsm8k.py asks GSM8K's questions with verl's "Let's think step by step and
# output the final answer after ####"; this asks for the one line a small model writes in 32 tokens.
GSM8K_ARITH_INSTRUCTION = 'Answer in one short sentence, then write "####" and the number on the last line.'
# One worked example before the question (as GSM8K few-shot prompts do): without it the model knows the
# sums but almost never writes the "####" line, and GRPO groups of all-zero rewards teach nothing.
GSM8K_ARITH_EXAMPLE = (
    "Question: Ann has 2 cats. Ann gets 3 more cats. How many cats does Ann have now?\n"
    "Answer: Ann has 2 + 3 = 5 cats now.\n#### 5"
)
_NAMES = ["Tom", "Sara", "Ben", "Mia", "Leo", "Ana", "Sam", "Eva"]
_ITEMS = ["apples", "pens", "stickers", "marbles", "books", "cookies", "stamps", "shells"]


def _word_problem(rng: random.Random) -> tuple[str, str, int]:
    """One one-step word problem: (question, worked solution ending in `#### n`, n)."""
    name, item, kind = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(["add", "sub", "mul"])
    if kind == "add":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        answer = a + b
        question = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
        step = f"{name} has {a} + {b} = {answer} {item} now."
    elif kind == "sub":
        a = rng.randint(5, 30)
        b = rng.randint(1, a - 1)
        answer = a - b
        question = f"{name} has {a} {item}. {name} gives {b} {item} to a friend. How many {item} are left?"
        step = f"{name} has {a} - {b} = {answer} {item} left."
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        answer = a * b
        question = f"{name} buys {a} bags of {item}. Each bag has {b} {item}. How many {item} does {name} buy?"
        step = f"{name} buys {a} * {b} = {answer} {item}."
    return question, f"{step}\n#### {answer}", answer


def gsm8k_arith_rows(split: str, num_samples: int, seed: int) -> list[dict]:
    """Rows of the `gsm8k_arith` task, laid out as examples/data_preprocess/gsm8k.py lays out GSM8K."""
    rng = random.Random(f"gsm8k_arith/{split}/{seed}")
    rows = []
    for index in range(num_samples):
        question, solution, answer = _word_problem(rng)
        rows.append(
            {
                "data_source": "gsm8k_arith",
                "prompt": [
                    {
                        "role": "user",
                        "content": f"{GSM8K_ARITH_EXAMPLE}\n\nQuestion: {question}\n{GSM8K_ARITH_INSTRUCTION}",
                    }
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": index, "question": question, "answer": solution},
            }
        )
    return rows


BUILTIN_TASKS: dict[str, Callable[[str, int, int], list[dict]]] = {
    "countdown_add": countdown_add_rows,
    "add_digits": add_digits_rows,
    "gsm8k_arith": gsm8k_arith_rows,
    "calc_multiply": calc_multiply_rows,  # a tool-use task (rlframe.data.tool_tasks)
    "colour_vl": colour_vl_rows,  # image tasks (rlframe.data.image_tasks), for vision-language models
    "count_vl": count_vl_rows,
}


def builtin_task_path(name: str, split: str, builtin_dir: str | None, seed: int) -> Path:
    """Where the parquet file of one split of a built-in task lives (generated or not)."""
    root = Path(os.path.expanduser(builtin_dir or os.path.join(cache_dir(), "data")))
    return root / f"{name}-v{GENERATOR_VERSION}" / f"seed{seed}" / f"{split}.parquet"


def _write_parquet_atomically(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique temporary name, then an atomic rename: a reader never sees a half-written file, and
    # two processes generating the same task at once both end with the same complete file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{random.getrandbits(32):08x}.tmp")
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def generate_builtin_task(name: str, builtin_dir: str | None, seed: int) -> dict[str, Path]:
    """Write every split of built-in task `name` (train and val use different seeds); return paths."""
    if name not in BUILTIN_TASKS:
        raise ValueError(
            f"unknown built-in task {BUILTIN_PREFIX}{name}; known tasks: "
            f"{', '.join(BUILTIN_PREFIX + n for n in sorted(BUILTIN_TASKS))}"
        )
    paths = {}
    for split, num_samples in SPLIT_SIZES.items():
        path = builtin_task_path(name, split, builtin_dir, seed)
        if not path.exists():
            _write_parquet_atomically(BUILTIN_TASKS[name](split, num_samples, seed), path)
        paths[split] = path
    return paths


def resolve_data_files(spec, builtin_dir: str | None = None, seed: int = 1, split: str = "train") -> list[str]:
    """Turn `data.train_files`/`val_files` (a path, `builtin://NAME`, or a list) into parquet paths.

    `builtin://NAME` becomes the `split` split of that task, generated under `builtin_dir` on first
    use. Other entries are returned as given (with `~` expanded); their existence is not checked here.
    """
    if split not in SPLIT_SIZES:
        raise ValueError(f"split must be one of {sorted(SPLIT_SIZES)}, got {split!r}")
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not specs:
        raise ValueError("no data files given (data.train_files / data.val_files is empty)")
    paths = []
    for entry in specs:
        entry = str(entry)
        if entry.startswith(BUILTIN_PREFIX):
            name = entry[len(BUILTIN_PREFIX) :]
            paths.append(str(generate_builtin_task(name, builtin_dir, seed)[split]))
        else:
            paths.append(os.path.expanduser(entry))
    return paths
