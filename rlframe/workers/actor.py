"""The PPO actor on one rank: log-probs and the policy update over mini- and micro-batches.

The math lives in `rlframe.algorithms` (pure functions); this class runs the model, prepares the
mini-batches and composes the loss of one micro-batch, and `PPOUpdater` (rlframe.workers.updater) cuts
the batches and steps the optimizer. The update's mode (decoupled, bypass, on-policy:
`rlframe.algorithms.update_mode`) and the parsed rollout correction are fixed when the actor is built;
the loss dispatches on them, and a batch that lacks a key the mode reads is refused by name.

Losses are normalized by the token/sequence counts of the whole mini-batch summed over DP ranks, and
multiplied by `dp_size` because FSDP averages gradients over ranks: the accumulated gradient is exactly
the single-process full-batch gradient, whatever dp, sp, micro-batch size or micro-batching mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlframe.algorithms import distillation
from rlframe.algorithms.kl import kl_penalty
from rlframe.algorithms.loss import (
    TOKEN_SELECTORS,
    PolicyLossArgs,
    get_policy_loss_fn,
    keyword_parameters,
    policy_loss_kwargs,
)
from rlframe.algorithms.masked import masked_mean
from rlframe.algorithms.rollout_correction import PREFIX, bypass_policy_loss, is_weights, normalizer_sums
from rlframe.algorithms.update_mode import ActorUpdate, UpdateMode
from rlframe.batch_plan import ForwardPlan, UpdatePlan
from rlframe.config.keys import ACTOR
from rlframe.distributed.parallel_dims import ParallelDims
from rlframe.protocol import DataProto
from rlframe.workers.batching import (
    GlobalCounts,
    response_mask_of,
    update_inputs,
)
from rlframe.workers.config.actor import clip_ratio_bounds
from rlframe.workers.model_forward import ScoringSpec, forward_micro_batch, layout_for
from rlframe.workers.multimodal import RowImages, with_image_rows
from rlframe.workers.updater import PPOUpdater, RoleModel, append_metrics


@dataclass
class UpdateContext:
    """What one call of the actor's update knows besides its batch; built once per call and passed down.

    `images` are a vision-language batch's per-row image inputs (rlframe.workers.multimodal; None for text).
    In on-policy mode, `on_policy_parts` collects (rows, old log-probs, entropy), and `own_old_log_probs` is
    True while the first mini-batch's step runs: its loss takes its own forward's log-probs as the old ones.
    """

    images: RowImages | None = None
    on_policy_parts: list | None = None
    own_old_log_probs: bool = False


class PPOActor(PPOUpdater):
    """Computes log-probs and updates a (possibly FSDP-wrapped) causal LM."""

    role = "actor"

    def __init__(
        self,
        model: RoleModel,
        config,
        plan: UpdatePlan,
        dims: ParallelDims | None = None,
        seed: int = 0,
        log_prob: ForwardPlan | None = None,
        update: ActorUpdate | None = None,
    ):
        """`config` is the actor's section (`ActorConfig`: actor_rollout_ref.actor); `log_prob` replaces the
        plan's forward pass (the reference policy's: the batch plan's `ref`); `update` is the update's
        mode, rollout correction and scoring temperature (`ActorUpdate.from_config`; default: decoupled, no
        correction, T = 1)."""
        super().__init__(model, config, plan, dims or ParallelDims.single(), seed, forward=log_prob)
        self.update = update or ActorUpdate()
        self.clip_ratio_low, self.clip_ratio_high = clip_ratio_bounds(config)
        self.policy_loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode)
        self.policy_loss_kwargs = policy_loss_params(self.policy_loss_fn, config)
        # clip_cov/kl_cov choose tokens over the whole mini-batch (see _select_tokens); the same seed on
        # every rank, so every rank draws the same clip_cov permutation
        self.token_selector = TOKEN_SELECTORS.get(config.policy_loss.loss_mode)
        self.selection_generator = torch.Generator().manual_seed(seed)
        if self.update.mode is UpdateMode.ON_POLICY:
            self._check_on_policy()

    def _check_on_policy(self) -> None:
        """An update that computes its own old log-probs: one epoch, and nothing reads them before the loss."""
        if self.plan.ppo_epochs != 1:
            raise ValueError(
                f"an update that computes its own old log-probs takes one epoch: ppo_epochs={self.plan.ppo_epochs}"
            )
        if self.token_selector is not None:
            raise ValueError(
                f"{ACTOR}.policy_loss.loss_mode={self.config.policy_loss.loss_mode}: its token choice reads the old "
                "log-probs before the loss, so the update cannot compute them itself"
            )

    def _forward(
        self,
        micro: dict,
        calculate_entropy: bool,
        calculate_sum_pi_squared: bool = False,
        images: RowImages | None = None,
        topk: int = 0,
        gather_ids: torch.Tensor | None = None,
    ):
        spec = ScoringSpec(
            temperature=self.update.temperature,
            calculate_entropy=calculate_entropy,
            calculate_sum_pi_squared=calculate_sum_pi_squared,
            topk=topk,
            use_torch_compile=self.options.use_torch_compile,
            use_fused_kernels=self.options.use_fused_kernels,
        )
        layout = layout_for(self.options.use_remove_padding, self.dims.sp_group)
        response_length = micro["responses"].shape[-1]
        return forward_micro_batch(self.module, micro, response_length, spec, layout, images, gather_ids)

    def _score(self, batch: TensorDict, plan: ForwardPlan | UpdatePlan, images: RowImages | None, **wanted) -> dict:
        """The per-token outputs of one forward without gradients over `batch`, cut as `plan`, in its order."""
        return self._no_grad_outputs(batch, plan, lambda micro: self._forward(micro, images=images, **wanted))

    def compute_log_prob(
        self, data: DataProto, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-response-token log-probs [bs, resp_len] (and entropy) in the input order."""
        out = self.compute_token_stats(data, calculate_entropy)
        return out["log_probs"], out.get("entropy")

    def compute_token_stats(
        self, data: DataProto, calculate_entropy: bool = False, calculate_sum_pi_squared: bool = False, topk: int = 0
    ) -> dict[str, torch.Tensor]:
        """Per-response-token `log_probs` [bs, resp_len], and `entropy` / `sum_pi_squared` (Σ_v π(v)²) /
        `topk_log_probs` and `topk_ids` [bs, resp_len, topk] (the `topk` most likely tokens in place of each
        response token) when asked, in the input order."""
        self.module.eval()
        batch, images = with_image_rows(data.batch, data.non_tensor_batch)
        return self._score(
            batch,
            self.forward_plan,
            images,
            calculate_entropy=calculate_entropy,
            calculate_sum_pi_squared=calculate_sum_pi_squared,
            topk=topk,
        )

    def update_policy(self, data: DataProto) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
        """`ppo_epochs` passes of mini-batch optimizer steps in this actor's mode.

        Returns the metric lists (one value per step) and, in on-policy mode, what the separate old-log-prob
        pass would have given: `old_log_probs` and `entropys` [bs, resp_len] in the input order ({} otherwise).
        """
        keys = self.update.batch_keys(bool(self.config.use_kl_loss))
        missing = [key for key in keys if key not in data.batch.keys()]
        if missing:
            raise ValueError(
                f"the actor's update in {self.update.mode.value} mode reads "
                + "; ".join(f"'{key}' ({keys[key]})" for key in missing)
                + f", which its batch lacks: it has {sorted(data.batch.keys())}"
            )
        batch, images = with_image_rows(update_inputs(data.batch, *keys), data.non_tensor_batch)
        ctx = UpdateContext(images=images)
        if self.update.mode is UpdateMode.ON_POLICY:  # each row's index, to put the old log-probs back in order
            ctx.on_policy_parts = []
            batch["on_policy_row"] = torch.arange(len(batch), device=batch.device)
        metrics = self._update(batch, ctx)
        # verl names the rollout-correction metrics without the role
        role_prefix = f"{self.role}/"
        metrics = {
            name.removeprefix(role_prefix) if name.startswith(role_prefix + PREFIX) else name: values
            for name, values in metrics.items()
        }
        return metrics, self._on_policy_stats(ctx)

    def _update(self, batch: TensorDict, ctx: UpdateContext) -> dict[str, list[float]]:
        """One optimizer step per mini-batch of every epoch, each mini-batch prepared first; metric lists."""
        on_policy = self.update.mode is UpdateMode.ON_POLICY
        self.module.train()
        metrics: dict[str, list[float]] = {}
        for epoch_batch in self._epochs(batch):
            if on_policy:  # one epoch (checked when built)
                epoch_batch = self._score_later_mini_batches(epoch_batch, ctx)
            for index, mini in enumerate(epoch_batch.split(self.plan.mini_batch_size_per_dp)):
                ctx.own_old_log_probs = on_policy and index == 0
                append_metrics(metrics, self._optimizer_step(self._prepare_mini_batch(mini, ctx), ctx))
        self._end_update()
        return metrics

    @staticmethod
    def _on_policy_stats(ctx: UpdateContext) -> dict[str, torch.Tensor]:
        """On-policy mode: the old log-probs and entropy the update computed, in the input order ({} otherwise)."""
        if ctx.on_policy_parts is None:
            return {}
        rows = torch.cat([row for row, _, _ in ctx.on_policy_parts])
        stats = {}
        for name, index in (("old_log_probs", 1), ("entropys", 2)):
            values = torch.cat([part[index] for part in ctx.on_policy_parts])
            stats[name] = torch.empty_like(values).index_copy_(0, rows, values)
        return stats

    def _score_later_mini_batches(self, batch: TensorDict, ctx: UpdateContext) -> TensorDict:
        """On-policy mode: the later mini-batches' rows get their old log-probs before any step.

        The first mini-batch's loss takes its own forward's (`own_old_log_probs`); the others are scored as
        the separate pass scores them (its micro-batching, entropy included), under the parameters the update
        starts from.
        """
        first = min(self.plan.mini_batch_size_per_dp, len(batch))
        batch = batch.clone(recurse=False)
        later = batch[first:]
        batch["old_log_probs"] = torch.zeros_like(batch["advantages"])
        if len(later) > 0:
            self.module.eval()  # as the separate pass scores them
            stats = self._score(later, self.forward_plan, ctx.images, calculate_entropy=True)
            self.module.train()
            batch["old_log_probs"][first:] = stats["log_probs"]
            ctx.on_policy_parts.append((later["on_policy_row"], stats["log_probs"], stats["entropy"]))
        return batch

    def _prepare_mini_batch(self, mini: TensorDict, ctx: UpdateContext) -> TensorDict:
        """What the loss needs from the whole mini-batch (all DP ranks), added before its optimizer step:
        clip_cov/kl_cov's token choice, or bypass mode's IS normalizer."""
        if self.update.mode is UpdateMode.BYPASS:
            if self.update.correction.needs_mini_batch_normalizer:
                mini = self._with_is_normalizer(mini, ctx)
        elif self.token_selector is not None:
            mini = self._select_tokens(mini, ctx)
        return mini

    def _with_is_normalizer(self, mini: TensorDict, ctx: UpdateContext) -> TensorDict:
        """`mini` with `rollout_is_normalizer` [rows, 2]: (Σ weights, count) of the whole mini-batch, all DP ranks.

        Bypass mode's IS weights π_θ/π_rollout follow the parameters of this optimizer step, so their mean
        takes one forward without gradients over the mini-batch (the loss's micro-batching) before the
        micro-batches' losses; the sums are added over the DP group.
        """
        correction = self.update.correction
        log_probs = self._score(mini, self.plan, ctx.images, calculate_entropy=False)["log_probs"]
        with torch.no_grad():
            mask = response_mask_of(mini)
            weights, _ = is_weights(
                log_probs - mini["old_log_probs"], mask, correction.rollout_is, correction.is_bounds
            )
            sums = torch.stack(normalizer_sums(weights, mask, correction.rollout_is)).to(torch.float64)
        if self.dims.reduces_over_dp:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.dims.dp_group)
        mini = mini.clone(recurse=False)
        mini["rollout_is_normalizer"] = sums.to(weights.dtype).expand(len(mini), 2).clone()
        return mini

    def _loss(self, micro, counts: GlobalCounts, ctx: UpdateContext) -> tuple[torch.Tensor, dict]:
        """Policy loss, minus the entropy bonus, plus the KL loss, normalized by the mini-batch's global counts."""
        c = self.config
        agg = counts.aggregation(c.loss_agg_mode)
        args = PolicyLossArgs(self.clip_ratio_low, self.clip_ratio_high, float(c.clip_ratio_c), agg)
        response_mask = response_mask_of(micro)
        calculate_entropy = c.entropy_coeff != 0 or ctx.own_old_log_probs
        distill = self.update.distillation
        gather_ids = micro["teacher_topk_ids"] if distill is not None and distill.uses_topk else None
        out = self._forward(micro, calculate_entropy=calculate_entropy, images=ctx.images, gather_ids=gather_ids)
        pg_loss, pg_metrics = self._policy_loss(micro, out, response_mask, args, ctx)
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
        if c.entropy_coeff != 0:
            entropy = agg(out["entropy"], response_mask)
            loss = loss - float(c.entropy_coeff) * entropy
            metrics["entropy_loss"] = entropy
        if c.use_kl_loss:
            kl = kl_penalty(out["log_probs"], micro["ref_log_prob"], c.kl_loss_type)
            kl_loss = agg(kl, response_mask)
            loss = loss + float(c.kl_loss_coef) * kl_loss
            metrics["kl_loss"] = kl_loss
        if self.update.distillation is not None:
            distill_loss, distill_metrics = self._distillation_loss(micro, out, response_mask, agg, ctx)
            loss = distillation.combine(loss, distill_loss, self.update.distillation)
            metrics["distillation/loss"] = distill_loss
            metrics.update({f"distillation/{name}": value * share for name, value in distill_metrics.items()})
        return loss, metrics

    def _distillation_loss(
        self, micro: TensorDict, out: dict, response_mask: torch.Tensor, agg, ctx: UpdateContext
    ) -> tuple[torch.Tensor, dict]:
        """The distillation term of one micro-batch: the teacher's log-probs against this forward's (top-k: its
        top-k tokens' log-probs against this forward's log-probs of the same tokens).

        Its policy-gradient form takes π_old as the task loss does (this forward's own in an on-policy update's
        first mini-batch) and the decoupled mode's IS weights (verl passes rollout_is_weights to it too).
        """
        settings = self.update.distillation
        masses = {}
        if settings.uses_topk:  # the student's log-probs of the teacher's top-k tokens, from this forward
            topk = distillation.topk_forward_kl_of_log_probs(
                out["gathered_log_probs"], micro["teacher_topk_log_probs"], settings.log_prob_min_clamp
            )
            token_losses = topk["losses"]
            masses = {
                name: masked_mean(topk[name], response_mask).detach() for name in ("student_mass", "teacher_mass")
            }
        else:
            token_losses = distillation.estimator_losses(
                out["log_probs"], micro["teacher_log_probs"], settings.loss_mode
            )
        old_log_probs = out["log_probs"].detach() if ctx.own_old_log_probs else micro["old_log_probs"]
        is_weights = micro["rollout_is_weights"] if self.update.applies_is_weights else None
        loss, metrics = distillation.distillation_loss(
            token_losses, out["log_probs"], old_log_probs, response_mask, settings, agg, is_weights
        )
        return loss, {**metrics, **masses}

    def _policy_loss(
        self, micro: TensorDict, out: dict, response_mask: torch.Tensor, args: PolicyLossArgs, ctx: UpdateContext
    ) -> tuple[torch.Tensor, dict]:
        """The policy loss of one micro-batch in this actor's mode, and its metrics."""
        if self.update.mode is UpdateMode.BYPASS:  # π_old is the rollout's; the correction is in the loss
            correction = self.update.correction
            normalizer = tuple(micro["rollout_is_normalizer"][0]) if correction.needs_mini_batch_normalizer else None
            rollout_log_probs = micro["old_log_probs"]
            advantages = micro["advantages"]
            return bypass_policy_loss(
                rollout_log_probs, out["log_probs"], advantages, response_mask, correction, args, normalizer
            )
        old_log_probs = self._on_policy_old(micro, out, ctx) if ctx.own_old_log_probs else micro["old_log_probs"]
        advantages = micro["advantages"]
        if self.update.applies_is_weights:  # ℓ(w·A) = w·ℓ(A) for the losses that take them
            advantages = advantages * micro["rollout_is_weights"]
        extra = self.policy_loss_kwargs
        if self.token_selector is not None:  # chosen over the whole mini-batch (_select_tokens)
            extra = {**extra, "token_selection": micro["pg_token_selection"]}
        return self.policy_loss_fn(old_log_probs, out["log_probs"], advantages, response_mask, args, **extra)

    def _on_policy_old(self, micro: TensorDict, out: dict, ctx: UpdateContext) -> torch.Tensor:
        """The old log-probs of an on-policy update: this forward's, detached; kept with the entropy."""
        old = out["log_probs"].detach()
        ctx.on_policy_parts.append((micro["on_policy_row"], old, out["entropy"].detach()))
        return old

    def _select_tokens(self, mini: TensorDict, ctx: UpdateContext) -> TensorDict:
        """`mini` with `pg_token_selection`: the tokens clip_cov/kl_cov treat apart, chosen over the whole
        mini-batch of every DP rank, as one single-process call on the whole mini-batch would.

        The choice needs the current policy's log-probs of every token before any micro-batch's loss,
        so this costs one extra forward (no grad) per optimizer step. The DP ranks' rows are gathered
        in rank order (equal row counts and widths: one dispatched batch), selected on every rank
        alike, and each rank keeps its own rows.
        """
        log_probs = self._score(mini, self.plan, ctx.images, calculate_entropy=False)["log_probs"]
        inputs = [mini["old_log_probs"], log_probs, mini["advantages"], response_mask_of(mini).to(log_probs.dtype)]
        rank, world = 0, 1
        if self.dims.reduces_over_dp:
            rank, world = self.dims.dp_rank, self.dims.dp_size
            inputs = [_all_gather_rows(x, self.dims.dp_group, world) for x in inputs]
        params = {
            **self.policy_loss_kwargs,
            "clip_ratio_low": self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio_high,
            "generator": self.selection_generator,
        }
        selected = self.token_selector(*inputs, **policy_loss_kwargs(self.token_selector, params))
        mini = mini.clone(recurse=False)
        mini["pg_token_selection"] = selected.chunk(world)[rank]
        return mini


def policy_loss_params(fn, config) -> dict:
    """The keyword parameters policy loss `fn` declares, read from the actor's section by verl's names.

    A loss's own parameters live in `policy_loss` (clip_cov_ratio, dro_beta, ...) or, for sapo's gate
    temperatures, on the actor (tau_pos, tau_neg): the loss's signature says which it reads.
    """
    out = {}
    for name in keyword_parameters(fn):
        for section in (config.policy_loss, config):
            if hasattr(section, name):
                value = getattr(section, name)
                out[name] = float(value) if isinstance(value, (int, float)) else value
                break
    return out


def _all_gather_rows(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """The rows of `x` from every rank of `group`, concatenated in rank order."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)
