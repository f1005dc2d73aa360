"""Print a run's reward curve from its metrics.jsonl: python scripts/summarize_run.py RUN_DIR."""

import json
import os
import sys


def main(run_dir: str) -> None:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if "critic/score/mean" in r]
    if not train and not any(key.startswith("val-core/") for r in rows for key in r):
        sys.exit(f"no training steps and no validation in {run_dir}/metrics.jsonl")
    if train:
        window = max(1, min(10, len(train) // 4))
        first = sum(r["critic/score/mean"] for r in train[:window]) / window
        last = sum(r["critic/score/mean"] for r in train[-window:]) / window
        step_s = sorted(r["timing_s/step"] for r in train)[len(train) // 2]
        print(f"steps: {len(train)}   median step time: {step_s:.2f}s")
        print(f"mean training reward, first {window} steps: {first:.3f}   last {window} steps: {last:.3f}")
    else:  # trainer.val_only
        print("no training steps (validation only)")
    for r in rows:
        for key, value in r.items():
            if key.startswith("val-core/"):
                print(f"  step {r['step']:4d}  {key} = {value:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "checkpoints/rlframe/tiny_grpo")
