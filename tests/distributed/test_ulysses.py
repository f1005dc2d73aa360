"""Ulysses sequence parallelism over gloo: sp > 1 gives the single-process log-probs, values and gradients.

Each multi-process job spawns once (import time dominates on a small machine) and saves rank 0's
results; the tests below compare them with the same computation run in this process with sp=1.
Gradients from the SP ranks are averaged, as FSDP does over its dp x sp mesh.
"""

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.padding import RESPONSE_LEN, assert_rel_close, load, make_rl_batch

from rlframe.distributed.ulysses import (
    check_ulysses_config,
    gather_outputs,
    head_to_seq_shard,
    kv_repeat_factor,
    seq_to_head_shard,
)
from rlframe.workers.model_forward import PackedLayout, ScoringSpec, forward_micro_batch

JOB_TIMEOUT_S = 240
# total valid tokens 24 (a multiple of 2 and 4) and 17 (neither), with 4 and 3 sequences
BATCHES = {"even": ([6, 3, 1, 4], [5, 2, 2, 1]), "odd": ([5, 2, 6], [1, 3, 0])}
MODES = ("log_probs", "values", "checkpointed")


def run_job(fn, world_size, *args):
    """Run fn(rank, world_size, *args) in `world_size` spawned gloo processes; fail on error or timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(
        _entry, args=(fn, world_size, port, args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            raise TimeoutError(f"{fn.__name__} with {world_size} processes did not finish in {JOB_TIMEOUT_S}s")


def _entry(rank, fn, world_size, port, args):
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=JOB_TIMEOUT_S),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


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


def _model_worker(rank, world_size, model_paths, vocab_size, out_path):
    results = {}
    for model_name, path in model_paths.items():
        for batch_name, lens in BATCHES.items():
            for mode in MODES:
                batch = make_rl_batch(*lens, vocab_size=vocab_size)
                results[model_name, batch_name, mode] = score(path, batch, mode, sp_group=dist.group.WORLD)
    if rank == 0:
        torch.save(results, out_path)


def _collectives_worker(rank, world_size, out_path):
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
    all_results = [None] * world_size
    dist.all_gather_object(all_results, results)
    if rank == 0:
        torch.save(all_results, out_path)


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
def sp2_results(model_paths, vocab_size, tmp_path_factory):
    out = tmp_path_factory.mktemp("sp2") / "results.pt"
    run_job(_model_worker, 2, model_paths, vocab_size, str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_all_to_all_round_trip_and_gather_adjoint(tmp_path):
    world_size = 2
    run_job(_collectives_worker, world_size, str(tmp_path / "c.pt"))
    results = torch.load(tmp_path / "c.pt", weights_only=False)
    for rank, r in enumerate(results):
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


def _sp4_worker(rank, world_size, model_path, vocab_size, out_path):
    batch = make_rl_batch(*BATCHES["odd"], vocab_size=vocab_size)
    result = score(model_path, batch, "log_probs", sp_group=dist.group.WORLD)
    if rank == 0:
        torch.save(result, out_path)


@pytest.mark.slow
def test_sp4_with_two_kv_heads_matches_sp1(tiny_model_path, vocab_size, tmp_path):
    run_job(_sp4_worker, 4, tiny_model_path, vocab_size, str(tmp_path / "sp4.pt"))
    out, grads = torch.load(tmp_path / "sp4.pt", weights_only=False)
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
