"""rlframe.distributed.push_group and rlframe.workers.weight_push: a process group of its own, formed by an explicit
TCP rendezvous beside the processes' default world, carries a bucketed state from rank 0 to every other rank."""

import torch
from helpers.world import free_port, spawned_world

from rlframe.distributed.push_group import PushGroup, open_store
from rlframe.workers.weight_sync import AdapterWeights


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed_tokens.weight": torch.randn(50, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),
        "model.norm.weight": torch.randn(8, generator=g, dtype=torch.float64),
        "step": torch.tensor(3),
    }


class RecordingRollout:
    """What a rollout engine was given: update_weights' tensors (copied as they stream) and the adapter."""

    def __init__(self):
        self.weights, self.adapter, self.peft_config = {}, None, None

    def update_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.weights[name] = tensor.clone()

    def update_lora_adapter(self, tensors, peft_config):
        self.adapter, self.peft_config = {n: t.clone() for n, t in tensors.items()}, peft_config


def _group(rank: int, port: int, world: int, timeout_s: float = 60) -> PushGroup:
    store = open_store("127.0.0.1", port, world, timeout_s) if rank == 0 else None
    return PushGroup("127.0.0.1", port, rank, world, torch.device("cpu"), timeout_s, store=store)


def _push_twice(rank: int, port: int):
    """Two pushes over one group (a state, then an adapter after its base), then the default world still works."""
    import torch.distributed as dist

    from rlframe.workers.weight_push import push_parts, receive_into

    group = _group(rank, port, dist.get_world_size())
    state = _state()
    adapter = {"base_model.model.layers.0.lora_A.weight": torch.ones(2, 8)}
    rollouts = [RecordingRollout(), RecordingRollout()]
    sent = []
    for rollout, weights in zip(rollouts, [state, AdapterWeights(state, adapter, {"r": 2})]):
        if rank == 0:
            parts, extra = push_parts(weights)
            sent.append(group.send(parts, extra, bucket_bytes=300))  # several buckets
        else:
            receive_into(group, rollout)
    total = torch.tensor([rank])
    dist.all_reduce(total)  # the default world is untouched by the push group
    return {"sent": sent, "rollouts": [(r.weights, r.adapter, r.peft_config) for r in rollouts], "sum": int(total)}


def test_rank_0_pushes_a_state_and_an_adapter_to_every_other_rank_bit_for_bit():
    results = spawned_world(3).run(_push_twice, free_port())
    state = _state()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert results[0]["sent"][0] >= nbytes  # every byte went out (plus alignment padding)
    for result in results[1:]:
        (weights, none, _), (base, adapter, peft_config) = result["rollouts"]
        assert none is None and list(weights) == list(state) and list(base) == list(state)
        for name, tensor in state.items():
            for got in (weights[name], base[name]):
                assert got.dtype == tensor.dtype and torch.equal(got, tensor)
        assert list(adapter) == ["base_model.model.layers.0.lora_A.weight"]
        assert torch.equal(adapter["base_model.model.layers.0.lora_A.weight"], torch.ones(2, 8))
        assert peft_config == {"r": 2}
    assert [r["sum"] for r in results] == [3, 3, 3]


def _late_receiver(rank: int, port: int):
    """Rank 2 reaches the push well after the group's 3 s timeout (a generation queued before it)."""
    import time

    import torch.distributed as dist

    from rlframe.workers.weight_push import push_parts, receive_into

    group = _group(rank, port, dist.get_world_size(), timeout_s=3)
    if rank == 0:
        return group.send(*push_parts(_state()), bucket_bytes=300)
    if rank == 2:
        time.sleep(6)
    rollout = RecordingRollout()
    receive_into(group, rollout)
    return rollout.weights


def test_a_push_waits_for_a_receiver_busy_past_the_groups_timeout():
    results = spawned_world(3).run(_late_receiver, free_port())
    for weights in results[1:]:
        assert list(weights) == list(_state()) and all(torch.equal(weights[n], t) for n, t in _state().items())
