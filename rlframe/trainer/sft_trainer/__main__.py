"""`python -m rlframe.trainer.sft_trainer KEY=VALUE ...` (verl's module path)."""

from rlframe.trainer.sft_trainer.trainer import main

if __name__ == "__main__":
    main()
