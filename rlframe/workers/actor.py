"""The PPO actor on one rank: log-probs and the policy update over mini- and micro-batches.

The math lives in `rlframe.algorithms` (pure functions); this class runs the model and composes
the loss of one micro-batch, and `PPOUpdater` (rlframe.workers.updater) cuts the batches and steps
the optimizer. Losses are normalized by the token/sequence counts of the
whole mini-batch summed over DP ranks, and multiplied by `dp_size` because FSDP averages gradients
over ranks: the accumulated gradient is exactly the single-process full-batch gradient, whatever
dp, sp, micro-batch size or micro-batching mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from rlframe.algorithms.kl import kl_penalty
from rlframe.algorithms.loss import (
    TOKEN_SELECTORS,
    agg_loss,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    policy_loss_kwargs,
)
from rlframe.algorithms.rollout_correction import (
    PREFIX,
    bypass_policy_loss,
    is_weights,
    needs_mini_batch_normalizer,
    normalizer_sums,
)
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
from rlframe.workers.model_forward import ScoringSpec, forward_micro_batch, layout_for
from rlframe.workers.updater import PPOUpdater


@dataclass(frozen=True)
class ActorSettings:
    """Plain values for one actor, read once from the config and the batch plan."""

    mini_batch_size: int  # sequences per optimizer step on this DP rank
    update: MicroBatchSpec  # micro-batching of the update
    log_prob: MicroBatchSpec  # micro-batching of forward-only log-probs
    ppo_epochs: int
    shuffle: bool
    grad_clip: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    policy_loss: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    use_remove_padding: bool
    use_torch_compile: bool = False  # torch.compile the log-prob/entropy kernels (CUDA)
    use_fused_kernels: bool = False  # score from hidden states a chunk at a time (model.use_fused_kernels)
    reshard_after_forward: bool = True  # fsdp_config's; False: gathered across an optimizer step (PPOUpdater)
    # the policy loss's own parameters by verl's names (policy_loss.clip_cov_ratio, tau_pos, ...)
    policy_loss_params: dict = field(default_factory=dict)


class PPOActor(PPOUpdater):
    """Computes log-probs and updates a (possibly FSDP-wrapped) causal LM."""

    role = "actor"
    _on_policy_parts: list | None = None  # (rows, log-probs, entropy) per micro-batch of an on-policy update
    _bypass: dict | None = None  # algorithm.rollout_correction in bypass mode (set per update from meta_info)

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        settings: ActorSettings,
        dp_group=None,
        sp_group=None,
        dp_size: int = 1,
        lr_scheduler=None,
        seed: int = 0,
    ):
        super().__init__(module, optimizer, settings, dp_group, sp_group, dp_size, lr_scheduler, seed)
        self.policy_loss_fn = get_policy_loss_fn(settings.policy_loss)
        self.policy_loss_kwargs = policy_loss_kwargs(self.policy_loss_fn, settings.policy_loss_params)
        # clip_cov/kl_cov choose tokens over the whole mini-batch (see _select_tokens); the same seed on
        # every rank, so every rank draws the same clip_cov permutation
        self.token_selector = TOKEN_SELECTORS.get(settings.policy_loss)
        self.selection_generator = torch.Generator().manual_seed(seed)

    def _forward(self, micro: dict, temperature: float, calculate_entropy: bool, calculate_sum_pi_squared=False):
        spec = ScoringSpec(
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            calculate_sum_pi_squared=calculate_sum_pi_squared,
            use_torch_compile=self.settings.use_torch_compile,
            use_fused_kernels=self.settings.use_fused_kernels,
        )
        layout = layout_for(self.settings.use_remove_padding, self.sp_group)
        return forward_micro_batch(self.module, micro, micro["responses"].shape[-1], spec, layout)

    def compute_log_prob(
        self, data: DataProto, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-response-token log-probs [bs, resp_len] (and entropy) in the input order."""
        out = self.compute_token_stats(data, calculate_entropy)
        return out["log_probs"], out.get("entropy")

    @torch.no_grad()
    def compute_token_stats(
        self, data: DataProto, calculate_entropy: bool = False, calculate_sum_pi_squared: bool = False
    ) -> dict[str, torch.Tensor]:
        """Per-response-token `log_probs` [bs, resp_len], and `entropy` / `sum_pi_squared` (Σ_v π(v)²)
        when asked, in the input order."""
        self.module.eval()
        temperature = data.meta_info.get("temperature", 1.0)
        micro_batches, reverse_idx = split_micro_batches(
            forward_inputs(data.batch), self.settings.log_prob, self.dp_group
        )
        outputs = [self._forward(m, temperature, calculate_entropy, calculate_sum_pi_squared) for m in micro_batches]
        return {name: restore_order([out[name] for out in outputs], reverse_idx) for name in outputs[0]}

    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """`ppo_epochs` passes of mini-batch optimizer steps; returns metric lists (one value per step)."""
        return self._update(data, on_policy=False)

    def update_policy_on_policy(self, data: DataProto) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
        """The update without `old_log_probs` given: it computes them from the policy it starts from.

        The first optimizer step's loss takes its own forward's log-probs, detached, as the old ones (they are
        equal: same parameters, same tokens); the rows of the later mini-batches get theirs, with their entropy,
        from one forward without gradients before that step (`_before_first_step`): the separate pass's numbers
        on the rows that need them, inside this call. One epoch only: later epochs would reuse the first
        mini-batch's old log-probs, which this call does not keep.

        Returns the metrics and what the separate old-log-prob pass would have given: `old_log_probs` and
        `entropys` [bs, resp_len] in the input order.
        """
        s = self.settings
        if s.ppo_epochs != 1:
            raise ValueError(
                f"an update that computes its own old log-probs takes one epoch: ppo_epochs={s.ppo_epochs}"
            )
        if self.token_selector is not None or data.meta_info.get("rollout_correction") is not None:
            raise ValueError("clip_cov/kl_cov and bypass-mode rollout correction read old_log_probs before the loss")
        self._on_policy_parts = []
        metrics = self._update(data, on_policy=True)
        parts, self._on_policy_parts = self._on_policy_parts, None
        rows = torch.cat([row for row, _, _ in parts])
        stats = {}
        for name, index in (("old_log_probs", 1), ("entropys", 2)):
            values = torch.cat([part[index] for part in parts])
            stats[name] = torch.empty_like(values).index_copy_(0, rows, values)
        return metrics, stats

    def _update(self, data: DataProto, on_policy: bool) -> dict[str, list[float]]:
        """The update; `on_policy`: the update computes the old log-probs (`update_policy_on_policy`)."""
        temperature = data.meta_info.get("temperature", 1.0)
        keys = ["advantages"] + (["ref_log_prob"] if self.settings.use_kl_loss else [])
        keys += [] if on_policy else ["old_log_probs"]
        keys += [k for k in ("rollout_is_weights",) if k in data.batch.keys()]  # decoupled rollout correction
        self._bypass = data.meta_info.get("rollout_correction")  # bypass mode: old_log_probs are the rollout's
        self._temperature = temperature
        prepare = None if self.token_selector is None else (lambda mini: self._select_tokens(mini, temperature))
        batch = update_inputs(data.batch, *keys)
        if on_policy:  # each row's index, to put the old log-probs back in the input order
            batch["on_policy_row"] = torch.arange(len(batch), device=batch.device)
        metrics = self._train(batch, lambda micro, counts: self._loss(micro, counts, temperature), prepare)
        # verl names the rollout-correction metrics without the role
        role_prefix = f"{self.role}/"
        return {
            name.removeprefix(role_prefix) if name.startswith(role_prefix + PREFIX) else name: values
            for name, values in metrics.items()
        }

    def _before_first_step(self, batch: TensorDict) -> TensorDict:
        """With the old log-probs computed here: the later mini-batches' rows get theirs before any step.

        The first mini-batch's rows are marked `on_policy` (their loss takes its own forward's); the others are
        scored as the separate pass scores them (its micro-batching, entropy included), under the parameters
        the update starts from.
        """
        if self._on_policy_parts is None:
            return batch
        first = min(self.settings.mini_batch_size, len(batch))
        batch = batch.clone(recurse=False)
        batch["on_policy"] = torch.arange(len(batch), device=batch.device) < first
        later = batch[first:]
        batch["old_log_probs"] = torch.zeros_like(batch["advantages"])
        if len(later) > 0:
            later_data = DataProto(batch=forward_inputs(later), meta_info={"temperature": self._temperature})
            stats = self.compute_token_stats(later_data, calculate_entropy=True)
            self.module.train()  # compute_token_stats left it in eval mode
            batch["old_log_probs"][first:] = stats["log_probs"]
            self._on_policy_parts.append((later["on_policy_row"], stats["log_probs"], stats["entropy"]))
        return batch

    def _optimizer_step(self, mini: TensorDict, loss_fn) -> dict[str, float]:
        """The shared optimizer step; in bypass mode with batch-normalized IS weights, after their mini-batch mean."""
        if needs_mini_batch_normalizer(self._bypass):
            mini = self._with_is_normalizer(mini)
        return super()._optimizer_step(mini, loss_fn)

    def _with_is_normalizer(self, mini: TensorDict) -> TensorDict:
        """`mini` with `rollout_is_normalizer` [rows, 2]: (Σ weights, count) of the whole mini-batch, all DP ranks.

        Bypass mode's IS weights π_θ/π_rollout follow the parameters of this optimizer step, so their mean
        takes one forward without gradients over the mini-batch (the loss's micro-batching) before the
        micro-batches' losses; the sums are added over the DP group.
        """
        cfg = self._bypass
        with torch.no_grad():
            micro_batches, reverse_idx = split_micro_batches(forward_inputs(mini), self.settings.update, self.dp_group)
            log_probs = restore_order(
                [self._forward(m, self._temperature, False)["log_probs"] for m in micro_batches], reverse_idx
            )
            mask = response_mask_of(mini)
            weights, _ = is_weights(
                log_probs - mini["old_log_probs"], mask, cfg["rollout_is"], cfg["rollout_is_threshold"]
            )
            sums = torch.stack(normalizer_sums(weights, mask, cfg["rollout_is"])).to(torch.float64)
        if self.dp_group is not None and dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.dp_group)
        mini = mini.clone(recurse=False)
        mini["rollout_is_normalizer"] = sums.to(weights.dtype).expand(len(mini), 2).clone()
        return mini

    def _loss(self, micro, counts: GlobalCounts, temperature: float) -> tuple[torch.Tensor, dict]:
        """Policy loss, minus the entropy bonus, plus the KL loss, normalized by the mini-batch's global counts."""
        s = self.settings
        norm = counts.agg_kwargs()
        response_mask = response_mask_of(micro)
        on_policy = "on_policy" in micro.keys() and bool(micro["on_policy"][0])  # a mini-batch is wholly one or other
        out = self._forward(micro, temperature, calculate_entropy=s.entropy_coeff != 0 or on_policy)
        old_log_probs = self._on_policy_old(micro, out) if on_policy else micro["old_log_probs"]
        advantages = micro["advantages"]
        if "rollout_is_weights" in micro.keys():  # ℓ(w·A) = w·ℓ(A) for the losses that take them
            advantages = advantages * micro["rollout_is_weights"]
        args = (s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c, s.loss_agg_mode)
        if self._bypass is not None:
            pg_loss, pg_metrics = bypass_policy_loss(
                micro["old_log_probs"],
                out["log_probs"],
                advantages,
                response_mask,
                self._bypass,
                lambda old, new, adv, mask: compute_policy_loss_vanilla(old, new, adv, mask, *args, **norm),
                lambda mat, mask: agg_loss(mat, mask, s.loss_agg_mode, **norm),
                tuple(micro["rollout_is_normalizer"][0]) if "rollout_is_normalizer" in micro.keys() else None,
            )
        else:
            if "pg_token_selection" in micro.keys():
                extra = {**self.policy_loss_kwargs, "token_selection": micro["pg_token_selection"]}
            else:
                extra = self.policy_loss_kwargs
            pg_loss, pg_metrics = self.policy_loss_fn(
                old_log_probs, out["log_probs"], advantages, response_mask, *args, **norm, **extra
            )
        loss = pg_loss
        # token-weighted metrics: local means weighted by this micro-batch's share of global tokens
        share = counts.token_share(response_mask)
        metrics = {
            "pg_loss": pg_loss,
            **{
                name: pg_metrics[name] * share
                for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
                if name in pg_metrics
            },
            **{name: value * share for name, value in pg_metrics.items() if name.startswith(PREFIX)},
        }
        if s.entropy_coeff != 0:
            entropy = agg_loss(out["entropy"], response_mask, s.loss_agg_mode, **norm)
            loss = loss - s.entropy_coeff * entropy
            metrics["entropy_loss"] = entropy
        if s.use_kl_loss:
            kl = kl_penalty(out["log_probs"], micro["ref_log_prob"], s.kl_loss_type)
            kl_loss = agg_loss(kl, response_mask, s.loss_agg_mode, **norm)
            loss = loss + s.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss
        return loss, metrics

    def _on_policy_old(self, micro: TensorDict, out: dict) -> torch.Tensor:
        """The old log-probs of an on-policy update: this forward's, detached; kept with the entropy."""
        old = out["log_probs"].detach()
        self._on_policy_parts.append((micro["on_policy_row"], old, out["entropy"].detach()))
        return old

    def _select_tokens(self, mini: TensorDict, temperature: float) -> TensorDict:
        """`mini` with `pg_token_selection`: the tokens clip_cov/kl_cov treat apart, chosen over the whole
        mini-batch of every DP rank, as one single-process call on the whole mini-batch would.

        The choice needs the current policy's log-probs of every token before any micro-batch's loss,
        so this costs one extra forward (no grad) per optimizer step. The DP ranks' rows are gathered
        in rank order (equal row counts and widths: one dispatched batch), selected on every rank
        alike, and each rank keeps its own rows.
        """
        s = self.settings
        with torch.no_grad():
            micro_batches, reverse_idx = split_micro_batches(forward_inputs(mini), s.update, self.dp_group)
            log_probs = restore_order(
                [self._forward(m, temperature, False)["log_probs"] for m in micro_batches], reverse_idx
            )
        inputs = [mini["old_log_probs"], log_probs, mini["advantages"], response_mask_of(mini).to(log_probs.dtype)]
        rank, world = 0, 1
        if self.dp_group is not None and dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
            rank, world = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
            inputs = [_all_gather_rows(x, self.dp_group, world) for x in inputs]
        params = {
            **self.policy_loss_kwargs,
            "clip_ratio_low": s.clip_ratio_low,
            "clip_ratio_high": s.clip_ratio_high,
            "generator": self.selection_generator,
        }
        selected = self.token_selector(*inputs, **policy_loss_kwargs(self.token_selector, params))
        mini = mini.clone(recurse=False)
        mini["pg_token_selection"] = selected.chunk(world)[rank]
        return mini


def _all_gather_rows(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """The rows of `x` from every rank of `group`, concatenated in rank order."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)
