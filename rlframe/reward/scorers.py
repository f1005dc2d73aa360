"""Rule-based scorers, chosen by a sample's `data_source`.

A scorer maps (solution_str, ground_truth) to a float, or to a dict with a "score" key whose other
keys become per-sample extra info (e.g. "acc"). `default_compute_score` dispatches by data source
and is what the reward managers call unless `custom_reward_function.path` names another function.
"""

from __future__ import annotations

import re

_NUMBER = r"-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+"


def _to_number(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------- gsm8k
def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer of a GSM8K-style solution: after the last `####` (strict) or the last number (flexible)."""
    if method == "strict":
        matches = re.findall(rf"####\s*\$?\s*({_NUMBER})", solution_str)
    elif method == "flexible":
        matches = re.findall(_NUMBER, solution_str)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    return matches[-1] if matches else None


def gsm8k_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals the ground truth numerically, `format_score` if wrong, 0 if none."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    if "####" in truth:  # a full reference solution was stored instead of the bare answer
        truth = truth.split("####")[-1]
    predicted, expected = _to_number(answer), _to_number(truth)
    if predicted is not None and expected is not None and abs(predicted - expected) < 1e-6:
        return score
    return format_score


# ----------------------------------------------------------------------------------------- math
def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`) in `text`, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    after = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if not after.lstrip().startswith("{"):  # "\\boxed 5": the answer is the next word
        words = after.split("$")[0].split()
        return words[0] if after[:1].isspace() and words else None
    after = after.lstrip()
    depth = 0
    for i, char in enumerate(after):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return after[1:i]
    return None  # unbalanced: the answer was cut off


_STRIP_SUBSTRINGS = [
    "\\left",
    "\\right",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\displaystyle",
    "$",
    "^\\circ",
    "^{\\circ}",
    "\\%",
    "%",
    " ",
    "\n",
]


def normalize_math_answer(answer: str) -> str:
    """A light canonical form for comparing final answers (spacing, sizing commands, fraction spelling)."""
    answer = answer.strip()
    answer = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", answer)
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for s in _STRIP_SUBSTRINGS:
        answer = answer.replace(s, "")
    answer = re.sub(r"\\frac([0-9])([0-9])", r"\\frac{\1}{\2}", answer)  # \frac12 -> \frac{1}{2}
    answer = re.sub(r"^[a-zA-Z]\s*=", "", answer)  # "x=3" -> "3"
    answer = answer.rstrip(".")
    if re.fullmatch(r"-?[0-9,]+(\.[0-9]+)?", answer):  # 1,000 -> 1000, 2.50 -> 2.5, 3.0 -> 3
        answer = answer.replace(",", "")
        if "." in answer:
            answer = answer.rstrip("0").rstrip(".")
    if answer.startswith("."):  # .5 -> 0.5
        answer = "0" + answer
    return answer


def math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last `\\boxed{}` answer matches the ground truth after normalization, else 0.0."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth  # accept a ground truth stored with its \boxed{}
    return 1.0 if normalize_math_answer(answer) == normalize_math_answer(truth) else 0.0


# -------------------------------------------------------------------------------------------- geo3k
def geo3k_score(solution_str: str, ground_truth: str, format_score: float = 0.1) -> float:
    """verl's hiyouga/geometry3k score: 0.9 x (the last \\boxed{} grades equal to the truth by mathruler) +
    0.1 x (the response is `<think>...</think>...\\boxed{...}...`), as verl.utils.reward_score.geo3k."""
    from mathruler.grader import extract_boxed_content, grade_answer

    # str(): a number stored as the truth (verl's function fails on one) is graded as its text
    accurate = 1.0 if grade_answer(extract_boxed_content(solution_str), str(ground_truth)) else 0.0
    formatted = 1.0 if re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", solution_str, re.DOTALL) else 0.0
    return (1.0 - format_score) * accurate + format_score * formatted


# ---------------------------------------------------------------------------- builtin countdown_add
def countdown_add_score(solution_str: str, ground_truth: str) -> dict:
    """Graded reward of the built-in task: a ladder a random policy climbs one rung at a time.

    1.0 the response is exactly the answer (so it stopped right after it);
    0.5 it starts with the answer but goes on;  0.2 it starts with a (wrong) digit;
    0.1 it contains a digit somewhere;  0.0 otherwise. "acc" is 1.0 only for the exact answer.
    """
    text = solution_str.strip()
    truth = str(ground_truth).strip()
    if text == truth:
        return {"score": 1.0, "acc": 1.0}
    if text.startswith(truth):
        score = 0.5
    elif text[:1].isascii() and text[:1].isdigit():
        score = 0.2
    elif re.search(r"[0-9]", text):
        score = 0.1
    else:
        score = 0.0
    return {"score": score, "acc": 0.0}


# ------------------------------------------------------------------------------ builtin add_digits
def add_digits_score(solution_str: str, ground_truth: str) -> dict:
    """Reward of the quickstart task: 1.0 for exactly the answer, 0.5 for starting with it, else 0.

    No credit for a wrong digit: a policy that gives every prompt the same digit gains nothing, so
    the reward rises only as the policy learns the sums. "acc" is 1.0 only for the exact answer.
    """
    text = solution_str.strip()
    truth = str(ground_truth).strip()
    if text == truth:
        return {"score": 1.0, "acc": 1.0}
    return {"score": 0.5 if text.startswith(truth) else 0.0, "acc": 0.0}


# ------------------------------------------------------------------------------------- dispatch
_SCORERS = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "calc_multiply": gsm8k_score,  # the built-in tool-use task: strict, the number after ####
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math": math_score,
    "countdown_add": countdown_add_score,
    "add_digits": add_digits_score,
    "gsm8k_arith": gsm8k_score,  # the built-in word problems, graded as GSM8K (strict)
    "hiyouga/geometry3k": geo3k_score,  # verl's geo3k (examples/data_preprocess/geo3k.py)
    "colour_vl": add_digits_score,  # the built-in image tasks (rlframe.data.image_tasks): one digit, exactly
    "count_vl": add_digits_score,
}
KNOWN_DATA_SOURCES = tuple(_SCORERS)


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None):
    """Score one response with the rule-based scorer of its `data_source` (float or dict with "score")."""
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise ValueError(
            f"no rule-based scorer for data_source={data_source!r}; known data sources: "
            f"{', '.join(KNOWN_DATA_SOURCES)}. Set custom_reward_function.path to score others"
        )
    return scorer(solution_str, ground_truth)


def check_builtin_scoring(rows: list[dict], origins: list[tuple[str, int]], reward_fn_key: str) -> None:
    """Rows the built-in scorers will score: a known data source and a non-empty text or number ground truth.

    Run on the datasets before Ray starts when no custom scorer is set: a row failing here could only
    ever score 0 (an unknown source fails every time; str(None), b'..' or "" compare wrongly).
    """
    for row, (path, row_number) in zip(rows, origins):
        where = f"data file {path}, row {row_number}"
        source = row[reward_fn_key]
        if source not in _SCORERS:
            raise ValueError(
                f"{where}, column {reward_fn_key!r}: no built-in scorer for data_source={source!r} (known: "
                f"{', '.join(KNOWN_DATA_SOURCES)}); set custom_reward_function.path to score it"
            )
        truth = row["reward_model"]["ground_truth"]
        text = repr(truth)
        if isinstance(truth, bool) or not isinstance(truth, (str, int, float)) or not str(truth).strip():
            raise ValueError(
                f"{where}, column 'reward_model': ground_truth is {type(truth).__name__} "
                f"{text[:60]}{'...' if len(text) > 60 else ''}; the built-in scorer of {source!r} compares "
                "against non-empty text or a number. Fix the data, or set custom_reward_function.path to a "
                "scorer that reads this ground truth"
            )
