"""How close a run's samples are to the teacher: per step, the teacher's mean negative log-likelihood per response
token of the samples the run trained on (its `trainer.rollout_data_dir` dumps), and the share of samples that end
with GSM8K's `#### <number>` line (what the strict scorer reads, `extract_gsm8k_answer`).

    python examples/distillation/teacher_nll.py RUN_DIR [RUN_DIR ...] [--every 5]

The distillation run minimizes a divergence from the teacher on its own samples, which this number follows (lower:
samples the teacher finds likelier). GRPO alone does not compute it (`distillation.enabled=false` loads no teacher),
so the two runs of `examples/distill_smollm2_cpu.sh` are compared here, from their dumps. The dumps hold text:
each prompt and response is tokenized again, which may split a sampled token sequence differently in rare places;
the number is a comparison between runs, not the trained loss.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlframe.models import smollm2
from rlframe.models.builtin import resolve_model_path
from rlframe.reward.scorers import extract_gsm8k_answer

TEACHER = f"builtin://{smollm2.NAME}"


def step_nll(model, tokenizer, rows: list[dict]) -> float:
    """Mean NLL per response token over `rows` (prompt and response as the dump wrote them)."""
    total, tokens = 0.0, 0
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"]
        if not response:
            continue
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        total -= float(log_probs.gather(-1, torch.tensor(response)[:, None]).sum())
        tokens += len(response)
    return total / max(tokens, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--every", type=int, default=1, help="average the steps in windows of this many")
    args = parser.parse_args()
    path = resolve_model_path(TEACHER)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for run_dir in args.run_dirs:
        dumps = sorted((run_dir / "rollouts").glob("*.jsonl"), key=lambda p: int(p.stem))
        steps = [[json.loads(line) for line in p.read_text().splitlines()] for p in dumps]
        cells = []
        for start in range(0, len(steps), args.every):
            window = steps[start : start + args.every]
            nll = sum(step_nll(model, tokenizer, rows) for rows in window) / len(window)
            rows = [row for rows in window for row in rows]
            answered = sum(extract_gsm8k_answer(row["response"]) is not None for row in rows) / len(rows)
            cells.append(f"steps {start + 1}-{start + len(window)}: NLL {nll:.3f}, '####' {answered:.2f}")
        print(f"{run_dir}: teacher NLL per response token, share of samples with an answer line; " + "; ".join(cells))


if __name__ == "__main__":
    main()
