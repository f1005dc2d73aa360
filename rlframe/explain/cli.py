"""`rlframe explain KEY=VALUE ... [--lengths uniform|bimodal|FILE] [--format text|json]`: the command."""

from __future__ import annotations

import argparse
import sys

from rlframe.explain.report import explain


def main(argv: list[str] | None = None) -> int:
    """Entry of `rlframe explain KEY=VALUE ... [--lengths uniform|bimodal|FILE] [--format text|json]`."""
    parser = argparse.ArgumentParser(
        prog="rlframe explain",
        description="Print the batch plan of a config: the flow from data.train_batch_size to one GPU's "
        "micro-batch for each role, the keys in effect and ignored, and optionally a simulation "
        "of balancing and micro-batching. Takes the trainer's key=value overrides.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as given to the trainer")
    parser.add_argument(
        "--lengths",
        help="simulate with uniform | bimodal | a parquet/jsonl of response lengths or a run's metrics folder",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic lengths")
    parser.add_argument(
        "--plan-only",
        action="store_true",
        help="skip the checks that need files (model weights, device, datasets): plan a run for "
        "another machine from a folder holding only the model's config.json",
    )
    args = parser.parse_intermixed_args(argv)
    try:
        print(explain(args.overrides, args.lengths, args.format, args.seed, args.plan_only))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # Hydra's composition errors (unknown key, bad syntax) carry their own text
        if type(err).__module__.split(".")[0] not in ("hydra", "omegaconf"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
