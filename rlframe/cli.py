"""The `rlframe` command: `train`, `sft`, `explain`, `make-tiny-model`, `prepare-model`, `plot`, `report`, `compare`.

Each subcommand forwards its arguments to the module that owns it, imported only when used, so
`rlframe explain` never imports Ray or torch's distributed stack.
"""

from __future__ import annotations

import sys

USAGE = """usage: rlframe COMMAND [ARGS ...]

commands:
  train KEY=VALUE ...        train (same as python -m rlframe.trainer.main_ppo KEY=VALUE ...)
  sft [--explain] KEY=VALUE ...
                             supervised fine-tuning with verl's SFT keys (same as
                             python -m rlframe.trainer.sft_trainer KEY=VALUE ...; torchrun for several devices);
                             --explain prints the batch plan and the keys without effect, and starts nothing
  explain KEY=VALUE ...      print the batch plan of a config, its keys in effect and ignored, and
                             with --lengths uniform|bimodal|FILE a balancing/micro-batching simulation
  make-tiny-model OUT_DIR    write a tiny random-init model and tokenizer (no downloads)
  prepare-model NAME [--cache DIR] [--source FILE]
                             prepare a builtin:// model (e.g. smollm2-135m-instruct) now, print its folder
  plot RUN_DIR [RUN_DIR ...] [-o OUT.png] [--smooth N] [--metrics PATTERN]
                             one PNG of a run's standard panels (several runs overlaid)
  report RUN_DIR [-o OUT.html]
                             one self-contained HTML page: curves, config, batch plan, rollout samples
  compare RUN_A RUN_B        the config keys two runs differ in, and their final and best metrics
  merge CHECKPOINT_DIR OUT_DIR [--role actor|critic] [--model PATH] [--dtype D]
                             a checkpoint (global_step_N, any world size) as a Hugging Face folder, offline

`rlframe COMMAND --help` for the options of one command."""


def _train(args: list[str]) -> int:
    from rlframe.trainer import main_ppo

    main_ppo.main(args)
    return 0


def _sft(args: list[str]) -> int:
    from rlframe.trainer.sft_trainer.trainer import main as sft_main

    sft_main(args)
    return 0


def _explain(args: list[str]) -> int:
    from rlframe.explain.cli import main as explain_main

    return explain_main(args)


def _make_tiny_model(args: list[str]) -> int:
    from rlframe.models.tiny import main as tiny_main

    tiny_main(args)
    return 0


def _prepare_model(args: list[str]) -> int:
    from rlframe.models.builtin import main as prepare_main

    return prepare_main(args)


def _plot(args: list[str]) -> int:
    from rlframe.viz.plot import main as plot_main

    return plot_main(args)


def _report(args: list[str]) -> int:
    from rlframe.viz.report import main as report_main

    return report_main(args)


def _compare(args: list[str]) -> int:
    from rlframe.viz.compare import main as compare_main

    return compare_main(args)


def _merge(args: list[str]) -> int:
    from rlframe.trainer.merge import main as merge_main

    return merge_main(args)


COMMANDS = {"train": _train, "explain": _explain, "make-tiny-model": _make_tiny_model, "prepare-model": _prepare_model}
COMMANDS.update({"plot": _plot, "report": _report, "compare": _compare})
COMMANDS.update({"merge": _merge, "sft": _sft})


def main(argv: list[str] | None = None) -> int:
    """Dispatch `rlframe COMMAND ARGS...` to the command's module."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"rlframe: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[command](args)


if __name__ == "__main__":
    sys.exit(main())
