"""The rollout server of one rollout replica: generation requests in, one sequence at a time; batches out.

Agent loops (`agent_loop.py`) submit one request per policy turn from their own threads (`generate`) and
await its completion; the server runs the engine on the thread that called the rollout (`serve`), so the
engine, its weights and its memory stay where the synchronous rollout keeps them: weights synced in place,
memory released during training, nothing shipped to another process.

`BatchingServer` (HF, and any engine with a batch `_generate`) puts every waiting request into one generate
call. It starts a batch once no running trajectory could still add a request to it: each one is waiting for
the server, running its tools (`away`), or finished. So a batch holds what the turn-synchronous loop would
have batched, and a trajectory whose tools are slow does not hold the others back. `vllm_server.py` has
vLLM's continuous batching instead. Either way a request's tokens depend only on its prompt, its sample
seed and the weights (`position_seed`), never on its batch.

With `tensor_model_parallel_size > 1` the TP ranks must run the engine on identical inputs at identical
moments: TP rank 0 (the leader) runs the agent loops and broadcasts every engine call's requests to its TP
peers, which run the same call (`follow`) and discard the results.

A request a weight push cuts (`Stop.INTERRUPTED`) is answered with what it has, to be continued by the driver
(`partial.py`, `multi_turn.py`), unless the server continues cuts itself (`continue_cuts`, the OpenAI endpoint's
requests on the rollout pool: their episodes live in the agent's coroutine and cannot move to a continuation call).
Then the request goes back to the queue as its prompt plus the tokens it has, with the rest of its budget and the
same seed; before its next engine call the server loads the announced weights (`catch_up`), and the agent gets one
answer, slower, whose tokens each carry the version that sampled them (`Completion.versions`). On a TP replica the
leader sends the version it holds with each engine call, and a peer loads that version's weights before the call.

Metrics: `rollout/server_queue_time_s/{mean,max}` (from a request's arrival to the start of its batch),
`rollout/server_tokens_per_s` (generated tokens over the serving time), `rollout/server_batch_size_mean`, and with
`continue_cuts` `rollout/server_requests_cut` (requests cut by a push and continued on the new weights).
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from rlframe.models.vision import images_of
from rlframe.protocol import DataProto
from rlframe.workers.rollout.base import BaseRollout, Stop, clip_row
from rlframe.workers.rollout.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One policy turn of one trajectory: generate at most `max_tokens` after `prompt_ids`."""

    index: int  # the trajectory's row in this rollout call; batches list requests in this order
    prompt_ids: list[int]
    max_tokens: int
    seed: int  # the sample's seed (`request_seeds`)
    # a vision-language row's images (rlframe.models.vision): processed for the HF model, as PIL for vLLM
    multi_modal_inputs: dict | None = None
    multi_modal_data: dict | None = None


@dataclass
class Completion:
    """Generated ids up to and including the first EOS (or `max_tokens` of them), their log-probs, and why the
    engine stopped (`Stop.INTERRUPTED`: a push of newer weights cut the turn, which is continued later)."""

    tokens: list[int]
    log_probs: list[float] | None
    stop: Stop = Stop.EOS
    versions: list[int] = field(default_factory=list)  # per token: the policy version that sampled it


@dataclass
class _Pending:
    request: GenerationRequest
    future: Future
    arrived: float
    done: Completion | None = None  # what the request generated before a cut (`continue_cuts`)


class RolloutServer(ABC):
    """The request queue and the bookkeeping shared by the engines' serving loops."""

    def __init__(self, engine: BaseRollout, params: SamplingParams, eos_ids: list[int], pad_id: int):
        self.engine, self.params, self.eos_ids, self.pad_id = engine, params, list(eos_ids), pad_id
        self._cond = threading.Condition()
        self._waiting: list[_Pending] = []
        self._in_flight: dict[int, _Pending] = {}  # taken by the engine, not completed (by id)
        self._open = 0  # trajectories not finished
        self._away = 0  # trajectories running their tools
        self._queue_times: list[float] = []
        self._batch_sizes: list[int] = []
        self._generated = 0
        self._closed: BaseException | None = None
        self.version = 0  # the engine's policy version: each completed token is stamped with it
        self._catch_up: Callable[[], int] | None = None  # `continue_cuts`
        self._awaits_weights = False  # a cut request waits for the announced weights
        self._cuts = 0  # requests cut and continued
        self._leaders_version: int | None = None  # a TP peer: the version TP rank 0's engine last held

    def continue_cuts(self, version: int, catch_up: Callable[[], int] | None) -> None:
        """Serve under policy `version`; with `catch_up` (it loads the newest announced weights and returns their
        version), a request a push cuts is continued here on the new weights instead of being answered cut."""
        self.version, self._catch_up = int(version), catch_up

    # ------------------------------------------------------------------ the agent loops' side (any thread)
    async def generate(self, request: GenerationRequest, away: bool = False) -> Completion:
        """`away`: the caller's trajectory counts as away (an HTTP agent between its requests, `openai_endpoint.py`)
        except while this request waits."""
        future: Future = Future()
        with self._cond:
            if self._closed is not None:
                raise RuntimeError("the rollout server stopped") from self._closed
            self._waiting.append(_Pending(request, future, time.perf_counter()))
            self._away -= int(away)
            self._cond.notify_all()
        try:
            return await asyncio.wrap_future(future)
        finally:
            if away:
                with self._cond:
                    self._away += 1
                    self._cond.notify_all()

    @contextmanager
    def away(self):
        """A trajectory waiting for something other than the server (its tool calls)."""
        with self._cond:
            self._away += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._away -= 1

    def finished(self) -> None:
        """One trajectory is done (or failed): it will send no more requests."""
        with self._cond:
            self._open -= 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ the engine's side (the rollout's thread)
    def serve(self, num_trajectories: int) -> dict[str, float]:
        """Run the engine until `num_trajectories` trajectories have finished; then tell the TP peers to stop."""
        with self._cond:
            self._open += num_trajectories
        start = time.perf_counter()
        try:
            self._serve_loop()
        except BaseException as error:  # no agent may wait forever on a request the engine will never finish
            self.close(error)
            raise
        finally:
            self._broadcast(None)
        return self._metrics(time.perf_counter() - start)

    def close(self, error: BaseException | None = None) -> None:
        """No more requests: waiting, in-flight and later ones fail (after an engine error, no agent may hang)."""
        with self._cond:
            self._closed = error or RuntimeError("closed")
            for pending in [*self._waiting, *self._in_flight.values()]:
                if not pending.future.done():
                    pending.future.set_exception(RuntimeError(f"the rollout server stopped: {self._closed!r}"))
            self._waiting.clear()
            self._in_flight.clear()

    def _batch_ready(self) -> bool:
        """Every running trajectory has sent its request or is running its tools (or none is left)."""
        if self._open == 0:
            return True
        return bool(self._waiting) and len(self._waiting) + self._away >= self._open

    def _take(self, pendings: list[_Pending]) -> list[GenerationRequest]:
        """Requests leaving the queue for the engine, in trajectory order; the leader's peers get them too."""
        pendings.sort(key=lambda p: p.request.index)
        with self._cond:
            self._in_flight.update((id(p), p) for p in pendings)
        now = time.perf_counter()
        self._queue_times += [now - p.arrived for p in pendings]
        self._batch_sizes.append(len(pendings))
        requests = [p.request for p in pendings]
        self._broadcast(requests)
        return requests

    def _complete(self, pending: _Pending, completion: Completion) -> None:
        self._generated += len(completion.tokens)
        new = replace(completion, versions=[self.version] * len(completion.tokens))
        whole = new if pending.done is None else _joined(pending.done, new)
        request, left = pending.request, pending.request.max_tokens - len(new.tokens)
        with self._cond:
            self._in_flight.pop(id(pending), None)
            if new.stop == Stop.INTERRUPTED and self._catch_up is not None and left > 0:
                # back to the queue: its prompt and tokens so far, the rest of its budget, the same seed
                rest = replace(request, prompt_ids=[*request.prompt_ids, *new.tokens], max_tokens=left)
                self._waiting.append(_Pending(rest, pending.future, time.perf_counter(), whole))
                self._awaits_weights, self._cuts = True, self._cuts + 1
                self._cond.notify_all()
                return
        pending.future.set_result(whole)

    def _catch_up_after_cut(self) -> None:
        """Before an engine call: if a push cut requests, load the announced weights they continue on."""
        if self._awaits_weights:
            self.version, self._awaits_weights = int(self._catch_up()), False

    def _broadcast(self, requests, receive: bool = False):
        """TP rank 0's engine call to its TP peers (nothing to do without TP), with the policy version its engine
        holds: when the leader caught up to newer weights (`continue_cuts`), a peer loads the same ones before it
        repeats the call."""
        group = self.engine.tp_group
        if group is None or self.engine.tp_size == 1:
            return requests
        shared = [None if receive else (self.version, requests)]
        dist.broadcast_object_list(shared, group_src=0, group=group)
        version, requests = shared[0]
        if receive:
            if self._leaders_version is not None and version != self._leaders_version:
                if self.engine.catch_up is None:
                    raise RuntimeError(f"TP rank 0 continues on policy version {version}, which this rank cannot load")
                self.engine.catch_up(version)
            self._leaders_version = version
        return requests

    @abstractmethod
    def _serve_loop(self) -> None:
        """Take waiting requests to the engine and complete them until every trajectory has finished."""

    @abstractmethod
    def follow(self) -> None:
        """A TP peer's side of `_serve_loop`: repeat the leader's engine calls until it says stop."""

    def cut(self, tokens: list[int], log_probs: list[float] | None, max_tokens: int, stop: Stop) -> Completion:
        """A completion ends at its first EOS (kept) or at `max_tokens`; `stop` is what the engine reported."""
        tokens, stop = clip_row(tokens, max_tokens, stop, self.eos_ids)
        return Completion(tokens, log_probs[: len(tokens)] if log_probs is not None else None, stop)

    def _metrics(self, elapsed: float) -> dict[str, float]:
        if not self._queue_times:
            return {}
        return {
            "rollout/server_queue_time_s/mean": sum(self._queue_times) / len(self._queue_times),
            "rollout/server_queue_time_s/max": max(self._queue_times),
            "rollout/server_tokens_per_s": self._generated / max(elapsed, 1e-9),
            "rollout/server_batch_size_mean": sum(self._batch_sizes) / len(self._batch_sizes),
            **({"rollout/server_requests_cut": float(self._cuts)} if self._catch_up is not None else {}),
        }


def _joined(before: Completion, after: Completion) -> Completion:
    """A cut request's completion: what it generated before the cut, then its continuation."""
    log_probs = None if after.log_probs is None else before.log_probs + after.log_probs
    return Completion(before.tokens + after.tokens, log_probs, after.stop, before.versions + after.versions)


class BatchingServer(RolloutServer):
    """Every waiting request in one `_generate` call, once no running trajectory can add one (see the module)."""

    def _serve_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._batch_ready)
                if not self._waiting:
                    return  # every trajectory finished
                pendings, self._waiting = self._waiting, []
            self._catch_up_after_cut()
            requests = self._take(pendings)
            by_index = {p.request.index: p for p in pendings}
            for request, completion in zip(requests, self._run(requests)):
                self._complete(by_index[request.index], completion)

    def follow(self) -> None:
        """A TP peer: run every engine call the leader broadcasts, until it says stop."""
        while (requests := self._broadcast(None, receive=True)) is not None:
            self._run(requests)

    def _run(self, requests: list[GenerationRequest]) -> list[Completion]:
        """One engine call over the requests, left-padded as the synchronous rollout pads its prompts."""
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):
            ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            mask[row, width - len(request.prompt_ids) :] = 1
        images = images_of([vars(r) for r in requests])  # the rows' images, when a vision-language model's have some
        batch = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, images
        )
        params = replace(self.params, response_length=max(r.max_tokens for r in requests))
        seeds = [r.seed for r in requests]
        tokens, lengths, log_probs, stops = self.engine._generate(batch, params, self.eos_ids, self.pad_id, seeds)
        return [
            self.cut(
                tokens[row, : int(lengths[row])].tolist(),
                log_probs[row].tolist() if log_probs is not None else None,
                request.max_tokens,
                Stop(int(stops[row])),
            )
            for row, request in enumerate(requests)
        ]
