"""Write demonstrations of the built-in add_digits task ("3+4=" -> "7") as SFT parquet (verl's `messages` rows).

python examples/data_preprocess/add_digits_sft.py --out ~/data/add_digits_sft --num-train 16

Each row is the RL task's prompt followed by the right answer as the assistant's turn, so a model fine-tuned on
them is asked, during GRPO on builtin://add_digits, what it was shown. The task has only 55 distinct sums; --num-train
keeps the demonstrations few (drawn with another seed than the RL run's rows), so that SFT alone leaves room for RL
(examples/sft_then_grpo_tiny_cpu.sh, docs/sft.md).
"""

import argparse
import os

from rlframe.data.builtin_tasks import add_digits_rows


def to_row(row: dict) -> dict:
    answer = row["reward_model"]["ground_truth"]
    return {"messages": [*row["prompt"], {"role": "assistant", "content": answer}], "data_source": row["data_source"]}


def main() -> None:
    import pandas as pd

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="~/data/add_digits_sft")
    parser.add_argument("--num-train", type=int, default=16, help="demonstrations to train on")
    parser.add_argument("--num-val", type=int, default=64)
    parser.add_argument("--seed", type=int, default=2, help="the generator's seed (the RL run's data.seed is 1)")
    args = parser.parse_args()
    out = os.path.expanduser(args.out)
    os.makedirs(out, exist_ok=True)
    for split, count in (("train", args.num_train), ("val", args.num_val)):
        rows = [to_row(row) for row in add_digits_rows(split, count, args.seed)]
        pd.DataFrame(rows).to_parquet(os.path.join(out, f"{split}.parquet"))
        print(f"{split}: {len(rows)} rows -> {os.path.join(out, split + '.parquet')}")


if __name__ == "__main__":
    main()
