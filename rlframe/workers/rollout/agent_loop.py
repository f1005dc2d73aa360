"""`rollout.mode=async`: agent-loop workers run trajectories concurrently against the replica's rollout server.

`AgentLoopRollout.generate_sequences` keeps the synchronous rollout's contract (rows in, the rollout layout out)
but generates differently: every row is one trajectory, run by an agent loop as a coroutine; the rows are
split into `agent.num_workers` contiguous chunks, as verl splits a batch over its agent-loop workers, and each
chunk runs on its own worker thread with its own asyncio event loop (threads and loops kept from one
generation to the next). A trajectory sends one generation request
per policy turn to the server (`server.py`) and, as `tool_agent`, runs its tool calls right away, without
waiting for the other trajectories' turns. The server runs the engine on the calling thread.

- `single_turn_agent` (no tools configured): one request per row; the output is laid out exactly as the
  synchronous rollout lays it out (`build_rollout_output`), the prompts as given.
- `tool_agent` (tools configured, or the default agent): the multi-turn trajectory of `multi_turn.py`, turn by
  turn, with the same masks, limits, sanity check and metrics; rows naming `single_turn_agent` take one turn.

Why threads in the worker process rather than verl's Ray actors: the engine, its weights and the tools stay in
the process that trains, as in the synchronous rollout, and nothing is serialized per request. Samples stay
reproducible because each row's random draws are keyed by its sample seed and the positions it fills, not by
the order in which requests reach the server or how it batches them: the same seed gives the same tokens for
every `num_workers`, and for `mode=sync`. Each worker thread has its own tokenizer copy (a fast tokenizer is
not safe to share between threads).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist

from rlframe.models.vision import row_images
from rlframe.protocol import DataProto
from rlframe.workers.rollout.base import (
    BaseRollout,
    Rollout,
    build_rollout_output,
    check_prompts,
    mark_rollout_state,
    policy_version,
    response_metrics,
)
from rlframe.workers.rollout.multi_turn import MultiTurnRollout, Trajectory
from rlframe.workers.rollout.openai_agent import OpenAIAgents
from rlframe.workers.rollout.server import BatchingServer, Completion, GenerationRequest, RolloutServer
from rlframe.workers.rollout.tp import group_rank_and_size


class AgentLoopRollout(Rollout):
    """The rollout of `mode=async`; the engine's weights, memory and LoRA lifecycle pass through unchanged
    (`Rollout`'s methods, on `unwrapped`)."""

    def __init__(
        self,
        engine: BaseRollout,
        num_workers: int,
        multi_turn: MultiTurnRollout | None = None,
        openai_agents: OpenAIAgents | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"actor_rollout_ref.rollout.agent.num_workers={num_workers}: must be >= 1")
        self.engine, self.num_workers, self.config = engine, num_workers, engine.config
        self.multi_turn, self.openai_agents = multi_turn, openai_agents
        self._worker_agents = [_worker_copy(multi_turn) for _ in range(num_workers)] if multi_turn else []
        self._loops: _EventLoopThreads | None = None  # the worker threads, started at the first generation

    @property
    def unwrapped(self) -> BaseRollout:
        return self.engine

    @property
    def runs_trajectories(self) -> bool:
        return self.multi_turn is not None

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompts(prompts, self.engine.config.prompt_length)
        if self.multi_turn is not None and "raw_prompt" not in prompts.non_tensor_batch:
            raise ValueError("the tool agent needs the chat messages of each prompt: set data.return_raw_chat=true")
        return self._serve(prompts, None)

    @torch.no_grad()
    def continue_trajectories(self, rows: DataProto, trajectories: list[Trajectory]) -> DataProto:
        """The tool agent's cut trajectories, run on from their state by the agent loops (`multi_turn.py`)."""
        return self._serve(rows, trajectories)

    def _serve(self, prompts: DataProto, trajectories: list[Trajectory] | None) -> DataProto:
        """Start the server and run the rows' agents against it (new trajectories, or the given cut ones)."""
        params = self.engine.sampling_for(prompts.meta_info)
        eos_ids, pad_id = self.engine.special_tokens_for(prompts.meta_info)
        # a cut trajectory keeps its sample seed; new rows take theirs (drawn here unless the rows bring them)
        seeds = self.engine.seeds_for(prompts) if trajectories is None else [t.seed for t in trajectories]
        server_class = self.engine.server_class or BatchingServer
        server: RolloutServer = server_class(self.engine, params, eos_ids, pad_id)
        rank, size = group_rank_and_size(self.engine.tp_group)
        if rank > 0:  # a TP peer: the leader drives the engine calls and sends the output
            server.follow()
            return _from_leader(None, self.engine.tp_group)
        start = time.perf_counter()
        if self.openai_agents is not None:
            out = self._openai_agent(prompts, seeds, server, pad_id)
        elif self.multi_turn is None:
            out = self._single_turn(prompts, seeds, server, params.response_length, eos_ids, pad_id)
        else:
            out = self._tool_agent(prompts, seeds, server, params.response_length, eos_ids, pad_id, trajectories)
        out.meta_info["metrics"]["timing_s/generate"] = time.perf_counter() - start
        return _from_leader(out, self.engine.tp_group) if size > 1 else out

    # ------------------------------------------------------------------ the two agents
    def _single_turn(self, prompts, seeds, server, response_length, eos_ids, pad_id) -> DataProto:
        ids, mask = prompts.batch["input_ids"].cpu(), prompts.batch["attention_mask"].cpu().bool()
        requests = [
            GenerationRequest(
                row, ids[row][mask[row]].tolist(), response_length, seeds[row], **row_images(prompts, row)
            )
            for row in range(len(prompts))
        ]

        async def agent(request: GenerationRequest, _) -> Completion:
            return await server.generate(request)

        start = time.perf_counter()
        completions, server_metrics = self._run(requests, agent, server)
        elapsed = time.perf_counter() - start
        tokens = torch.full((len(prompts), response_length), pad_id, dtype=torch.long)
        log_probs = torch.zeros(len(prompts), response_length) if self.engine.config.calculate_log_probs else None
        lengths = torch.zeros(len(prompts), dtype=torch.long)
        for row, completion in enumerate(completions):
            tokens[row, : len(completion.tokens)] = torch.tensor(completion.tokens, dtype=torch.long)
            lengths[row] = len(completion.tokens)
            if log_probs is not None:
                log_probs[row, : len(completion.tokens)] = torch.tensor(completion.log_probs)
        out = build_rollout_output(prompts, tokens, lengths, response_length, eos_ids, pad_id, log_probs)
        versions = torch.full(tokens.shape, policy_version(prompts.meta_info))
        mark_rollout_state(out, torch.tensor([int(c.stop) for c in completions]), versions)
        metrics = response_metrics(out.batch["response_mask"], out.batch["responses"], eos_ids)
        metrics["perf/rollout_tokens_per_s"] = int(out.batch["response_mask"].sum()) / max(elapsed, 1e-9)
        out.meta_info["metrics"] = {**metrics, **server_metrics}
        return out

    def _tool_agent(self, prompts, seeds, server, response_length, eos_ids, pad_id, trajectories) -> DataProto:
        """Each trajectory as an agent loop: its pending tool calls run (once), else its next turn is generated,
        until it is done or the interrupt cut it (`multi_turn.py` holds the turn logic both rollout modes share)."""
        if trajectories is None:
            trajectories = [self.multi_turn.start_trajectory(row, prompts, seeds[row]) for row in range(len(prompts))]
        version = policy_version(prompts.meta_info)
        for trajectory in trajectories:
            trajectory.interrupted = False

        async def agent(item: tuple[int, Trajectory], worker: MultiTurnRollout) -> Trajectory:
            row, trajectory = item
            while not (trajectory.done or trajectory.interrupted):
                if trajectory.pending:
                    with server.away():
                        results = await worker.tool_turn(trajectory)
                    worker.append_tool_turn(trajectory, results)
                    continue
                context = trajectory.prompt_ids + trajectory.response_ids
                request = GenerationRequest(  # every turn's context holds the first turn's images
                    row, context, worker.budget(trajectory), trajectory.seed, **trajectory.images
                )
                completion = await server.generate(request)
                worker.take_turn(trajectory, completion.tokens, completion.log_probs, eos_ids, completion.stop, version)
            return trajectory

        start = time.perf_counter()
        _, server_metrics = self._run(list(enumerate(trajectories)), agent, server)
        out = self.multi_turn.finish(prompts, trajectories, response_length, pad_id, time.perf_counter() - start)
        out.meta_info["metrics"].update(server_metrics)
        return out

    def _openai_agent(self, prompts, seeds, server, pad_id) -> DataProto:
        agents = self.openai_agents
        names = prompts.non_tensor_batch.get("agent_name")
        if names is not None and set(map(str, names)) - {"openai_agent"}:
            raise ValueError(
                f"rows name agent_name {sorted(set(map(str, names)))}, but with "
                "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent every row runs openai_agent"
            )
        agents.serve_with(server, int(prompts.meta_info.get("policy_version", 0)))

        async def agent(row: int, _) -> tuple:
            return await agents.run_episode(row, prompts, seeds[row])

        episodes, server_metrics = self._run(list(range(len(prompts))), agent, server)
        out = agents.finish(prompts, episodes, pad_id)
        out.meta_info["metrics"].update(server_metrics)
        return out

    # ------------------------------------------------------------------ workers and server
    def _run(self, items: list, agent, server: RolloutServer) -> tuple[list, dict]:
        """`agent(item, worker)` for every item, on `num_workers` threads in contiguous chunks, against `server`."""
        chunk = -(-len(items) // self.num_workers) if items else 1
        chunks = [items[i : i + chunk] for i in range(0, len(items), chunk)]

        async def run_chunk(part: list, worker) -> list:
            async def one(item):
                try:
                    return await agent(item, worker)
                finally:
                    server.finished()

            # every trajectory of the chunk ends (an engine error fails them all) before the first error is raised
            results = await asyncio.gather(*(one(item) for item in part), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return results

        if self._loops is None:
            self._loops = _EventLoopThreads(self.num_workers)
        workers = self._worker_agents or [None] * len(chunks)
        futures = [self._loops.submit(i, run_chunk(part, workers[i])) for i, part in enumerate(chunks)]
        try:
            metrics = server.serve(len(items))
        finally:
            server.close()
        results = [result for future in futures for result in future.result()]
        return results, metrics


class _EventLoopThreads:
    """The agent-loop workers: one thread per worker, each running its own asyncio event loop.

    Started at the first generation and kept for the rollout's life (daemon threads, idle in their event
    loop between generations), so a generation pays no thread or event-loop start-up.
    """

    def __init__(self, num_workers: int):
        self.loops = [asyncio.new_event_loop() for _ in range(num_workers)]
        for index, loop in enumerate(self.loops):
            threading.Thread(target=loop.run_forever, name=f"agent-loop-{index}", daemon=True).start()

    def submit(self, index: int, coroutine) -> Future:
        """Run `coroutine` on worker `index`'s loop; its result or exception through the returned future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loops[index])


def _worker_copy(multi_turn: MultiTurnRollout) -> MultiTurnRollout:
    """The multi-turn logic for one worker thread: shared engine and tools, its own tokenizer and templates."""
    worker = copy.copy(multi_turn)
    worker.tokenizer = copy.deepcopy(multi_turn.tokenizer)
    worker.turns = copy.copy(multi_turn.turns)
    worker.turns.tokenizer = worker.tokenizer
    return worker


def _from_leader(out: DataProto | None, tp_group) -> DataProto:
    """The TP leader's output on every TP rank (peers ran the same engine calls but no agent loops)."""
    shared = [out.to("cpu") if out is not None else None]
    dist.broadcast_object_list(shared, group_src=0, group=tp_group)
    return shared[0]
