"""Data path: built-in task files, chat templating and padding, length policies, schema errors,
and the resumable dataloader."""

import io
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.small_config import SMALL
from omegaconf import OmegaConf

from rlframe.data.builtin_tasks import SPLIT_SIZES, builtin_task_path, resolve_data_files
from rlframe.data.dataloader import make_dataloader
from rlframe.data.dataset import RLHFDataset, collate_fn
from rlframe.protocol import DataProto
from rlframe.reward.scorers import countdown_add_score
from rlframe.trainer.config import compose, typed


def with_overrides(config, **overrides):
    return OmegaConf.merge(config, overrides)


def row(question, index, data_source="countdown_add", answer="1"):
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "test", "index": index},
    }


def write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def mixed_length_file(tmp_path):
    """Rows 0 and 2 are short; row 1 is long (about 60 prompt tokens)."""
    return write_rows(
        tmp_path / "mixed.parquet",
        [row("What is 1 + 2?", 0), row("count " * 40 + "1 2 3", 1), row("What is 3 + 4?", 2)],
    )


# ---------------------------------------------------------------------------------- builtin task
def test_builtin_task_writes_train_and_val_parquet_in_verl_schema(tmp_path):
    train = resolve_data_files("builtin://countdown_add", str(tmp_path), seed=1, split="train")
    val = resolve_data_files("builtin://countdown_add", str(tmp_path), seed=1, split="val")
    assert train == [str(builtin_task_path("countdown_add", "train", str(tmp_path), 1))]
    rows = pq.read_table(train[0]).to_pylist()
    val_rows = pq.read_table(val[0]).to_pylist()
    assert (len(rows), len(val_rows)) == (SPLIT_SIZES["train"], SPLIT_SIZES["val"])
    assert set(rows[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    for r in rows:
        assert r["data_source"] == "countdown_add"
        assert r["prompt"][0]["role"] == "user"
        assert r["reward_model"]["style"] == "rule"
        info = r["extra_info"]
        assert r["reward_model"]["ground_truth"] == str(info["a"] + info["b"])
        assert f"{info['a']} + {info['b']}" in r["prompt"][0]["content"]
        assert info["split"] == "train"
    assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
    # Answers cover every digit, so no constant answer is a good strategy.
    assert {r["reward_model"]["ground_truth"] for r in rows} == {str(d) for d in range(10)}
    # The val split is drawn with another seed.
    assert [r["prompt"] for r in val_rows] != [r["prompt"] for r in rows[: len(val_rows)]]
    assert not [name for name in os.listdir(os.path.dirname(train[0])) if name.endswith(".tmp")]


def test_builtin_task_is_generated_once_and_depends_on_seed(tmp_path):
    path = resolve_data_files("builtin://countdown_add", str(tmp_path), seed=1)[0]
    mtime = os.stat(path).st_mtime_ns
    assert resolve_data_files(["builtin://countdown_add"], str(tmp_path), seed=1) == [path]
    assert os.stat(path).st_mtime_ns == mtime  # reused, not rewritten
    other = resolve_data_files("builtin://countdown_add", str(tmp_path), seed=2)[0]
    assert other != path
    assert pq.read_table(other).to_pylist() != pq.read_table(path).to_pylist()


def test_resolve_data_files_passes_plain_paths_and_rejects_unknown_tasks(tmp_path):
    assert resolve_data_files(["/data/a.parquet", "~/b.parquet"], str(tmp_path)) == [
        "/data/a.parquet",
        os.path.expanduser("~/b.parquet"),
    ]
    with pytest.raises(ValueError, match="builtin://countdown_add"):
        resolve_data_files("builtin://nope", str(tmp_path))
    with pytest.raises(ValueError, match="split"):
        resolve_data_files("builtin://countdown_add", str(tmp_path), split="test")


def test_builtin_scorer_gives_full_reward_to_the_ground_truth(tmp_path):
    rows = pq.read_table(resolve_data_files("builtin://countdown_add", str(tmp_path), seed=1)[0]).to_pylist()
    truth = rows[0]["reward_model"]["ground_truth"]
    assert countdown_add_score(truth, truth) == {"score": 1.0, "acc": 1.0}


# --------------------------------------------------------------------------------------- dataset
def test_prompts_are_chat_templated_left_padded_with_position_ids(tmp_path, tokenizer, data_config):
    path = write_rows(tmp_path / "d.parquet", [row("What is 1 + 2?", 7), row("What is 3 + 4? Answer now.", 8)])
    dataset = RLHFDataset(path, tokenizer, data_config)
    length = data_config.max_prompt_length
    for i, question in enumerate(["What is 1 + 2?", "What is 3 + 4? Answer now."]):
        item = dataset[i]
        assert item["input_ids"].shape == item["attention_mask"].shape == item["position_ids"].shape == (length,)
        num_real = int(item["attention_mask"].sum())
        assert item["attention_mask"].tolist() == [0] * (length - num_real) + [1] * num_real
        assert (item["input_ids"][: length - num_real] == tokenizer.pad_token_id).all()
        assert item["position_ids"].tolist() == [0] * (length - num_real) + list(range(num_real))
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        assert tokenizer.decode(item["input_ids"][length - num_real :]) == text
        assert text.endswith("<|im_start|>assistant\n")
        assert item["index"] == 7 + i
        assert item["reward_model"]["ground_truth"] == "1"
        assert item["raw_prompt"][-1]["content"] == question and "prompt" not in item  # return_raw_chat: verl's true


THINKING_TEMPLATE = (  # the tiny model's template with a Qwen3-style enable_thinking switch
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}answer now{% endif %}{% endif %}"
)


def test_apply_chat_template_kwargs_reach_the_template(tmp_path, tokenizer, data_config):
    thinking = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    thinking.chat_template = THINKING_TEMPLATE
    path = write_rows(tmp_path / "d.parquet", [row("What is 1 + 2?", 0)])
    default = RLHFDataset(path, thinking, data_config)
    off_config = compose([*SMALL, "+data.apply_chat_template_kwargs.enable_thinking=false"]).data
    off = RLHFDataset(path, thinking, off_config)
    assert thinking.decode(default.prompt_ids[0]).endswith("<|im_start|>assistant\n")
    assert thinking.decode(off.prompt_ids[0]).endswith("<|im_start|>assistant\nanswer now")


def test_multi_turn_turns_are_rendered_with_apply_chat_template_kwargs(tokenizer):
    from rlframe.workers.rollout.multi_turn import ChatTemplateTurns

    thinking = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    thinking.chat_template = THINKING_TEMPLATE
    eos_ids = [thinking.eos_token_id]
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    tool_turn = [{"role": "tool", "content": "3"}]
    default = ChatTemplateTurns(thinking, None, eos_ids)
    off = ChatTemplateTurns(thinking, None, eos_ids, {"enable_thinking": False})
    assert not thinking.decode(default.prompt_ids(messages)).endswith("answer now")
    assert thinking.decode(off.prompt_ids(messages)).endswith("<|im_start|>assistant\nanswer now")
    assert thinking.decode(off.tool_turn_ids(tool_turn)).endswith("<|im_start|>assistant\nanswer now")


def test_apply_chat_template_kwargs_refuse_what_rlframe_sets():
    with pytest.raises(ValueError, match=r"data.apply_chat_template_kwargs=.*\['tokenize'\] are set by rlframe"):
        typed(compose([*SMALL, "+data.apply_chat_template_kwargs.tokenize=true"]))


def test_return_raw_chat_keeps_messages(tmp_path, tokenizer, data_config):
    path = write_rows(tmp_path / "d.parquet", [row("What is 1 + 2?", 0)])
    dataset = RLHFDataset(path, tokenizer, with_overrides(data_config, return_raw_chat=True))
    assert dataset[0]["raw_prompt"] == [{"role": "user", "content": "What is 1 + 2?"}]


def test_collated_batch_becomes_a_dataproto(tmp_path, tokenizer, data_config):
    files = [
        write_rows(tmp_path / "a.parquet", [row("What is 1 + 2?", 0)]),
        write_rows(tmp_path / "b.parquet", [row("What is 5 + 4?", 1, data_source="gsm8k", answer="9")]),
    ]
    dataset = RLHFDataset(files, tokenizer, data_config)
    batch = DataProto.from_single_dict(collate_fn([dataset[0], dataset[1]]))
    assert len(batch) == 2
    assert batch.batch["input_ids"].shape == (2, data_config.max_prompt_length)
    assert list(batch.non_tensor_batch["data_source"]) == ["countdown_add", "gsm8k"]
    assert batch.non_tensor_batch["reward_model"][1]["ground_truth"] == "9"
    assert batch.non_tensor_batch["extra_info"][0]["index"] == 0
    assert list(batch.non_tensor_batch["index"]) == [0, 1]


def test_overlong_prompts_are_filtered_and_counted(mixed_length_file, tokenizer, data_config, caplog):
    config = with_overrides(data_config, max_prompt_length=32, filter_overlong_prompts=True)
    with caplog.at_level(logging.WARNING, logger="rlframe.data.dataset"):
        dataset = RLHFDataset(mixed_length_file, tokenizer, config)
    assert len(dataset) == 2 and dataset.num_filtered == 1
    assert [dataset[i]["index"] for i in range(2)] == [0, 2]
    assert "filtered 1 of 3 prompts" in caplog.text


def test_overlong_prompt_error_names_index_length_and_keys(mixed_length_file, tokenizer, data_config):
    config = with_overrides(data_config, max_prompt_length=32, filter_overlong_prompts=False, truncation="error")
    with pytest.raises(ValueError) as info:
        RLHFDataset(mixed_length_file, tokenizer, config)
    message = str(info.value)
    assert f"data file {mixed_length_file}, row 1, column 'prompt'" in message
    assert "data.max_prompt_length=32" in message and "data.truncation" in message
    full_length = len(
        RLHFDataset(mixed_length_file, tokenizer, with_overrides(config, max_prompt_length=128)).prompt_ids[1]
    )
    assert f"the prompt is {full_length} tokens long" in message


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_keeps_the_chosen_end(mixed_length_file, tokenizer, data_config, truncation):
    config = with_overrides(data_config, max_prompt_length=32, filter_overlong_prompts=False, truncation=truncation)
    full = RLHFDataset(mixed_length_file, tokenizer, with_overrides(config, max_prompt_length=128)).prompt_ids[1]
    item = RLHFDataset(mixed_length_file, tokenizer, config)[1]
    assert item["attention_mask"].all()
    expected = full[-32:] if truncation == "left" else full[:32]
    assert item["input_ids"].tolist() == expected
    assert item["position_ids"].tolist() == list(range(32))


def test_unknown_truncation_mode_is_rejected(mixed_length_file, tokenizer, data_config):
    with pytest.raises(ValueError, match="data.truncation='center'; expected one of error, left, right, middle"):
        RLHFDataset(mixed_length_file, tokenizer, with_overrides(data_config, truncation="center"))


def test_missing_column_error_names_column_file_and_present_columns(tmp_path, tokenizer, data_config):
    good = write_rows(tmp_path / "good.parquet", [row("What is 1 + 2?", 0)])
    bad = write_rows(tmp_path / "bad.parquet", [{"question": "1 + 2?", "data_source": "gsm8k"}])
    with pytest.raises(ValueError) as info:
        RLHFDataset([good, bad], tokenizer, data_config)
    message = str(info.value)
    assert "'prompt'" in message and bad in message and "['question', 'data_source']" in message


def test_missing_file_is_named(tmp_path, tokenizer, data_config):
    with pytest.raises(FileNotFoundError, match="nothere.parquet"):
        RLHFDataset(str(tmp_path / "nothere.parquet"), tokenizer, data_config)


# ------------------------------------------------------------------------------------ dataloader
@pytest.fixture(scope="module")
def builtin_dataset(tmp_path_factory, tokenizer, data_config):
    files = resolve_data_files("builtin://countdown_add", str(tmp_path_factory.mktemp("builtin")), seed=1, split="val")
    return RLHFDataset(files, tokenizer, data_config)  # 64 prompts


def batch_ids(batch):
    return [int(i) for i in batch["index"]]


def run(loader, num_batches):
    """Take `num_batches` batches across epochs, the way a trainer loop does."""
    out = []
    while len(out) < num_batches:
        for batch in loader:
            out.append(batch_ids(batch))
            if len(out) == num_batches:
                break
    return out


def through_checkpoint(state):
    """`state` after torch.save/torch.load, as the trainer's checkpoint stores it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "stop_after", [3, 8, 11, 19], ids=["mid_epoch", "epoch_boundary", "second_epoch", "third_epoch"]
)
def test_dataloader_resume_yields_the_batches_it_would_have(builtin_dataset, stop_after):
    # 64 prompts, batch 8 -> 8 batches per epoch; run 28 batches straight vs stop/save/resume.
    straight = run(make_dataloader(builtin_dataset, 8, shuffle=True, seed=3), 28)
    first = make_dataloader(builtin_dataset, 8, shuffle=True, seed=3)
    before = run(first, stop_after)
    state = through_checkpoint(first.state_dict())
    resumed = make_dataloader(builtin_dataset, 8, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert before + run(resumed, 28 - stop_after) == straight


def test_dataloader_resume_after_a_finished_epoch(builtin_dataset):
    # The state is taken after the epoch's loop ended (StopIteration seen), not after its last batch.
    straight = run(make_dataloader(builtin_dataset, 8, shuffle=True, seed=5), 16)
    first = make_dataloader(builtin_dataset, 8, shuffle=True, seed=5)
    epoch0 = [batch_ids(batch) for batch in first]
    resumed = make_dataloader(builtin_dataset, 8, shuffle=True, seed=5)
    resumed.load_state_dict(through_checkpoint(first.state_dict()))
    assert epoch0 + [batch_ids(batch) for batch in resumed] == straight


def test_dataloader_epochs_cover_the_data_in_new_orders(builtin_dataset):
    loader = make_dataloader(builtin_dataset, 8, shuffle=True, seed=3)
    assert len(loader) == 8
    epochs = [[i for batch in loader for i in batch_ids(batch)] for _ in range(3)]
    assert all(sorted(epoch) == list(range(64)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3
    again = make_dataloader(builtin_dataset, 8, shuffle=True, seed=3)
    assert [i for batch in again for i in batch_ids(batch)] == epochs[0]
    other_seed = make_dataloader(builtin_dataset, 8, shuffle=True, seed=4)
    assert [i for batch in other_seed for i in batch_ids(batch)] != epochs[0]
    unshuffled = make_dataloader(builtin_dataset, 8, shuffle=False, seed=3)
    assert [i for batch in unshuffled for i in batch_ids(batch)] == list(range(64))


def test_dataloader_leaves_the_global_rng_alone(builtin_dataset):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    loader = make_dataloader(builtin_dataset, 8, shuffle=True, seed=3)
    for _ in range(2):
        list(loader)
    loader.state_dict()
    assert torch.equal(torch.rand(3), expected)


def test_dataloader_batch_is_a_dataproto_dict(builtin_dataset):
    batch = next(iter(make_dataloader(builtin_dataset, 4, shuffle=True, seed=0)))
    data = DataProto.from_single_dict(batch)
    assert data.batch["input_ids"].shape == (4, builtin_dataset.max_prompt_length)
    assert data.batch["input_ids"].dtype == torch.long
    assert isinstance(data.non_tensor_batch["reward_model"], np.ndarray)


def test_dataloader_drop_last_and_state_mismatch(builtin_dataset):
    assert len(make_dataloader(builtin_dataset, 10, shuffle=False, seed=0)) == 6
    loader = make_dataloader(builtin_dataset, 10, shuffle=False, seed=0, drop_last=False)
    assert len(loader) == 7 and [len(batch_ids(b)) for b in loader][-1] == 4
    state = make_dataloader(builtin_dataset, 8, shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        make_dataloader(builtin_dataset, 8, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="fewer than one batch"):
        make_dataloader(builtin_dataset, 100, shuffle=True, seed=0)
