"""Pooled CPU generation (rollout/pool.py): every rank gets the rows it would have generated alone.

On 2 and 3 gloo ranks with different prompt counts, sync and async rollouts: `generate_pooled` hands each
rank exactly the tokens, masks and log-probs `generate_in_tp_group` gives it on its own, leaves its torch
RNG where generating alone leaves it, and only rank 0 generates (with every rank's threads). And the rule
that decides when to pool.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.agent_loop import KEYS
from helpers.rollout import load_tokenizer, make_prompts, rollout_config
from helpers.world import spawned_world

from rlframe.workers.rollout import build_rollout, generate_in_tp_group, pool
from rlframe.workers.rollout.base import SEED_KEY

LENGTHS = [(8, 3, 5), (1, 7), (6, 2, 4, 8)]  # rank r's prompts: unequal counts


def _worker(rank: int, model_path: str, mode: str) -> dict:
    cfg = rollout_config("actor_rollout_ref.rollout.calculate_log_probs=true", f"actor_rollout_ref.rollout.mode={mode}")
    rollout = build_rollout("hf", cfg, model_path, load_tokenizer(model_path), "cpu")
    prompts = make_prompts(LENGTHS[rank], seed=rank)
    torch.manual_seed(100 + rank)  # each rank's own RNG stream, as in a worker
    alone = generate_in_tp_group(rollout, prompts)
    rng_alone = torch.get_rng_state()
    torch.manual_seed(100 + rank)
    generated = []
    real = rollout.generate_sequences
    rollout.generate_sequences = lambda batch: generated.append(torch.get_num_threads()) or real(batch)
    pooled = pool.generate_pooled(rollout, prompts, dist.group.WORLD)
    result = {
        "same": {key: torch.equal(pooled.batch[key], alone.batch[key]) for key in KEYS if key != "rollout_log_probs"},
        # log-probs come from a forward over a differently padded batch: equal up to fp32 rounding
        "log_prob_error": (pooled.batch["rollout_log_probs"] - alone.batch["rollout_log_probs"]).abs().max(),
        "uid": list(pooled.non_tensor_batch["uid"]) == list(alone.non_tensor_batch["uid"]),
        "no_seed_key": SEED_KEY not in pooled.non_tensor_batch and SEED_KEY not in prompts.non_tensor_batch,
        "rng": torch.equal(torch.get_rng_state(), rng_alone),
        "generated": generated,
        "metrics": pooled.meta_info["metrics"],
    }
    return result


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
@pytest.mark.parametrize("world, mode", [(2, "sync"), (3, "async")])
def test_pooled_generation_gives_each_rank_the_rows_it_would_generate_alone(tiny_model_path, world, mode):
    for rank, result in enumerate(spawned_world(world).run(_worker, tiny_model_path, mode)):
        assert all(result["same"].values()), (rank, result["same"])
        assert result["log_prob_error"] <= 1e-5  # about 10 ulps at |log p| ~ 8
        assert result["uid"] and result["no_seed_key"] and result["rng"]
        assert result["generated"] == ([world] if rank == 0 else [])  # rank 0 alone, with every rank's thread
        assert "response_length/truncated_ratio" in result["metrics"]


def _failing_worker(rank: int, model_path: str) -> str:
    cfg = rollout_config("actor_rollout_ref.rollout.mode=sync")
    rollout = build_rollout("hf", cfg, model_path, load_tokenizer(model_path), "cpu")
    rollout._generate = lambda *args: (_ for _ in ()).throw(RuntimeError("engine died"))
    try:
        pool.generate_pooled(rollout, make_prompts(LENGTHS[rank], seed=rank), dist.group.WORLD)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    return message


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
def test_an_engine_error_on_rank_0_reaches_every_rank(tiny_model_path):
    first, second = spawned_world(2).run(_failing_worker, tiny_model_path)
    assert first == "engine died"
    assert second == (
        "pooled generation failed on rank 0 of the machine (it generates every rank's rows): RuntimeError: engine died"
    )


def test_pooling_follows_the_key_and_by_default_the_l2_cache(monkeypatch):
    monkeypatch.setattr(pool, "ranks_share_a_machine", lambda group, memory=None: True)
    l2 = pool.l2_cache_bytes()
    assert l2 > 0
    assert not pool.pools_generation(None, l2 // 2, group=None)  # fits in a core's cache: per-rank decoding
    assert pool.pools_generation(None, 2 * l2, group=None)
    assert pool.pools_generation(True, 1, group=None) and not pool.pools_generation(False, 1 << 40, group=None)
    monkeypatch.setattr(pool, "ranks_share_a_machine", lambda group, memory=None: False)
    assert not pool.pools_generation(True, 1 << 40, group=None)  # ranks on several machines never pool
