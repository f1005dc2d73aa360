"""SFTDataset renders conversations turn by turn exactly as verl 0.9.1's MultiTurnSFTDataset: the same token ids,
positions and loss mask on every row (differential test against verl's own class), and refuses bad rows by name."""

from __future__ import annotations

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.verl_reference import verl_multiturn_sft_dataset
from transformers import AutoTokenizer

from rlframe.data.sft_dataset import SFTDataset

# verl 0.9.1's sft_trainer_engine.yaml `data` defaults that the dataset reads
VERL_DATA = {
    "messages_key": "messages",
    "tools_key": "tools",
    "enable_thinking_key": "enable_thinking",
    "enable_thinking_default": None,
    "pad_mode": "no_padding",
    "max_length": 1024,
    "truncation": "error",
    "apply_chat_template_kwargs": {},
    "ignore_input_ids_mismatch": False,
}

# A Qwen2.5-shaped template written for this test: a default system prompt, tool schemas in the system turn,
# assistant tool calls and tool answers as user-side turns.
TOOL_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "{%- else %}<|im_start|>system\nYou are a helpful assistant.{%- endif %}"
    "{%- if tools %}\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}\n<tool_call>{{ call.function.name }} "
    "{{ call.function.arguments }}</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

CALC = {"type": "function", "function": {"name": "calc", "description": "add", "parameters": {"type": "object"}}}


def conversations() -> list[dict]:
    call = {"type": "function", "function": {"name": "calc", "arguments": json.dumps({"a": 1, "b": 2})}}
    return [
        {"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]},
        {
            "messages": [
                {"role": "system", "content": "Answer in words."},
                {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "four"},
                {"role": "user", "content": "And 3 + 3?"},
                {"role": "assistant", "content": "six, as 3 + 3 = 6"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Add 1 and 2 with the tool."},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "3"},
                {"role": "assistant", "content": "It is 3."},
            ],
            "tools": [CALC],
        },
    ]


def write(tmp_path, rows: list[dict], name: str = "sft.parquet") -> str:
    path = str(tmp_path / name)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module", params=["tiny", "smollm2", "tool_template"])
def tokenizer(request, tiny_model_path):
    if request.param == "smollm2":
        return AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_path"))
    loaded = AutoTokenizer.from_pretrained(tiny_model_path)
    if request.param == "tool_template":
        loaded = copy.deepcopy(loaded)
        loaded.chat_template = TOOL_TEMPLATE
    return loaded


@pytest.mark.parametrize(
    "overrides",
    [{}, {"pad_mode": "right", "max_length": 200}, {"pad_mode": "right", "max_length": 30, "truncation": "right"}],
    ids=["no_padding", "right_padded", "right_truncated"],
)
def test_every_row_equals_verls_multiturn_sft_dataset(tmp_path, tokenizer, overrides):
    path = write(tmp_path, conversations())
    config = {**VERL_DATA, **overrides}
    ours = SFTDataset(path, tokenizer, config)
    theirs = verl_multiturn_sft_dataset()(path, tokenizer, config)
    assert len(ours) == len(theirs) == 3
    for item in range(len(ours)):
        got, expected = ours[item], theirs[item]
        assert sorted(got) == sorted(expected)
        for key in expected:
            assert torch.equal(got[key], expected[key].to(got[key].dtype)), (item, key)
    if "truncation" not in overrides:  # the assistant's words are trained on, the user's are not
        row = ours[1]
        trained = tokenizer.decode(row["input_ids"][row["loss_mask"].bool()])
        assert "four" in trained and "six" in trained and "2 + 2" not in trained


def test_the_first_n_rows_with_max_samples(tmp_path, tokenizer):
    path = write(tmp_path, conversations())
    ours = SFTDataset(path, tokenizer, VERL_DATA, max_samples=2)
    theirs = verl_multiturn_sft_dataset()(path, tokenizer, VERL_DATA, max_samples=2)
    assert len(ours) == len(theirs) == 2
    assert all(torch.equal(ours[i]["input_ids"], theirs[i]["input_ids"]) for i in range(2))


def test_an_overlong_row_is_refused_by_name_with_truncation_error(tmp_path, tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    path = write(tmp_path, conversations())
    with pytest.raises(ValueError) as info:
        SFTDataset(path, tokenizer, {**VERL_DATA, "max_length": 20})
    assert str(info.value).startswith(f"data file {path}, row 1: the conversation is ")
    assert "data.max_length=20 with data.truncation=error" in str(info.value)


def test_left_truncation_keeps_the_end_in_both_pad_modes(tmp_path, tiny_model_path):
    """verl's no_padding keeps the start for truncation=left; here left means the same in both modes."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    path = write(tmp_path, conversations())
    whole = SFTDataset(path, tokenizer, VERL_DATA)[1]
    for pad_mode in ("no_padding", "right"):
        cut = SFTDataset(path, tokenizer, {**VERL_DATA, "max_length": 16, "truncation": "left", "pad_mode": pad_mode})
        assert torch.equal(cut[1]["input_ids"][:16], whole["input_ids"][-16:])
        assert torch.equal(cut[1]["position_ids"][:16], whole["position_ids"][-16:])


def test_a_template_that_renders_a_turn_by_its_place_is_refused_unless_told(tmp_path, tiny_model_path):
    tokenizer = copy.deepcopy(AutoTokenizer.from_pretrained(tiny_model_path))
    # the last turn gets a marker: rendered alone, every turn is last
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if loop.last %} END{% endif %}"
        "<|im_end|>\n{% endfor %}"
    )
    path = write(tmp_path, conversations()[:1])
    with pytest.raises(ValueError) as info:
        SFTDataset(path, tokenizer, VERL_DATA)
    assert str(info.value).startswith(f"data file {path}, row 0: the conversation's turns rendered one by one")
    assert "data.ignore_input_ids_mismatch=true" in str(info.value)
    told = SFTDataset(path, tokenizer, {**VERL_DATA, "ignore_input_ids_mismatch": True})
    theirs = verl_multiturn_sft_dataset()(path, tokenizer, {**VERL_DATA, "ignore_input_ids_mismatch": True})
    assert torch.equal(told[0]["input_ids"], theirs[0]["input_ids"])


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "row 0: the conversation has no assistant turn"),
        ({"messages": []}, "row 0, column 'messages' (data.messages_key): expected a non-empty list"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "images": [b"\x89PNG"]},
            "row 0, column 'images': SFT rows with images or videos are not taken yet",
        ),
    ],
    ids=["no_assistant", "empty", "images"],
)
def test_bad_rows_are_refused_naming_the_row(tmp_path, tiny_model_path, row, message):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    path = write(tmp_path, [row])
    with pytest.raises(ValueError) as info:
        SFTDataset(path, tokenizer, VERL_DATA)
    assert str(info.value).startswith(f"data file {path}, {message}")
