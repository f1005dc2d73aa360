"""RLHFDataset: parquet prompts in verl's schema -> chat-templated, left-padded token tensors.

Every prompt is templated and tokenized once, up front, so that overlong prompts are filtered or
rejected before any training work starts, and `__getitem__` only pads. A row of the result:

    input_ids, attention_mask, position_ids   [max_prompt_length] tensors, left-padded
    raw_prompt                                the chat messages (only with data.return_raw_chat)
    index                                     extra_info["index"] when present, else the row number
    every other column                        as read (data_source, reward_model, extra_info, ...)
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlframe.distributed.padding import position_ids_from_mask

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right")


def read_parquet_rows(files: list[str], required_columns: list[str]) -> list[dict]:
    """Read parquet files into row dicts, checking every file's columns before reading any rows."""
    import pyarrow.parquet as pq

    for path in files:
        try:
            columns = pq.read_schema(path).names
        except FileNotFoundError:
            raise FileNotFoundError(f"data file {path} does not exist") from None
        for column in required_columns:
            if column not in columns:
                raise ValueError(
                    f"data file {path} has no column {column!r} (columns: {columns}); "
                    f"rlframe expects verl's schema: {', '.join(required_columns)}"
                )
    rows, columns = [], {}
    for path in files:
        table = pq.read_table(path)
        columns.update(dict.fromkeys(table.column_names))
        rows.extend(table.to_pylist())  # plain python: lists and dicts, no numpy
    if len(files) > 1:  # files may carry different optional columns; give every row all of them
        rows = [{column: row.get(column) for column in columns} for row in rows]
    return rows


def left_pad(ids: list[int], length: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token ids to `length`; return (input_ids, attention_mask, position_ids)."""
    num_pad = length - len(ids)
    input_ids = torch.tensor([pad_token_id] * num_pad + list(ids), dtype=torch.long)
    attention_mask = torch.tensor([0] * num_pad + [1] * len(ids), dtype=torch.long)
    return input_ids, attention_mask, position_ids_from_mask(attention_mask)


class RLHFDataset(torch.utils.data.Dataset):
    """Prompts of one or more parquet files, chat-templated and left-padded to `max_prompt_length`."""

    def __init__(self, files, tokenizer, config):
        if isinstance(config, dict):
            config = OmegaConf.create(config)
        if not isinstance(config, DictConfig):
            raise TypeError(f"config must be the `data` section (DictConfig or dict), got {type(config).__name__}")
        self.files = [files] if isinstance(files, str) else [str(f) for f in files]
        self.tokenizer = tokenizer
        self.prompt_key = config.prompt_key
        self.max_prompt_length = int(config.max_prompt_length)
        self.return_raw_chat = bool(config.return_raw_chat)
        self.truncation = config.truncation
        filter_overlong = bool(config.filter_overlong_prompts)
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r}; expected one of {', '.join(TRUNCATION_MODES)}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set one (e.g. tokenizer.pad_token = tokenizer.eos_token)")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; RLHFDataset applies one to every prompt")

        rows = read_parquet_rows(self.files, [self.prompt_key, config.reward_fn_key, "reward_model"])
        self.rows, self.prompt_ids, self.num_filtered = [], [], 0
        for row_number, row in enumerate(rows):
            ids = self._tokenize(row[self.prompt_key])
            if len(ids) > self.max_prompt_length:
                if filter_overlong:
                    self.num_filtered += 1
                    continue
                ids = self._truncate(ids, row_number)
            self.rows.append(row)
            self.prompt_ids.append(ids)
        if self.num_filtered:
            logger.warning(
                "filtered %d of %d prompts longer than data.max_prompt_length=%d tokens (%s)",
                self.num_filtered,
                len(rows),
                self.max_prompt_length,
                ", ".join(self.files),
            )
        if not self.rows:
            raise ValueError(
                f"no prompts left in {self.files} after filtering prompts longer than "
                f"data.max_prompt_length={self.max_prompt_length}"
            )

    def _tokenize(self, messages) -> list[int]:
        if isinstance(messages, str):
            raise TypeError(
                f"column {self.prompt_key!r} holds a plain string; expected chat messages "
                "(a list of {'role': ..., 'content': ...})"
            )
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already wrote every special token; do not let the tokenizer add a BOS again.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _truncate(self, ids: list[int], row_number: int) -> list[int]:
        if self.truncation == "left":  # keep the end: the question and the generation prompt
            return ids[-self.max_prompt_length :]
        if self.truncation == "right":
            return ids[: self.max_prompt_length]
        raise ValueError(
            f"prompt {row_number} of {self.files} is {len(ids)} tokens long, over "
            f"data.max_prompt_length={self.max_prompt_length} with data.truncation=error; "
            "raise data.max_prompt_length, set data.filter_overlong_prompts=true, "
            "or set data.truncation=left|right"
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int) -> dict:
        out = dict(self.rows[item])
        messages = out.pop(self.prompt_key)
        ids = self.prompt_ids[item]
        out["input_ids"], out["attention_mask"], out["position_ids"] = left_pad(
            ids, self.max_prompt_length, self.tokenizer.pad_token_id
        )
        if self.return_raw_chat:
            out["raw_prompt"] = messages
        extra_info = out.get("extra_info")
        out["index"] = extra_info["index"] if isinstance(extra_info, dict) and "index" in extra_info else item
        return out


def collate_fn(samples: list[dict]) -> dict:
    """Stack tensors and gather everything else into numpy object arrays (for DataProto.from_single_dict)."""
    out = {}
    for key in samples[0]:
        values = [sample[key] for sample in samples]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.stack(values)
        else:
            array = np.empty(len(values), dtype=object)
            for i, value in enumerate(values):  # element-wise so lists/dicts stay per-sample objects
                array[i] = value
            out[key] = array
    return out
