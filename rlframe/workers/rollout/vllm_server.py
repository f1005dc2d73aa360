"""The vLLM rollout server: continuous batching on the replica's in-process vLLM engine.

The engine is the `LLM` that `VLLMRollout` built inside the training process (executor `external_launcher`),
so its weight sync and sleep/wake are the synchronous rollout's. Requests are added to its `LLMEngine`
(`add_request`) the moment they arrive and the engine is stepped (`step`): vLLM's scheduler admits new
requests between steps, which is the continuous batching of vLLM's `AsyncLLM`, without the engine-core
process that `AsyncLLM` would start (that process could not share the training process's GPU memory and
TP group, and the weights would have to be shipped to it). A request's seed is the one the synchronous
path gives it (`VLLMRollout.request_params`), so its tokens do not depend on what it was batched with.

With TP > 1 every TP rank holds one shard of the same engine and must add the same requests before the
same step: the leader broadcasts each step's new requests (`RolloutServer._take`), the peers add them and
step too (`follow`). Under partial rollout every rank asks the interrupt once before each step, at the same point
of the loop (the leader's answer is broadcast, `VersionedRollout`), so a push aborts the same requests before the
same step on every rank.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from rlframe.workers.rollout.base import Generated, Stop
from rlframe.workers.rollout.server import Completion, GenerationRequest, RolloutServer, _Pending

# the completion of a request that an interrupt stopped before its first token
NO_TOKENS = SimpleNamespace(token_ids=[], logprobs=[], stop_reason=None, finish_reason=None)  # never started


class VLLMServer(RolloutServer):
    """Requests join the running vLLM batch at the next engine step."""

    def _serve_loop(self) -> None:
        running: dict[str, _Pending] = {}
        latest: dict[str, object] = {}  # each running request's last (cumulative) output
        while True:
            with self._cond:
                # idle engine: start with every request the trajectories can send now (single-turn: the
                # whole batch, as LLM.generate schedules it); running engine: admit whatever has arrived
                self._cond.wait_for(lambda: self._batch_ready() if not running else True)
                closing = self._open == 0 and not running
                pendings, self._waiting = ([], self._waiting) if closing else (self._waiting, [])
            if not (running or closing):  # requests a push cut continue on the announced weights (`continue_cuts`)
                self._catch_up_after_cut()
            cut = self._interrupted()  # asked on every TP rank here, each turn of the loop (`follow`)
            if closing:
                return  # `serve` tells the TP peers to stop
            if cut:
                self._cut(running, latest, pendings)
                self._take_nothing()  # the peers abort theirs on the same answer
                continue
            for pending in pendings:
                running[request_id(pending.request)] = pending
            for output in self._step(self._take(pendings) if pendings else self._take_nothing()):
                latest[output.request_id] = output
                if output.finished:
                    pending = running.pop(output.request_id)
                    del latest[output.request_id]
                    self._complete(pending, self._completion(output, pending.request))

    def _cut(self, running: dict[str, _Pending], latest: dict[str, object], new: list[_Pending]) -> None:
        """Partial rollout (the rollout pool): newer weights were announced. The running requests are aborted
        and answered with the tokens they have; the new ones are answered at once with none (or, under
        `continue_cuts`, all go back to the queue and continue once the new weights are loaded)."""
        self.engine.llm.llm_engine.abort_request(sorted(running))
        for pending in new:
            self._complete(pending, self._completion(SimpleNamespace(outputs=[NO_TOKENS]), pending.request))
        for key, pending in list(running.items()):
            output = latest.pop(key, SimpleNamespace(outputs=[NO_TOKENS]))
            self._complete(pending, self._completion(output, pending.request))
        running.clear()

    def _take_nothing(self) -> list[GenerationRequest]:
        self._broadcast([])
        return []

    def _interrupted(self) -> bool:
        """Partial rollout: whether newer weights were announced (with TP, the leader's answer on every rank)."""
        return self.engine.interrupt is not None and self.engine.interrupt()

    def follow(self) -> None:
        """A TP peer: each turn of the leader's loop, ask the interrupt with it and take what it broadcasts: stop, or
        the requests to add before one engine step; on a cut, abort the running requests as the leader does."""
        running: set[str] = set()
        while True:
            cut = self._interrupted()
            requests = self._broadcast(None, receive=True)
            if requests is None:
                return
            if cut:
                self.engine.llm.llm_engine.abort_request(sorted(running))
                running.clear()
                continue
            running.update(request_id(request) for request in requests)
            for output in self._step(requests):
                if output.finished:
                    running.discard(output.request_id)

    def _step(self, new: list[GenerationRequest]) -> list:
        """Add the new requests, then one engine step; the requests that finished in it come back."""
        engine = self.engine
        engine.wake_for_generation()
        llm_engine = engine.llm.llm_engine

        def params(request: GenerationRequest):
            return replace(self.params, response_length=request.max_tokens)

        for request in new:
            llm_engine.add_request(
                request_id(request),
                engine_prompt(list(request.prompt_ids), request.multi_modal_data),
                engine.request_params(params(request), self.eos_ids, request.seed, len(request.prompt_ids)),
                lora_request=engine._lora_request,
            )
        return llm_engine.step() if llm_engine.has_unfinished_requests() else []

    def _completion(self, output, request: GenerationRequest) -> Completion:
        limited = self.engine.context_limited(len(request.prompt_ids), request.max_tokens)
        tokens, lengths, log_probs, stops = completions_to_tensors(
            [output.outputs[0]], request.max_tokens, self.eos_ids, self.pad_id, self.engine.with_log_probs, [limited]
        )
        length = int(lengths[0])
        return self.cut(
            tokens[0, :length].tolist(),
            log_probs[0, :length].tolist() if log_probs is not None else None,
            request.max_tokens,
            Stop(int(stops[0])),
        )


def request_id(request: GenerationRequest) -> str:
    """Unique among the requests in flight: a trajectory has one request at a time, at a new context length."""
    return f"{request.index}-{len(request.prompt_ids)}"


def engine_prompt(prompt_token_ids: list[int], multi_modal_data: dict | None) -> dict:
    """vLLM's prompt of one row: its tokens, and a vision-language row's images (PIL) under vLLM's
    `multi_modal_data`. The tokens already hold each image's pad token repeated for its grid, as vLLM finds them."""
    prompt = {"prompt_token_ids": prompt_token_ids}
    if multi_modal_data and multi_modal_data.get("image"):
        prompt["multi_modal_data"] = {"image": list(multi_modal_data["image"])}
    return prompt


def completions_to_tensors(
    completions, width: int, eos_ids: list[int], pad_id: int, with_log_probs: bool, context_limited: list[bool]
) -> Generated:
    """vLLM completions as token ids [B, width], generated counts [B], log-probs [B, width] or None, and `Stop`s.

    A stop token that vLLM reports as the stop reason but left out of the ids is put back: the rollout contract
    keeps the EOS token (masked in). Log-probs only `with_log_probs` (calculate_log_probs). The stop reason is
    vLLM's `finish_reason`: "stop" an EOS, "length" the budget (the context limit's where `context_limited[i]`:
    `max_tokens_for` shortened it), none (aborted, or never started) an interrupt.
    """
    stops = torch.tensor([int(vllm_stop(c, limited)) for c, limited in zip(completions, context_limited)])
    tokens = torch.full((len(completions), width), pad_id, dtype=torch.long)
    lengths = torch.zeros(len(completions), dtype=torch.long)
    log_probs = torch.zeros(len(completions), width) if with_log_probs else None
    for i, completion in enumerate(completions):
        generated = list(completion.token_ids)
        stop = getattr(completion, "stop_reason", None)
        if isinstance(stop, int) and stop in eos_ids and (not generated or generated[-1] != stop):
            generated.append(stop)
        generated = generated[:width]
        tokens[i, : len(generated)] = torch.tensor(generated, dtype=torch.long)
        lengths[i] = len(generated)
        if log_probs is not None and completion.logprobs:
            log_probs[i, : len(generated)] = torch.tensor(
                [step[token].logprob for step, token in zip(completion.logprobs, generated)]
            )
    return Generated(tokens, lengths, log_probs, stops.to(torch.int8))


def vllm_stop(completion, context_limited: bool) -> Stop:
    """Why vLLM stopped a request, from its `finish_reason`."""
    reason = getattr(completion, "finish_reason", None)
    if reason == "stop":
        return Stop.EOS
    if reason == "length":
        return Stop.CONTEXT_LIMIT if context_limited else Stop.LENGTH
    return Stop.INTERRUPTED  # aborted by the interrupt, or not started before it fired
