"""Hostile prompts, fuzzed: unusual text, empty and wrong-typed prompts, overlong prompts, broken chat templates.

Each input either builds a dataset whose tokens are exactly the templated prompt (cut as `data.truncation`
says, or counted in `num_filtered`), or fails while the dataset is built with an error naming the file,
the row and the column. The chat-template and ground-truth checks run before Ray starts (`main_ppo.prepare`).
Hypothesis runs derandomized with few examples so CI is fast and reproducible (`docs/data_and_rewards.md`).
"""

from __future__ import annotations

import copy
import itertools
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.small_config import SMALL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from rlframe.data.dataset import RLHFDataset
from rlframe.reward.scorers import check_builtin_scoring
from rlframe.trainer.main_ppo import check_config, load_data_and_rewards

FUZZ = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# text a parquet file can hold (valid UTF-8: no lone surrogates) with the hard cases made likely:
# NUL and control characters, right-to-left text and marks, zero-width characters, combining marks, emoji
HOSTILE_CHARACTERS = ["\x00", "\x1b", "\u202e", "\u200f", "\u200b", "\ufeff", "\u0301", "\u05d0", "\U0001f600", "\n"]
text = st.text(st.one_of(st.sampled_from(HOSTILE_CHARACTERS), st.characters(exclude_categories=["Cs"])), max_size=40)
_file_numbers = itertools.count()


def good_row(i: int, content: str = "What is 1 + 1?") -> dict:
    return {
        "data_source": "countdown_add",
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
    }


def write(folder, rows: list[dict]) -> str:
    path = str(folder / f"rows_{next(_file_numbers)}.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def config(data_config, **changes):
    return OmegaConf.merge(data_config, changes)


def templated_ids(tokenizer, messages) -> list[int]:
    """The prompt's tokens computed here: the chat template's text, tokenized without added special tokens."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(dataset: RLHFDataset, item: int) -> list[int]:
    sample = dataset[item]
    return sample["input_ids"][sample["attention_mask"].bool()].tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_data")


# ------------------------------------------------------------------------------------------- text
@FUZZ
@given(contents=st.lists(text, min_size=1, max_size=3), system=st.none() | text)
def test_any_text_is_templated_and_tokenized_exactly(folder, tokenizer, data_config, contents, system):
    """Unusual unicode and empty content are prompts like any other: the tokens decode to the templated text."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": content} for content in contents
    ]
    path = write(folder, [{**good_row(0), "prompt": messages}])
    dataset = RLHFDataset(path, tokenizer, config(data_config, max_prompt_length=4096, truncation="error"))
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert len(dataset) == 1 and dataset.num_filtered == 0
    assert tokenizer.decode(prompt_ids(dataset, 0)) == templated  # byte-level: nothing lost or replaced
    assert dataset[0]["raw_prompt"] == messages


def test_a_very_long_line_is_tokenized_whole(folder, tokenizer, data_config):
    line = "x\u0301\U0001f600" * 20_000  # one 60,000-character line without a space
    path = write(folder, [good_row(0, line)])
    dataset = RLHFDataset(path, tokenizer, config(data_config, max_prompt_length=200_000, truncation="error"))
    assert line in tokenizer.decode(prompt_ids(dataset, 0))


@FUZZ
@given(data=st.binary(min_size=1, max_size=12))
def test_bytes_in_a_text_column_are_read_or_named(folder, tokenizer, data_config, data):
    """Bytes stored as a string column: valid UTF-8 is text; anything else is named by file, row and column."""
    table = pa.Table.from_pylist([good_row(0), good_row(1)])
    sources = pa.array([b"countdown_add", data], type=pa.binary()).view(pa.string())
    path = str(folder / f"raw_{next(_file_numbers)}.parquet")
    pq.write_table(table.set_column(0, "data_source", sources), path)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(ValueError, match=rf"data file {path}, row 1, column 'data_source': text is not UTF-8"):
            RLHFDataset(path, tokenizer, data_config)
    else:
        assert RLHFDataset(path, tokenizer, data_config)[1]["data_source"] == data.decode("utf-8")


# ------------------------------------------------------------------------------------ wrong types
key_name = st.text("abcdefgh", min_size=1, max_size=4)
not_chat_messages = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    text,
    st.just([]),
    st.lists(st.integers(), min_size=1, max_size=3),
    st.lists(st.fixed_dictionaries({"role": text}), min_size=1, max_size=2),  # no content
    st.lists(st.fixed_dictionaries({"content": text}), min_size=1, max_size=2),  # no role
    st.lists(st.fixed_dictionaries({"role": text, "content": st.dictionaries(key_name, text, min_size=1)}), min_size=1),
    st.lists(st.fixed_dictionaries({"role": st.integers(), "content": text}), min_size=1, max_size=2),
)


@FUZZ
@given(value=not_chat_messages)
def test_a_prompt_that_is_not_chat_messages_is_named_by_file_and_row(folder, tokenizer, data_config, value):
    rows, bad_row = [good_row(0), {**good_row(1), "prompt": value}], 1
    try:
        path = write(folder, rows)
    except (pa.ArrowException, TypeError):  # a parquet column has one type: the bad value alone then
        rows, bad_row = [{**good_row(0), "prompt": value}], 0
        path = write(folder, rows)
    with pytest.raises(ValueError) as info:
        RLHFDataset(path, tokenizer, data_config)
    message = str(info.value)
    assert message.startswith(f"data file {path}, row {bad_row}, column 'prompt'"), message
    assert "expected chat messages" in message or "not text" in message, message
    assert len(message) < 400, message  # the value is abbreviated


# -------------------------------------------------------------------------------------- too long
@FUZZ
@given(
    lengths=st.lists(st.integers(0, 60), min_size=1, max_size=5),
    max_prompt_length=st.integers(1, 40),
    mode=st.sampled_from(["error", "left", "right", "middle", "filter"]),
)
def test_overlong_prompts_are_cut_filtered_or_named(folder, tokenizer, data_config, lengths, max_prompt_length, mode):
    """Every prompt is kept whole, cut to exactly max_prompt_length as verl cuts it, counted as filtered, or named."""
    rows = [good_row(i, "7 " * length) for i, length in enumerate(lengths)]
    path = write(folder, rows)
    full = [templated_ids(tokenizer, row["prompt"]) for row in rows]
    settings_ = {"max_prompt_length": max_prompt_length, "filter_overlong_prompts": mode == "filter"}
    settings_["truncation"] = "error" if mode == "filter" else mode
    overlong = [i for i, ids in enumerate(full) if len(ids) > max_prompt_length]
    if mode == "error" and overlong:
        with pytest.raises(ValueError, match=rf"data file {path}, row {overlong[0]}, column 'prompt': the prompt is"):
            RLHFDataset(path, tokenizer, config(data_config, **settings_))
        return
    if mode == "filter" and len(overlong) == len(rows):
        with pytest.raises(ValueError, match="no prompts left"):
            RLHFDataset(path, tokenizer, config(data_config, **settings_))
        return
    dataset = RLHFDataset(path, tokenizer, config(data_config, **settings_))
    kept = [i for i in range(len(rows)) if mode != "filter" or i not in overlong]
    assert len(dataset) == len(kept) and dataset.num_filtered == len(rows) - len(kept)
    assert [row_number for _, row_number in dataset.origins] == kept
    for item, i in enumerate(kept):
        ids, head = full[i], max_prompt_length // 2
        expected = {
            "left": ids[-max_prompt_length:],
            "right": ids[:max_prompt_length],
            "middle": ids[:head] + ids[len(ids) - (max_prompt_length - head) :],
        }.get(mode, ids)
        assert prompt_ids(dataset, item) == (expected if len(ids) > max_prompt_length else ids)
        assert dataset[item]["input_ids"].shape == (max_prompt_length,)


def test_middle_truncation_keeps_both_ends_as_verl(folder, tokenizer, data_config):
    path = write(folder, [good_row(0, "1 2 3 4 5 6 7 8 9 " * 20)])
    ids = templated_ids(tokenizer, good_row(0, "1 2 3 4 5 6 7 8 9 " * 20)["prompt"])
    with pytest.raises(ValueError, match=re.escape("or set data.truncation=left|right|middle")):
        RLHFDataset(path, tokenizer, config(data_config, max_prompt_length=9, filter_overlong_prompts=False))
    dataset = RLHFDataset(
        path, tokenizer, config(data_config, max_prompt_length=9, filter_overlong_prompts=False, truncation="middle")
    )
    assert prompt_ids(dataset, 0) == ids[:4] + ids[-5:]  # verl: max_length // 2 from the start, the rest from the end


def test_middle_truncation_is_a_valid_config_value():
    _, cfg, _, _ = check_config([*SMALL, "data.truncation=middle"], check_files=False)
    assert cfg.data.truncation == "middle"


# --------------------------------------------------------------------------------- chat templates
def with_template(tokenizer, template):
    changed = copy.deepcopy(tokenizer)
    changed.chat_template = template
    return changed


def test_a_tokenizer_without_chat_template_is_refused_with_the_fix(folder, tokenizer, data_config):
    path = write(folder, [good_row(0)])
    for template in (None, ""):
        with pytest.raises(ValueError, match="the tokenizer has no chat template.*set tokenizer.chat_template"):
            RLHFDataset(path, with_template(tokenizer, template), data_config)


RAISING_TEMPLATE = (
    "{% for m in messages %}{% if 'forbidden' in m.content %}{{ raise_exception('no forbidden words') }}{% endif %}"
    "{{ m.content }}{% endfor %}"
)


def test_a_chat_template_that_raises_is_named_by_row(folder, tokenizer, data_config):
    path = write(folder, [good_row(0), good_row(1, "a forbidden word")])
    with pytest.raises(ValueError) as info:
        RLHFDataset(path, with_template(tokenizer, RAISING_TEMPLATE), data_config)
    assert str(info.value).startswith(
        f"data file {path}, row 1, column 'prompt': the tokenizer's chat template failed on this prompt "
        "(TemplateError: no forbidden words)"
    )


@pytest.mark.parametrize("template", ["{{ '' }}", "{% for m in messages %}{{ m.content }}{% endfor %}"])
def test_a_prompt_templated_to_no_tokens_is_named_by_row(folder, tokenizer, data_config, template):
    """An empty rendering would be an all-padding prompt (an all-masked row); the second template renders
    the empty content of row 1 as nothing."""
    path = write(folder, [good_row(0), good_row(1, "")])
    with pytest.raises(ValueError) as info:
        RLHFDataset(path, with_template(tokenizer, template), data_config)
    row = 0 if template == "{{ '' }}" else 1
    assert str(info.value).startswith(
        f"data file {path}, row {row}, column 'prompt': the chat template rendered this prompt as no tokens at all"
    )


def test_a_template_with_a_jinja_syntax_error_is_named(folder, tokenizer, data_config):
    path = write(folder, [good_row(0)])
    with pytest.raises(ValueError, match=rf"data file {path}, row 0, .*chat template failed .*TemplateSyntaxError"):
        RLHFDataset(path, with_template(tokenizer, "{% for m in messages %}"), data_config)


# ------------------------------------------------------------------------- ground truths (built-in)
ground_truths = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), text, st.binary(), st.lists(st.integers())
) | st.dictionaries(key_name, st.integers())


@FUZZ
@given(truth=ground_truths, source=st.sampled_from(["countdown_add", "openai/gsm8k", "math", "my/data"]))
def test_built_in_scorers_accept_only_text_or_number_ground_truths(truth, source):
    """A row the built-in scorers could only score wrongly (str(None), b'..', '', an unknown source) is named."""
    rows = [{"data_source": "countdown_add", "reward_model": {"ground_truth": "1"}}] * 2
    rows[1] = {"data_source": source, "reward_model": {"ground_truth": truth}}
    origins = [("f.parquet", 0), ("f.parquet", 7)]
    usable = not isinstance(truth, bool) and isinstance(truth, (str, int, float)) and str(truth).strip() != ""
    if source != "my/data" and usable:
        check_builtin_scoring(rows, origins, "data_source")
        return
    with pytest.raises(ValueError) as info:
        check_builtin_scoring(rows, origins, "data_source")
    message = str(info.value)
    if source == "my/data":
        assert message.startswith("data file f.parquet, row 7, column 'data_source': no built-in scorer for")
    else:
        expected = f"data file f.parquet, row 7, column 'reward_model': ground_truth is {type(truth).__name__}"
        assert message.startswith(expected), message
        assert "custom_reward_function.path" in message and len(message) < 400


def load(tiny_model_path, path, *overrides):
    _, cfg, _, _ = check_config(
        [*SMALL, f"actor_rollout_ref.model.path={tiny_model_path}", f"data.train_files={path}",
         f"data.val_files={path}", *overrides],
        check_files=False,
    )  # fmt: skip
    return load_data_and_rewards(cfg)


def test_ground_truths_the_built_in_scorers_cannot_read_stop_the_run_before_ray(folder, tiny_model_path, tmp_path):
    rows = [good_row(i) for i in range(8)]
    rows[5] = {**rows[5], "reward_model": {"style": "rule", "ground_truth": ""}}
    path = write(folder, rows)
    with pytest.raises(ValueError, match=rf"data file {path}, row 5, column 'reward_model': ground_truth is str ''"):
        load(tiny_model_path, path)
    scorer = tmp_path / "scorer.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    load(tiny_model_path, path, f"custom_reward_function.path={scorer}")  # a custom scorer reads what it likes


# ---------------------------------------------------------------------------------- extra_info index
@FUZZ
@given(
    index=st.none()
    | st.integers(-(2**63), 2**63 - 1)
    | text
    | st.floats()
    | st.booleans()
    | st.lists(st.integers(), min_size=1, max_size=2)
)
def test_an_index_of_any_type_is_used_or_named(folder, tokenizer, data_config, index):
    """extra_info.index names a prompt in the rollout dumps: an int or a str; null means the row number."""
    rows = [{**good_row(0), "extra_info": {"index": None}}, {**good_row(1), "extra_info": {"index": index}}]
    path = write(folder, rows)
    if index is None or (isinstance(index, (int, str)) and not isinstance(index, bool)):
        dataset = RLHFDataset(path, tokenizer, data_config)
        assert [dataset[0]["index"], dataset[1]["index"]] == [0, 1 if index is None else index]
        return
    with pytest.raises(ValueError, match=rf"data file {path}, row 1, column 'extra_info': 'index' is "):
        RLHFDataset(path, tokenizer, data_config)


def test_rollout_dumps_write_text_and_missing_indexes(folder, tokenizer, data_config, tmp_path):
    """A str index, and a null one (a row without it in a file whose other rows have one), used to stop the step
    that dumps rollouts (`int(index)`)."""
    import json
    from types import SimpleNamespace

    import numpy as np
    import torch

    from rlframe.data.dataset import collate_fn
    from rlframe.protocol import DataProto
    from rlframe.trainer.ray_trainer import RayPPOTrainer

    rows = [{**good_row(i), "extra_info": {"index": index}} for i, index in enumerate(["q-17", None])]
    dataset = RLHFDataset(write(folder, rows), tokenizer, data_config)
    batch = DataProto.from_single_dict(collate_fn([dataset[0], dataset[1]]))
    responses = torch.full((2, 3), tokenizer.eos_token_id)
    batch.batch["input_ids"] = torch.cat([batch.batch["input_ids"], responses], dim=-1)
    batch.batch["attention_mask"] = torch.cat([batch.batch["attention_mask"], torch.ones_like(responses)], dim=-1)
    batch.batch["responses"], batch.batch["token_level_scores"] = responses, torch.zeros(2, 3)
    batch.non_tensor_batch["uid"] = np.array(["a", "b"], dtype=object)
    trainer = SimpleNamespace(tokenizer=tokenizer, global_step=1)
    RayPPOTrainer._dump_rollouts(trainer, batch, str(tmp_path))
    lines = (tmp_path / "1.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == ["q-17", 1]


# ----------------------------------------------------------------------------------------- loader
@FUZZ
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    batch_size=st.integers(1, 4),
    shuffle=st.booleans(),
)
def test_the_loader_hands_out_every_row_of_files_with_different_columns_once(
    folder, tokenizer, data_config, sizes, batch_size, shuffle
):
    """Files with different optional columns: every row comes once per epoch, a missing column as None."""
    from rlframe.data.dataloader import make_dataloader

    files, expected = [], []
    for number, size in enumerate(sizes):
        optional = {f"column_{number}": "x"}  # each file has an optional column of its own
        rows = [
            {**good_row(len(expected) + i), **optional, "extra_info": {"index": f"{number}-{i}"}} for i in range(size)
        ]
        files.append(write(folder, rows))
        expected += [f"{number}-{i}" for i in range(size)]
    dataset = RLHFDataset(files, tokenizer, data_config)
    loader = make_dataloader(dataset, batch_size, shuffle=shuffle, seed=0, drop_last=False)
    seen = [index for batch in loader for index in batch["index"]]
    assert sorted(seen) == sorted(expected)
    for batch in loader:
        for column in (f"column_{number}" for number in range(len(sizes))):
            for index, value in zip(batch["index"], batch[column]):
                assert value == ("x" if index.startswith(f"{column[-1]}-") else None)
