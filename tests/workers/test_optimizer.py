"""The actor's optimizer: multi-tensor AdamW over FSDP2 shards gives the per-parameter AdamW's numbers bitwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.world import spawned_world

from rlframe.distributed.parallel_dims import build_fsdp_mesh
from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
from rlframe.workers.model_loading import ModelSpec, load_hf_model
from rlframe.workers.optimizer import build_optimizer

STEPS = 3
OPTIM = SimpleNamespace(lr=1e-2, betas=[0.9, 0.95], weight_decay=0.1)


def _loss(model, step: int) -> torch.Tensor:
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(step))
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


def _load(model_path: str):
    spec = ModelSpec(path=model_path, role="actor", dtype=torch.float32, use_remove_padding=False)
    return load_hf_model(spec)


def _worker(rank: int, model_path: str) -> dict | None:

    spec = FSDPSpec("fsdp2", torch.float32, torch.float32, False, True)
    model = wrap_fsdp(_load(model_path), spec, build_fsdp_mesh("cpu", 2, -1), "cpu")
    optimizer = build_optimizer(model, OPTIM)
    for step in range(STEPS):  # both ranks the same batch: FSDP's mean of two equal gradients is exact
        _loss(model, step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return {"foreach": optimizer.defaults["foreach"], "params": full} if rank == 0 else None


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
def test_multi_tensor_adamw_on_fsdp2_shards_equals_per_parameter_adamw_bitwise(tiny_model_path):
    sharded = spawned_world(2).run(_worker, tiny_model_path)[0]
    assert sharded["foreach"] is True

    plain = _load(tiny_model_path)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=OPTIM.lr, betas=tuple(OPTIM.betas), weight_decay=0.1)
    assert optimizer.defaults["foreach"] is None  # torch's CPU default: one op per parameter
    for step in range(STEPS):
        _loss(plain, step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for name, param in plain.named_parameters():
        assert torch.equal(sharded["params"][name], param.detach()), name
