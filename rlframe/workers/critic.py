"""The PPO critic on one rank: values and the clipped value-loss update, batched like the actor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlframe.algorithms.loss import compute_value_loss
from rlframe.algorithms.masked import masked_mean
from rlframe.protocol import DataProto
from rlframe.seqpack import MicroBatchSpec
from rlframe.workers.batching import (
    GlobalCounts,
    forward_inputs,
    response_mask_of,
    restore_order,
    split_micro_batches,
    update_inputs,
)
from rlframe.workers.model_forward import VALUES, forward_micro_batch, layout_for
from rlframe.workers.updater import PPOUpdater


@dataclass(frozen=True)
class CriticSettings:
    """Plain values for one critic, read once from the config and the batch plan."""

    mini_batch_size: int  # sequences per optimizer step on this DP rank
    update: MicroBatchSpec
    forward: MicroBatchSpec
    ppo_epochs: int
    shuffle: bool
    grad_clip: float
    cliprange_value: float
    loss_agg_mode: str
    use_remove_padding: bool
    reshard_after_forward: bool = True  # fsdp_config's; False: gathered across an optimizer step (PPOUpdater)


class PPOCritic(PPOUpdater):
    """Computes values and updates a (possibly FSDP-wrapped) value model."""

    role = "critic"

    def _values(self, micro) -> torch.Tensor:
        layout = layout_for(self.settings.use_remove_padding, self.sp_group)
        return forward_micro_batch(self.module, micro, micro["responses"].shape[-1], VALUES, layout)["values"]

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Per-response-token values [bs, resp_len] in the input order."""
        self.module.eval()
        micro_batches, reverse_idx = split_micro_batches(
            forward_inputs(data.batch), self.settings.forward, self.dp_group
        )
        return restore_order([self._values(micro) for micro in micro_batches], reverse_idx)

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """`ppo_epochs` passes of mini-batch optimizer steps; returns metric lists (one value per step)."""
        return self._train(update_inputs(data.batch, "values", "returns"), self._loss)

    def _loss(self, micro, counts: GlobalCounts) -> tuple[torch.Tensor, dict]:
        """The clipped value loss of one micro-batch, normalized by the mini-batch's global counts."""
        s = self.settings
        response_mask = response_mask_of(micro)
        vpreds = self._values(micro)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds,
            micro["returns"],
            micro["values"],
            response_mask,
            s.cliprange_value,
            s.loss_agg_mode,
            **counts.agg_kwargs(),
        )
        share = counts.token_share(response_mask)
        return vf_loss, {
            "vf_loss": vf_loss,
            "vf_clipfrac": vf_clipfrac * share,
            "vpred_mean": masked_mean(vpreds.detach(), response_mask) * share,
        }
