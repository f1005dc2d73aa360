"""Write Geometry3K as parquet in verl's vision-language layout (needs network and `pip install datasets`).

python examples/data_preprocess/geo3k.py --out ~/data/geo3k

Each row: the problem (its text holds one `<image>` where the figure goes) plus verl's instruction to think in
<think></think> and box the answer, the figure under `images` as {"bytes", "path"}, and the answer as ground truth;
data source `hiyouga/geometry3k`, which rlframe scores as verl does (rlframe.reward.scorers.geo3k_score).
"""

import argparse
import os

INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)


def to_row(example: dict, index: int, split: str) -> dict:
    """A row's new columns; its `images` column is kept as it is (datasets writes each image as {"bytes", "path"})."""
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": f"{example['problem']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": example["answer"]},
        "extra_info": {"split": split, "index": index, "answer": example["answer"], "question": example["problem"]},
    }


def main() -> None:
    import datasets

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="~/data/geo3k")
    parser.add_argument("--source", default="hiyouga/geometry3k", help="the hub dataset, or a local copy of it")
    args = parser.parse_args()
    out = os.path.expanduser(args.out)
    os.makedirs(out, exist_ok=True)
    dataset = datasets.load_dataset(args.source)
    for split in ("train", "test"):
        rows = dataset[split].map(
            to_row, with_indices=True, fn_kwargs={"split": split}, remove_columns=["problem", "answer"]
        )
        rows.to_parquet(os.path.join(out, f"{split}.parquet"))
        print(f"{split}: {len(rows)} rows -> {out}/{split}.parquet")


if __name__ == "__main__":
    main()
