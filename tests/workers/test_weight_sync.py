"""The bucketed weight-sync stream: the same full tensors as one all-gather per tensor, in fewer collectives.

On 2 and 3 gloo ranks (3 gives uneven and empty dim-0 shards), after an optimizer step has made every
shard differ from the checkpoint: `iter_full_params_bucketed` yields the names, in the order, and the
bytes of `iter_full_params`, with small buckets (many) and the default (one), and the rollout replica
that takes it holds the actor's parameters exactly. And the worker's sync is skipped only while the
replica still holds the actor's weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.world import spawned_world

from rlframe.distributed.parallel_dims import ParallelDims, build_fsdp_mesh
from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
from rlframe.workers.full_tensors import iter_full_params
from rlframe.workers.model_loading import ModelSpec, load_hf_model
from rlframe.workers.weight_sync import _rows_per_rank, iter_full_params_bucketed


def _counting(real, counter: list):
    """`real` (`SharedMemoryGroups.shared_half`, asked once per bucket on CPU), counting its calls in `counter`."""

    def all_gather(*args, **kwargs):
        counter.append(1)
        return real(*args, **kwargs)

    return all_gather


def _worker(rank: int, model_path: str) -> dict:
    from rlframe.workers.rollout.base import ServedModel
    from rlframe.workers.rollout.hf_rollout import HFRollout

    model = load_hf_model(ModelSpec(path=model_path, role="actor", dtype=torch.float32, use_remove_padding=True))
    spec = FSDPSpec("fsdp2", torch.float32, torch.float32, False, True)
    model = wrap_fsdp(model, spec, build_fsdp_mesh("cpu", dist.get_world_size(), -1), "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids).logits.square().mean().backward()
    optimizer.step()
    reference = [(name, tensor.clone()) for name, tensor in iter_full_params(model)]
    result = {"reference": reference}
    memory = model._rlframe_shared_memory  # what wrap_fsdp gave the model (a worker passes its own)
    real = memory.shared_half
    for label, bucket_bytes in (("small", 4096), ("default", None), ("gloo", None)):
        calls: list = []
        memory.shared_half = _counting(real, calls)
        if label == "gloo":  # no room in /dev/shm: the flat all_gather through gloo
            memory.shared_half = _counting(lambda group, nbytes: None, calls)
        try:
            kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
            result[label] = [(name, tensor.clone()) for name, tensor in iter_full_params_bucketed(model, **kwargs)]
        finally:
            memory.shared_half = real
        result[f"{label}_calls"] = len(calls)
    result["through_shared_memory"] = any(group.buffer is not None for group in memory._groups.values())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rollout = HFRollout(_rollout_cfg(), ServedModel(model_path), tokenizer, "cpu")
    rollout.update_weights(iter_full_params_bucketed(model))
    result["rollout"] = {n: p.detach().clone() for n, p in rollout.model.state_dict().items()}
    return result


def _rollout_cfg():
    from helpers.rollout import typed_rollout

    from rlframe.config.loader import load_config

    return typed_rollout(load_config([]))


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
@pytest.mark.parametrize("world", [2, 3])
def test_bucketed_sync_gives_every_full_tensor_bitwise_in_fewer_collectives(tiny_model_path, world):
    for result in spawned_world(world).run(_worker, tiny_model_path):
        reference = result["reference"]
        for label in ("small", "default", "gloo"):
            assert [n for n, _ in result[label]] == [n for n, _ in reference], label
            for (name, got), (_, want) in zip(result[label], reference):
                assert got.dtype == want.dtype and torch.equal(got, want), (label, name)
        assert 1 < result["small_calls"] < len(reference)
        assert result["default_calls"] == result["gloo_calls"] == 1  # the tiny model fits one bucket
        assert result["through_shared_memory"]  # every rank on this machine: /dev/shm, not gloo's sockets
        full = dict(reference)
        for name, value in result["rollout"].items():
            assert torch.equal(value, full[name]), name


def test_rows_per_rank_follow_torch_chunk():
    for rows in (0, 1, 5, 9, 10, 576):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            expected = [len(c) for c in chunks] + [0] * (world - len(chunks))
            assert _rows_per_rank(rows, world) == expected, (rows, world)


@pytest.mark.parametrize("free_cache_engine", [False, True])
def test_the_worker_syncs_the_rollout_only_when_it_may_differ_from_the_actor(tiny_model_path, free_cache_engine):
    # ActorRolloutRefWorker.generate_sequences on one process, a plain actor and a real HF replica:
    # without free_cache_engine the second generation skips the sync and the replica still equals
    # the actor; with it the replica is freed after each generation, so each one syncs again
    from helpers.rollout import typed_rollout
    from transformers import AutoTokenizer

    from rlframe.config.loader import load_config
    from rlframe.protocol import DataProto
    from rlframe.workers.fsdp_workers import ActorRolloutRefWorker
    from rlframe.workers.profiler import Profiler
    from rlframe.workers.rollout.base import ServedModel
    from rlframe.workers.rollout.hf_rollout import HFRollout

    cfg = load_config(
        [
            "data.max_prompt_length=8",
            "data.max_response_length=4",
            f"actor_rollout_ref.rollout.free_cache_engine={str(free_cache_engine).lower()}",
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rollout = HFRollout(typed_rollout(cfg), ServedModel(tiny_model_path), tokenizer, "cpu")
    actor = load_hf_model(ModelSpec(path=tiny_model_path, role="actor", dtype=torch.float32, use_remove_padding=False))
    with torch.no_grad():  # the actor differs from the checkpoint the replica was loaded from
        for param in actor.parameters():
            param.add_(0.01)
    syncs = []
    real_update = rollout.update_weights
    rollout.update_weights = lambda tensors: (syncs.append(1), real_update(tensors))[1]
    worker = object.__new__(ActorRolloutRefWorker)
    worker.device_type, worker.dims, worker.rollout, worker.actor_module = "cpu", ParallelDims.single(), rollout, actor
    worker._weights_dirty = True  # as after init_model
    worker.generation_pool = None  # one process: nothing to pool
    worker.versioned = None  # the sync mode: generations are not stamped or cut
    worker.profiler = Profiler(cfg.global_profiler, None, "actor_rollout_ref", 0, 1, "cpu")  # profiling off
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [0, 5, 6, 7, 8, 9, 10, 11]])
    mask = (ids != 0).long()
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    )
    for expected_syncs in (1, 1 if not free_cache_engine else 2):
        worker.generate_sequences(prompts.select(deepcopy=True))
        assert len(syncs) == expected_syncs
    if not free_cache_engine:  # the skipped sync left the replica equal to the actor
        replica = dict(rollout.model.named_parameters())
        for name, param in actor.named_parameters():
            assert torch.equal(replica[name], param), name
