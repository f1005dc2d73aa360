"""Generation with Hugging Face `generate` on a plain (non-FSDP) replica of the actor.

The replica is not the FSDP training module on purpose: with FSDP every forward all-gathers
parameters, and `generate` stops a batch when all its rows hit EOS, so DP ranks would run different
numbers of forwards and deadlock. The replica takes the actor's weights through `update_weights`
(full tensors); with `tensor_model_parallel_size > 1` it is sharded with DTensor plans over the TP
group (see `tp.py`), and all TP ranks see the same prompts and RNG, hence the same stopping step.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from rlframe.models.vision import causal_lm_class, generation_image_inputs
from rlframe.protocol import DataProto
from rlframe.workers.rollout.base import BaseRollout, Generated, ServedModel, Stop, position_seed, stop_of
from rlframe.workers.rollout.sampling import SamplingParams
from rlframe.workers.rollout.spec import Capabilities, EngineSpec
from rlframe.workers.rollout.tp import apply_tensor_parallel, load_full_tensors, tp_mesh_from_group
from rlframe.workers.rollout.vllm_rollout import VLLM_ONLY_KEYS

if TYPE_CHECKING:
    from rlframe.workers.rollout.config import RolloutConfig


class _LogProbRecorder:
    """Logits processor recording log p(chosen token) under softmax(logits / temperature).

    HF runs custom processors before its temperature/top-k/top-p warpers, so `scores` are raw
    logits here; the token chosen at step t is only known at step t+1 (or after generate), so
    one step's log-softmax is kept pending. Memory: one [batch, vocab] tensor, not one per step.
    """

    def __init__(self, temperature: float):
        self.temperature, self.pending, self.steps = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self._take(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        self.steps.append(self.pending.gather(1, tokens[:, None]).squeeze(1))
        self.pending = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self._take(sequences[:, -1])
        return torch.stack(self.steps, dim=1) if self.steps else sequences.new_zeros(sequences.shape[0], 0).float()


class _Suppress:
    """Logits processor giving `token_ids` probability 0 (after the log-prob recorder, before sampling)."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.token_ids] = float("-inf")
        return scores


class _SeededSampler:
    """Logits processor that samples each row's next token itself, from that row's own random number.

    The scores go through Hugging Face's own warpers, in the order `generate(do_sample=True)` applies them
    (temperature, top-k, top-p); the token is then drawn by inverse CDF with one uniform keyed by the row's
    sample seed and the position it fills (`position_seed`), and every other token is masked to -inf so that
    greedy decoding picks it. A row's tokens therefore do not depend on which rows share its batch, the
    order they came in, or how many draws other rows made: what the rollout server needs to batch freely.
    """

    def __init__(self, params: SamplingParams, seeds: list[int], pad_counts: torch.Tensor):
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.warpers = [TemperatureLogitsWarper(params.temperature)]
        if params.top_k > 0:
            self.warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(params.top_p))
        self.seeds, self.pad_counts = list(seeds), pad_counts.tolist()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        cdf = torch.softmax(scores.float(), dim=-1).double().cumsum(-1)
        width = input_ids.shape[1]
        uniforms = [
            (position_seed(seed, width - pad) >> 10) / 2.0**53 for seed, pad in zip(self.seeds, self.pad_counts)
        ]
        targets = torch.tensor(uniforms, dtype=torch.float64, device=cdf.device)[:, None] * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, targets, right=True).clamp(max=cdf.shape[1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens, 0.0)


class _StopRows:
    """Stopping criterion: a row stops once it spent its own token budget; every row stops once `interrupt()`.

    Hugging Face pads a stopped row from then on, so a row's generated count is min(steps, budget).
    """

    def __init__(self, budgets: torch.Tensor | None, interrupt: Callable[[], bool] | None, start_width: int):
        self.budgets, self.interrupt, self.start_width, self.fired = budgets, interrupt, start_width, False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.budgets is not None:
            done |= self.budgets.to(input_ids.device) <= input_ids.shape[1] - self.start_width
        if self.interrupt is not None and self.interrupt():
            self.fired = True
            done[:] = True
        return done


class HFRollout(BaseRollout):
    """`model.generate` over micro-batches, on a replica that `update_weights` keeps in sync with the actor.

    `interrupt`, when set (the rollout pool's partial rollout, `rollout/partial.py`), is asked at every decoding
    step: once it says True, the running generation stops every unfinished row and the micro-batches not started
    yet generate nothing; the caller tells the cut rows by their missing EOS.
    """

    def __init__(self, config: RolloutConfig, served: ServedModel, tokenizer, device_type: str, tp_group=None):
        from transformers import AutoConfig, GenerationConfig

        super().__init__(config, served, tokenizer, device_type, tp_group)
        model_path, trust_remote_code, override_config = served.path, served.trust_remote_code, served.override_config
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        for key, value in (override_config or {}).items():
            setattr(hf_config, key, value)
        model = causal_lm_class(hf_config).from_pretrained(
            model_path,
            config=hf_config,
            dtype=self.dtype,
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        )
        # A blank generation config: sampling comes from rlframe's config alone, never from a
        # checkpoint's generation_config.json (Qwen ships top_k=20, repetition_penalty=1.1, ...).
        model.generation_config = GenerationConfig(pad_token_id=self.pad_id, eos_token_id=self.eos_ids)
        model.requires_grad_(False).eval().to(self.device)
        if self.device.type == "cpu":  # own, resizable storage: loaded CPU weights may be file-backed
            for param in model.parameters():
                param.data = param.data.clone()
        if self.tp_size > 1:
            apply_tensor_parallel(model, tp_mesh_from_group(tp_group, device_type))
        self.model = model
        self._targets = dict(model.state_dict(keep_vars=True))
        self._params = dict(model.named_parameters(remove_duplicate=False))  # tied names both listed
        self._storages = _unique_storages(self._params.values())
        self._missing: set[str] = set()
        self._released = False

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full actor tensors into the replica (each TP rank keeps its shard)."""
        if self._released:
            raise RuntimeError("hf rollout: update_weights after release(); call resume() first")
        loaded = load_full_tensors(self._targets, named_tensors)
        for name in loaded:  # a tied weight arrives under one name and fills every alias
            param = self._targets[name]
            self._missing -= {n for n, p in self._params.items() if p is param}

    def release(self) -> None:
        """With free_cache_engine, free the replica's parameter memory (storage resized to 0).

        The next generation then needs `resume()` plus a full `update_weights`; generating before
        every parameter was reloaded raises instead of using garbage.
        """
        if not self.config.free_cache_engine or self._released:
            return
        for storage, _ in self._storages:
            storage.resize_(0)
        self._released, self._missing = True, set(self._params)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        """Re-allocate the freed parameter memory (uninitialized until update_weights)."""
        if not self._released:
            return
        for storage, nbytes in self._storages:
            storage.resize_(nbytes)
        self._released = False

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts: DataProto, params: SamplingParams, eos_ids: list[int], pad_id: int, seeds):
        return self.generate_tokens(prompts, params, eos_ids, pad_id, seeds)

    def generate_tokens(
        self,
        prompts: DataProto,
        params: SamplingParams,
        eos_ids: list[int],
        pad_id: int,
        seeds: list[int],
        budgets: torch.Tensor | None = None,
    ) -> Generated:
        """`_generate`, with an optional token budget per row (`budgets` [B], at most params.response_length):
        the continuation of cut rows, whose prompts may be wider than `prompt_length`. A row stops at an EOS, at its
        budget, or `Stop.INTERRUPTED` when the interrupt fired first (HF has no context limit of its own)."""
        if self._released or self._missing:
            missing = sorted(self._missing)
            raise RuntimeError(
                f"hf rollout weights were released and not reloaded ({len(missing)} parameters "
                f"missing, e.g. {missing[:3]}); call resume() and update_weights() with the full "
                "actor state before generating"
            )
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        input_ids = prompts.batch["input_ids"].to(self.device)
        attention_mask = prompts.batch["attention_mask"].to(self.device)
        images = prompts.non_tensor_batch.get("multi_modal_inputs")  # a vision-language model's rows' images
        # sampling happens in _SeededSampler; HF decodes greedily over the one token it leaves
        generation_config = GenerationConfig(
            max_new_tokens=params.response_length,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            do_sample=False,
            use_cache=True,
            return_dict_in_generate=True,
        )
        temperature = 1.0 if params.greedy else params.temperature
        tokens, lengths, log_probs, stops, size = [], [], [], [], self.config.micro_batch_size
        interrupted = False
        for start in range(0, len(prompts), size):
            ids, mask = input_ids[start : start + size], attention_mask[start : start + size]
            row_budgets = None if budgets is None else budgets[start : start + size].to(torch.long)
            if interrupted or (self.interrupt is not None and self.interrupt()):
                interrupted = True  # this micro-batch's rows come back cut, with no token
                tokens.append(torch.full((len(ids), params.response_length), pad_id, device=self.device))
                lengths.append(torch.zeros(len(ids), dtype=torch.long))
                stops.append(torch.full((len(ids),), int(Stop.INTERRUPTED), dtype=torch.int8))
                if self.config.calculate_log_probs:
                    log_probs.append(torch.zeros(len(ids), params.response_length, device=self.device))
                continue
            first = int(mask.any(0).long().argmax())  # columns padded in every row cost compute, not results
            ids, mask = ids[:, first:], mask[:, first:]
            image_inputs = (
                {} if images is None else generation_image_inputs(images[start : start + size], ids, self.vision)
            )
            stop = _StopRows(row_budgets, self.interrupt, ids.shape[1])
            recorder = _LogProbRecorder(temperature) if self.config.calculate_log_probs else None
            processors = [recorder] if recorder else []  # the recorder sees the raw logits, before sampling
            if self.never_generated:  # a vision-language model's image pads: an image token without an image
                processors.append(_Suppress(self.never_generated))
            if not params.greedy:
                processors.append(_SeededSampler(params, seeds[start : start + size], (mask == 0).sum(-1)))
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=generation_config,
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList([stop]) if budgets is not None or self.interrupt else None,
                **(image_inputs or self._shared_prompt_cache(ids, mask)),  # images: no shared prefill (yet)
            )
            interrupted = stop.fired
            new = out.sequences[:, ids.shape[1] :]
            tokens.append(_pad_right(new, params.response_length, pad_id))
            count = torch.full((new.shape[0],), new.shape[1], dtype=torch.long)
            count = count if row_budgets is None else torch.minimum(count, row_budgets.cpu())
            lengths.append(count)
            stops.append(_stops(new, count, row_budgets, params.response_length, eos_ids, stop.fired))
            if recorder is not None:
                log_probs.append(_pad_right(recorder.finish(out.sequences), params.response_length, 0.0))
        return Generated(
            torch.cat(tokens), torch.cat(lengths), torch.cat(log_probs) if log_probs else None, torch.cat(stops)
        )

    @torch.no_grad()
    def _shared_prompt_cache(self, ids: torch.Tensor, mask: torch.Tensor) -> dict:
        """A prefilled KV cache for the micro-batch when some rows share their prompt (GRPO's n samples of one
        prompt), as `generate`'s cache argument; {} when every prompt is distinct.

        Each distinct prompt runs through the model once, but for its last token, with the positions
        `generate` gives left-padded rows; the cache rows are then repeated to the batch's rows, and
        `generate` starts from the last prompt token. The same cache `generate` would build for each row,
        so the same tokens (its values rounded as in a smaller batch: log-probs agree to a few ulps);
        the prompt's forward is paid once per distinct prompt instead of once per sample.
        """
        from transformers import DynamicCache

        if ids.shape[1] < 2:
            return {}
        unique, row_of = torch.unique(torch.cat([ids, mask], dim=1), dim=0, return_inverse=True)
        if len(unique) == len(ids):
            return {}
        prompt_ids, prompt_mask = unique[:, : ids.shape[1]], unique[:, ids.shape[1] :]
        positions = prompt_mask.long().cumsum(-1) - 1
        positions.masked_fill_(prompt_mask == 0, 1)  # generate's prefill positions for left padding
        name = _cache_argument(type(self.model))
        cache = DynamicCache(config=self.model.config) if _cache_takes_config() else DynamicCache()
        self.model(
            input_ids=prompt_ids[:, :-1],
            attention_mask=prompt_mask[:, :-1],
            position_ids=positions[:, :-1],
            use_cache=True,
            **{name: cache},
        )
        cache.batch_select_indices(row_of.to(ids.device))
        return {name: cache}


@functools.cache
def _cache_takes_config() -> bool:
    """transformers 5's DynamicCache builds its layers from the model config (sliding windows); 4.x takes none."""
    from transformers import DynamicCache

    return "config" in inspect.signature(DynamicCache.__init__).parameters


@functools.cache
def _cache_argument(model_class: type) -> str:
    """The name transformers gives the KV cache argument (`cache` from 5.x, `past_key_values` before)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _stops(new, counts, budgets, response_length: int, eos_ids: list[int], interrupted: bool) -> torch.Tensor:
    """[B] int8 `Stop`s of one micro-batch: `new` [B, W] generated ids, `counts` [B] how many are the row's."""
    is_eos = torch.isin(new.cpu(), torch.tensor(eos_ids))
    rows = []
    for row, count in enumerate(counts.tolist()):
        budget = response_length if budgets is None else int(budgets[row])
        rows.append(int(stop_of(bool(is_eos[row, :count].any()), count, budget, interrupted)))
    return torch.tensor(rows, dtype=torch.int8)


def _pad_right(x: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def _unique_storages(params) -> list[tuple[torch.UntypedStorage, int]]:
    """Each parameter storage once (tied weights share one), with its size in bytes."""
    seen, out = set(), []
    for param in params:
        local = param.to_local() if hasattr(param, "to_local") else param
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append((storage, storage.nbytes()))
    return out


def _inactive(rollout, path: str, root) -> dict[str, str]:
    return {f"{path}.{name}": f"{path}.name=hf: a vLLM setting" for name in VLLM_ONLY_KEYS}


SPEC = EngineSpec(
    name="hf",
    build=HFRollout,
    capabilities=Capabilities(partial_rollout=True, tp_cut=True, micro_batches=True, pools_cpu_generation=True),
    inactive=_inactive,
)
