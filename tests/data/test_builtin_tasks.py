"""The quickstart task (add_digits) and the GSM8K-format task (gsm8k_arith): rows, scorers, model."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from rlframe.data.builtin_tasks import BUILTIN_TASKS, GSM8K_ARITH_EXAMPLE, add_digits_rows, gsm8k_arith_rows
from rlframe.reward.scorers import add_digits_score, default_compute_score, gsm8k_score

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gsm8k_preprocess():
    """examples/data_preprocess/gsm8k.py, which writes the real GSM8K in verl's layout."""
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", f"{ROOT}/examples/data_preprocess/gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------ add_digits
def test_add_digits_rows_are_sums_with_uniform_single_digit_answers():
    rows = add_digits_rows("train", 1000, seed=1)
    answers = [int(row["reward_model"]["ground_truth"]) for row in rows]
    for row, answer in zip(rows, answers):
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert row["prompt"] == [{"role": "user", "content": f"{a}+{b}="}] and a + b == answer
        assert row["data_source"] == "add_digits"
    assert set(answers) == set(range(10)) and max(answers.count(d) for d in range(10)) < 140  # about 100 each
    assert add_digits_rows("val", 8, seed=1) != add_digits_rows("train", 8, seed=1)


@pytest.mark.parametrize(
    "response, expected",
    [("7", 1.0), (" 7\n", 1.0), ("71", 0.5), ("7 is it", 0.5), ("6", 0.0), ("", 0.0), ("the answer is 7", 0.0)],
)
def test_add_digits_score_rewards_only_the_right_answer(response, expected):
    result = add_digits_score(response, "7")
    assert result == {"score": expected, "acc": 1.0 if expected == 1.0 else 0.0}
    assert default_compute_score("add_digits", response, "7") == result


# ----------------------------------------------------------------------------------- gsm8k_arith
def test_gsm8k_arith_rows_follow_gsm8ks_layout_and_their_solutions_score_full():
    rows = gsm8k_arith_rows("train", 300, seed=1)
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        solution = row["extra_info"]["answer"]
        # GSM8K's convention: the worked solution ends with "#### <number>", the ground truth is the number
        assert solution.endswith(f"\n#### {truth}") and re.fullmatch(r"[0-9]+", truth)
        assert _gsm8k_preprocess().final_answer(solution) == truth
        # one worked example in the same layout, then the question and the instruction
        content = row["prompt"][0]["content"]
        assert content.startswith(GSM8K_ARITH_EXAMPLE) and f"Question: {row['extra_info']['question']}\n" in content
        assert default_compute_score("gsm8k_arith", GSM8K_ARITH_EXAMPLE, "5") == 1.0
        assert default_compute_score("gsm8k_arith", solution, truth) == 1.0
        assert default_compute_score("gsm8k_arith", solution.split("####")[0], truth) == 0.0  # strict: no ####
    # the three kinds of one-step problem all occur, and the arithmetic in each solution is right
    for op in ("+", "-", "*"):
        steps = [r["extra_info"]["answer"] for r in rows if f" {op} " in r["extra_info"]["answer"]]
        assert len(steps) > 50, op
        for step in steps:
            a, b, c = map(int, re.search(rf"(\d+) \{op} (\d+) = (\d+)", step).groups())
            assert {"+": a + b, "-": a - b, "*": a * b}[op] == c


def test_gsm8k_scorer_grades_the_real_data_sets_rows_as_the_built_in_ones():
    # two GSM8K rows as examples/data_preprocess/gsm8k.py writes them (the data set needs a download)
    preprocess = _gsm8k_preprocess()
    examples = [
        {
            "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May?",
            "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
            "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
        },
        {
            "question": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
            "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total is 2+1=<<2+1=3>>3 bolts\n#### 3",
        },
    ]
    rows = [preprocess.to_row(example, "test", i) for i, example in enumerate(examples)]
    for row, example in zip(rows, examples):
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(row["data_source"], example["answer"], truth) == 1.0
        assert default_compute_score(row["data_source"], f"So the answer is {truth}.", truth) == 0.0  # strict
        assert gsm8k_score(f"So the answer is {truth}.", truth, method="flexible") == 1.0
        assert default_compute_score(row["data_source"], "#### 1000", truth) == 0.0
    # the same scorer on a built-in row: the data sources differ, the grading does not
    built_in = gsm8k_arith_rows("val", 1, seed=1)[0]
    truth = built_in["reward_model"]["ground_truth"]
    for response in (built_in["extra_info"]["answer"], f"#### {truth}", "no marker", "#### 9999"):
        assert default_compute_score("gsm8k_arith", response, truth) == default_compute_score(
            "openai/gsm8k", response, truth
        )


def test_every_builtin_task_has_a_scorer():
    for name, make_rows in BUILTIN_TASKS.items():
        row = make_rows("val", 1, 1)[0]
        # an empty response scores 0 with every task's scorer (no KeyError for a missing data source)
        score = default_compute_score(row["data_source"], "", row["reward_model"]["ground_truth"])
        assert (score["score"] if isinstance(score, dict) else score) == 0.0, name


# ----------------------------------------------------------------------------- the quickstart model
def test_quickstart_model_has_a_task_vocabulary_and_encodes_ascii(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from rlframe.models.builtin import prepare_builtin
    from rlframe.models.tiny import QUICKSTART_SHAPE

    path = prepare_builtin("builtin://tiny-quickstart", cache=str(tmp_path))
    assert path == str(tmp_path / "models" / "tiny-quickstart-qwen2-v1")
    assert prepare_builtin("tiny-quickstart", cache=str(tmp_path)) == path  # built once
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    assert len(tokenizer) == config.vocab_size == QUICKSTART_SHAPE["vocab_size"]
    assert (config.hidden_size, config.num_hidden_layers) == (128, 2)
    assert tokenizer.decode(tokenizer.encode("12+34=46")) == "12+34=46"
    # a task vocabulary: characters the task does not use are dropped (docs/data_and_rewards.md)
    assert tokenizer.decode(tokenizer.encode("3+4=$")) == "3+4="
    messages = [{"role": "user", "content": "3+4="}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    # the template's words are single tokens and digits one token each: the prompt is 12 tokens
    assert len(ids) == 12 and tokenizer.convert_ids_to_tokens(ids)[3:7] == ["3", "+", "4", "="]
    assert all(len(tokenizer.encode(str(d))) == 1 for d in range(10))
    with pytest.raises(ValueError, match="takes no --source"):
        prepare_builtin("tiny-quickstart", cache=str(tmp_path), source="x.gguf")
