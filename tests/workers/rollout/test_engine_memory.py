"""A vLLM engine whose configured size cannot fit its machine is refused on the driver, before Ray starts, naming
the keys and a size that fits (rlframe/workers/rollout/engine_memory.py). The arithmetic is checked here with pure
functions and through `check_config`, without vLLM (it lives in an environment of its own).

Before: vLLM's CPU engine at max_num_seqs=1024 with no max_model_len on a 24 GiB machine (2 workers) took half the
machine for its KV caches, and Ray's memory monitor killed a worker with no word about the setting behind it.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers.small_config import SMALL

from rlframe.workers.rollout import engine_memory
from rlframe.workers.rollout.engine_memory import check_cpu_engines, check_gpu_engine
from rlframe.workers.rollout.vllm_cpu import cpu_kv_cache_bytes, sequence_kv_bytes, user_kv_cache_bytes

ROLLOUT = "actor_rollout_ref.rollout"
GiB = 2**30
# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 → 46,080 bytes of fp32 KV cache a token
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
SMOLLM2_TOKEN = 2 * 30 * 3 * 64 * 4


@pytest.fixture()
def smollm2_folder(tmp_path):
    """A model folder with SmolLM2-135M's config (the launch checks read config.json only)."""
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2))
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


@pytest.fixture()
def machine_of_24_gib(monkeypatch):
    """The driver sees a 24 GiB machine with 22 GiB available."""
    monkeypatch.setattr(engine_memory, "machine_memory_bytes", lambda: 24 * GiB)
    monkeypatch.setattr(engine_memory, "available_memory_bytes", lambda: 22 * GiB)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def vllm_cpu_run(model_path: str, *overrides: str) -> list[str]:
    return [
        *SMALL,
        f"actor_rollout_ref.model.path={model_path}",
        f"{ROLLOUT}.name=vllm",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        *overrides,
    ]


def test_the_engine_at_verls_size_is_refused_before_ray_and_the_size_it_names_fits(smollm2_folder, machine_of_24_gib):
    from rlframe.trainer.main_ppo import check_config

    with pytest.raises(ValueError) as info:
        check_config(vllm_cpu_run(smollm2_folder, f"{ROLLOUT}.max_num_seqs=1024"))
    message = str(info.value)
    assert message.startswith(
        f"{ROLLOUT}.max_num_seqs=1024 sequences of max_model_len=8192 tokens need 360.00 GiB of KV cache in each "
        f"vLLM engine, more than this machine gives each: {ROLLOUT}.gpu_memory_utilization=0.5 × 24.00 GiB / 2 "
        "engine(s) on the machine = 6.00 GiB"
    ), message
    # the sizes it offers: at the model's context, and at the job's prompt + response (64 + 16 tokens)
    at_context = int(re.search(rf"{ROLLOUT}\.max_num_seqs=(\d+)", message.split("A size that fits:")[1]).group(1))
    at_job = int(re.search(r"max_model_len=80 \(prompt \+ response\) with max_num_seqs<=(\d+)", message).group(1))
    assert (at_context, at_job) == (17, 1092)
    for fitting in (
        [f"{ROLLOUT}.max_num_seqs={at_context}"],
        [f"{ROLLOUT}.max_model_len=80", f"{ROLLOUT}.max_num_seqs={at_job}"],
    ):
        check_config(vllm_cpu_run(smollm2_folder, *fitting))  # accepted
    with pytest.raises(ValueError, match="max_num_seqs=18 sequences"):
        check_config(vllm_cpu_run(smollm2_folder, f"{ROLLOUT}.max_num_seqs={at_context + 1}"))


def test_the_cpu_cache_is_what_the_configured_batch_needs_within_the_workers_share():
    sizes = dict(max_model_len=200, bytes_per_token=1000, memory_fraction=0.5, total_memory=10**9, workers_on_machine=2)
    assert sequence_kv_bytes(200, 1000) == 256 * 1000  # two blocks of 128 tokens
    assert cpu_kv_cache_bytes(max_num_seqs=976, **sizes) == 976 * 256_000  # within 250 MB: allocated as needed
    with pytest.raises(ValueError, match=rf"A size that fits: {ROLLOUT}\.max_num_seqs=976$"):
        cpu_kv_cache_bytes(max_num_seqs=977, **sizes)
    with pytest.raises(ValueError, match="a larger actor_rollout_ref.rollout.gpu_memory_utilization"):
        cpu_kv_cache_bytes(max_num_seqs=1, **{**sizes, "total_memory": 10**5})  # not even one sequence


def test_a_cache_the_user_sets_is_used_as_is_and_refused_only_where_the_machine_cannot_hold_it():
    assert user_kv_cache_bytes({}, {}) is None
    assert user_kv_cache_bytes({}, {"VLLM_CPU_KVCACHE_SPACE": "0"}) is None  # vLLM's "unset"
    assert user_kv_cache_bytes({}, {"VLLM_CPU_KVCACHE_SPACE": "4"}) == (
        4 * GiB,
        "VLLM_CPU_KVCACHE_SPACE (environment variable, GiB)",
    )
    assert user_kv_cache_bytes({"kv_cache_memory_bytes": 10**9}, {"VLLM_CPU_KVCACHE_SPACE": "4"})[0] == 10**9
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE='lots' is not a number of GiB"):
        user_kv_cache_bytes({}, {"VLLM_CPU_KVCACHE_SPACE": "lots"})

    machine = dict(
        max_num_seqs=1024,  # vLLM schedules within the user's cache: the batch need not fit it at once
        max_model_len=8192,
        bytes_per_token=SMOLLM2_TOKEN,
        available_memory=22 * GiB,
        workers_on_machine=2,
    )
    check_cpu_engines(cache=4 * GiB, source="VLLM_CPU_KVCACHE_SPACE", **machine)  # accepted
    with pytest.raises(ValueError) as info:
        check_cpu_engines(cache=40 * GiB, source="VLLM_CPU_KVCACHE_SPACE", **machine)
    assert str(info.value) == (
        "2 vLLM engine(s) on this machine with 40.00 GiB of KV cache each (VLLM_CPU_KVCACHE_SPACE) need 80.00 GiB, "
        "but the machine has 22.00 GiB available now; the training needs its own share besides. "
        "A size that fits: VLLM_CPU_KVCACHE_SPACE of at most 11.00 GiB"
    )
    source = f"{ROLLOUT}.engine_kwargs.vllm.kv_cache_memory_bytes"
    with pytest.raises(ValueError, match=r"less than one sequence of .*max_model_len=8192 tokens needs \(360 MiB\)"):
        check_cpu_engines(cache=100 * 2**20, source=source, **machine)


def test_rlframes_cache_is_refused_where_the_machine_has_not_that_much_available_now():
    sizes = dict(max_num_seqs=64, max_model_len=1024, bytes_per_token=SMOLLM2_TOKEN, workers_on_machine=4)
    cache = cpu_kv_cache_bytes(memory_fraction=0.9, total_memory=24 * GiB, **sizes)  # within the share: 2.81 GiB
    with pytest.raises(
        ValueError, match=rf"has 1.00 GiB available now; .* A size that fits: {ROLLOUT}\.max_num_seqs=5$"
    ):
        check_cpu_engines(cache=cache, source=None, available_memory=1 * GiB, **sizes)  # a busy machine


def test_a_gpu_engine_without_room_for_one_sequence_is_refused_and_the_sizes_it_names_fit():
    """Qwen2.5-7B in bf16 (15.2 GB of weights, 57,344 KV bytes a token) at 20% of an 80 GiB GPU."""
    engine = dict(weight_bytes=15_231_233_024, bytes_per_token=57_344, total_memory=80 * GiB, free_memory=79 * GiB)
    with pytest.raises(ValueError) as info:
        check_gpu_engine(max_model_len=65536, memory_fraction=0.2, **engine)
    message = str(info.value)
    assert "its weights take 14.19 GiB, leaving 1.81 GiB for the KV cache, less than one sequence" in message
    fits = message.split("A size that fits: ")[1]
    fit_len = int(re.search(rf"{ROLLOUT}\.max_model_len=(\d+)", fits).group(1))
    fit_fraction = float(re.search(rf"{ROLLOUT}\.gpu_memory_utilization=([\d.]+)", fits).group(1))
    assert (fit_len, fit_fraction) == (33968, 0.23)
    assert check_gpu_engine(max_model_len=fit_len, memory_fraction=0.2, **engine) >= 0
    assert check_gpu_engine(max_model_len=65536, memory_fraction=fit_fraction, **engine) >= 0
    with pytest.raises(ValueError):
        check_gpu_engine(max_model_len=fit_len + 16, memory_fraction=0.2, **engine)
    # the budget is capped by what is free now: 0.9 of the device is not there when other processes hold most of it
    with pytest.raises(ValueError, match=r"min\(.*gpu_memory_utilization=0.9 × 80.00 GiB, 15.00 GiB free now\)"):
        check_gpu_engine(max_model_len=32768, memory_fraction=0.9, **{**engine, "free_memory": 15 * GiB})
