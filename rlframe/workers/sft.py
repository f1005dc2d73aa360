"""Supervised fine-tuning on one rank: the actor's update with a negative log-likelihood loss.

An SFT row is laid out as the actor lays out a trajectory (`sft_batch`): the prompt is the row's tokens before its
first trained token, the response is the rest, and `response_mask` is the loss mask over the response (zeros where
a user or tool turn sits between two assistant turns). The forward (padded or packed, Ulysses), the micro-batching
(static or dynamic) and the optimizer step are `PPOUpdater`'s; only the loss is SFT's (`rlframe.algorithms.sft`):

    loss = -Σ log p(trained tokens) / N,   N = the trained tokens of the whole step, summed over the DP ranks,

which is verl 0.9.1's `sft_loss` (`batch_num_tokens`, times `dp_size`: the updater's scale that undoes FSDP's
gradient average), so the accumulated gradient is the single-process full-batch gradient under any dp, sp,
remove-padding or micro-batching.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlframe.algorithms.sft import sft_loss
from rlframe.batch_plan import ForwardPlan, UpdatePlan
from rlframe.distributed.parallel_dims import ParallelDims
from rlframe.workers.batching import GlobalCounts, response_mask_of
from rlframe.workers.model_forward import ScoringSpec, forward_micro_batch, layout_for
from rlframe.workers.updater import PPOUpdater, RoleModel


def sft_batch(rows: list[dict], pad_token_id: int) -> TensorDict:
    """SFTDataset rows (either pad_mode) as one actor batch: left-padded prompts, right-padded responses.

    A row's prompt ends before its first trained token (at least one token: the first token has nothing to be
    predicted from, so a loss mask on it is dropped, as it is in verl, where it wraps onto the previous row).
    """
    parts = [_split_row(row) for row in rows]
    prompt_width = max(len(prompt) for prompt, _, _, _ in parts)
    response_width = max(1, max(len(response) for _, response, _, _ in parts))
    width = prompt_width + response_width
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), response_width), dtype=torch.long)
    for i, (prompt, response, positions, loss_mask) in enumerate(parts):
        start, end = prompt_width - len(prompt), prompt_width + len(response)
        input_ids[i, start:end] = torch.cat([prompt, response])
        attention_mask[i, start:end] = 1
        position_ids[i, start:end] = positions
        response_mask[i, : len(response)] = loss_mask
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "responses": input_ids[:, prompt_width:],
            "response_mask": response_mask,
        },
        batch_size=[len(rows)],
    )


def _split_row(row: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids, response ids, positions, the response's loss mask) of one row, padding removed."""
    length = int(row["attention_mask"].sum()) if "attention_mask" in row else len(row["input_ids"])
    ids, positions, loss_mask = (row[name][:length] for name in ("input_ids", "position_ids", "loss_mask"))
    trained = torch.nonzero(loss_mask).flatten()
    split = max(1, int(trained[0])) if len(trained) else length
    return ids[:split], ids[split:], positions, loss_mask[split:]


def sft_update_plan(
    rows_per_dp: int, dims: ParallelDims, micro_batch_size: int | None, max_token_len: int | None, token_len_key: str
) -> UpdatePlan:
    """One optimizer step per batch of `rows_per_dp` rows on each DP rank, cut in micro-batches of `micro_batch_size`
    rows, or (`micro_batch_size` None) dynamically under a budget of `max_token_len` tokens (`token_len_key`)."""
    dynamic = micro_batch_size is None
    cut = dict(
        sequence_parallel_size=dims.sp_size,
        dp_size=dims.dp_size,
        sequences_per_gpu=rows_per_dp,
        sequences_per_dp=rows_per_dp,
        use_dynamic_bsz=dynamic,
        micro_batch_size=micro_batch_size,
        max_token_len_per_gpu=max_token_len // dims.sp_size if dynamic else None,
        max_token_len=max_token_len if dynamic else None,
        packing_algorithm="kk" if dynamic else None,
        max_token_len_key=token_len_key if dynamic else None,
    )
    steps = None if dynamic else -(-rows_per_dp // micro_batch_size)
    return UpdatePlan(
        **cut,
        mini_batch_size=rows_per_dp * dims.dp_size,
        mini_batch_size_per_dp=rows_per_dp,
        num_mini_batches=1,
        ppo_epochs=1,
        optimizer_steps_per_step=1,
        grad_accum_steps=steps,
        forward=ForwardPlan(**cut, num_micro_batches=steps),
    )


class SFTLearner(PPOUpdater):
    """A (possibly FSDP-wrapped) causal LM trained on SFT batches: one optimizer step per batch."""

    role = "train"

    def __init__(self, model: RoleModel, config, plan: UpdatePlan, dims: ParallelDims | None = None):
        """`config`: the SFT config (`SFTTrainerConfig`; the updater reads `optim.clip_grad`); `plan`:
        `sft_update_plan`."""
        super().__init__(model, config, plan, dims or ParallelDims.single())

    def train_batch(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step over this rank's share of a step's rows; the step's metrics (`train/loss`, ...)."""
        self.module.train()
        metrics = self._optimizer_step(batch, None)
        self._end_update()  # the learning-rate schedule advances once per step, as verl's
        return metrics

    def nll_sums(self, batch: TensorDict) -> torch.Tensor:
        """[Σ -log p over the trained tokens, their count] of `batch`, summed over the DP ranks, without gradients."""
        self.module.eval()
        log_probs = self._no_grad_outputs(batch, self.forward_plan, self._forward)["log_probs"]
        mask = response_mask_of(batch)
        sums = torch.stack([-(log_probs * mask).sum(), mask.sum()]).to(torch.float64)
        if self.dims.reduces_over_dp:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.dims.dp_group)
        return sums

    def _forward(self, micro: TensorDict) -> dict[str, torch.Tensor]:
        spec = ScoringSpec(
            temperature=1.0,
            calculate_entropy=False,
            use_torch_compile=self.options.use_torch_compile,
            use_fused_kernels=self.options.use_fused_kernels,
        )
        layout = layout_for(self.options.use_remove_padding, self.dims.sp_group)
        return forward_micro_batch(self.module, micro, micro["responses"].shape[-1], spec, layout)

    def _loss(self, micro: TensorDict, counts: GlobalCounts, ctx) -> tuple[torch.Tensor, dict]:
        """The micro-batch's share of the step's mean NLL over trained tokens (see the module doc)."""
        loss = sft_loss(self._forward(micro)["log_probs"], response_mask_of(micro), counts.num_tokens)
        return loss, {"loss": loss.detach()}
