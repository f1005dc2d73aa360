"""`agent.default_agent_loop=openai_agent`: the user's own agent, trained through the OpenAI endpoint.

For each row, rlframe calls `await FUNCTION(base_url, sample)` (`agent.openai_agent.path` / `.name`) on the
agent-loop workers, concurrently; `sample` holds the row's `prompt` (chat messages), `data_source`, `reward_model`
and `extra_info`. The function drives its agent against `base_url` (an episode's session of `openai_endpoint.py`)
with any client, and returns a float reward, a dict with `score` (its other entries logged like a scorer's), or
None to have the configured reward function score the conversation. An exception, a timeout
(`openai_agent.timeout_s`) or another return value fails the episode: the reward manager counts and scores it like
a failed scorer (`custom_reward_function.on_scorer_error`), and the step goes on.

A row's trajectory is its episode's newest (`episodes.py`): the prompt the policy saw first, then the policy's
sampled tokens (`response_mask = 1`, their log-probs) and the chat template's tokens between its turns (0). An
episode that made no request has an empty response (nothing trained).
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import torch

from rlframe.protocol import DataProto
from rlframe.reward.manager import AGENT_SCORE_KEY
from rlframe.workers.rollout.agent_function import load_agent
from rlframe.workers.rollout.base import BaseRollout, Stop, mark_rollout_state
from rlframe.workers.rollout.episodes import Episode, EpisodeTrajectory
from rlframe.workers.rollout.multi_turn import ChatTemplateTurns
from rlframe.workers.rollout.openai_endpoint import EpisodeBudget, OpenAIEndpoint
from rlframe.workers.rollout.server import GenerationRequest, RolloutServer

MODEL_NAME = "policy"  # the one model the endpoint serves (GET /v1/models)
SAMPLE_KEYS = ("raw_prompt", "data_source", "reward_model", "extra_info")  # what the driver sends the rollout


class AgentFailed(RuntimeError):
    """An episode whose agent raised, ran out of time or returned something else than a reward."""


class OpenAIAgents:
    """The endpoint of one rollout replica and the agent function it serves (one per `AgentLoopRollout`)."""

    def __init__(self, engine: BaseRollout, tokenizer, chat_template_kwargs: dict | None = None):
        cfg = engine.config.agent.openai_agent
        self.engine, self.timeout_s = engine, float(cfg.timeout_s) or None
        self.function = load_agent(cfg.path, cfg.name)
        limits = (int(engine.config.prompt_length), int(engine.config.response_length))
        budget = EpisodeBudget(int(cfg.max_requests), int(cfg.max_generated_tokens))
        self.endpoint = OpenAIEndpoint(
            self._generate,
            tokenizer,
            engine.eos_ids,
            limits,
            MODEL_NAME,
            host=str(cfg.host),
            budget=budget,
            chat_template_kwargs=chat_template_kwargs,
        )
        # its own tokenizer copy: the endpoint's thread tokenizes with the other (a fast tokenizer is not shared)
        self.turns = ChatTemplateTurns(copy.deepcopy(tokenizer), None, engine.eos_ids, chat_template_kwargs)
        self._server: RolloutServer | None = None  # the current rollout call's server

    async def _generate(self, request: GenerationRequest):
        return await self._server.generate(request, away=True)

    def serve_with(self, server: RolloutServer, policy_version: int) -> None:
        """Send the endpoint's requests to this rollout call's server (started at the first call), which serves
        `policy_version` (the trainer's weight updates so far). On the rollout pool with partial rollout a push cuts
        a running request and the server continues it on the new weights (`catch_up`): the agent only waits
        longer, and each sampled token keeps the version that sampled it."""
        self._server = server
        server.continue_cuts(policy_version, self.engine.catch_up)
        self.endpoint.start()

    async def run_episode(self, row: int, prompts: DataProto, seed: int) -> tuple[Episode, object]:
        """Row `row`'s episode: the agent's run against its session, and its result (or an `AgentFailed`)."""
        episode, base_url = self.endpoint.open_episode(seed)
        columns = prompts.non_tensor_batch
        sample = {key: columns[key][row] if key in columns else None for key in SAMPLE_KEYS}
        sample["prompt"] = [dict(m) for m in sample.pop("raw_prompt")]
        try:
            with self._server.away():  # between its requests the agent is not waiting for the engine
                result = await asyncio.wait_for(self.function(base_url, sample), self.timeout_s)
            return episode, _checked(result)
        except Exception as error:  # noqa: BLE001 - one agent's failure must not stop the step
            why = f"timed out after {self.timeout_s} s" if isinstance(error, asyncio.TimeoutError) else repr(error)
            return episode, AgentFailed(f"row {row}: the agent failed: {why}")
        finally:
            self.endpoint.close_episode(episode)

    def finish(self, prompts: DataProto, episodes: list[tuple[Episode, object]], pad_id: int) -> DataProto:
        """Each row's trajectory in the rollout layout, with its agent result under `AGENT_SCORE_KEY`."""
        prompt_length, response_length = self.endpoint.limits
        trajectories = [self._row_trajectory(prompts, row, episode) for row, (episode, _) in enumerate(episodes)]
        num = len(trajectories)
        prompt = torch.full((num, prompt_length), pad_id, dtype=torch.long)
        response = torch.full((num, response_length), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((num, prompt_length), dtype=torch.long)
        response_attention = torch.zeros((num, response_length), dtype=torch.long)
        response_mask = torch.zeros((num, response_length), dtype=torch.long)
        log_probs = torch.zeros((num, response_length), dtype=torch.float32)
        for row, t in enumerate(trajectories):
            prompt[row, prompt_length - len(t.prompt_ids) :] = torch.tensor(t.prompt_ids, dtype=torch.long)
            prompt_mask[row, prompt_length - len(t.prompt_ids) :] = 1
            length = len(t.response_ids)
            response[row, :length] = torch.tensor(t.response_ids, dtype=torch.long)
            response_attention[row, :length] = 1
            response_mask[row, :length] = torch.tensor(t.response_mask, dtype=torch.long)
            log_probs[row, :length] = torch.tensor(t.log_probs)
        attention_mask = torch.cat([prompt_mask, response_attention], -1)
        tensors = {
            "prompts": prompt,
            "responses": response,
            "input_ids": torch.cat([prompt, response], -1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask,
        }
        if self.engine.config.calculate_log_probs:
            tensors["rollout_log_probs"] = log_probs * response_mask
        device = prompts.batch["input_ids"].device
        non_tensor = {k: v for k, v in prompts.non_tensor_batch.items() if k not in (*SAMPLE_KEYS, "agent_name")}
        non_tensor[AGENT_SCORE_KEY] = np.array([result for _, result in episodes] + [None], dtype=object)[:-1]
        non_tensor["__num_turns__"] = np.array([len(t.policy_versions) for t in trajectories])
        out = DataProto.from_dict({k: v.to(device) for k, v in tensors.items()}, non_tensor)
        out.meta_info["metrics"] = _metrics(episodes)
        # an episode never comes back cut (its agent's coroutine cannot be continued elsewhere; a push's cut is
        # continued by the server): it stopped at an EOS or where its agent or budget stopped it
        eos = self.engine.eos_ids
        stops = [Stop.EOS if t.response_ids and t.response_ids[-1] in eos else Stop.LENGTH for t in trajectories]
        versions = torch.full(response.shape, -1, dtype=torch.int32)
        for row, t in enumerate(trajectories):
            versions[row, : len(t.versions)] = torch.tensor(t.versions, dtype=torch.int32)
        return mark_rollout_state(out, torch.tensor([int(stop) for stop in stops]), versions)

    def _row_trajectory(self, prompts: DataProto, row: int, episode: Episode) -> EpisodeTrajectory:
        if episode.trajectories:
            return episode.trajectories[-1]
        messages = list(prompts.non_tensor_batch["raw_prompt"][row])
        ids = self.turns.prompt_ids([dict(m) for m in messages])[-self.endpoint.limits[0] :]
        return EpisodeTrajectory([], ids)


def _checked(result):
    """The agent's return value, if it is one the reward manager takes."""
    if result is None or (isinstance(result, (int, float)) and not isinstance(result, bool)):
        return result
    if isinstance(result, dict) and "score" in result:
        return result
    raise AgentFailed(f"the agent returned {result!r}; return a float, a dict with 'score', or None")


def _metrics(episodes: list[tuple[Episode, object]]) -> dict[str, list[float]]:
    """The `openai_agent/*` metrics as lists, one value per episode of this call: the driver's mean over a step's
    calls and DP ranks (`reduce_metrics` of the merged lists) is then the mean over the step's episodes, whatever
    the sizes of the calls that ran them (`MultiTurnRollout._metrics` does the same per trajectory)."""
    if not episodes:
        return {}
    return {
        "openai_agent/failed_ratio": [float(isinstance(r, AgentFailed)) for _, r in episodes],
        "openai_agent/requests_per_episode": [float(e.num_requests) for e, _ in episodes],
        "openai_agent/request_errors_per_episode": [float(e.num_errors) for e, _ in episodes],
        "openai_agent/trajectories_per_episode": [float(len(e.trajectories)) for e, _ in episodes],
        "openai_agent/untrained_trajectories_per_episode": [
            float(max(len(e.trajectories) - 1, 0)) for e, _ in episodes
        ],
    }
