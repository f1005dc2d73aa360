"""The SGLang rollout on a GPU (`pytest -m gpu`; scripts/gpu_check.sh's `sglang rollout` and `sglang tp2` steps).

What the CPU tests cannot check: that sglang 0.5.23 builds the engine from `sglang_engine_kwargs`, that
the weights synced through CUDA IPC reach every TP scheduler, that release/resume frees and restores the
memory, and that the engine's log-probs are the model's. Log-probs are compared as in tests/gpu/test_gpu.py:
within `BF16_SLACK` times the plain HF bf16 forward's own distance to fp32, never bit for bit.
Skipped with "sglang not installed" where the `sglang` extra is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.gpu_logprobs import BF16_SLACK, FLOOR, _hf_log_probs, _mean_abs
from helpers.world import free_port, join_tp2_gpu_world

pytestmark = pytest.mark.gpu


def _sglang_config(*overrides: str):
    from helpers.rollout import typed_rollout

    from rlframe.config.loader import load_config

    base = [
        "data.max_prompt_length=16",
        "data.max_response_length=24",
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.dtype=bf16",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.max_model_len=64",
    ]
    return typed_rollout(load_config([*base, *overrides]))


def _build(cfg, model: str, tokenizer, tp_group=None):
    """The engine itself (not wrapped in agent loops), as `build_rollout` builds it."""
    from rlframe.workers.rollout.base import ServedModel
    from rlframe.workers.rollout.sglang_rollout import SGLangRollout

    return SGLangRollout(cfg, ServedModel(model), tokenizer, "cuda", tp_group)


def _free_gpu_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_sglang_rollout_weight_sync_release_and_log_probs(smollm2, monkeypatch):  # noqa: F811
    """Engine built from the rollout settings; release frees memory; resume + a full sync bring the actor's
    weights (log-probs as HF's within bf16 error, and the second sync takes effect); RNG untouched."""
    pytest.importorskip("sglang", reason="sglang not installed")
    from helpers.rollout import load_tokenizer, make_prompts
    from transformers import AutoModelForCausalLM

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = _sglang_config("actor_rollout_ref.rollout.load_format=dummy")
    torch.manual_seed(1234)
    rng_before = (torch.get_rng_state(), torch.cuda.get_rng_state())
    engine = _build(cfg, smollm2, load_tokenizer(smollm2))
    try:
        assert torch.equal(torch.get_rng_state(), rng_before[0])
        assert torch.equal(torch.cuda.get_rng_state(), rng_before[1])
        base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).state_dict()
        gen = torch.Generator().manual_seed(0)
        perturbed = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) for k, v in base.items()}
        previous = None
        for state in (base, perturbed):
            awake = _free_gpu_bytes()
            engine.release()  # KV cache and weights (a CPU copy kept); every weight is synced again
            freed = _free_gpu_bytes() - awake
            print(f"SGLang release freed {freed / 2**30:.2f} GiB")
            assert freed > 2**30  # mem_fraction_static 0.3 of the GPU: the KV cache alone is far more
            engine.resume()
            engine.update_weights(state.items())
            out = engine.generate_sequences(make_prompts(seed=3, do_sample=True)).batch
            batch = {k: out[k].cpu() for k in ("input_ids", "attention_mask", "position_ids", "responses")}
            mask = out["response_mask"].cpu()
            engine_lp = out["rollout_log_probs"].cpu()
            assert int(mask.sum()) > 0
            fp32 = _hf_log_probs(smollm2, state, batch, torch.float32)
            bf16 = _hf_log_probs(smollm2, state, batch, torch.bfloat16)
            engine_error, reference_error = _mean_abs(engine_lp, fp32, mask), _mean_abs(bf16, fp32, mask)
            print(f"SGLang log-prob error {engine_error:.2e}, HF bf16 error {reference_error:.2e}")
            assert engine_error <= BF16_SLACK * reference_error + FLOOR
            if previous is not None:  # the second sync took effect: HF under the old weights disagrees
                old_state_lp = _hf_log_probs(smollm2, previous, batch, torch.float32)
                assert _mean_abs(engine_lp, old_state_lp, mask) > BF16_SLACK * reference_error + FLOOR
            previous = state
    finally:
        engine.shutdown()


def _tp2_worker(rank: int, port: int, model: str, out_dir: str) -> None:
    """One of two processes, each shown one GPU as Ray shows it; rank 0 holds the TP group's engine."""
    import torch.distributed as dist

    tp_group = join_tp2_gpu_world(rank, port)
    from helpers.rollout import load_tokenizer, make_prompts
    from transformers import AutoModelForCausalLM

    from rlframe.workers.rollout import generate_in_tp_group

    cfg = _sglang_config(
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.load_format=dummy"
    )
    engine = _build(cfg, model, load_tokenizer(model), tp_group)
    try:
        engine.release()
        engine.resume()
        engine.update_weights(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict().items())
        out = generate_in_tp_group(engine, make_prompts(seed=4, do_sample=False).to("cuda"), tp_group).batch
        keys = ("input_ids", "attention_mask", "position_ids", "responses", "rollout_log_probs", "response_mask")
        torch.save({k: out[k].cpu() for k in keys}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        engine.shutdown()
        dist.destroy_process_group()


def test_sglang_tp2_engine_on_the_groups_gpus(tmp_path):
    """TP=2 with one visible GPU per process: rank 0's engine runs a scheduler on each rank's GPU, the dummy
    weights are replaced through each rank's own CUDA IPC handles, and both ranks get log-probs as HF's."""
    pytest.importorskip("sglang", reason="sglang not installed")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from helpers.gpu_models import tp2_stand_in

    model = tp2_stand_in(str(tmp_path / "model"))
    torch.multiprocessing.spawn(_tp2_worker, args=(free_port(), model, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        share = torch.load(tmp_path / f"rank{rank}.pt")
        batch = {k: share[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
        mask = share["response_mask"]
        fp32 = _hf_log_probs(model, None, batch, torch.float32)
        bf16 = _hf_log_probs(model, None, batch, torch.bfloat16)
        engine_error, reference_error = _mean_abs(share["rollout_log_probs"], fp32, mask), _mean_abs(bf16, fp32, mask)
        print(f"sglang tp2 rank {rank} log-prob error {engine_error:.2e}, HF bf16 error {reference_error:.2e}")
        assert engine_error <= BF16_SLACK * reference_error + FLOOR
