"""The vLLM rollout's process-level decisions, checked on CPU against a stand-in `vllm` package.

The stand-in records what the real engine reads while it is built (LOCAL_RANK, the all-reduce
switches, the engine arguments) and does what the real one does to the process (vLLM's
set_random_seed reseeds random, numpy and torch). What it cannot check — that vLLM 0.33 accepts
these arguments, builds on a GPU and loads the weights — is in tests/gpu/test_gpu.py and
scripts/gpu_check.sh.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch
from helpers.rollout import load_tokenizer, rollout_config
from helpers.vllm_stub import _fake_vllm, _reseed_everything

from rlframe.workers.rollout import vllm_rollout
from rlframe.workers.rollout.vllm_rollout import (
    check_all_loaded,
    check_vllm_temperature,
    drop_unsupported_args,
    engine_environment,
    preserved_rng_state,
    scoped_local_rank,
    sleep_level,
)

ROLLOUT = "actor_rollout_ref.rollout"


# ---------------------------------------------------------------------------------------- pure decisions
def test_engine_environment_uses_the_visible_device_and_turns_off_p2p_all_reduces_for_tp():
    assert engine_environment(0, 1) == {"LOCAL_RANK": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert engine_environment(3, 2) == {
        "LOCAL_RANK": "3",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
        "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
    }


def test_local_rank_is_scoped_to_the_engine_build(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with scoped_local_rank(engine_environment(0, 1)):
        import os

        assert os.environ["LOCAL_RANK"] == "0"
    assert os.environ["LOCAL_RANK"] == "1"  # the worker's own meaning is back
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # read again by vLLM later: stays
    monkeypatch.delenv("LOCAL_RANK")
    with scoped_local_rank({"LOCAL_RANK": "0"}):
        pass
    assert "LOCAL_RANK" not in os.environ


def test_rng_state_survives_a_reseeding_block():
    _reseed_everything(123)
    random.random(), np.random.rand(), torch.rand(1)  # advance the streams somewhere
    expected = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    with preserved_rng_state():
        _reseed_everything(42)
    assert random.getstate() == expected[0]
    assert np.array_equal(np.random.get_state()[1], expected[1])
    assert torch.equal(torch.get_rng_state(), expected[2])


def test_rng_state_is_restored_when_the_block_raises():
    torch.manual_seed(5)
    expected = torch.get_rng_state()
    with pytest.raises(RuntimeError), preserved_rng_state():
        torch.manual_seed(6)
        raise RuntimeError("engine failed")
    assert torch.equal(torch.get_rng_state(), expected)


def test_sleep_level_two_unless_buffers_would_be_lost():
    assert sleep_level(True) == 2
    assert sleep_level(False) == 1


@pytest.mark.parametrize("value", [0, 0.01, 0.7, 1.0, 2.0])
def test_vllm_temperatures_accepted(value):
    check_vllm_temperature(value, f"{ROLLOUT}.temperature")


@pytest.mark.parametrize("value", [2.5, 0.005, -1.0])
def test_vllm_temperatures_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=rf"{ROLLOUT}.temperature={value}: .*must be 0 \(greedy\) or in \[0.01, 2.0\]"):
        check_vllm_temperature(value, f"{ROLLOUT}.temperature")


def test_temperature_above_two_is_refused_at_launch_with_vllm_only():
    from rlframe.trainer.config import compose, typed

    with pytest.raises(ValueError, match=rf"{ROLLOUT}.temperature=2.5: with {ROLLOUT}.name=vllm"):
        typed(compose([f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.temperature=2.5"]))
    with pytest.raises(ValueError, match=rf"{ROLLOUT}.val_kwargs.temperature=3.0"):
        typed(
            compose(
                [f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.val_kwargs.do_sample=true", f"{ROLLOUT}.val_kwargs.temperature=3"]
            )
        )
    typed(compose([f"{ROLLOUT}.name=hf", f"{ROLLOUT}.temperature=2.5"]))  # the HF engine has no such limit
    typed(compose([f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.temperature=2.5", f"{ROLLOUT}.do_sample=false"]))  # greedy


def test_unsupported_optional_arguments_are_dropped_by_declaration_not_by_error():
    kwargs = {"model": "m", "logprobs_mode": "processed_logprobs", "swap_space": 4}
    assert drop_unsupported_args(kwargs, frozenset({"model", "logprobs_mode", "swap_space"})) == kwargs
    assert drop_unsupported_args(kwargs, frozenset({"model", "swap_space"})) == {"model": "m", "swap_space": 4}
    # only optional rlframe arguments go; anything else is left for vLLM to refuse by name
    assert drop_unsupported_args(kwargs, frozenset({"model"})) == {"model": "m", "swap_space": 4}


def test_weight_sync_must_reach_every_engine_parameter():
    check_all_loaded(["a.weight", "b.weight"], {"a.weight", "b.weight", "extra"})
    with pytest.raises(RuntimeError, match=r"left 1 vLLM parameter\(s\) without a value: b.weight"):
        check_all_loaded(["a.weight", "b.weight"], {"a.weight"})


def _build(monkeypatch, tiny_model_path, record, new_api=True, *overrides):
    for name, module in _fake_vllm(record, new_api=new_api).items():
        monkeypatch.setitem(sys.modules, name, module)
    from rlframe.workers.rollout import build_rollout

    cfg = rollout_config(f"{ROLLOUT}.name=vllm", *overrides)
    rollout = build_rollout("vllm", cfg, tiny_model_path, load_tokenizer(tiny_model_path), "cuda")
    engine = rollout.engine  # the engine inside the agent loops (rollout.mode=async)
    engine.device = torch.device("cpu")  # where update_weights puts tensors: cuda:0 on a GPU
    return engine


def test_engine_is_built_with_local_rank_of_the_visible_device_and_rng_untouched(
    monkeypatch, tiny_model_path, cuda_less_gpu
):
    import os

    record: dict = {}
    _reseed_everything(7)
    expected = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    engine = _build(monkeypatch, tiny_model_path, record)
    assert record["env"]["LOCAL_RANK"] == "0"  # LOCAL_RANK=1 would be vLLM's device index 1: out of range
    assert os.environ["LOCAL_RANK"] == "1"
    assert record["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert record["env"]["VLLM_ALLREDUCE_USE_SYMM_MEM"] is None  # TP = 1: no TP all-reduce to configure
    assert record["kwargs"]["disable_custom_all_reduce"] is True
    assert record["kwargs"]["logprobs_mode"] == "processed_logprobs"
    assert record["kwargs"]["seed"] == 42 + 1  # rollout.seed + this rank's DP index
    assert random.getstate() == expected[0]
    assert np.array_equal(np.random.get_state()[1], expected[1])
    assert torch.equal(torch.get_rng_state(), expected[2])
    assert engine._sleep_level == 2


def test_sleep_wake_and_weight_sync_sequence(monkeypatch, tiny_model_path, cuda_less_gpu):
    record: dict = {}
    engine = _build(monkeypatch, tiny_model_path, record)
    engine.release()
    engine.resume()
    weights = {"a.weight": torch.full((2, 2), 3.0), "b.weight": torch.full((2, 2), 4.0)}
    engine.update_weights(weights.items())
    model = record["worker"].model
    assert torch.equal(model.a.weight, weights["a.weight"]) and torch.equal(model.b.weight, weights["b.weight"])
    assert record["config_context"] is record["worker"].vllm_config  # loaded inside vLLM's config context
    assert record["calls"] == [("sleep", 2), ("wake_up", ["weights"]), ("reset_prefix_cache",)]
    engine.release()
    engine.resume()
    with pytest.raises(RuntimeError, match="b.weight"):  # a partial sync after a level-2 sleep is refused
        engine.update_weights([("a.weight", weights["a.weight"])])


def test_older_vllm_is_detected_by_its_declarations(monkeypatch, tiny_model_path, cuda_less_gpu):
    record: dict = {}
    engine = _build(monkeypatch, tiny_model_path, record, False)
    assert "logprobs_mode" not in record["kwargs"]  # not an EngineArgs field there
    assert engine._sleep_level == 1  # no buffers saved around level 2 (vllm 0.8.0 gpu_worker.sleep)
    engine.release()
    engine.resume()
    assert record["calls"] == [("sleep", 1), ("wake_up", None)]  # wake_up without tags


def test_tp2_turns_off_peer_to_peer_all_reduces(monkeypatch):
    env = engine_environment(0, 2)
    assert {name: env[name] for name in vllm_rollout.P2P_ALLREDUCE_ENV} == dict.fromkeys(
        vllm_rollout.P2P_ALLREDUCE_ENV, "0"
    )
