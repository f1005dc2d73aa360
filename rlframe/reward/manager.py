"""Reward managers: decode responses, score them, and place each score on its last response token.

Input (verl's convention): a DataProto whose batch has `responses` [bs, response_len] and
`attention_mask` over prompt + response (optionally `prompts` and `response_mask`), and whose
non_tensor_batch has the data source (`data.reward_fn_key`), `reward_model` (a dict with
`ground_truth`) and optionally `extra_info`.

Output: `reward_tensor` [bs, response_len] (zeros except the score at the last valid response token),
`reward_extra_info` (per-sample lists: "score" always, plus the other keys of dict scores; NaN where
a sample lacks a key), `dropped` (a bool per sample) and `metrics` (`reward/num_scorer_errors`,
`reward/num_scorer_timeouts`; with `drop` also `reward/num_dropped_samples`). A sample whose scorer
raises, returns a non-finite or malformed score or one beyond ±2**48 (`MAX_ABS_SCORE`: its group's float32
statistics would overflow), or runs out of time is *failed*; the run goes on and it is counted.
`custom_reward_function.on_scorer_error` says what a failed sample gets: `zero` scores it 0 (trained
on like any other sample); `drop` marks it in `dropped` (the trainer gives it no weight in the
advantages and the loss) and makes its extra info NaN, so that the reward metrics leave it out.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable

import numpy as np
import torch

from rlframe.algorithms.advantage import MAX_ABS_SCORE
from rlframe.protocol import DataProto
from rlframe.reward.config import ON_SCORER_ERROR
from rlframe.reward.custom import load_custom_reward_function
from rlframe.reward.isolated import IsolatedScorer
from rlframe.reward.scorers import default_compute_score

AGENT_SCORE_KEY = "agent_score"  # a rollout's non-tensor column of agent results (None: the scorer scores the row)

logger = logging.getLogger(__name__)


def abbreviate(value, limit: int = 60) -> str:
    """`type repr` of a value, its repr cut to `limit` characters (a 10**400 score, a long string)."""
    text = repr(value)
    return f"{type(value).__name__} {text[:limit]}{'...' if len(text) > limit else ''}"


def normalize_score(result) -> tuple[float, dict]:
    """A scorer's result (number, or dict with "score") -> (score, extra info); raises on anything else."""
    extras = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"a dict score needs a 'score' key, got a dict with keys {sorted(map(str, result))}")
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        result = result.item()
    if not isinstance(result, numbers.Real):
        raise TypeError(f"a score must be a number or a dict with a 'score' key, got {abbreviate(result)}")
    try:
        score = float(result)
    except OverflowError:  # an int beyond float64
        score = math.inf
    if not math.isfinite(score):
        raise ValueError(f"score {abbreviate(result)} is not a finite number")
    if abs(score) > MAX_ABS_SCORE:  # its group's float32 std (or the batch whitening) would be inf or NaN
        raise ValueError(
            f"score {abbreviate(result)} is beyond ±{MAX_ABS_SCORE:.3g} (2**48), past which the float32 "
            "statistics of its group and batch overflow (docs/data_and_rewards.md)"
        )
    return score, extras


def response_lengths(data: DataProto) -> torch.Tensor:
    """Valid length of each response: one past its last unmasked token (0 when all masked)."""
    responses = data.batch["responses"]
    if "response_mask" in data.batch.keys():
        mask = data.batch["response_mask"]
    else:
        mask = data.batch["attention_mask"][:, -responses.shape[1] :]
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device).expand_as(mask)
    return (positions * (mask != 0)).max(dim=1).values


class RewardManager:
    """Shared decode -> score -> place logic; subclasses decide how the scorer is called."""

    # whether score_samples scores each sample on its own (a time limit then keeps those scored before it)
    scores_per_sample = False

    def __init__(
        self,
        tokenizer,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        num_examine: int = 0,
        on_scorer_error: str = "zero",
    ):
        if on_scorer_error not in ON_SCORER_ERROR:
            raise ValueError(f"on_scorer_error={on_scorer_error!r} is not one of {', '.join(ON_SCORER_ERROR)}")
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.reward_fn_key = reward_fn_key
        self.num_examine = num_examine
        self.on_scorer_error = on_scorer_error
        self._logged_traceback = False
        self._isolated: IsolatedScorer | None = None  # with custom_reward_function.timeout_s

    def isolate(self, timeout_s: float) -> None:
        """Score in a child process from now on, cutting a batch off after `timeout_s` seconds."""
        self._isolated = IsolatedScorer(self, timeout_s)

    def __getstate__(self):
        return {**self.__dict__, "_isolated": None}  # the child process scores in-process

    def score_samples(self, data_sources, solution_strs, ground_truths, extra_infos) -> list:
        """Per sample: the scorer's result, or the exception it raised."""
        raise NotImplementedError

    @classmethod
    def config_kwargs(cls, config) -> dict:
        """The manager's own arguments, read from the trainer config (none here)."""
        return {}

    def __call__(self, data: DataProto, return_dict: bool = False):
        """Score a batch; the reward tensor, or a dict with reward_tensor, reward_extra_info and metrics."""
        for key in (self.reward_fn_key, "reward_model"):
            if key not in data.non_tensor_batch:
                raise ValueError(
                    f"the batch has no non-tensor field {key!r} (needed for rule-based rewards); "
                    f"fields present: {sorted(data.non_tensor_batch)}"
                )
        responses = data.batch["responses"]
        lengths = response_lengths(data).tolist()
        solution_strs = self.tokenizer.batch_decode(
            [responses[i, :n].tolist() for i, n in enumerate(lengths)], skip_special_tokens=True
        )
        data_sources = list(data.non_tensor_batch[self.reward_fn_key])
        ground_truths = [reward_model["ground_truth"] for reward_model in data.non_tensor_batch["reward_model"]]
        extra_infos = list(data.non_tensor_batch.get("extra_info", [None] * len(data)))

        # rows an OpenAI agent scored itself (workers/rollout/openai_agent.py): its result, or its failure
        agent_results = data.non_tensor_batch.get(AGENT_SCORE_KEY, [None] * len(data))
        rows = [i for i, result in enumerate(agent_results) if result is None]
        columns = tuple(
            [column[i] for i in rows] for column in (data_sources, solution_strs, ground_truths, extra_infos)
        )
        if not rows:
            scored, num_timeouts = [], 0
        elif self._isolated:
            scored, num_timeouts = self._isolated.score(*columns)
        else:
            scored, num_timeouts = self.score_samples(*columns), 0
        if len(scored) != len(rows):
            raise ValueError(f"the scorer returned {len(scored)} results for a batch of {len(rows)}")
        results = list(agent_results)
        for i, result in zip(rows, scored):
            results[i] = result
        scores, extras, errors = [], [], []
        for i, result in enumerate(results):
            try:
                if isinstance(result, BaseException):
                    raise result
                score, extra = normalize_score(result)
            except Exception as error:  # noqa: BLE001 - one bad sample must not stop the run
                errors.append((i, error))
                score, extra = 0.0, {}
            scores.append(score)
            extras.append(extra)
        self._report_errors(errors, data_sources, data.non_tensor_batch.get("index"))
        dropped = torch.zeros(len(data), dtype=torch.bool)
        if self.on_scorer_error == "drop":
            dropped[[i for i, _ in errors]] = True

        reward_tensor = torch.zeros(responses.shape, dtype=torch.float32)
        for i, (score, length) in enumerate(zip(scores, lengths)):
            reward_tensor[i, max(length - 1, 0)] = score
        # a dropped sample has no score: NaN keeps it out of every reward/<key>/mean (nanmean)
        reward_extra_info = {"score": [math.nan if gone else score for score, gone in zip(scores, dropped.tolist())]}
        for key in dict.fromkeys(k for extra in extras for k in extra):
            reward_extra_info[key] = [extra.get(key, math.nan) for extra in extras]
        self._examine(data_sources, solution_strs, ground_truths, scores)
        if not return_dict:
            return reward_tensor
        metrics = {"reward/num_scorer_errors": len(errors), "reward/num_scorer_timeouts": num_timeouts}
        if self.on_scorer_error == "drop":
            metrics["reward/num_dropped_samples"] = int(dropped.sum())
        return {
            "reward_tensor": reward_tensor,
            "reward_extra_info": reward_extra_info,
            "dropped": dropped,
            "metrics": metrics,
        }

    def _report_errors(self, errors: list, data_sources: list, indices) -> None:
        """Log the failures: the first batch with any shows a traceback, later ones a line."""
        if not errors:
            return
        first_index, first_error = errors[0]
        where = f"sample {first_index} of the batch, data_source={data_sources[first_index]!r}"
        if indices is not None:  # the dataset's `index`: extra_info["index"] or the prompt's row
            where += f", index={indices[first_index]!r}"
        if not self._logged_traceback:
            self._logged_traceback = True
            logger.error(
                "reward scorer failed on %d of %d samples (%s); first failure (%s):",
                len(errors),
                len(data_sources),
                self._fate,
                where,
                exc_info=first_error,
            )
        else:
            logger.warning(
                "reward scorer failed on %d of %d samples (%s); first: %s: %r",
                len(errors),
                len(data_sources),
                self._fate,
                where,
                first_error,
            )

    @property
    def _fate(self) -> str:
        return "dropped" if self.on_scorer_error == "drop" else "scored 0"

    def _examine(self, data_sources, solution_strs, ground_truths, scores) -> None:
        shown: dict = {}
        for source, solution, truth, score in zip(data_sources, solution_strs, ground_truths, scores):
            if shown.get(source, 0) < self.num_examine:
                shown[source] = shown.get(source, 0) + 1
                logger.info("[%s] response=%r ground_truth=%r score=%s", source, solution, truth, score)


def extra_info_metrics(reward_extra_info: dict) -> dict[str, float]:
    """`reward/<key>/mean` of every extra-info entry whose values are all numbers (or None), NaN left out.

    NaN or None marks a sample without the entry (or a dropped one); entries holding text or other
    values (a scorer's "pred") stay in the extra info but are not averaged (they used to stop the step).
    """
    metrics = {}
    for key, values in reward_extra_info.items():
        if not all(value is None or isinstance(value, (numbers.Real, np.bool_)) for value in values):
            continue
        present = [number for number in map(as_float, values) if not math.isnan(number)]
        if present:
            metrics[f"reward/{key}/mean"] = float(np.mean(present))
    return metrics


def as_float(value) -> float:
    """An extra-info value as a float: NaN for None and anything not a number, +-inf beyond float64."""
    if not isinstance(value, (numbers.Real, np.bool_)):
        return math.nan
    try:
        return float(value)
    except OverflowError:  # an int beyond float64
        return math.inf if value > 0 else -math.inf


def drop_failed_samples(batch: DataProto, dropped: torch.Tensor) -> None:
    """`on_scorer_error=drop`: the `dropped` samples get no weight in the advantages and the loss.

    Their response mask is zeroed (every loss, the KL and the advantage whitening sum over it) and
    they are marked in `batch.batch["reward_dropped"]`, which `group_index` and the metrics read.
    """
    mask = batch.batch["response_mask"]
    batch.batch["response_mask"] = mask * (~dropped).unsqueeze(-1).to(mask.dtype)
    batch.batch["reward_dropped"] = dropped


def group_index(batch: DataProto) -> np.ndarray:
    """The advantage estimators' group of each sample: its prompt's uid; a dropped sample leaves its group.

    A dropped sample gets a group of its own (advantage 0: its mask is zero), so that the group
    mean, std and leave-one-out baselines of its prompt are computed over the kept samples only.
    """
    uids = batch.non_tensor_batch["uid"]
    if "reward_dropped" not in batch.batch.keys():
        return uids
    index = np.empty(len(uids), dtype=object)
    for row, (uid, gone) in enumerate(zip(uids, batch.batch["reward_dropped"].tolist())):
        index[row] = ("dropped", row) if gone else uid  # a tuple never equals a uid string
    return index


def score_each(fn: Callable, data_sources, solution_strs, ground_truths, extra_infos) -> list:
    """Call a per-sample scorer on every sample; a sample that fails gets its exception in its place."""
    results = []
    for data_source, solution_str, ground_truth, extra_info in zip(
        data_sources, solution_strs, ground_truths, extra_infos
    ):
        try:
            results.append(
                fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
            )
        except Exception as error:  # noqa: BLE001 - counted and logged by the manager
            results.append(error)
    return results


def default_batch_compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> list:
    """`default_compute_score` over lists (the batch manager's scorer when no custom one is set)."""
    return score_each(default_compute_score, data_sources, solution_strs, ground_truths, extra_infos)


class NaiveRewardManager(RewardManager):
    """One scorer call per sample: fn(data_source=, solution_str=, ground_truth=, extra_info=)."""

    scores_per_sample = True

    def score_samples(self, data_sources, solution_strs, ground_truths, extra_infos) -> list:
        return score_each(
            self.compute_score or default_compute_score, data_sources, solution_strs, ground_truths, extra_infos
        )


class BatchRewardManager(RewardManager):
    """One scorer call per batch: fn(data_sources=, solution_strs=, ground_truths=, extra_infos=) -> list.

    The function may put an exception in place of a sample's result to fail only that sample;
    if the call itself raises, every sample of the batch scores 0 and counts as an error.
    """

    def score_samples(self, data_sources, solution_strs, ground_truths, extra_infos) -> list:
        fn = self.compute_score or default_batch_compute_score
        try:
            results = fn(
                data_sources=data_sources,
                solution_strs=solution_strs,
                ground_truths=ground_truths,
                extra_infos=extra_infos,
            )
        except Exception as error:  # noqa: BLE001 - counted and logged by the caller
            return [error] * len(data_sources)
        one_dimensional = isinstance(results, (list, tuple)) or (isinstance(results, np.ndarray) and results.ndim == 1)
        if not one_dimensional or len(results) != len(data_sources):
            # a result per sample cannot be told apart: the batch fails as if the call had raised
            error = ValueError(
                f"the batch reward function returned {abbreviate(results)}; expected a list of "
                f"{len(data_sources)} results (one number or dict with 'score' per sample)"
            )
            return [error] * len(data_sources)
        return list(results)


REWARD_MANAGERS: dict[str, type[RewardManager]] = {"naive": NaiveRewardManager, "batch": BatchRewardManager}


def get_reward_manager_cls(name: str) -> type[RewardManager]:
    """The reward manager class registered as `name` (`reward_model.reward_manager`)."""
    if name not in REWARD_MANAGERS:
        raise ValueError(f"reward_model.reward_manager={name!r} is unknown; valid names: {', '.join(REWARD_MANAGERS)}")
    return REWARD_MANAGERS[name]


def load_reward_manager(
    config, tokenizer, num_examine: int = 0, compute_score: Callable | None = None
) -> RewardManager:
    """The reward manager the full trainer config asks for, with the custom scorer if one is set.

    Pass `compute_score` (e.g. another manager's) to reuse a scorer instead of executing the
    user's file again.
    """
    if compute_score is None:
        compute_score = load_custom_reward_function(
            config.custom_reward_function.path, config.custom_reward_function.name
        )
    manager_cls = get_reward_manager_cls(config.reward_model.reward_manager)
    manager = manager_cls(
        tokenizer,
        compute_score=compute_score,
        reward_fn_key=config.data.reward_fn_key,
        num_examine=num_examine,
        on_scorer_error=config.custom_reward_function.on_scorer_error,
        **manager_cls.config_kwargs(config),
    )
    if config.custom_reward_function.timeout_s is not None:
        manager.isolate(config.custom_reward_function.timeout_s)
    return manager
