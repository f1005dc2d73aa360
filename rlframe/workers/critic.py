"""The PPO critic on one rank: values and the clipped value-loss update, batched like the actor."""

from __future__ import annotations

import torch

from rlframe.algorithms.loss import compute_value_loss
from rlframe.algorithms.masked import masked_mean
from rlframe.batch_plan import UpdatePlan
from rlframe.distributed.parallel_dims import ParallelDims
from rlframe.protocol import DataProto
from rlframe.workers.batching import (
    GlobalCounts,
    response_mask_of,
    update_inputs,
)
from rlframe.workers.model_forward import VALUES, forward_micro_batch, layout_for
from rlframe.workers.updater import PPOUpdater, RoleModel


class PPOCritic(PPOUpdater):
    """Computes values and updates a (possibly FSDP-wrapped) value model."""

    role = "critic"

    def __init__(self, model: RoleModel, config, plan: UpdatePlan, dims: ParallelDims | None = None, seed: int = 0):
        """`config` is the `critic` section (`CriticConfig`); `plan` the critic's update plan."""
        super().__init__(model, config, plan, dims or ParallelDims.single(), seed)

    def _values(self, micro) -> torch.Tensor:
        layout = layout_for(self.options.use_remove_padding, self.dims.sp_group)
        return forward_micro_batch(self.module, micro, micro["responses"].shape[-1], VALUES, layout)["values"]

    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Per-response-token values [bs, resp_len] in the input order."""
        self.module.eval()
        values = self._no_grad_outputs(data.batch, self.forward_plan, lambda micro: {"values": self._values(micro)})
        return values["values"]

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """`ppo_epochs` passes of mini-batch optimizer steps; returns metric lists (one value per step)."""
        return self._train(update_inputs(data.batch, "values", "returns"))

    def _loss(self, micro, counts: GlobalCounts, ctx: None) -> tuple[torch.Tensor, dict]:
        """The clipped value loss of one micro-batch, normalized by the mini-batch's global counts."""
        s = self.config
        response_mask = response_mask_of(micro)
        vpreds = self._values(micro)
        agg = counts.aggregation(s.loss_agg_mode)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds, micro["returns"], micro["values"], response_mask, float(s.cliprange_value), agg
        )
        share = counts.token_share(response_mask)
        return vf_loss, {
            "vf_loss": vf_loss,
            "vf_clipfrac": vf_clipfrac * share,
            "vpred_mean": masked_mean(vpreds.detach(), response_mask) * share,
        }
