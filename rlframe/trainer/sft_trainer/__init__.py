"""Supervised fine-tuning with verl 0.9.1's SFT keys: `python -m rlframe.trainer.sft_trainer KEY=VALUE ...`.

`config` declares verl's `sft_trainer_engine.yaml` keys (each honoured or refused); `trainer` runs one rank of a
run (launched alone or under torchrun). The loss and the update are the actor's (`rlframe.workers.sft`).
"""
