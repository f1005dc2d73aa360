"""RLHFDataset: parquet prompts in verl's schema -> chat-templated, left-padded token tensors.

Every prompt is templated and tokenized once, up front, so that overlong prompts are filtered or
rejected before any training work starts, and `__getitem__` only pads. A row of the result:

    input_ids, attention_mask, position_ids   [max_prompt_length] tensors, left-padded
    raw_prompt                                the chat messages (only with data.return_raw_chat)
    index                                     extra_info["index"] (an int or a str) when set, else the row number
    every other column                        as read (data_source, reward_model, extra_info, ...)

With a vision-language model (a `VisionProcessor`), the `data.image_key` column's images take the places of
the prompt's `<image>` placeholders (verl's layout), each image's pad token is repeated for its patch grid
(so prompt lengths count image tokens), `position_ids` are [4, max_prompt_length] (`rlframe.models.vision`),
and a row also has
    multi_modal_data     {"image": [PIL images]}: what the rollout engine takes
    multi_modal_inputs   {"pixel_values", "image_grid_thw"}: what the model's forward takes
The images are decoded and processed again in `__getitem__`: only their token counts are kept up front.
"""

from __future__ import annotations

import logging
from contextlib import closing

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlframe.data.config import TRUNCATION_MODES
from rlframe.data.template import render_chat_prompts
from rlframe.distributed.padding import position_ids_from_mask
from rlframe.models.vision import load_image, messages_with_images, mrope_position_ids

logger = logging.getLogger(__name__)


def _read_table(path: str, required_columns: list[str]):
    """One parquet file as a pyarrow table, after checking that it is parquet, has the columns and has rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        columns = pq.read_schema(path).names
        table = pq.read_table(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"data file {path} does not exist") from None
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"data file {path} is not a readable parquet file ({e})") from e
    for column in required_columns:
        if column not in columns:
            raise ValueError(
                f"data file {path} has no column {column!r} (columns: {columns}); "
                f"rlframe expects verl's schema: {', '.join(required_columns)}"
            )
    if table.num_rows == 0:
        raise ValueError(f"data file {path} has no rows")
    return table


def _column_values(table, column: str, path: str) -> list:
    """A column as Python values; text that is not valid UTF-8 is named by row and column."""
    try:
        return table.column(column).to_pylist()
    except UnicodeDecodeError:
        chunked = table.column(column)
        for row_number in range(len(chunked)):
            try:
                chunked[row_number].as_py()
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"data file {path}, row {row_number}, column {column!r}: text is not UTF-8 ({e})"
                ) from e
        raise


def read_parquet_rows(files: list[str], required_columns: list[str]) -> tuple[list[dict], list[tuple[str, int]]]:
    """Read parquet files into row dicts and each row's (file, row number), checking every file first."""
    tables = [(path, _read_table(path, required_columns)) for path in files]
    rows, origins, columns = [], [], {}
    for path, table in tables:
        columns.update(dict.fromkeys(table.column_names))
        values = {column: _column_values(table, column, path) for column in table.column_names}
        rows.extend(dict(zip(values, row)) for row in zip(*values.values()))  # plain python: lists and dicts
        origins.extend((path, row_number) for row_number in range(table.num_rows))
    if len(files) > 1:  # files may carry different optional columns; give every row all of them
        rows = [{column: row.get(column) for column in columns} for row in rows]
    return rows, origins


def check_row(row: dict, where: str, prompt_key: str, reward_fn_key: str) -> None:
    """The types verl's schema needs, each error naming the file, row and column (`where`)."""
    messages = row[prompt_key]
    expected = "chat messages (a non-empty list of {'role': str, 'content': str})"
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}, column {prompt_key!r}: expected {expected}, got {_describe(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(
                f"{where}, column {prompt_key!r}, message {i}: expected {expected}, got {_describe(message)}"
            )
        content = message.get("content")
        if isinstance(content, bytes):
            raise ValueError(
                f"{where}, column {prompt_key!r}, message {i}: content is bytes, not text"
                + ("" if _is_utf8(content) else " (and not valid UTF-8)")
            )
        if not isinstance(content, str):
            raise ValueError(f"{where}, column {prompt_key!r}, message {i}: content is {_describe(content)}, not text")
    if not isinstance(row[reward_fn_key], str):
        raise ValueError(
            f"{where}, column {reward_fn_key!r} (data.reward_fn_key): expected a string naming the scorer, "
            f"got {_describe(row[reward_fn_key])}"
        )
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(
            f"{where}, column 'reward_model': expected a dict with a 'ground_truth' key, got {_describe(reward_model)}"
        )
    index = _extra_index(row)
    if index is not None and (isinstance(index, bool) or not isinstance(index, (int, str))):
        raise ValueError(
            f"{where}, column 'extra_info': 'index' is {_describe(index)}; expected an int or a str naming the "
            "prompt, or null for the row number (pandas writes a column of ints with gaps as floats: cast it to int)"
        )


def _extra_index(row: dict):
    """extra_info["index"] of a row; None when the row has no extra_info dict or no index in it."""
    extra_info = row.get("extra_info")
    return extra_info.get("index") if isinstance(extra_info, dict) else None


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def left_pad(ids: list[int], length: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token ids to `length`; return (input_ids, attention_mask, position_ids)."""
    num_pad = length - len(ids)
    input_ids = torch.tensor([pad_token_id] * num_pad + list(ids), dtype=torch.long)
    attention_mask = torch.tensor([0] * num_pad + [1] * len(ids), dtype=torch.long)
    return input_ids, attention_mask, position_ids_from_mask(attention_mask)


class RLHFDataset(torch.utils.data.Dataset):
    """Prompts of one or more parquet files, chat-templated and left-padded to `max_prompt_length`."""

    def __init__(self, files, tokenizer, config, processor=None):
        if isinstance(config, dict):
            config = OmegaConf.create(config)
        if not isinstance(config, DictConfig):
            raise TypeError(f"config must be the `data` section (DictConfig or dict), got {type(config).__name__}")
        self.files = [files] if isinstance(files, str) else [str(f) for f in files]
        self.tokenizer = tokenizer
        self.processor = processor  # a rlframe.models.vision.VisionProcessor for a vision-language model
        self.image_key = config.image_key
        self.prompt_key = config.prompt_key
        self.max_prompt_length = int(config.max_prompt_length)
        self.return_raw_chat = bool(config.return_raw_chat)
        self.truncation = config.truncation
        self.chat_template_kwargs = OmegaConf.to_container(config.apply_chat_template_kwargs)
        filter_overlong = bool(config.filter_overlong_prompts)
        if self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length}; must be >= 1 token")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r}; expected one of {', '.join(TRUNCATION_MODES)}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set one (e.g. tokenizer.pad_token = tokenizer.eos_token)")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; RLHFDataset applies one to every prompt. Use a tokenizer "
                "that has one (an instruct model's, via data.tokenizer) or set tokenizer.chat_template"
            )

        rows, origins = read_parquet_rows(self.files, [self.prompt_key, config.reward_fn_key, "reward_model"])
        for row, (path, row_number) in zip(rows, origins):  # every row before tokenizing any
            check_row(row, f"data file {path}, row {row_number}", self.prompt_key, config.reward_fn_key)
        # the prompts with their images' places, then every one rendered under the template's bounds
        where_rows = [f"data file {path}, row {row_number}" for path, row_number in origins]
        conversations, grids = zip(*(self._with_images(row, where) for row, where in zip(rows, where_rows)))
        wheres = [f"{where}, column {self.prompt_key!r}" for where in where_rows]
        texts = render_chat_prompts(tokenizer, list(conversations), self.chat_template_kwargs, wheres)
        # origins: each kept row's (file, row number), for errors found later (e.g. by the reward checks)
        self.rows, self.prompt_ids, self.origins, self.num_filtered = [], [], [], 0
        with closing(texts):
            for row, origin, messages, grid, text, where in zip(rows, origins, conversations, grids, texts, wheres):
                self._add_row(row, origin, self._tokenize(text, messages, where), grid, where, filter_overlong)
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

    def _add_row(self, row: dict, origin: tuple, ids: list[int], grid, where: str, filter_overlong: bool) -> None:
        """Keep a tokenized prompt (its image tokens expanded), cut or filtered as data.truncation says."""
        if grid is not None:
            ids = self.processor.spec.expand(ids, grid)
        if len(ids) > self.max_prompt_length:
            if filter_overlong:
                self.num_filtered += 1
                return
            ids = self._truncate(ids, where)
            if grid is not None and sum(token == self.processor.spec.image_token_id for token in ids) != sum(
                map(self.processor.spec.tokens_per_image, grid)
            ):
                raise ValueError(
                    f"{where}: data.truncation={self.truncation} would cut into the prompt's image tokens; "
                    "raise data.max_prompt_length or set data.filter_overlong_prompts=true"
                )
        self.rows.append(row)
        self.prompt_ids.append(ids)
        self.origins.append(origin)

    def _images(self, row: dict, where: str) -> list:
        """The row's images as RGB PIL images (none without a vision processor or an image column)."""
        images = row.get(self.image_key) if self.processor is not None else None
        if images is None:
            return []
        if not isinstance(images, list):
            raise ValueError(f"{where}, column {self.image_key!r} (data.image_key): expected a list of images")
        return [load_image(image, f"{where}, column {self.image_key!r}, image {i}") for i, image in enumerate(images)]

    def _with_images(self, row: dict, where: str):
        """(the prompt's messages with image parts, the images' patch grids [images, 3] or None without images)."""
        messages = row[self.prompt_key]
        if self.processor is None:
            if row.get(self.image_key):
                raise ValueError(
                    f"{where}, column {self.image_key!r} (data.image_key): the row has images, but the model has no "
                    "vision tower (its config has no vision_config): use a vision-language model (Qwen2-VL family) "
                    "or data without images"
                )
            return messages, None
        images = self._images(row, where)
        messages = messages_with_images(messages, len(images), f"{where}, column {self.prompt_key!r}")
        return messages, (self.processor.images(images)["image_grid_thw"] if images else None)

    def _tokenize(self, text: str, messages, where: str) -> list[int]:
        """The templated prompt's token ids; a template that rendered nothing is an error naming the row."""
        # The template already wrote every special token; do not let the tokenizer add a BOS again.
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:  # an all-padding prompt: nothing to condition on, an all-masked row in every forward
            raise ValueError(
                f"{where}: the chat template rendered this prompt as no tokens at all (text {text!r}); "
                f"the prompt was {_describe(messages)}"
            )
        return ids

    def _truncate(self, ids: list[int], where: str) -> list[int]:
        """Cut a prompt to max_prompt_length tokens as data.truncation says (verl's modes)."""
        length = self.max_prompt_length
        if self.truncation == "left":  # keep the end: the question and the generation prompt
            return ids[-length:]
        if self.truncation == "right":
            return ids[:length]
        if self.truncation == "middle":  # keep the start (system prompt) and the end (generation prompt)
            head = length // 2
            return ids[:head] + ids[len(ids) - (length - head) :]
        raise ValueError(
            f"{where}: the prompt is {len(ids)} tokens long, over "
            f"data.max_prompt_length={length} with data.truncation=error; "
            "raise data.max_prompt_length, set data.filter_overlong_prompts=true, "
            "or set data.truncation=left|right|middle"
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
        if self.processor is not None:
            path, row_number = self.origins[item]
            where = f"data file {path}, row {row_number}"
            images = self._images(out, where)
            messages = messages_with_images(messages, len(images), where)
            out.pop(self.image_key, None)
            out["multi_modal_data"] = {"image": images}
            out["multi_modal_inputs"] = self.processor.images(images)
            grid = out["multi_modal_inputs"].get("image_grid_thw")
            out["position_ids"] = mrope_position_ids(out["input_ids"], out["attention_mask"], grid, self.processor.spec)
        if self.return_raw_chat:
            out["raw_prompt"] = messages
        index = _extra_index(out)
        out["index"] = item if index is None else index
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
