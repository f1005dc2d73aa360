"""Ulysses sequence parallelism over gloo: sp > 1 gives the single-process log-probs, values and gradients.

Each multi-process job runs once on the session's spawned gloo world (tests/helpers/world.py) and returns rank 0's
results; the tests below compare them with the same computation run in this process with sp=1.
Gradients from the SP ranks are averaged, as FSDP does over its dp x sp mesh.
"""

import pytest
import torch
import torch.distributed as dist
from helpers.padding import RESPONSE_LEN, assert_rel_close, load, make_rl_batch
from helpers.world import spawned_world

from rlframe.distributed.ulysses import (
    check_ulysses_config,
    gather_outputs,
    head_to_seq_shard,
    kv_repeat_factor,
    seq_to_head_shard,
)
from rlframe.workers.model_forward import PackedLayout, ScoringSpec, forward_micro_batch

# total valid tokens 24 (a multiple of 2 and 4) and 17 (neither), with 4 and 3 sequences
BATCHES = {"even": ([6, 3, 1, 4], [5, 2, 2, 1]), "odd": ([5, 2, 6], [1, 3, 0])}
MODES = ("log_probs", "values", "checkpointed")


def score(model_path, batch, mode, sp_group=None):
    """Forward + backward of a masked sum with the SP-averaged gradients; one `mode` of MODES."""
    model = load(model_path, "rlframe_varlen", value_head=mode == "values")
    if mode == "checkpointed":  # recomputation in backward must find the SP group again
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    spec = ScoringSpec(calculate_entropy=mode != "values", value_head=mode == "values")
    out = forward_micro_batch(model, batch, RESPONSE_LEN, spec, PackedLayout(sp_group))
    mask = batch["attention_mask"][:, -RESPONSE_LEN:]
    sum(((x * mask) * (i + 1)).sum() for i, x in enumerate(out.values())).backward()
    grads = {}
    for name, p in model.named_parameters():
        if sp_group is not None:
            dist.all_reduce(p.grad, group=sp_group)
            p.grad /= dist.get_world_size(sp_group)
        grads[name] = p.grad
    return {k: v.detach() for k, v in out.items()}, grads


def _model_worker(rank, model_paths, vocab_size):
    results = {}
    for model_name, path in model_paths.items():
        for batch_name, lens in BATCHES.items():
            for mode in MODES:
                batch = make_rl_batch(*lens, vocab_size=vocab_size)
                results[model_name, batch_name, mode] = score(path, batch, mode, sp_group=dist.group.WORLD)
    return results


def _collectives_worker(rank):
    world_size = dist.get_world_size()
    seq, heads, dim = 4 * world_size, 2 * world_size, 3
    full = torch.randn(seq, heads, dim, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(seq, heads, dim, generator=torch.Generator().manual_seed(1))
    shard = full.chunk(world_size, dim=0)[rank].clone().requires_grad_()
    head_shard = seq_to_head_shard(shard, dist.group.WORLD)
    back = head_to_seq_shard(head_shard, dist.group.WORLD)
    # d/d shard of sum(head_shard * upstream's head shard), summed over ranks, is upstream's sequence shard
    (head_shard * upstream.chunk(world_size, dim=1)[rank]).sum().backward()

    tokens = torch.arange(5.0) + 10 * rank  # 5 per rank, the last rank's last 2 are SP padding
    tokens.requires_grad_()
    gathered = gather_outputs(tokens, dist.group.WORLD, dim=0, pad_size=2)
    (gathered * (rank + 1)).sum().backward()  # each rank's loss differs, to see the reduce-scatter
    results = {
        "head_shard_ok": torch.equal(head_shard, full.chunk(world_size, dim=1)[rank]),
        "round_trip_ok": torch.equal(back, shard),
        "grad_ok": torch.equal(shard.grad, upstream.chunk(world_size, dim=0)[rank]),
        "gathered": gathered.detach(),
        "gather_grad": tokens.grad,
    }
    return results


@pytest.fixture(scope="module")
def model_paths(tiny_model_path, tmp_path_factory):
    from rlframe.models.tiny import make_tiny_model

    # 4 query heads over 1 kv head: with sp=2 each kv head is repeated before the head split
    mqa = make_tiny_model(str(tmp_path_factory.mktemp("tiny_mqa")), num_kv_heads=1)
    return {"gqa_kv2": tiny_model_path, "mqa_kv1": mqa}


@pytest.fixture(scope="module")
def vocab_size(tiny_model_path):
    return load(tiny_model_path, "sdpa").config.vocab_size


@pytest.fixture(scope="module")
def sp2_results(model_paths, vocab_size):
    return spawned_world(2).run(_model_worker, model_paths, vocab_size)[0]


@pytest.mark.slow
def test_all_to_all_round_trip_and_gather_adjoint():
    for rank, r in enumerate(spawned_world(2).run(_collectives_worker)):
        assert r["head_shard_ok"] and r["round_trip_ok"] and r["grad_ok"], rank
        assert r["gathered"].tolist() == [0, 1, 2, 3, 4, 10, 11, 12]
        # backward of the gather is a reduce-scatter: every rank's loss weight (1 + 2) reaches every shard
        expected = torch.tensor([3.0] * 5) if rank == 0 else torch.tensor([3.0] * 3 + [0.0] * 2)
        assert torch.equal(r["gather_grad"], expected)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["gqa_kv2", "mqa_kv1"])
@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("mode", MODES)
def test_sp2_outputs_and_grads_match_sp1(sp2_results, model_paths, vocab_size, model_name, batch_name, mode):
    batch = make_rl_batch(*BATCHES[batch_name], vocab_size=vocab_size)
    expected_out, expected_grads = score(model_paths[model_name], batch, mode)
    out, grads = sp2_results[model_name, batch_name, mode]
    assert out.keys() == expected_out.keys()
    for name in out:
        assert_rel_close(out[name], expected_out[name])
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        assert_rel_close(grads[name], expected_grads[name])


def _sp4_worker(rank, model_path, vocab_size):
    return score(model_path, make_rl_batch(*BATCHES["odd"], vocab_size=vocab_size), "log_probs", dist.group.WORLD)


@pytest.mark.slow
def test_sp4_with_two_kv_heads_matches_sp1(tiny_model_path, vocab_size):
    out, grads = spawned_world(4).run(_sp4_worker, tiny_model_path, vocab_size)[0]
    expected_out, expected_grads = score(
        tiny_model_path, make_rl_batch(*BATCHES["odd"], vocab_size=vocab_size), "log_probs"
    )
    for name in out:
        assert_rel_close(out[name], expected_out[name])
    for name in grads:
        assert_rel_close(grads[name], expected_grads[name])


def test_kv_heads_are_repeated_until_they_split_over_sp():
    assert kv_repeat_factor(2, 4) == 2 and kv_repeat_factor(1, 2) == 2
    assert kv_repeat_factor(4, 2) == 1 and kv_repeat_factor(2, 3) == 3


def test_bad_sp_size_names_the_config_key():
    check_ulysses_config(num_attention_heads=4, num_key_value_heads=2, sp_size=4)
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"):
        check_ulysses_config(num_attention_heads=4, num_key_value_heads=2, sp_size=3)
