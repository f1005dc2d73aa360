"""SFT's loss and gradient against a plain single-process reference: a plain HF model and plain torch NLL.

The reference runs every row alone through `AutoModelForCausalLM` (no padding, no packing), takes log-softmax of
its logits and sums -log p over the tokens whose loss mask is 1 (a token is predicted from the ones before it, so
the first token is never trained), divided by the count of those tokens over all rows. `run_learner` runs
`SFTLearner` on one rank's share of the same rows, under whatever knobs, recording the full gradient right before
the optimizer step (`RecordingSGD`); `run_distributed_learner` does so on a spawned gloo world.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from helpers.fsdp_harness import RecordingSGD
from helpers.world import spawned_world
from rlframe.distributed.parallel_dims import ParallelDims, ParallelPlan
from rlframe.trainer.sft_trainer.config import sft_config
from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
from rlframe.workers.model_loading import ModelSpec, load_hf_model
from rlframe.workers.sft import SFTLearner, sft_batch, sft_update_plan
from rlframe.workers.updater import ModelOptions, RoleModel


def make_rows(vocab_size: int, num_rows: int = 8, seed: int = 0) -> list[dict]:
    """Conversations of 6-16 tokens: a prompt, an assistant turn, a user turn (a hole), a last assistant turn."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        length = int(torch.randint(6, 17, (1,), generator=gen))
        ids = torch.randint(3, vocab_size, (length,), generator=gen)
        loss_mask = torch.zeros(length, dtype=torch.long)
        first, hole = 2 + int(torch.randint(0, 3, (1,), generator=gen)), length // 2 + 1
        loss_mask[first:hole] = 1
        loss_mask[hole + 2 :] = 1  # the user turn between the two assistant turns is not trained
        rows.append({"input_ids": ids, "position_ids": torch.arange(length), "loss_mask": loss_mask})
    return rows


def reference(model_path: str, rows: list[dict], dtype: torch.dtype = torch.float32) -> dict:
    """The mean NLL over trained tokens and its gradient, row by row through a plain HF model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    total = sum(int(row["loss_mask"][1:].sum()) for row in rows)
    loss = torch.zeros((), dtype=torch.float64)
    for row in rows:
        ids = row["input_ids"]
        log_probs = torch.log_softmax(model(ids[None]).logits[0, :-1], dim=-1)
        token_log_probs = log_probs.gather(-1, ids[1:, None])[:, 0]
        loss = loss - (token_log_probs * row["loss_mask"][1:]).sum() / total
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(loss.detach()), "grads": grads}


def run_learner(
    model_path: str,
    rows: list[dict],
    knobs: dict,
    dims: ParallelDims | None = None,
) -> dict:
    """One rank's SFT step on its DP share of `rows`: {"loss", "val_loss" (before the step), "grads"}.

    `knobs`: use_remove_padding, use_dynamic_bsz, micro_batch_size, max_token_len (per GPU, × sp), and optionally
    dtype (float64 tells rounding from math on a deep model, docs/models.md).
    """
    dims = dims or ParallelDims.single()
    dtype = knobs.get("dtype", torch.float32)
    model = load_hf_model(ModelSpec(model_path, "actor", dtype, knobs["use_remove_padding"]))
    if dims.fsdp_mesh is not None:
        spec = FSDPSpec("fsdp2", dtype, dtype, param_offload=False, reshard_after_forward=True)
        model = wrap_fsdp(model, spec, dims.fsdp_mesh, "cpu")
    optimizer = RecordingSGD(model, keep=not dist.is_initialized() or dist.get_rank() == 0)
    per_dp = len(rows) // dims.dp_size
    share = rows[dims.dp_rank * per_dp : (dims.dp_rank + 1) * per_dp]
    dynamic = knobs["use_dynamic_bsz"]
    micro, budget = (None, knobs["max_token_len"] * dims.sp_size) if dynamic else (knobs["micro_batch_size"], None)
    plan = sft_update_plan(per_dp, dims, micro, budget, "data.max_token_len_per_gpu")
    config = sft_config(["optim.clip_grad=1e9"])
    options = ModelOptions(use_remove_padding=knobs["use_remove_padding"])
    learner = SFTLearner(RoleModel(model, options, optimizer), config, plan, dims)
    batch = sft_batch(share, pad_token_id=0)
    sums = learner.nll_sums(batch)
    metrics = learner.train_batch(batch)
    return {"loss": metrics["train/loss"], "val_loss": float(sums[0] / sums[1]), "grads": optimizer.grads}


def _rank_job(rank: int, model_path: str, rows_path: str, sp: int, knobs: dict) -> dict:
    dims = ParallelDims.build(ParallelPlan(dist.get_world_size(), sp), "cpu")
    return run_learner(model_path, torch.load(rows_path), knobs, dims)


def run_distributed_learner(model_path: str, rows: list[dict], world: int, sp: int, knobs: dict, out_dir: str):
    """`run_learner` on a spawned gloo world of `world` ranks with Ulysses degree `sp`: rank 0's result."""
    rows_path = os.path.join(out_dir, "rows.pt")
    torch.save(rows, rows_path)
    return spawned_world(world).run(_rank_job, model_path, rows_path, sp, knobs)[0]
