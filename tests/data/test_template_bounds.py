"""A chat template is a program: one that loops without end, builds a huge value or renders a huge text is
stopped at its bound on the row that does it, and the error names the file, the row, the column and the bound.

Before, a template with nested `range` hung the dataset build forever and `'x' * 10**9` allocated 1.2 GB.
"""

from __future__ import annotations

import copy
import multiprocessing
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlframe.data import template
from rlframe.data.dataset import RLHFDataset

# a template that misbehaves only on a message containing `trigger`, and renders every other row normally
TEMPLATE = "{% for m in messages %}{% if 'trigger' in m.content %}BODY{% endif %}{{ m.content }}{% endfor %}"
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 10**10 steps


def children() -> set:
    return {child.pid for child in multiprocessing.active_children()}


def rendering_processes_left(before: set) -> list:
    """Child processes started since `before` and still alive (other tests' process groups may be running)."""
    return [child for child in multiprocessing.active_children() if child.pid not in before]


def dataset_with(tmp_path, tokenizer, data_config, body: str) -> RLHFDataset:
    """Rows 0 and 2 are plain; row 1 triggers `body` in the tokenizer's template."""
    rows = [
        {
            "data_source": "countdown_add",
            "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": "2"},
        }
        for content in ("What is 1 + 1?", "trigger", "What is 2 + 2?")
    ]
    path = str(tmp_path / "prompts.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    changed = copy.deepcopy(tokenizer)
    changed.chat_template = TEMPLATE.replace("BODY", body)
    return RLHFDataset(path, changed, data_config)


@pytest.mark.timeout(120)  # before: the build never ended
def test_a_template_that_loops_without_end_is_stopped_at_the_row_time_bound(
    tmp_path, tokenizer, data_config, monkeypatch
):
    monkeypatch.setattr(template, "RENDER_TIMEOUT_S", 2.0)
    before = children()
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        dataset_with(tmp_path, tokenizer, data_config, ENDLESS)
    assert time.monotonic() - start < 30
    assert str(info.value).startswith(
        f"data file {tmp_path / 'prompts.parquet'}, row 1, column 'prompt': the chat template did not finish "
        "rendering this prompt within 2 s, the bound on one row (RENDER_TIMEOUT_S"
    )
    assert not rendering_processes_left(before)  # the rendering process was killed, not left looping


def test_a_template_that_builds_a_huge_value_is_refused_at_the_memory_bound(tmp_path, tokenizer, data_config):
    """`'x' * 10**9` needs 1 GB: the rendering process may grow by 512 MiB, so the allocation itself fails."""
    before = children()
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        dataset_with(tmp_path, tokenizer, data_config, "{{ 'x' * 10**9 }}")
    assert time.monotonic() - start < 30
    assert str(info.value).startswith(
        f"data file {tmp_path / 'prompts.parquet'}, row 1, column 'prompt': the chat template needed more than "
        "512 MiB to render this prompt, the bound on one row (RENDER_MEMORY_BYTES"
    )
    assert not rendering_processes_left(before)


def test_a_rendered_text_over_the_length_bound_is_refused(tmp_path, tokenizer, data_config, monkeypatch):
    monkeypatch.setattr(template, "MAX_RENDERED_CHARS", 1000)
    with pytest.raises(ValueError) as info:
        dataset_with(tmp_path, tokenizer, data_config, "{{ 'y' * 5000 }}")
    assert str(info.value).startswith(
        f"data file {tmp_path / 'prompts.parquet'}, row 1, column 'prompt': the chat template rendered this prompt "
        "as 5,007 characters, more than the bound of 1,000 (MAX_RENDERED_CHARS"
    )


def test_within_the_bounds_every_row_is_rendered_as_in_process(tmp_path, tokenizer, data_config):
    """The bounded rendering gives the same prompts, in order, as the template called directly (the long row too)."""
    before = children()
    dataset = dataset_with(tmp_path, tokenizer, data_config, "{{ 'z' * 40 }}")
    assert dataset.num_filtered == 0
    for item, content in enumerate(("What is 1 + 1?", "trigger", "What is 2 + 2?")):
        messages = [{"role": "user", "content": content}]
        text = dataset.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert dataset.prompt_ids[item] == dataset.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert not rendering_processes_left(before)
