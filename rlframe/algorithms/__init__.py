"""The math of RL for language models, as pure torch functions (no ranks, no micro-batches).

- `masked`: masked sums, means, variances and whitening, and the name registries.
- `advantage`: advantage estimators (`algorithm.adv_estimator`), looked up by name.
- `kl`: per-token KL estimators, KL controllers and the KL penalty in the reward.
- `loss`: loss aggregation (exact under any micro-batch or DP split), policy and value losses.
- `rollout_correction`: importance weights and rejection against the rollout policy; `bypass_loss` registers
  its bypass loss as `loss_mode=bypass_mode` (imported here, so every import of the package registers it).

Everything works on padded [batch, response_len] tensors with a 0/1 `response_mask`. Exactness under
gradient accumulation and data parallelism comes from `loss.agg_loss` taking the *global* token and
sequence counts of the mini-batch from its caller. Formulas are in docs/algorithms.md; an unknown
name raises ValueError listing the valid ones.
"""

from rlframe.algorithms import bypass_loss  # noqa: F401  (registers loss_mode=bypass_mode)
