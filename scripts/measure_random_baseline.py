"""Measure the reward a model gets on the built-in task before any training (the random baseline).

    python scripts/measure_random_baseline.py                      # the quickstart's model and task
    python scripts/measure_random_baseline.py --model builtin://tiny --task builtin://countdown_add \
        --max-response-length 16 --seeds 0 1 2 3

Samples `--samples` responses for each of `--num-prompts` prompts with plain temperature sampling
(no top-k/top-p), scores them with the naive reward manager, and prints the mean score, the
accuracy and how often each reward level is hit.
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import numpy as np
import torch

from rlframe.config.loader import load_config
from rlframe.data.builtin_tasks import resolve_data_files
from rlframe.data.dataset import RLHFDataset, collate_fn
from rlframe.protocol import DataProto
from rlframe.reward.manager import NaiveRewardManager


def response_mask_until_eos(responses: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it."""
    is_eos = (responses == eos_token_id).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos
    return (eos_before == 0).long()


def measure(
    model, tokenizer, dataset, num_prompts: int, samples: int, temperature: float, max_response_length: int, seed: int
) -> dict:
    """Sample, score, and summarize one round on the first `num_prompts` prompts."""
    batch = collate_fn([dataset[i] for i in range(min(num_prompts, len(dataset)))])
    torch.manual_seed(seed)
    with torch.no_grad():
        output = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_response_length,
            min_new_tokens=0,
            num_return_sequences=samples,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    prompts = batch["input_ids"].repeat_interleave(samples, dim=0)
    responses = output[:, prompts.shape[1] :]
    response_mask = response_mask_until_eos(responses, tokenizer.eos_token_id)
    non_tensors = {k: np.repeat(batch[k], samples) for k in ("data_source", "reward_model", "extra_info")}
    data = DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "attention_mask": torch.cat([batch["attention_mask"].repeat_interleave(samples, 0), response_mask], 1),
        },
        non_tensors,
    )
    result = NaiveRewardManager(tokenizer)(data, return_dict=True)
    scores = np.array(result["reward_extra_info"]["score"])
    return {
        "score": scores,
        "acc": np.array(result["reward_extra_info"]["acc"]),
        "length": response_mask.sum(1).float().numpy(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin://tiny-quickstart", help="HF model dir or builtin://NAME")
    parser.add_argument("--task", default="builtin://add_digits")
    parser.add_argument(
        "--max-response-length", type=int, default=4, help="the quickstart's (examples/grpo_tiny_cpu.sh)"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one sampling round per seed")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlframe.models.builtin import resolve_model_path

    # the quickstart's task sizes (examples/grpo_tiny_cpu.sh), not verl's defaults
    cfg = load_config(
        [
            "data.max_prompt_length=64",
            f"data.max_response_length={args.max_response_length}",
            "data.filter_overlong_prompts=true",
        ]
    ).data
    with tempfile.TemporaryDirectory() as tmp:
        model_path = resolve_model_path(args.model)  # a built-in one is made (or converted) once, in the cache
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        files = resolve_data_files(args.task, builtin_dir=f"{tmp}/data", seed=cfg.seed, split="train")
        dataset = RLHFDataset(files, tokenizer, cfg)
        rounds = [
            measure(
                model,
                tokenizer,
                dataset,
                args.num_prompts,
                args.samples,
                args.temperature,
                cfg.max_response_length,
                seed,
            )
            for seed in args.seeds
        ]

    scores = np.concatenate([r["score"] for r in rounds])
    per_round = [r["score"].mean() for r in rounds]
    print(
        f"task {args.task}, {len(scores)} responses ({args.num_prompts} prompts x {args.samples} samples "
        f"x {len(args.seeds)} seeds), temperature {args.temperature}, max reward 1.0"
    )
    print(
        f"mean score      {scores.mean():.4f} (stderr {scores.std() / np.sqrt(len(scores)):.4f}; "
        f"per seed {', '.join(f'{s:.4f}' for s in per_round)})"
    )
    print(f"accuracy        {np.concatenate([r['acc'] for r in rounds]).mean():.4f}")
    print(f"score > 0       {(scores > 0).mean():.4f}")
    print(f"mean length     {np.concatenate([r['length'] for r in rounds]).mean():.2f} tokens")
    levels = collections.Counter(float(s) for s in scores)
    print("score levels    " + ", ".join(f"{level:g}: {count}" for level, count in sorted(levels.items())))


if __name__ == "__main__":
    main()
