"""Fixtures of the data tests: the small config's data section and the tiny model's tokenizer."""

import pytest
from helpers.small_config import SMALL

from rlframe.trainer.config import compose


@pytest.fixture(scope="module")
def data_config():
    return compose(SMALL).data


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)
