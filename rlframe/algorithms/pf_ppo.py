"""PF-PPO (policy filtration, Zhang et al. 2024, arXiv:2409.06957): resample a batch toward reliable rewards.

After GAE, the batch is resampled with replacement, as many rows as it has, each row drawn with a
weight taken from its sequence score (the sum of its `token_level_scores`, before any KL penalty):

- `pow`:        |score| ** weight_pow (weight_pow = 0 is uniform resampling)
- `max_min`:    1 for the rows with the batch's highest or lowest score, else 0
- `max_random`: 0.4 for the rows with the highest score, else 0.1

Every weight gets 1e-8 added (so an all-zero batch is sampled uniformly), as in verl 0.9.1's
`compute_pf_ppo_reweight_data`. Rows keep everything they carry (advantages, returns, old log-probs);
a row drawn twice counts twice in the losses. The keys are declared in `PfPpoConfig` (`rlframe/algorithms/config.py`).
"""

from __future__ import annotations

import torch

from rlframe.algorithms.config import REWEIGHT_METHODS


def pf_ppo_weights(scores: torch.Tensor, reweight_method: str, weight_pow: float) -> torch.Tensor:
    """Sampling weights [bs] from the sequence scores [bs]."""
    if reweight_method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif reweight_method == "max_min":
        extreme = (scores == scores.max()) | (scores == scores.min())
        weights = extreme.to(scores.dtype)
    elif reweight_method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={reweight_method!r}: expected one of {REWEIGHT_METHODS}")
    return torch.clamp(weights + 1e-8, min=1e-8)


def pf_ppo_resample_index(
    token_level_scores: torch.Tensor, reweight_method: str, weight_pow: float, generator: torch.Generator
) -> torch.Tensor:
    """Row indices [bs] drawn with replacement, weighted by `pf_ppo_weights` of each row's summed score."""
    weights = pf_ppo_weights(token_level_scores.sum(dim=-1).float(), reweight_method, weight_pow)
    return torch.multinomial(weights, len(weights), replacement=True, generator=generator)
