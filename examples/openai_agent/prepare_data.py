"""The built-in `calc_multiply` task (data.seed 1, the rows the tool agent's example trains on) without its
`agent_name` column, so that every row runs `default_agent_loop=openai_agent`: `python prepare_data.py OUT_DIR`."""

import os
import sys

import pandas as pd

from rlframe.data.builtin_tasks import resolve_data_files

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
for split in ("train", "val"):
    (path,) = resolve_data_files("builtin://calc_multiply", seed=1, split=split)
    pd.read_parquet(path).drop(columns=["agent_name"]).to_parquet(os.path.join(out_dir, f"{split}.parquet"))
