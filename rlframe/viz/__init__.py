"""Seeing a finished (or running) run: `rlframe plot`, `rlframe report`, `rlframe compare`.

Everything here reads a run folder (`trainer.default_local_dir`): `metrics.jsonl` (one JSON object
per logged step), `config.yaml` (the resolved config) and the rollout dumps under
`trainer.rollout_data_dir`. Nothing here starts Ray or touches a model.
"""
