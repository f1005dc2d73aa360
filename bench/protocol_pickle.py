"""DataProto pickling speed: our tensor-dict state vs pickling the TensorDict itself.

    python bench/protocol_pickle.py [--quick]

Prints MB/s for dumps+loads of N sequences × 1024 tokens (int64 ids, attention mask, position
ids), with the ratio against TensorDict's own pickling measured in the same run.
"""

import argparse
import pickle

import torch
from _common import best_of

from rlframe.protocol import DataProto


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = [1024, 4096] if args.quick else [1024, 8192, 32768]
    print(f"{'seqs':>6} {'MB':>8} {'DataProto MB/s':>15} {'TensorDict MB/s':>16} {'ratio':>6}")
    for n in sizes:
        ids = torch.randint(0, 32000, (n, 1024))
        data = DataProto.from_dict(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(1024).expand(n, -1).contiguous(),
            }
        )
        megabytes = 3 * ids.numel() * 8 / 1e6
        ours = best_of(lambda: pickle.loads(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)), 3)
        theirs = best_of(lambda: pickle.loads(pickle.dumps(data.batch, protocol=pickle.HIGHEST_PROTOCOL)), 3)
        print(f"{n:>6} {megabytes:>8.0f} {megabytes / ours:>15.0f} {megabytes / theirs:>16.0f} {theirs / ours:>6.2f}")


if __name__ == "__main__":
    main()
