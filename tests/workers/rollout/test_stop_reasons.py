"""The engines report why each row stopped (`Stop`): an EOS, its budget, its context limit, or the interrupt.

The HF engine on the tiny model, greedy, so a row's tokens are known from a first call: the EOS case makes one of a
row's own tokens the EOS, the length case names an EOS the rows never generate, the interrupt fires after a fixed
number of decoding steps. HF has no context limit of its own; vLLM's is in test_vllm_cpu.py (marker `vllm`).
"""

from __future__ import annotations

import pytest
import torch
from helpers.rollout import RESPONSE_LEN, CutAfter, load_tokenizer, make_prompts, rollout_config

from rlframe.workers.rollout import build_rollout
from rlframe.workers.rollout.base import STOP_KEY, Stop, clip_row

GREEDY = {"do_sample": False}


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    config = rollout_config("actor_rollout_ref.rollout.micro_batch_size=8", "actor_rollout_ref.rollout.mode=sync")
    return build_rollout("hf", config, tiny_model_path, load_tokenizer(tiny_model_path), "cpu")


def _never_generated(engine) -> int:
    """A token id that no row generates greedily: as the EOS, every row runs to its budget."""
    seen = set(engine.generate_sequences(make_prompts(**GREEDY)).batch["responses"].flatten().tolist())
    return next(token for token in range(3, 10_000) if token not in seen)


def test_rows_that_fill_their_budget_stop_length(engine):
    out = engine.generate_sequences(make_prompts(**GREEDY, eos_token_id=_never_generated(engine)))
    assert (out.batch["response_mask"].sum(-1) == RESPONSE_LEN).all()
    assert (out.batch[STOP_KEY] == Stop.LENGTH).all()


def _whole_rows(engine) -> torch.Tensor:
    return engine.generate_sequences(make_prompts(**GREEDY, eos_token_id=_never_generated(engine))).batch["responses"]


def test_a_row_that_generates_an_eos_stops_eos_and_the_others_length(engine):
    whole = _whole_rows(engine)
    eos = int(whole[0, 2])  # row 0's third token, made the EOS
    out = engine.generate_sequences(make_prompts(**GREEDY, eos_token_id=eos))
    ends_with_eos = (whole == eos).any(-1)
    assert ends_with_eos[0] and not ends_with_eos.all()
    stops = out.batch[STOP_KEY]
    assert (stops[ends_with_eos] == Stop.EOS).all() and (stops[~ends_with_eos] == Stop.LENGTH).all()
    assert int(out.batch["response_mask"][0].sum()) <= 3


@pytest.mark.parametrize("steps", [0, 2])
def test_rows_the_interrupt_finds_unfinished_stop_interrupted(engine, steps):
    never = _never_generated(engine)
    engine.interrupt = CutAfter(steps)
    try:
        out = engine.generate_sequences(make_prompts(**GREEDY, eos_token_id=never))
    finally:
        engine.interrupt = None
    assert (out.batch["response_mask"].sum(-1) == steps).all()
    assert (out.batch[STOP_KEY] == Stop.INTERRUPTED).all()


def test_a_row_finished_before_the_interrupt_fired_keeps_its_own_stop(engine):
    whole = _whole_rows(engine)
    eos = int(whole[0, 0])  # row 0 ends at its first token
    engine.interrupt = CutAfter(3)
    try:
        out = engine.generate_sequences(make_prompts(**GREEDY, eos_token_id=eos))
    finally:
        engine.interrupt = None
    first_eos = (whole[:, :3] == eos).any(-1)
    stops = out.batch[STOP_KEY]
    assert first_eos[0] and (stops[first_eos] == Stop.EOS).all()
    assert (stops[~first_eos] == Stop.INTERRUPTED).all()


def test_a_row_cut_to_its_own_budget_in_a_larger_batch_stops_at_that_budget():
    assert clip_row([5, 6, 7, 8], 2, Stop.INTERRUPTED, [9]) == ([5, 6], Stop.LENGTH)
    assert clip_row([5, 9, 7], 4, Stop.INTERRUPTED, [9]) == ([5, 9], Stop.EOS)
    assert clip_row([5, 6], 4, Stop.INTERRUPTED, [9]) == ([5, 6], Stop.INTERRUPTED)
    assert clip_row([5, 6], 2, Stop.CONTEXT_LIMIT, [9]) == ([5, 6], Stop.CONTEXT_LIMIT)
