"""Bad data files: each is a clear error before Ray starts, naming the file, the row and the column.

The dataset checks run in `main_ppo.prepare`; the last test runs the real entry point on a bad file and
shows it exits with one `rlframe: error:` line and status 2, before Ray is imported.
"""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.small_config import SMALL

from rlframe.data.dataset import RLHFDataset


def good_row(i: int) -> dict:
    return {
        "data_source": "countdown_add",
        "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
    }


def write(path, table) -> str:
    pq.write_table(table if isinstance(table, pa.Table) else pa.Table.from_pylist(table), path)
    return str(path)


def test_wrong_types_name_file_row_and_column(tmp_path, tokenizer, data_config):
    # parquet columns have one type: a wrong type is either in every row (named at row 0) or a
    # null/empty value in one row of a well-typed column
    cases = {
        "plain string prompts": ({"prompt": "What is 1 + 1?"}, "all", "column 'prompt': expected chat messages"),
        "empty prompt": ({"prompt": []}, "one", "column 'prompt': expected chat messages"),
        "message without content": (
            {"prompt": [{"role": "user"}]},
            "one",
            "column 'prompt', message 0: content is NoneType None, not text",
        ),
        "numbers as data_source": ({"data_source": 7}, "all", "column 'data_source' (data.reward_fn_key)"),
        "reward_model as text": ({"reward_model": "2"}, "all", "column 'reward_model': expected a dict"),
    }
    for name, (change, rows_changed, message) in cases.items():
        if rows_changed == "all":
            rows, bad_row = [{**good_row(i), **change} for i in range(3)], 0
        else:
            rows, bad_row = [good_row(0), good_row(1), {**good_row(2), **change}], 2
        path = write(tmp_path / f"{name.replace(' ', '_')}.parquet", rows)
        with pytest.raises(ValueError) as info:
            RLHFDataset(path, tokenizer, data_config)
        assert f"data file {path}, row {bad_row}, {message}" in str(info.value), (name, str(info.value))


def test_non_utf8_text_is_named(tmp_path, tokenizer, data_config):
    # bytes where text belongs (a binary column), and a string column holding invalid UTF-8
    rows = [{**good_row(0), "prompt": [{"role": "user", "content": b"caf\xe9"}]}, good_row(1)]
    path = write(tmp_path / "bytes.parquet", rows)  # the whole content column is binary
    with pytest.raises(ValueError) as info:
        RLHFDataset(path, tokenizer, data_config)
    expected = f"data file {path}, row 0, column 'prompt', message 0: content is bytes, not text (and not valid UTF-8)"
    assert expected in str(info.value)
    table = pa.Table.from_pylist([good_row(0), good_row(1)])
    sources = pa.array([b"countdown_add", b"caf\xe9"], type=pa.binary()).view(pa.string())
    path = write(tmp_path / "invalid_utf8.parquet", table.set_column(0, "data_source", sources))
    with pytest.raises(ValueError, match=rf"data file {path}, row 1, column 'data_source': text is not UTF-8"):
        RLHFDataset(path, tokenizer, data_config)


def test_empty_and_non_parquet_files_are_named(tmp_path, tokenizer, data_config):
    schema = pa.Table.from_pylist([good_row(0)]).schema
    empty = write(tmp_path / "empty.parquet", schema.empty_table())
    with pytest.raises(ValueError, match=rf"data file {empty} has no rows"):
        RLHFDataset(empty, tokenizer, data_config)
    zero_bytes = tmp_path / "zero.parquet"
    zero_bytes.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"data file {zero_bytes} is not a readable parquet file"):
        RLHFDataset(str(zero_bytes), tokenizer, data_config)


def test_second_file_errors_name_that_file_and_its_own_row(tmp_path, tokenizer, data_config):
    first = write(tmp_path / "a.parquet", [good_row(0), good_row(1)])
    second = write(tmp_path / "b.parquet", [good_row(2), {**good_row(3), "prompt": []}])
    with pytest.raises(ValueError, match=rf"data file {second}, row 1, column 'prompt'"):
        RLHFDataset([first, second], tokenizer, data_config)


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
def test_bad_file_stops_the_run_before_ray_with_one_line(tmp_path, cache_dir):
    path = write(tmp_path / "bad.parquet", [good_row(0), {**good_row(1), "prompt": []}])
    code = (
        "import sys; from rlframe.trainer import main_ppo; main_ppo.main(sys.argv[1:]); assert 'ray' not in sys.modules"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *SMALL, f"data.train_files={path}", f"trainer.default_local_dir={tmp_path}"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "RLFRAME_CACHE": str(cache_dir)},
        timeout=600,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"rlframe: error: data file {path}, row 1, column 'prompt'" in out.stderr
    assert "Traceback" not in out.stderr
