"""Step metrics under verl's names, computed on the driver from the step's batch and timings."""

from __future__ import annotations

import numpy as np
import torch

from rlframe.protocol import DataProto


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def compute_data_metrics(batch: DataProto, use_critic: bool) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one training batch."""
    response_length = batch.batch["responses"].shape[-1]
    response_mask = batch.batch["response_mask"].bool()
    prompt_mask = batch.batch["attention_mask"][:, :-response_length].bool()
    # as verl: a response's length counts every token in it, tool turns of a multi-turn trajectory too
    response_lens = batch.batch["attention_mask"][:, -response_length:].sum(-1).float()
    prompt_lens = prompt_mask.sum(-1).float()
    # samples dropped for a failed scorer (custom_reward_function.on_scorer_error=drop) have no score
    scored = ~batch.batch["reward_dropped"] if "reward_dropped" in batch.batch.keys() else slice(None)
    metrics = {}
    metrics.update(_stats("critic/score", batch.batch["token_level_scores"].sum(-1)[scored]))
    metrics.update(_stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)[scored]))
    metrics.update(_stats("critic/advantages", batch.batch["advantages"][response_mask]))
    metrics.update(_stats("critic/returns", batch.batch["returns"][response_mask]))
    if use_critic:
        values = batch.batch["values"][response_mask]
        returns = batch.batch["returns"][response_mask]
        metrics.update(_stats("critic/values", values))
        var_returns = torch.var(returns)
        metrics["critic/vf_explained_var"] = float(1.0 - torch.var(returns - values) / (var_returns + 1e-5))
    # as verl: clip_ratio is the share at the length limit, whether or not the last token is EOS
    # (the rollout reports response_length/truncated_ratio, which excludes responses that ended in EOS)
    metrics.update(_stats("response_length", response_lens))
    metrics["response_length/clip_ratio"] = float((response_lens == response_length).float().mean())
    metrics.update(_stats("prompt_length", prompt_lens))
    metrics["prompt_length/clip_ratio"] = float((prompt_lens == prompt_mask.shape[-1]).float().mean())
    if "__num_turns__" in batch.non_tensor_batch:  # multi-turn rollouts: user + assistant turns + 1, as verl
        metrics.update(_stats("num_turns", torch.tensor([float(t) for t in batch.non_tensor_batch["__num_turns__"]])))
    return metrics


def compute_timing_metrics(timings: dict[str, float], num_tokens: dict[str, int]) -> dict[str, float]:
    """`timing_s/<phase>` and `timing_per_token_ms/<phase>` for the phases that handle tokens."""
    metrics = {f"timing_s/{name}": seconds for name, seconds in timings.items()}
    for name, tokens in num_tokens.items():
        if name in timings and tokens > 0:
            metrics[f"timing_per_token_ms/{name}"] = 1000.0 * timings[name] / tokens
    return metrics


def compute_throughput_metrics(total_tokens: int, step_seconds: float, num_devices: int) -> dict[str, float]:
    """perf/throughput is tokens per second per device (prompt + response tokens of the step)."""
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / max(step_seconds, 1e-9) / max(num_devices, 1),
    }


def reduce_metrics(metrics: dict[str, list]) -> dict[str, float]:
    """Mean of each metric's list of values (per mini-batch or per worker)."""
    return {k: float(np.mean(v)) if isinstance(v, (list, tuple, np.ndarray)) else float(v) for k, v in metrics.items()}
