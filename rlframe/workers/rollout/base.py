"""The rollout contract shared by every engine: sampling settings, input checks, output layout, metrics.

An engine only has to turn left-padded prompt rows into generated token rows (`_generate`);
everything around it — which sampling parameters apply to this call, rejecting malformed prompts,
building the padded `responses`/`response_mask`/`input_ids`/`attention_mask`/`position_ids`
tensors and the metrics — lives here, so `hf` and `vllm` cannot drift apart.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from rlframe.models.vision import MULTIMODAL_KEYS, extend_positions, vision_spec
from rlframe.protocol import DataProto
from rlframe.workers.dtypes import resolve_dtype
from rlframe.workers.rollout.sampling import SamplingParams
from rlframe.workers.rollout.tp import group_rank_and_size

if TYPE_CHECKING:
    from rlframe.workers.rollout.config import RolloutConfig

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
KEY = "actor_rollout_ref.rollout"
STOP_KEY = "stop_reason"  # per row: why the engine stopped it (a `Stop`)
VERSIONS_KEY = "rollout_versions"  # the policy version that sampled each response token, -1 on padding and context
TRAJECTORY_KEY = "trajectory"  # per row: a cut multi-turn trajectory's state (`multi_turn.Trajectory`), else None
# the rollout's own bookkeeping in its output: the rollout pool reads it, a training batch does not carry it
ROLLOUT_STATE_KEYS = (STOP_KEY, VERSIONS_KEY)


class Stop(IntEnum):
    """Why an engine stopped a row, as the engine knows it (never guessed from the tokens afterwards)."""

    EOS = 0  # it generated an end-of-sequence token
    LENGTH = 1  # it spent its token budget
    CONTEXT_LIMIT = 2  # it spent a budget that the engine's context limit shortened (vLLM's max_model_len)
    INTERRUPTED = 3  # the engine's `interrupt` fired before the row finished: only these rows are continued


class Generated(NamedTuple):
    """What `_generate` returns: token ids [B, W], generated counts [B], log-probs [B, W] or None, `Stop`s [B]."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    log_probs: torch.Tensor | None
    stops: torch.Tensor


def stop_of(ended_with_eos: bool, count: int, budget: int, interrupted: bool, context_limited: bool = False) -> Stop:
    """A row's stop reason from what the engine knows: an EOS ends it, then a spent budget, then the interrupt."""
    if ended_with_eos:
        return Stop.EOS
    if count >= budget:
        return Stop.CONTEXT_LIMIT if context_limited else Stop.LENGTH
    if interrupted:
        return Stop.INTERRUPTED
    raise RuntimeError(f"an engine returned a row of {count} tokens without EOS, budget {budget} or interrupt")


def clip_row(tokens: list[int], budget: int, stop: Stop, eos_ids: list[int]) -> tuple[list[int], Stop]:
    """A row generated in a batch of larger budgets, cut to its own `budget` and first EOS (kept), with the stop
    reason that follows: EOS, then its spent budget, else what the engine reported (interrupted, context limit)."""
    tokens = tokens[:budget]
    end = next((i for i, token in enumerate(tokens) if token in eos_ids), None)
    if end is not None:
        return tokens[: end + 1], Stop.EOS
    if len(tokens) >= budget:
        return tokens, Stop.CONTEXT_LIMIT if stop == Stop.CONTEXT_LIMIT else Stop.LENGTH
    return tokens, Stop(int(stop))


def mark_rollout_state(out: DataProto, stops: torch.Tensor, versions: torch.Tensor) -> DataProto:
    """Put the rows' stop reasons and per-token policy versions into a rollout output (-1 where the mask is 0)."""
    out.batch[STOP_KEY] = stops.to(torch.int8).cpu()
    mask = out.batch["response_mask"]
    out.batch[VERSIONS_KEY] = versions.to(torch.int32).to(mask.device).masked_fill(mask == 0, -1)
    return out


def drop_rollout_state(output: DataProto) -> DataProto:
    """The output without the rollout's own bookkeeping (stop reasons, versions, cut trajectories): a training batch
    of the synchronous loop does not carry it (the OpenAI agent's output has none)."""
    for key in ROLLOUT_STATE_KEYS:
        if output.batch is not None and key in output.batch.keys():
            del output.batch[key]
    output.non_tensor_batch.pop(TRAJECTORY_KEY, None)
    return output


def policy_version(meta_info: dict) -> int:
    """The policy version a rollout call generates with (`policy_version` in its meta_info; 0 when not given)."""
    return int(meta_info.get("policy_version", 0))


def call_seed(dp_index: int) -> int:
    """The seed of one generate call: one draw of this process's torch RNG plus the DP index. Every worker's RNG
    starts from `data.seed`, so without the index all DP groups would sample the same stream. Every path draws
    it here (a TP group's generation, the rollout pool's replicas, pooled CPU generation), so a run's samples do
    not depend on which of them generated."""
    return draw_seed() + dp_index


def draw_seed() -> int:
    """One draw of this process's torch RNG, as a seed."""
    return int(torch.randint(0, 2**62, ()).item())


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run under `seed` (torch's CPU and CUDA generators), then give the process its own RNG state back."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@dataclass(frozen=True)
class ServedModel:
    """The model an engine serves: where its first weights come from and how to load it."""

    path: str
    trust_remote_code: bool = False
    override_config: dict | None = None  # fields merged into the model's HF config
    lora_rank: int = 0  # > 0: the actor trains a LoRA adapter of this rank, which vLLM serves


def default_special_tokens(tokenizer, model_path: str) -> tuple[list[int], int]:
    """EOS ids (tokenizer eos plus the model's generation_config eos list) and the pad id."""
    eos: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer decides
        extra = None
    for token in [extra] if isinstance(extra, int) else (extra or []):
        if int(token) not in eos:
            eos.append(int(token))
    if not eos:
        raise ValueError(f"no EOS token: neither the tokenizer nor {model_path}/generation_config.json names one")
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    return eos, int(eos[0] if pad is None else pad)


def check_prompts(prompts: DataProto, prompt_length: int) -> None:
    """Reject prompts the contract does not allow, with the offending sizes in the message."""
    missing = [k for k in PROMPT_KEYS if k not in prompts.batch_keys]
    if missing:
        raise ValueError(
            f"rollout prompts need batch keys {list(PROMPT_KEYS)}; missing {missing} (got {prompts.batch_keys})"
        )
    input_ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    if input_ids.dim() != 2 or input_ids.shape != mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(mask.shape)} must be "
            "equal [batch, prompt_len] shapes"
        )
    if input_ids.shape[1] > prompt_length:
        lengths = mask.sum(-1)
        raise ValueError(
            f"prompts are {input_ids.shape[1]} tokens wide (longest real prompt {int(lengths.max())}) "
            f"but {KEY}.prompt_length={prompt_length} (= data.max_prompt_length); filter or "
            "truncate them in the dataset (data.filter_overlong_prompts, data.truncation)"
        )
    if len(prompts) and not bool(mask[:, -1].all()):
        rows = torch.nonzero(mask[:, -1] == 0).flatten()[:5].tolist()
        raise ValueError(
            f"prompts must be left-padded with at least one real token: rows {rows} end in "
            "padding (attention_mask[:, -1] == 0)"
        )


def response_mask_from_tokens(responses: torch.Tensor, lengths: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """1 for generated tokens up to and including the first EOS, 0 after it and past `lengths`."""
    width = responses.shape[1]
    generated = torch.arange(width, device=responses.device)[None, :] < lengths[:, None]
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device)) & generated
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    return (generated & ~after_eos).long()


def build_rollout_output(
    prompts: DataProto,
    responses: torch.Tensor,
    lengths: torch.Tensor,
    response_length: int,
    eos_ids: list[int],
    pad_id: int,
    log_probs: torch.Tensor | None = None,
) -> DataProto:
    """Lay out generated tokens in the rollout contract.

    `responses` [B, W] (W <= response_length) holds generated ids, `lengths` [B] how many of them the
    engine produced. Tokens after the first EOS become `pad_id`; response positions continue from
    each prompt's last position; `non_tensor_batch` passes through.
    """
    num, width = responses.shape
    if width > response_length:
        raise ValueError(f"engine returned {width} tokens per response, more than response_length={response_length}")
    device = prompts.batch["input_ids"].device
    padded = torch.full((num, response_length), pad_id, dtype=torch.long, device=device)
    padded[:, :width] = responses.to(device)
    response_mask = response_mask_from_tokens(padded, lengths.to(device), eos_ids)
    padded = torch.where(response_mask.bool(), padded, torch.full_like(padded, pad_id))
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    tensors = {
        "prompts": prompt_ids,
        "responses": padded,
        "input_ids": torch.cat([prompt_ids, padded], dim=-1),
        "attention_mask": torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=-1),
        "position_ids": extend_positions(prompts.batch["position_ids"], response_length),
        "response_mask": response_mask,
    }
    if log_probs is not None:
        full = torch.zeros(num, response_length, dtype=torch.float32, device=device)
        full[:, : log_probs.shape[1]] = log_probs.to(device, torch.float32)
        tensors["rollout_log_probs"] = full * response_mask
    # the images stay with the driver's batch, which has them: only the rollout engine reads them
    passed = {key: value for key, value in prompts.non_tensor_batch.items() if key not in MULTIMODAL_KEYS}
    return DataProto.from_dict(tensors, passed)


SEED_KEY = "sample_seed"  # a row's sampling seed, when the rank owning the row drew it (rollout/pool.py)


def request_seeds(draw: int, seed: int, dp_rank: int, count: int) -> list[int]:
    """Per-sample sampling seeds: sample i's seed depends on (draw, seed, dp_rank, i) only, never on `count`.

    `draw` comes from the TP group's shared torch RNG (`generate_in_tp_group`), so the seeds are the same
    on every TP rank and follow `data.seed`; `seed` and `dp_rank` are the vLLM engine's (`rollout.seed` and
    the replica's index, as verl seeds each replica), 0 for the HF engine, whose draw already holds the DP index.
    """
    words = np.random.SeedSequence([draw, seed, dp_rank]).generate_state(count, dtype=np.uint32)
    return [int(word) & 0x7FFFFFFF for word in words]


def position_seed(sample_seed: int, position: int) -> int:
    """A 63-bit seed for the token a sample draws at `position` (its context length so far): splitmix64.

    Every random choice of a sample is keyed by (its seed, the position it fills), never by the batch it was
    generated in: the synchronous rollout and the rollout server, however they batch, draw the same tokens.
    """
    z = (sample_seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


_MASK64 = (1 << 64) - 1


def response_metrics(response_mask: torch.Tensor, responses: torch.Tensor, eos_ids: list[int]) -> dict[str, float]:
    """`response_length/truncated_ratio`: the share of responses stopped by the length limit, not by EOS.

    rlframe's own metric. verl's `response_length/clip_ratio` (length == max, EOS or not) and the
    length statistics are computed on the driver over the whole batch (`compute_data_metrics`).
    """
    lengths = response_mask.sum(-1)
    if lengths.numel() == 0:
        return {}
    last = (lengths - 1).clamp(min=0)
    ended_with_eos = torch.isin(
        responses.gather(1, last[:, None]).squeeze(1), torch.tensor(eos_ids, device=responses.device)
    ) & (lengths > 0)
    truncated = (lengths == responses.shape[1]) & ~ended_with_eos
    return {"response_length/truncated_ratio": float(truncated.float().mean())}


class Rollout(ABC):
    """What the worker holds as its rollout: an engine (`BaseRollout`) or a wrapper around one
    (`AgentLoopRollout` for mode=async, `MultiTurnRollout` for tool rows); every one implements this explicitly.

    Lifecycle inside the hybrid engine, per step: `resume()` → `update_weights(actor weights)` →
    `generate_sequences(prompts)` → `release()` → training. What an engine can do beyond this is declared in its
    `EngineSpec` (`spec.py`), looked up by name in the registry, never probed on the object.
    """

    config: RolloutConfig  # the rollout's section (`actor_rollout_ref.rollout`)
    # a tool agent's rollout: a row cut by the interrupt continues from its trajectory (`continue_trajectories`)
    runs_trajectories: bool = False

    @property
    @abstractmethod
    def unwrapped(self) -> BaseRollout:
        """The engine under any wrappers (an engine is its own)."""

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Left-padded prompts in, the rollout contract out (see `build_rollout_output`), with metrics."""

    def continue_trajectories(self, rows: DataProto, trajectories: list) -> DataProto:
        """Run cut trajectories (`TRAJECTORY_KEY`) on from their state: rollouts that `runs_trajectories`."""
        raise NotImplementedError(f"{type(self).__name__} runs no trajectories (single-turn rows continue by tokens)")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) actor tensors by their HF parameter names."""
        self.unwrapped.update_weights(named_tensors)

    def update_lora_adapter(self, tensors: dict[str, torch.Tensor], peft_config) -> None:
        """Serve a LoRA actor's adapter (engines whose `capabilities.lora` is "adapter")."""
        self.unwrapped.update_lora_adapter(tensors, peft_config)

    @property
    def needs_base_weights(self) -> bool:
        """Adapter sync: whether the base weights must be sent before the adapter (once, for dummy weights)."""
        return self.unwrapped.needs_base_weights

    def release(self) -> None:
        """Free generation memory before training (no-op unless free_cache_engine)."""
        self.unwrapped.release()

    def resume(self) -> None:
        """Restore what `release` freed, before `update_weights` and generation."""
        self.unwrapped.resume()

    def shutdown(self) -> None:
        """Stop the engine's own processes, if it has any."""
        self.unwrapped.shutdown()

    def sampling_for(self, meta_info: dict) -> SamplingParams:
        """This call's sampling: val_kwargs when `validate`, then the `do_sample` override (ReMax's greedy baseline)."""
        return self.unwrapped.sampling_for(meta_info)

    def special_tokens_for(self, meta_info: dict) -> tuple[list[int], int]:
        """This call's EOS ids and pad id: the meta_info's, else the engine's."""
        return self.unwrapped.special_tokens_for(meta_info)

    def sample_seeds(self, count: int) -> list[int]:
        """One seed per row of this call, from one draw of the torch RNG (under `seeded(call_seed(...))`)."""
        return self.unwrapped.sample_seeds(count)


class BaseRollout(Rollout):
    """A generation engine living in a worker process: an engine module's `SPEC.build` makes one.

    `release()` honours `free_cache_engine`: when it is false the engine keeps its memory and `release`/`resume`
    do nothing.
    """

    # rollout.mode=async: the server its agent loops send requests to (`server.py`); None: `BatchingServer`
    server_class: type | None = None
    needs_base_weights = False  # an adapter-serving engine started from dummy weights sets it until they arrive

    # partial rollout on the rollout pool (`rollout/partial.py`): the hf and vllm engines ask it while they generate;
    # once it says True the generation running stops every unfinished row and what has not started generates nothing,
    # and those rows come back `Stop.INTERRUPTED`
    interrupt: Callable[[], bool] | None = None
    # the rollout pool's engine: load the newest announced weights (a TP peer: those of the version given, its
    # leader's) and return their version (the OpenAI endpoint's requests continue on them in the same call,
    # `RolloutServer.continue_cuts`)
    catch_up: Callable[..., int] | None = None

    def __init__(self, config: RolloutConfig, served: ServedModel, tokenizer, device_type: str, tp_group=None):
        """`config` is the rollout's section; `tp_group` this rank's rollout TP group (None: TP=1)."""
        eos_ids, pad_id = default_special_tokens(tokenizer, served.path)
        self.config, self.eos_ids, self.pad_id = config, list(eos_ids), int(pad_id)
        self.dtype = resolve_dtype(config.dtype, device_type)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        )
        self.tp_group = tp_group
        _, self.tp_size = group_rank_and_size(tp_group)
        self.seed, self.dp_rank = 0, 0  # mixed into the per-sample seeds (vLLM: rollout.seed and its replica index)
        self.vision = vision_spec(served.path, served.trust_remote_code)  # a vision-language model's token layout
        # a vision-language model's image and video pads (an image token without an image): given probability 0
        # when sampling, after the log-probs are read, so those stay the actor's
        self.never_generated = [self.vision.image_token_id, self.vision.video_token_id] if self.vision else []
        if self.tp_size != config.tensor_model_parallel_size:
            raise ValueError(
                f"{KEY}.tensor_model_parallel_size={config.tensor_model_parallel_size} "
                f"but the rollout was given a TP group of size {self.tp_size}"
            )

    @property
    def unwrapped(self) -> BaseRollout:
        return self

    def sampling_for(self, meta_info: dict) -> SamplingParams:
        """This call's sampling: val_kwargs when `validate`, then the `do_sample` override (ReMax's greedy baseline).

        The temperature is the section's (or val_kwargs'), never the call's: the actor scores its log-probs at the
        same one, decided once (`ActorUpdate`)."""
        params = SamplingParams.from_config(self.config, validate=bool(meta_info.get("validate", False)))
        if "do_sample" in meta_info:
            params = replace(params, do_sample=bool(meta_info["do_sample"]))
        params.check()
        return params

    def special_tokens_for(self, meta_info: dict) -> tuple[list[int], int]:
        eos = meta_info.get("eos_token_id", self.eos_ids)
        eos = [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
        return eos, int(meta_info.get("pad_token_id", self.pad_id))

    def sample_seeds(self, count: int) -> list[int]:
        """One seed per row of this call, from one draw of the torch RNG (under `seeded(call_seed(...))`)."""
        return request_seeds(draw_seed(), self.seed, self.dp_rank, count)

    def seeds_for(self, prompts: DataProto) -> list[int]:
        """The rows' sample seeds: drawn by the rank that owns them when given (`SEED_KEY`, pooled generation)."""
        if SEED_KEY in prompts.non_tensor_batch:
            return [int(seed) for seed in prompts.non_tensor_batch[SEED_KEY]]
        return self.sample_seeds(len(prompts))

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Left-padded prompts in, the rollout contract out (see `build_rollout_output`), with metrics."""
        check_prompts(prompts, self.config.prompt_length)
        params = self.sampling_for(prompts.meta_info)
        eos_ids, pad_id = self.special_tokens_for(prompts.meta_info)
        seeds = self.seeds_for(prompts)
        start = time.perf_counter()
        generated = self._generate(prompts, params, eos_ids, pad_id, seeds)
        elapsed = time.perf_counter() - start
        out = build_rollout_output(
            prompts,
            generated.tokens,
            generated.lengths,
            params.response_length,
            eos_ids,
            pad_id,
            generated.log_probs if self.config.calculate_log_probs else None,
        )
        versions = torch.full(out.batch["response_mask"].shape, policy_version(prompts.meta_info))
        mark_rollout_state(out, generated.stops, versions)
        num_tokens = int(out.batch["response_mask"].sum())
        metrics = response_metrics(out.batch["response_mask"], out.batch["responses"], eos_ids)
        metrics["timing_s/generate"] = elapsed
        metrics["perf/rollout_tokens_per_s"] = num_tokens / max(elapsed, 1e-9)
        out.meta_info["metrics"] = metrics
        return out

    @abstractmethod
    def _generate(
        self, prompts: DataProto, params: SamplingParams, eos_ids: list[int], pad_id: int, seeds: list[int]
    ) -> Generated:
        """Generate for every prompt row: token ids [B, W], generated counts [B], log-probs [B, W] or None, and
        why each row stopped (`Stop`).

        `seeds[i]` is row i's sample seed: a sampling engine keys each random choice of the row by it and the
        position it fills (`position_seed`), so a row's tokens do not depend on the rows batched with it.
        """

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) actor tensors by their HF parameter names."""

    def generate_tokens(
        self,
        prompts: DataProto,
        params: SamplingParams,
        eos_ids: list[int],
        pad_id: int,
        seeds: list[int],
        budgets: torch.Tensor | None = None,
    ) -> Generated:
        """`_generate` with a token budget per row: the continuation of rows a weight push cut (`partial.py`),
        for engines whose `capabilities.partial_rollout` is declared."""
        raise NotImplementedError(f"{type(self).__name__} does not continue cut rows (no partial_rollout capability)")

    def update_lora_adapter(self, tensors: dict[str, torch.Tensor], peft_config) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} takes a LoRA actor as merged weights (its capabilities.lora is 'merged')"
        )

    def release(self) -> None:
        """Free generation memory before training (no-op unless free_cache_engine)."""

    def resume(self) -> None:
        """Restore what `release` freed, before `update_weights` and generation."""

    def shutdown(self) -> None:
        """Stop the engine's own processes (none unless the engine has them)."""
