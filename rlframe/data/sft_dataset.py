"""SFTDataset: conversations in verl's multi-turn SFT schema -> token ids and a loss mask on the assistant's tokens.

A row holds a `messages` list (data.messages_key), optionally a `tools` list (data.tools_key, given to the first
turn's rendering, as the chat template places tool schemas in the system turn) and an `enable_thinking` flag
(data.enable_thinking_key, else data.enable_thinking_default). Each message is rendered by the chat template on its
own and the pieces are joined, as verl 0.9.1's `MultiTurnSFTDataset` does, so that a turn's tokens do not depend on
the turns after it:

- a message after the first (other than a system message) loses the default system prompt the template puts before
  any conversation (the tokens of `system_prompt`, found by rendering one and two empty user turns);
- an assistant message is trained on, after its generation prompt (`<|im_start|>assistant\\n`); every other token
  (system, user and tool turns, and the generation prompts) has loss mask 0.

The joined ids must equal the whole conversation rendered at once, else the row is refused naming it, unless
data.ignore_input_ids_mismatch (then the joined ids are used, with one warning). Every row is rendered (under the
template's bounds, `rlframe.data.template`) and tokenized up front, so a bad row or an overlong one fails before any
training work. A row of the result, with data.pad_mode:

    no_padding   input_ids, position_ids, loss_mask     [its length] tensors
    right        input_ids, attention_mask, position_ids, loss_mask    [data.max_length] tensors, right-padded

A row longer than data.max_length is refused (truncation=error) or cut: `right` keeps its start, `left` its end.
verl's `no_padding` keeps the start for `left` too; here `left` means the same in both modes (docs/sft.md).
Images and videos in SFT rows are not taken yet: a row with an `images` or `videos` column is refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import closing

import torch

from rlframe.data.dataset import read_parquet_rows
from rlframe.data.template import ChatRender, render_chat

logger = logging.getLogger(__name__)

PAD_MODES = ("no_padding", "right")
SFT_TRUNCATION_MODES = ("error", "left", "right")
MEDIA_COLUMNS = ("images", "videos")


def chat_markers(tokenizer, template_kwargs: dict) -> tuple[list[int], list[int]]:
    """(the system prompt the template opens every conversation with, the generation prompt) as token ids.

    One empty user turn renders as [system prompt] + [user turn]; two as [system prompt] + 2 × [user turn]: the
    difference in length is one user turn, and what is left of the first rendering is the system prompt. The
    generation prompt is what add_generation_prompt appends to one empty user turn.
    """
    user = [{"role": "user", "content": ""}]
    renders = [ChatRender(user, {**template_kwargs, "add_generation_prompt": False})]
    renders.append(ChatRender(user * 2, {**template_kwargs, "add_generation_prompt": False}))
    renders.append(ChatRender(user, {**template_kwargs, "add_generation_prompt": True}))
    where = "the tokenizer's chat template, on empty user turns"
    with closing(render_chat(tokenizer, renders, [where] * 3, noun="conversation")) as texts:
        one, two, prompted = (_ids(tokenizer, text) for text in texts)
    system_prompt = one[: len(one) - (len(two) - len(one))]
    return system_prompt, prompted[len(one) :]


def _ids(tokenizer, text: str) -> list[int]:
    # the template wrote the special tokens itself: as apply_chat_template(tokenize=True), add none
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class SFTDataset(torch.utils.data.Dataset):
    """Conversations of one or more parquet files, each turn rendered by the chat template and joined."""

    def __init__(self, files, tokenizer, config: Mapping, max_samples: int = -1):
        self.files = [files] if isinstance(files, str) else [str(f) for f in files]
        self.tokenizer = tokenizer
        self.messages_key = config["messages_key"]
        self.tools_key = config["tools_key"]
        self.enable_thinking_key = config["enable_thinking_key"]
        self.enable_thinking_default = config["enable_thinking_default"]
        self.pad_mode = config["pad_mode"]
        self.max_length = int(config["max_length"])
        self.truncation = config["truncation"]
        self.ignore_mismatch = bool(config["ignore_input_ids_mismatch"])
        self.template_kwargs = dict(config["apply_chat_template_kwargs"] or {})
        if self.pad_mode not in PAD_MODES:
            raise ValueError(f"data.pad_mode={self.pad_mode!r}; expected one of {', '.join(PAD_MODES)}")
        if self.truncation not in SFT_TRUNCATION_MODES:
            raise ValueError(
                f"data.truncation={self.truncation!r}; expected one of {', '.join(SFT_TRUNCATION_MODES)} for SFT"
            )
        if self.max_length < 1:
            raise ValueError(f"data.max_length={self.max_length}; must be >= 1 token")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; SFT renders every turn with one (data.tokenizer)")
        if self.pad_mode == "right" and tokenizer.pad_token_id is None:
            raise ValueError("data.pad_mode=right needs a pad token; the tokenizer has none")

        rows, origins = read_parquet_rows(self.files, [self.messages_key])
        if max_samples > 0:
            rows, origins = rows[:max_samples], origins[:max_samples]
        wheres = [f"data file {path}, row {row_number}" for path, row_number in origins]
        conversations = [self._conversation(row, where) for row, where in zip(rows, wheres)]
        self.system_prompt, self.generation_prompt = chat_markers(tokenizer, self.template_kwargs)
        self.input_ids, self.loss_masks, self.origins = [], [], origins
        self._mismatch_warned, cut_out = False, 0
        for where, (ids, loss_mask) in zip(wheres, self._tokenized(conversations, wheres)):
            if not any(loss_mask):
                raise ValueError(f"{where}: the conversation has no assistant turn to train on")
            ids, loss_mask, positions = self._fit(ids, loss_mask, where)
            cut_out += not any(loss_mask)
            self.input_ids.append((ids, positions))
            self.loss_masks.append(loss_mask)
        if cut_out:
            logger.warning(
                "%d of %d conversations keep no assistant token within data.max_length=%d (data.truncation=%s): "
                "they add nothing to the loss (%s)",
                cut_out,
                len(self.input_ids),
                self.max_length,
                self.truncation,
                ", ".join(self.files),
            )

    def _conversation(self, row: dict, where: str) -> tuple[list, list | None, bool | None]:
        """(messages, tools, enable_thinking) of one row, checked."""
        for column in MEDIA_COLUMNS:
            if row.get(column):
                raise ValueError(
                    f"{where}, column {column!r}: SFT rows with images or videos are not taken yet; "
                    "use text-only conversations"
                )
        messages = row[self.messages_key]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}, column {self.messages_key!r} (data.messages_key): expected a non-empty list")
        for turn, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"{where}, column {self.messages_key!r}, message {turn}: expected a dict with a role")
        tools = row.get(self.tools_key)
        thinking = row.get(self.enable_thinking_key, self.enable_thinking_default)
        return messages, tools, None if thinking is None else bool(thinking)

    def _kwargs(self, thinking: bool | None, **more) -> dict:
        kwargs = {**self.template_kwargs, **more}
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        return kwargs

    def _tokenized(self, conversations: list, wheres: list[str]):
        """Per row, (ids, loss mask) of its turns joined, checked against the whole conversation rendered at once."""
        renders, render_wheres = [], []
        for (messages, tools, thinking), where in zip(conversations, wheres):
            for turn, message in enumerate(messages):
                kwargs = self._kwargs(thinking, add_generation_prompt=False, tools=tools if turn == 0 else None)
                renders.append(ChatRender([message], kwargs, user_first=True))
                render_wheres.append(f"{where}, message {turn}")
            renders.append(ChatRender(messages, self._kwargs(thinking, add_generation_prompt=False, tools=tools)))
            render_wheres.append(where)
        texts = render_chat(self.tokenizer, renders, render_wheres, noun="conversation")
        with closing(texts):
            for (messages, _, _), where in zip(conversations, wheres):
                ids, loss_mask = [], []
                for turn, message in enumerate(messages):
                    piece = _ids(self.tokenizer, next(texts))
                    if turn != 0 and message["role"] != "system":
                        piece = piece[len(self.system_prompt) :]
                    trained = message["role"] == "assistant"
                    skip = len(self.generation_prompt) if trained else len(piece)
                    ids += piece
                    loss_mask += [0] * min(skip, len(piece)) + [1] * max(len(piece) - skip, 0)
                whole = _ids(self.tokenizer, next(texts))
                if ids != whole:
                    self._mismatch(where, len(ids), len(whole))
                yield ids, loss_mask

    def _mismatch(self, where: str, joined: int, whole: int) -> None:
        message = (
            f"{where}: the conversation's turns rendered one by one and joined ({joined} tokens) differ from the "
            f"whole conversation rendered at once ({whole} tokens); the chat template renders a turn differently by "
            "its place (e.g. thinking tags only on the last turn). Set data.ignore_input_ids_mismatch=true to train "
            "on the joined tokens"
        )
        if not self.ignore_mismatch:
            raise ValueError(message)
        if not self._mismatch_warned:
            logger.warning("%s (data.ignore_input_ids_mismatch=true: the joined tokens are used)", message)
            self._mismatch_warned = True

    def _fit(self, ids: list[int], loss_mask: list[int], where: str):
        """The row cut to data.max_length as data.truncation says, with its positions (those of the cut part)."""
        positions = list(range(len(ids)))
        if len(ids) <= self.max_length:
            return ids, loss_mask, positions
        if self.truncation == "error":
            raise ValueError(
                f"{where}: the conversation is {len(ids)} tokens long, over data.max_length={self.max_length} with "
                "data.truncation=error; raise data.max_length or set data.truncation=left|right"
            )
        cut = slice(-self.max_length, None) if self.truncation == "left" else slice(0, self.max_length)
        return ids[cut], loss_mask[cut], positions[cut]

    def lengths(self) -> list[int]:
        """Each row's length in tokens (before padding): what dynamic micro-batches are balanced on."""
        return [len(ids) for ids, _ in self.input_ids]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, item: int) -> dict:
        ids, positions = self.input_ids[item]
        loss_mask = self.loss_masks[item]
        if self.pad_mode == "no_padding":
            return {
                "input_ids": torch.tensor(ids, dtype=torch.long),
                "position_ids": torch.tensor(positions, dtype=torch.long),
                "loss_mask": torch.tensor(loss_mask, dtype=torch.long),
            }
        pad = self.max_length - len(ids)
        return {
            "input_ids": torch.tensor(ids + [self.tokenizer.pad_token_id] * pad, dtype=torch.long),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad, dtype=torch.long),
            "position_ids": torch.tensor(positions + [0] * pad, dtype=torch.long),
            "loss_mask": torch.tensor(loss_mask + [0] * pad, dtype=torch.long),
        }
