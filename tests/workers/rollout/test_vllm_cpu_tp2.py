"""rollout.tensor_model_parallel_size=2 on vLLM's CPU build: two worker processes (gloo) share one engine's shards.

Each process builds the engine in its own process (external_launcher) over a TP group of both, samples the group's
rows (`generate_in_tp_group`: the group's prompts gathered, one seed) and keeps its share; a weight sync sends each
rank the whole state dict and vLLM's loader keeps the rank's shard. The model is SmolLM2's head size (64) with heads
that split over two ranks. Checked against transformers on the same weights: greedy tokens equal, log-probs at fp32
noise, before and after an update.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.rollout import load_tokenizer, make_prompts
from helpers.vllm_cpu import (
    PROB_DIFF_MAX,
    PROB_DIFF_MEAN,
    hf_greedy,
    hf_token_log_probs,
    rollout_cfg,
    updated,
    vllm_rows,
)
from helpers.world import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROLLOUT = "actor_rollout_ref.rollout"


def _worker(rank: int, port: int, model: str, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlframe.workers.rollout import build_rollout, generate_in_tp_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tp_group = dist.new_group([0, 1])
    cfg = rollout_cfg(f"{ROLLOUT}.tensor_model_parallel_size=2", f"{ROLLOUT}.load_format=auto")
    engine = build_rollout("vllm", cfg, model, load_tokenizer(model), "cpu", tp_group)
    try:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        shares = {}
        for step in range(2):
            if step:
                updated(hf, step)  # the same update on both ranks (a seeded generator)
                engine.update_weights(hf.state_dict().items())
            prompts = make_prompts(seed=10 * step + rank, do_sample=False)  # each rank its own rows
            shares[f"greedy{step}"] = generate_in_tp_group(engine, prompts, tp_group)
            torch.manual_seed(step)
            shares[f"sampled{step}"] = generate_in_tp_group(engine, make_prompts(seed=20 + rank), tp_group)
        keys = ("input_ids", "attention_mask", "position_ids", "responses", "rollout_log_probs", "response_mask")
        torch.save(
            {name: {k: out.batch[k] for k in keys} for name, out in shares.items()},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        engine.shutdown()  # vLLM's distributed environment, the default group included


def test_tp2_on_two_cpu_workers_matches_transformers_before_and_after_a_sync(tmp_path):
    from helpers.gpu_models import tp2_stand_in
    from transformers import AutoModelForCausalLM

    from rlframe.protocol import DataProto

    model = tp2_stand_in(str(tmp_path / "model"))
    torch.multiprocessing.spawn(_worker, args=(free_port(), model, str(tmp_path)), nprocs=2, join=True)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos_ids = [load_tokenizer(model).eos_token_id]
    for rank in range(2):
        assert os.path.exists(tmp_path / f"rank{rank}.pt")
    shares = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for step in range(2):
        if step:
            updated(hf, step)
        for rank, share in enumerate(shares):
            greedy = DataProto.from_dict(share[f"greedy{step}"])
            assert vllm_rows(greedy) == hf_greedy(hf, make_prompts(seed=10 * step + rank), 16, eos_ids), (step, rank)
            sampled = DataProto.from_dict(share[f"sampled{step}"])
            mask = sampled.batch["response_mask"].bool()
            diff = (hf_token_log_probs(hf, sampled).exp() - sampled.batch["rollout_log_probs"].exp()).abs()[mask]
            assert diff.mean() < PROB_DIFF_MEAN and diff.max() < PROB_DIFF_MAX, (step, rank, diff.max())
    ranks_differ = not torch.equal(shares[0]["sampled0"]["responses"], shares[1]["sampled0"]["responses"])
    assert ranks_differ  # each rank got its own rows back
