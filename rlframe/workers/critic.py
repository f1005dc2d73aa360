"""The PPO critic on one rank: values and the clipped value-loss update, batched like the actor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlframe.protocol import DataProto
from rlframe.seqpack import MicroBatchSpec
from rlframe.algorithms.loss import compute_value_loss
from rlframe.algorithms.masked import masked_mean
from rlframe.workers.batching import (DataParallelModel, apply_gradients, dp_sum, global_counts,
                                      micro_batch_metrics, response_mask_of, restore_order, split_micro_batches)
from rlframe.workers.model_forward import forward_micro_batch

MODEL_INPUTS = ("responses", "input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class CriticSettings:
    """Plain values for one critic, read once from the config and the batch plan."""

    mini_batch_size: int                  # sequences per optimizer step on this DP rank
    update: MicroBatchSpec
    forward: MicroBatchSpec
    ppo_epochs: int
    shuffle: bool
    grad_clip: float
    cliprange_value: float
    loss_agg_mode: str
    use_remove_padding: bool


class PPOCritic(DataParallelModel):
    """Computes values and updates a (possibly FSDP-wrapped) value model."""

    def _values(self, micro) -> torch.Tensor:
        out = forward_micro_batch(self.module, micro, response_length=micro["responses"].shape[-1],
                                  use_remove_padding=self.settings.use_remove_padding, sp_group=self.sp_group,
                                  value_head=True)
        return out["values"]

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Per-response-token values [bs, resp_len] in the input order."""
        self.module.eval()
        batch = data.batch.select(*MODEL_INPUTS)
        micro_batches, reverse_idx = split_micro_batches(batch, self.settings.forward, self.dp_group)
        return restore_order([self._values(micro) for micro in micro_batches], reverse_idx)

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        keys = list(MODEL_INPUTS) + ["values", "returns"]
        if "response_mask" in data.batch.keys():
            keys.append("response_mask")
        return self._train(data.batch.select(*keys), self._optimizer_step)

    def _optimizer_step(self, mini) -> dict[str, float]:
        s = self.settings
        num_tokens, num_seqs = global_counts(response_mask_of(mini), self.dp_group)
        norm = dict(global_num_tokens=num_tokens, global_num_seqs=num_seqs,
                    norm_factor=mini["responses"].shape[-1])
        micro_batches, _ = split_micro_batches(mini, s.update, self.dp_group)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for micro in micro_batches:
            response_mask = response_mask_of(micro)
            vpreds = self._values(micro)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds, micro["returns"], micro["values"], response_mask, s.cliprange_value, s.loss_agg_mode,
                **norm)
            (vf_loss * self.dp_size).backward()
            share = response_mask.sum() / num_tokens.clamp(min=1)
            sums["critic/vf_loss"] = sums.get("critic/vf_loss", 0.0) + float(vf_loss.detach())
            sums["critic/vf_clipfrac"] = sums.get("critic/vf_clipfrac", 0.0) + float(vf_clipfrac * share)
            vpred_mean = masked_mean(vpreds.detach(), response_mask)
            sums["critic/vpred_mean"] = sums.get("critic/vpred_mean", 0.0) + float(vpred_mean * share)
        step_metrics = dp_sum(sums, self.dp_group)
        step_metrics.update(micro_batch_metrics(micro_batches, s.update, "critic"))
        step_metrics.update(apply_gradients(self.module, self.optimizer, s.grad_clip, "critic"))
        return step_metrics
