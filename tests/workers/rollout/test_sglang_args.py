"""The SGLang rollout's settings and decisions, from the command line to `sglang.Engine(...)`, checked on CPU.

`sglang_engine_kwargs`, the sampling parameters, the reading of SGLang's results and the TP-group
helpers are pure, so they are checked here without sglang. The engine itself (sglang 0.5.23 building
on a GPU, loading the synced weights, sleeping and waking) is checked by the `gpu`-marked test in
tests/gpu/test_sglang_engine.py and the `sglang rollout` step of scripts/gpu_check.sh.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.rollout import make_prompts, rollout_config
from helpers.small_config import SMALL
from omegaconf import OmegaConf

from rlframe.config.key_status import ignored_key_warnings
from rlframe.config.loader import resolved
from rlframe.config.verl_keys import verl_defaults
from rlframe.trainer.config import compose, typed
from rlframe.workers.rollout import sglang_rollout
from rlframe.workers.rollout.base import ServedModel
from rlframe.workers.rollout.sampling import SamplingParams
from rlframe.workers.rollout.sglang_rollout import (
    SGLangRollout,
    check_engine_argument_names,
    group_payloads,
    max_new_tokens_for,
    response_from_output,
    sampling_params_for,
    scoped_visible_devices,
    sglang_engine_kwargs,
    visible_devices_for_group,
)

ROLLOUT = "actor_rollout_ref.rollout"
MAX_POSITIONS = 32768
SGLANG_SETTINGS = {  # rollout key -> (command-line text, the Engine argument and its value)
    "gpu_memory_utilization": ("0.6", "mem_fraction_static", 0.6),
    "max_num_seqs": ("512", "max_running_requests", 512),
    "max_num_batched_tokens": ("1536", "max_prefill_tokens", 1536),
    "max_model_len": ("2048", "context_length", 2048),
    "enable_prefix_caching": ("False", "disable_radix_cache", True),
    "enforce_eager": ("True", "disable_cuda_graph", True),
    "load_format": ("safetensors", "load_format", "safetensors"),
    "seed": ("7", "random_seed", 7),
}


@pytest.fixture
def sglang_importable(monkeypatch):
    """The launch checks as on a machine with sglang installed (this one has none)."""
    monkeypatch.setattr(sglang_rollout, "check_sglang_installed", lambda: None)


def rollout_section(*overrides: str):
    """`actor_rollout_ref.rollout` as the worker receives it (composed, resolved; sglang's install check aside)."""
    return resolved(compose([*overrides])).actor_rollout_ref.rollout


def engine_kwargs(rollout_cfg, dp_rank: int = 0, tp_size: int = 2) -> dict:
    return sglang_engine_kwargs(
        rollout_cfg,
        model=ServedModel("/models/m"),
        tp_size=tp_size,
        dtype=torch.bfloat16,
        dp_rank=dp_rank,
        max_position_embeddings=MAX_POSITIONS,
    )


# ---------------------------------------------------------------------------------------- engine arguments
def test_engine_kwargs_at_verl_defaults():
    assert engine_kwargs(rollout_section(), dp_rank=3) == {
        "model_path": "/models/m",
        "skip_tokenizer_init": True,
        "trust_remote_code": False,
        "tp_size": 2,
        "base_gpu_id": 0,
        "gpu_id_step": 1,
        "dtype": "bfloat16",
        "random_seed": 42 + 3,  # seed + the group's DP index, as verl seeds engine replicas
        "load_format": "dummy",
        "mem_fraction_static": 0.5,  # verl: gpu_memory_utilization
        "max_running_requests": 256,  # verl: max_num_seqs
        "chunked_prefill_size": 8192,
        "max_prefill_tokens": 8192,
        "disable_radix_cache": False,
        "disable_cuda_graph": False,  # verl: enforce_eager
        "enable_memory_saver": True,  # free_cache_engine
        "enable_weights_cpu_backup": True,
        "attention_backend": "flashinfer",  # verl 0.9.1's default for sglang >= 0.5.12
        "json_model_override_args": "{}",
        "log_level": "error",
    }  # no context_length: max_model_len=null leaves the model's own limit


def test_each_setting_reaches_its_engine_argument():
    overrides = [f"{ROLLOUT}.{name}={text}" for name, (text, _, _) in SGLANG_SETTINGS.items()]
    kwargs = engine_kwargs(rollout_section(*overrides), dp_rank=1)
    expected = {argument: value for _, (_, argument, value) in SGLANG_SETTINGS.items()}
    expected["random_seed"] = 7 + 1
    expected["chunked_prefill_size"] = 1536  # the same token budget while chunked prefill is on
    assert {name: kwargs[name] for name in expected} == expected


def test_chunked_prefill_off_and_free_cache_engine_off():
    kwargs = engine_kwargs(
        rollout_section(f"{ROLLOUT}.enable_chunked_prefill=False", f"{ROLLOUT}.free_cache_engine=False")
    )
    assert kwargs["chunked_prefill_size"] == -1  # SGLang: -1 disables chunked prefill
    assert kwargs["enable_memory_saver"] is False and kwargs["enable_weights_cpu_backup"] is False


def test_override_config_and_trust_remote_code_reach_the_engine():
    kwargs = sglang_engine_kwargs(
        rollout_section(),
        model=ServedModel("/m", trust_remote_code=True, override_config={"rope_theta": 5.0}),
        tp_size=1,
        dtype=torch.float16,
        dp_rank=0,
        max_position_embeddings=MAX_POSITIONS,
    )
    assert kwargs["json_model_override_args"] == '{"rope_theta": 5.0}'
    assert (kwargs["trust_remote_code"], kwargs["dtype"], kwargs["tp_size"]) == (True, "float16", 1)


def test_engine_kwargs_sglang_pass_through_and_win():
    kwargs = engine_kwargs(
        rollout_section(
            f"+{ROLLOUT}.engine_kwargs.sglang.attention_backend=triton",
            f"+{ROLLOUT}.engine_kwargs.sglang.mem_fraction_static=0.7",
            f"+{ROLLOUT}.engine_kwargs.sglang.enable_deterministic_inference=true",
            f"+{ROLLOUT}.engine_kwargs.sglang.cuda_graph_bs=[1,2,4]",
            f"+{ROLLOUT}.engine_kwargs.sglang.kv_cache_dtype=null",
        )
    )
    assert kwargs["attention_backend"] == "triton"  # verl's example scripts set it this way
    assert kwargs["mem_fraction_static"] == 0.7  # as in verl, engine_kwargs come last
    assert kwargs["enable_deterministic_inference"] is True
    assert kwargs["cuda_graph_bs"] == [1, 2, 4] and type(kwargs["cuda_graph_bs"]) is list  # plain containers
    assert "kv_cache_dtype" not in kwargs  # verl drops null entries


@pytest.mark.parametrize(
    "argument,instead",
    [
        ("tp_size=4", f"{ROLLOUT}.tensor_model_parallel_size"),
        ("model_path=/other", "actor_rollout_ref.model.path"),
        ("random_seed=3", f"{ROLLOUT}.seed"),
        ("enable_memory_saver=false", f"{ROLLOUT}.free_cache_engine"),
        ("context_length=4096", f"{ROLLOUT}.max_model_len"),
        ("base_gpu_id=2", "GPUs of its TP group"),
    ],
)
def test_engine_arguments_rlframe_owns_are_refused(argument, instead):
    override = f"+{ROLLOUT}.engine_kwargs.sglang.{argument}"
    name = argument.split("=")[0]
    with pytest.raises(ValueError, match=rf"engine_kwargs.sglang=.*rlframe sets {name} itself.*{instead}"):
        typed(compose([override]))  # at launch, before Ray, whatever the engine
    with pytest.raises(ValueError, match=rf"rlframe sets {name} itself.*{instead}"):
        engine_kwargs(rollout_section(override))  # and again where the engine is built


def test_unknown_engine_argument_is_named():
    check_engine_argument_names({"tp_size": 1, "attention_backend": "fa3"}, {"tp_size", "attention_backend"})
    with pytest.raises(ValueError, match=r"engine_kwargs.sglang: attention_backnd is not an argument"):
        check_engine_argument_names({"attention_backnd": "fa3"}, {"attention_backend"})


def test_max_model_len_above_the_model_limit_is_refused():
    with pytest.raises(ValueError, match=rf"{ROLLOUT}.max_model_len=40000 exceeds .*max_position_embeddings=32768"):
        engine_kwargs(rollout_section(f"{ROLLOUT}.max_model_len=40000"))


# ---------------------------------------------------------------------------------------- requests and results
def test_max_new_tokens_leave_one_position_free_as_verl():
    assert max_new_tokens_for(prompt_len=100, response_length=1024, max_model_len=4096) == 1024
    assert max_new_tokens_for(prompt_len=600, response_length=1024, max_model_len=1536) == 935  # 1536 - 600 - 1
    with pytest.raises(ValueError, match=rf"600 tokens leaves no room .*{ROLLOUT}.max_model_len=601"):
        max_new_tokens_for(prompt_len=600, response_length=1024, max_model_len=601)


def test_sampling_params_sampled_and_greedy():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, n=4, do_sample=True, response_length=32)
    assert sampling_params_for(params, [2, 7], 30, seed=11) == {
        "n": 1,  # the driver repeats prompts n times; each engine request is one sample
        "max_new_tokens": 30,
        "stop_token_ids": [2, 7],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # rlframe's 0 (off) is SGLang's -1
        "sampling_seed": 11,
    }
    greedy = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, n=1, do_sample=False, response_length=32)
    assert sampling_params_for(greedy, [2], 30, seed=11) == {
        "n": 1,
        "max_new_tokens": 30,
        "stop_token_ids": [2],
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
    }


def test_temperatures_sglang_would_turn_greedy_are_refused():
    params = SamplingParams(temperature=1e-7, top_p=1.0, top_k=-1, n=1, do_sample=True, response_length=8)
    with pytest.raises(ValueError, match=rf"{ROLLOUT}.temperature=1e-07: with {ROLLOUT}.name=sglang"):
        sampling_params_for(params, [2], 8, seed=0)


def test_response_keeps_the_eos_token_and_aligned_log_probs():
    output = {
        "output_ids": [5, 6, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [(-0.5, 5, None), (-1.5, 6, None), (-0.1, 2, None)],
        },
    }
    assert response_from_output(output, [2], width=8, with_log_probs=True) == ([5, 6, 2], [-0.5, -1.5, -0.1])
    assert response_from_output(output, [2], width=2, with_log_probs=False) == ([5, 6], None)
    without_eos = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}
    assert response_from_output(without_eos, [2], width=8, with_log_probs=False) == ([5, 6, 2], None)
    by_length = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2}}}
    assert response_from_output(by_length, [2], width=8, with_log_probs=False) == ([5, 6], None)


def test_misaligned_log_probs_are_an_error_not_a_shift():
    output = {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [(-0.5, 5, None), (-1.0, 9, None)]}}
    with pytest.raises(RuntimeError, match="do not match the 2 generated tokens"):
        response_from_output(output, [2], width=8, with_log_probs=True)


# ---------------------------------------------------------------------------------------- the TP group's engine
def test_each_tensor_gets_one_handle_per_tp_rank_in_rank_order():
    gathered = [[("a", b"a0"), ("b", b"b0")], [("a", b"a1"), ("b", b"b1")]]
    assert group_payloads(gathered) == [("a", [b"a0", b"a1"]), ("b", [b"b0", b"b1"])]
    with pytest.raises(RuntimeError, match="TP rank 1 sent other tensors"):
        group_payloads([[("a", b"a0")], [("b", b"b1")]])


def test_engine_sees_the_tp_groups_gpus_on_one_node_only():
    assert visible_devices_for_group([("n0", "4"), ("n0", "5")]) == "4,5"
    with pytest.raises(ValueError, match="spans hosts .*must divide trainer.n_gpus_per_node"):
        visible_devices_for_group([("n0", "7"), ("n1", "0")])


def test_visible_devices_are_scoped_to_the_engine_build(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with scoped_visible_devices("3,4"):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,4"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    with scoped_visible_devices(None):  # TP=1: the worker's own device, untouched
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


# ---------------------------------------------------------------------------------------- launch checks
def test_without_sglang_explain_and_train_refuse_naming_the_key_and_the_install(tmp_path, monkeypatch, capsys):
    from rlframe.explain.cli import main as explain_main
    from rlframe.trainer.main_ppo import prepare

    if sglang_rollout.importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    overrides = [*SMALL, f"trainer.default_local_dir={tmp_path / 'run'}", f"{ROLLOUT}.name=sglang"]
    with pytest.raises(ValueError) as err:
        prepare(overrides)  # `rlframe train`'s checks, before Ray
    message = str(err.value)
    assert f"{ROLLOUT}.name=sglang" in message and "not installed" in message
    assert "pip install 'rlframe[sglang]'" in message
    assert explain_main(overrides) == 2
    assert message in capsys.readouterr().err


def test_with_sglang_a_verl_command_is_taken_and_reaches_the_engine(sglang_importable, tmp_path, monkeypatch):
    from rlframe.trainer.main_ppo import check_config

    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    settings = [f"{ROLLOUT}.{name}={text}" for name, (text, _, _) in SGLANG_SETTINGS.items()]
    overrides = [
        *SMALL,
        f"{ROLLOUT}.name=sglang",
        *settings,
        f"+{ROLLOUT}.engine_kwargs.sglang.attention_backend=triton",
        f"{ROLLOUT}.multi_stage_wake_up=True",
    ]
    composed, cfg, _, _ = check_config(overrides)
    warnings = ignored_key_warnings(composed, overrides)
    assert [w for w in warnings if ROLLOUT in w] == [
        f"rlframe: warning: {ROLLOUT}.multi_stage_wake_up=True has no effect: rlframe, like verl 0.9.1, "
        "always wakes the weights, syncs them, then wakes the KV cache"
    ]
    kwargs = engine_kwargs(cfg.actor_rollout_ref.rollout)
    assert kwargs["attention_backend"] == "triton" and kwargs["mem_fraction_static"] == 0.6


def test_sglang_keys_warn_under_other_engines():
    for engine in ("hf", "vllm"):
        overrides = [f"{ROLLOUT}.name={engine}", f"+{ROLLOUT}.engine_kwargs.sglang.attention_backend=triton"]
        warnings = ignored_key_warnings(compose(overrides), overrides)
        assert any(
            f"engine_kwargs.sglang.attention_backend=triton has no effect: {ROLLOUT}.name={engine}" in w
            for w in warnings
        ), warnings


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([f"{ROLLOUT}.temperature=1e-7"], rf"{ROLLOUT}.temperature=1e-07: with {ROLLOUT}.name=sglang"),
        (
            [f"{ROLLOUT}.val_kwargs.do_sample=true", f"{ROLLOUT}.val_kwargs.temperature=1e-8"],
            rf"{ROLLOUT}.val_kwargs.temperature=1e-08",
        ),
        (
            [f"{ROLLOUT}.tensor_model_parallel_size=4", "trainer.n_gpus_per_node=6"],
            r"tensor_model_parallel_size=4 with .*name=sglang must divide trainer.n_gpus_per_node=6",
        ),
    ],
)
def test_sglang_limits_are_checked_at_launch(sglang_importable, overrides, message):
    with pytest.raises(ValueError, match=message):
        typed(compose([f"{ROLLOUT}.name=sglang", *overrides]))


def test_sglang_keys_default_to_verl_091():
    defaults = verl_defaults()
    cfg = rollout_section()
    assert OmegaConf.select(cfg, "multi_stage_wake_up") == defaults[f"{ROLLOUT}.multi_stage_wake_up"] is False
    assert cfg.engine_kwargs.sglang == defaults[f"{ROLLOUT}.engine_kwargs.sglang"] == {}


# ---------------------------------------------------------------------------------------- wake-up order
class RecordingEngine:
    """Records the engine calls the rollout makes; a test of their ORDER only, not an engine."""

    def __init__(self):
        self.calls = []

    def release_memory_occupation(self, tags):
        self.calls.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags):
        self.calls.append(("resume", tuple(tags)))

    def update_weights_from_tensor(self, names):
        self.calls.append(("update_weights", tuple(names)))

    def flush_cache(self):
        self.calls.append(("flush_cache",))

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append(("generate", len(input_ids)))
        eos = sampling_params[0]["stop_token_ids"][0]
        return [
            {"output_ids": [7, eos], "meta_info": {"finish_reason": {"type": "stop", "matched": eos}}}
            for _ in input_ids
        ]


def recording_rollout(free_cache_engine: bool) -> tuple[SGLangRollout, RecordingEngine]:
    """An SGLangRollout around a RecordingEngine (no sglang, no GPU): only its calls' order is real."""
    cfg = rollout_config(f"{ROLLOUT}.free_cache_engine={free_cache_engine}", f"{ROLLOUT}.calculate_log_probs=False")
    rollout = object.__new__(SGLangRollout)
    rollout.config, rollout.eos_ids, rollout.pad_id = cfg, [2], 0
    rollout.tp_group, rollout.tp_size, rollout.tp_rank, rollout.seed, rollout.dp_rank = None, 1, 0, 42, 0
    rollout.dtype, rollout.device, rollout.max_model_len = torch.float32, torch.device("cpu"), 2048
    rollout.engine = RecordingEngine()
    rollout._released = rollout._kv_cache_asleep = False
    rollout._load_bucket = lambda bucket: rollout.engine.update_weights_from_tensor([name for name, _ in bucket])
    return rollout, rollout.engine


def _one_step(rollout: SGLangRollout) -> None:
    """What ActorRolloutRefWorker.generate_sequences does: resume, sync, generate, release."""
    rollout.resume()
    rollout.update_weights([("w", torch.ones(2)), ("b", torch.zeros(1))])
    rollout.generate_sequences(make_prompts())
    rollout.release()


def test_weights_wake_then_sync_then_kv_cache_then_generate():
    rollout, engine = recording_rollout(free_cache_engine=True)
    _one_step(rollout)  # the engine starts awake (first sync right after it was built)
    engine.calls.clear()
    _one_step(rollout)
    assert engine.calls == [
        ("resume", ("weights",)),
        ("update_weights", ("w", "b")),
        ("flush_cache",),
        ("resume", ("kv_cache",)),
        ("generate", len(make_prompts())),
        ("release", ("kv_cache", "weights")),
    ]


def test_generating_while_released_is_refused_and_without_free_cache_engine_nothing_sleeps():
    rollout, engine = recording_rollout(free_cache_engine=True)
    rollout.release()
    with pytest.raises(RuntimeError, match="call resume"):
        rollout.generate_sequences(make_prompts())
    rollout, engine = recording_rollout(free_cache_engine=False)
    _one_step(rollout)
    _one_step(rollout)
    assert [call[0] for call in engine.calls] == ["update_weights", "flush_cache", "generate"] * 2


def test_engine_settings_reported_without_effect_per_engine(sglang_importable):
    micro, log_stats, max_seqs = (
        f"{ROLLOUT}.{name}" for name in ("micro_batch_size", "disable_log_stats", "max_num_seqs")
    )

    def warned(engine: str) -> set[str]:
        overrides = [f"{ROLLOUT}.name={engine}", f"{micro}=4", f"{log_stats}=False", f"{max_seqs}=8"]
        lines = ignored_key_warnings(compose(overrides), overrides)
        return {line.removeprefix("rlframe: warning: ").split("=")[0] for line in lines} & {micro, log_stats, max_seqs}

    assert warned("hf") == {log_stats, max_seqs}  # the HF engine batches by micro_batch_size
    assert warned("vllm") == {micro}
    assert warned("sglang") == {micro, log_stats}  # SGLang reads max_num_seqs (max_running_requests)


def _rank0_call_worker(rank: int) -> dict:
    import torch.distributed as dist

    rollout = object.__new__(SGLangRollout)
    rollout.tp_group, rollout.tp_size, rollout.tp_rank = dist.group.WORLD, 2, rank

    def engine_fails():
        raise ValueError("engine died")

    outcome = {"result": rollout._on_rank0(lambda: [[5, 2], [7]])}  # only rank 0 runs the call
    try:
        rollout._on_rank0(engine_fails)
    except (ValueError, RuntimeError) as err:
        outcome["error"] = f"{type(err).__name__}: {err}"
    return outcome


def test_tp_peers_get_rank0s_result_and_raise_with_its_error():
    """The peers of the engine's rank wait for its outcome: they get its result, or fail when it fails."""
    from helpers.world import spawned_world

    rank0, rank1 = spawned_world(2).run(_rank0_call_worker)
    assert rank0["result"] == rank1["result"] == [[5, 2], [7]]
    assert rank0["error"] == "ValueError: engine died"
    assert rank1["error"] == (
        "RuntimeError: the SGLang engine on TP rank 0 of this rollout group failed: ValueError: engine died"
    )
