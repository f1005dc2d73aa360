"""vLLM's engine settings: verl 0.9.1's names, defaults and meanings, from the command line to `LLM(...)`.

`vllm_engine_kwargs` is pure, so everything up to the engine is checked on CPU without vllm; the
test that starts an engine is marked `gpu`.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlframe.config.key_status import ignored_key_warnings
from rlframe.config.loader import resolved
from rlframe.config.verl_keys import verl_defaults
from rlframe.trainer.config import compose, typed
from rlframe.workers.rollout.base import ServedModel, request_seeds
from rlframe.workers.rollout.vllm_rollout import (
    VLLM_ONLY_KEYS,
    max_tokens_for,
    model_max_position_embeddings,
    vllm_engine_kwargs,
)

ROLLOUT = "actor_rollout_ref.rollout"
MAX_POSITIONS = 32768  # Qwen2.5's

# A verl GRPO command line (the shape of verl's examples/grpo_trainer scripts) with every vLLM setting
# at a value other than verl's default.
VERL_COMMAND = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=8",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=True",
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    f"{ROLLOUT}.n=4",
    f"{ROLLOUT}.tensor_model_parallel_size=1",
    "trainer.n_gpus_per_node=2",
]
VLLM_SETTINGS = {
    "gpu_memory_utilization": ("0.6", 0.6),
    "enable_chunked_prefill": ("False", False),
    "max_num_seqs": ("512", 512),
    "max_num_batched_tokens": ("1536", 1536),
    "max_model_len": ("1536", 1536),
    "load_format": ("safetensors", "safetensors"),
    "enforce_eager": ("True", True),
    "enable_prefix_caching": ("False", False),
    "disable_log_stats": ("False", False),
    "seed": ("7", 7),
}
PASSTHROUGH = "+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True"


def verl_command(engine: str) -> list[str]:
    settings = [f"{ROLLOUT}.{name}={text}" for name, (text, _) in VLLM_SETTINGS.items()]
    return [*VERL_COMMAND, f"{ROLLOUT}.name={engine}", *settings, PASSTHROUGH]


def rollout_section(*overrides: str):
    """`actor_rollout_ref.rollout` as the worker receives it: composed, checked, resolved."""
    cfg = compose([f"{ROLLOUT}.name=vllm", *overrides])
    typed(cfg)
    return resolved(cfg).actor_rollout_ref.rollout


def engine_kwargs(rollout_cfg, dp_rank: int = 0) -> dict:
    return vllm_engine_kwargs(
        rollout_cfg,
        model=ServedModel("/models/m"),
        tp_size=2,
        dtype=torch.bfloat16,
        dp_rank=dp_rank,
        max_position_embeddings=MAX_POSITIONS,
    )


# ---------------------------------------------------------------------------------------- defaults
def test_vllm_keys_default_to_verl_091():
    defaults = verl_defaults()
    cfg = rollout_section()
    for name in VLLM_ONLY_KEYS:
        assert OmegaConf.select(cfg, name) == defaults[f"{ROLLOUT}.{name}"], name
    for engine in ("vllm", "sglang", "trtllm"):
        assert cfg.engine_kwargs[engine] == defaults[f"{ROLLOUT}.engine_kwargs.{engine}"] == {}


def test_engine_kwargs_at_verl_defaults():
    assert engine_kwargs(rollout_section(), dp_rank=3) == {
        "model": "/models/m",
        "skip_tokenizer_init": True,
        "trust_remote_code": False,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "external_launcher",
        "dtype": "bfloat16",
        "seed": 42 + 3,  # verl: seed + replica rank
        "load_format": "dummy",
        "gpu_memory_utilization": 0.5,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "max_model_len": MAX_POSITIONS,  # verl: null = the model's max_position_embeddings
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "enforce_eager": False,
        "disable_log_stats": True,
        "enable_sleep_mode": True,
        "logprobs_mode": "processed_logprobs",
        "disable_custom_all_reduce": True,  # one visible GPU per process (issue: TP > 1 crashed)
        "hf_overrides": None,
    }


# ---------------------------------------------------------------------------------------- overrides
def test_each_setting_reaches_the_engine_arguments():
    overrides = [f"{ROLLOUT}.{name}={text}" for name, (text, _) in VLLM_SETTINGS.items()]
    kwargs = engine_kwargs(rollout_section(*overrides), dp_rank=1)
    expected = {name: value for name, (_, value) in VLLM_SETTINGS.items()}
    expected["seed"] = 7 + 1
    assert {name: kwargs[name] for name in expected} == expected


def test_engine_kwargs_vllm_pass_through_and_win():
    kwargs = engine_kwargs(
        rollout_section(
            f"{ROLLOUT}.gpu_memory_utilization=0.6",
            f"+{ROLLOUT}.engine_kwargs.vllm.gpu_memory_utilization=0.7",
            f"+{ROLLOUT}.engine_kwargs.vllm.swap_space=4",
            f"+{ROLLOUT}.engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL_DECODE_ONLY",
            f"+{ROLLOUT}.engine_kwargs.vllm.kv_cache_dtype=null",
        )
    )
    assert kwargs["gpu_memory_utilization"] == 0.7  # as in verl, engine_kwargs come last
    assert kwargs["swap_space"] == 4
    assert kwargs["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert type(kwargs["compilation_config"]) is dict  # plain containers, not OmegaConf nodes
    assert "kv_cache_dtype" not in kwargs  # verl drops null entries


@pytest.mark.parametrize(
    "argument,instead",
    [
        ("tensor_parallel_size=4", f"{ROLLOUT}.tensor_model_parallel_size"),
        ("distributed_executor_backend=mp", "external_launcher"),
        ("model=/other", "actor_rollout_ref.model.path"),
        ("seed=3", f"{ROLLOUT}.seed"),
        ("enable_sleep_mode=false", f"{ROLLOUT}.free_cache_engine"),
        ("disable_custom_all_reduce=false", "each process sees one GPU"),
    ],
)
def test_engine_arguments_rlframe_owns_are_refused(argument, instead):
    override = f"+{ROLLOUT}.engine_kwargs.vllm.{argument}"
    name = argument.split("=")[0]
    with pytest.raises(ValueError, match=rf"engine_kwargs.vllm=.*rlframe sets {name} itself.*{instead}"):
        typed(compose([f"{ROLLOUT}.name=vllm", override]))  # at launch, before Ray
    cfg = resolved(compose([f"{ROLLOUT}.name=vllm", override])).actor_rollout_ref.rollout
    with pytest.raises(ValueError, match=rf"rlframe sets {name} itself.*{instead}"):
        engine_kwargs(cfg)  # and again where the engine is built


@pytest.mark.parametrize("engine", ["trtllm"])  # sglang's: tests/workers/rollout/test_sglang_args.py
def test_arguments_for_engines_rlframe_lacks_are_refused(engine):
    with pytest.raises(
        ValueError,
        match=rf"engine_kwargs.{engine}=.*rlframe has no {engine} engine.*"
        rf"engine_kwargs.vllm",
    ):
        typed(compose([f"+{ROLLOUT}.engine_kwargs.{engine}.attention_backend=triton"]))


def test_chunked_prefill_off_raises_the_token_budget_to_max_model_len():
    kwargs = engine_kwargs(rollout_section(f"{ROLLOUT}.enable_chunked_prefill=False"))
    assert kwargs["max_num_batched_tokens"] == MAX_POSITIONS  # verl raises 8192 to max_model_len likewise
    kwargs = engine_kwargs(
        rollout_section(
            f"{ROLLOUT}.enable_chunked_prefill=False",
            f"{ROLLOUT}.max_model_len=1536",
            f"{ROLLOUT}.max_num_batched_tokens=1024",
        )
    )
    assert (kwargs["max_num_batched_tokens"], kwargs["max_model_len"]) == (1536, 1536)
    kwargs = engine_kwargs(rollout_section(f"{ROLLOUT}.max_model_len=1536", f"{ROLLOUT}.max_num_batched_tokens=1024"))
    assert kwargs["max_num_batched_tokens"] == 1024  # with chunked prefill the budget may be below max_model_len


def test_max_model_len_above_the_model_limit_is_refused():
    with pytest.raises(ValueError, match=rf"{ROLLOUT}.max_model_len=40000 exceeds .*max_position_embeddings=32768"):
        engine_kwargs(rollout_section(f"{ROLLOUT}.max_model_len=40000"))


@pytest.mark.parametrize(
    "override,message",
    [
        ("gpu_memory_utilization=0", r"gpu_memory_utilization=0.0: must be in \(0, 1\]"),
        ("gpu_memory_utilization=1.2", r"gpu_memory_utilization=1.2: must be in \(0, 1\]"),
        ("max_num_seqs=0", r"max_num_seqs=0: must be >= 1"),
        ("max_num_batched_tokens=0", r"max_num_batched_tokens=0: must be >= 1"),
        ("max_model_len=0", r"max_model_len=0: must be >= 1, or null"),
    ],
)
def test_bad_values_are_refused_at_launch_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        typed(compose([f"{ROLLOUT}.{override}"]))


def test_max_tokens_are_cut_to_what_max_model_len_leaves():
    assert max_tokens_for(prompt_len=100, response_length=1024, max_model_len=4096) == 1024
    assert max_tokens_for(prompt_len=600, response_length=1024, max_model_len=1536) == 936
    with pytest.raises(ValueError, match=rf"600 tokens leaves no room .*{ROLLOUT}.max_model_len=600"):
        max_tokens_for(prompt_len=600, response_length=1024, max_model_len=600)


def test_request_seeds_follow_rollout_seed_and_dp_rank():
    seeds = request_seeds(draw=123, seed=42, dp_rank=0, count=64)
    assert seeds == request_seeds(draw=123, seed=42, dp_rank=0, count=64)  # reproducible
    assert len(set(seeds)) == 64 and all(0 <= s < 2**31 for s in seeds)
    assert seeds[:8] == request_seeds(draw=123, seed=42, dp_rank=0, count=8)  # a prefix does not depend on count
    others = [request_seeds(123, 43, 0, 64), request_seeds(123, 42, 1, 64), request_seeds(124, 42, 0, 64)]
    for other in others:
        assert not set(other) & set(seeds)


def test_max_position_embeddings_come_from_the_model_config(tiny_model_path):
    assert model_max_position_embeddings(tiny_model_path) == 2048
    assert model_max_position_embeddings(tiny_model_path, override_config={"max_position_embeddings": 512}) == 512


# ---------------------------------------------------------------------------------------- launch checks
def test_verl_command_with_vllm_settings_is_taken_and_reaches_the_engine(tmp_path, monkeypatch):
    from rlframe.trainer.main_ppo import check_config

    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    overrides = verl_command("vllm")
    composed, cfg, _, _ = check_config(overrides)
    assert ignored_key_warnings(composed, overrides) == []
    kwargs = engine_kwargs(cfg.actor_rollout_ref.rollout)
    assert {name: kwargs[name] for name in VLLM_SETTINGS} == {
        **{name: value for name, (_, value) in VLLM_SETTINGS.items()},
        "seed": 7,
    }
    assert kwargs["disable_mm_preprocessor_cache"] is True


def test_verl_command_with_vllm_settings_warns_each_key_under_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    overrides = verl_command("hf")
    warnings = ignored_key_warnings(compose(overrides), overrides)
    warned = {line.split(" has no effect")[0].removeprefix("rlframe: warning: ").split("=")[0] for line in warnings}
    expected = {f"{ROLLOUT}.{name}" for name in VLLM_SETTINGS}
    expected.add(PASSTHROUGH.lstrip("+").split("=")[0])
    assert warned == expected
    assert all(f"{ROLLOUT}.name=hf: a vLLM setting" in line for line in warnings)


def test_over_sample_rate_is_taken_and_reported_without_effect_as_in_verl():
    # verl 0.9.1 declares rollout.over_sample_rate (abort the last requests once (1 - rate) are done) and
    # reads it nowhere: every request runs to its end there, and here
    assert verl_defaults()[f"{ROLLOUT}.over_sample_rate"] == 0
    assert OmegaConf.select(compose([]), f"{ROLLOUT}.over_sample_rate") == 0
    overrides = [f"{ROLLOUT}.name=vllm", f"{ROLLOUT}.over_sample_rate=0.1"]
    composed = compose(overrides)
    typed(composed)
    assert [w for w in ignored_key_warnings(composed, overrides) if "over_sample_rate" in w] == [
        f"rlframe: warning: {ROLLOUT}.over_sample_rate=0.1 has no effect: rlframe, like verl 0.9.1 (which reads "
        "it nowhere), finishes every request"
    ]
    with pytest.raises(ValueError, match=r"over_sample_rate=1.5: must be in \[0, 1\)"):
        typed(compose([f"{ROLLOUT}.over_sample_rate=1.5"]))
