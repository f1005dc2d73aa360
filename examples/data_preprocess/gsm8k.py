"""Write GSM8K as parquet in the verl schema (needs network and `pip install datasets`).

python examples/data_preprocess/gsm8k.py --out ~/data/gsm8k
"""

import argparse
import os
import re

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def final_answer(solution: str) -> str:
    match = re.search(r"#### (\-?[0-9\.\,]+)", solution)
    if match is None:
        raise ValueError(f"no '#### answer' in GSM8K solution: {solution[-80:]!r}")
    return match.group(1).replace(",", "")


def to_row(example: dict, split: str, index: int) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final_answer(example["answer"])},
        "extra_info": {"split": split, "index": index},
    }


def main() -> None:
    import datasets

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="~/data/gsm8k")
    args = parser.parse_args()
    out = os.path.expanduser(args.out)
    os.makedirs(out, exist_ok=True)
    dataset = datasets.load_dataset("openai/gsm8k", "main")
    for split in ("train", "test"):
        rows = [to_row(ex, split, i) for i, ex in enumerate(dataset[split])]
        datasets.Dataset.from_list(rows).to_parquet(os.path.join(out, f"{split}.parquet"))
        print(f"{split}: {len(rows)} rows -> {out}/{split}.parquet")


if __name__ == "__main__":
    main()
