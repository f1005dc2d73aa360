"""An OpenAI-endpoint episode's requests become token-exact trajectories.

Every chat request of an episode is recorded with the token ids of its rendered prompt, the ids the engine
sampled, their log-probs and the policy version that sampled each of them (a push that cuts a request on the rollout
pool continues it on the new weights: its later tokens carry the newer version). The session rule:

- a request whose messages begin with a trajectory's whole conversation (its requests' messages and the
  assistant message the endpoint returned last) *extends* it: the recorded ids are reused as they are, and only
  the chat template's rendering of the new messages is appended (`ChatTemplateTurns.tool_turn_ids`: the
  template's difference, never a re-tokenization of what the policy sampled), with `response_mask = 0`;
- any other request (the agent rewrote, summarized or branched its history) starts a new trajectory of the
  same episode, rendered from its messages.

The newest matching trajectory is extended; all trajectories of an episode share its reward.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from rlframe.workers.rollout.multi_turn import TOOL_CALL, ChatTemplateTurns, parse_hermes_tool_calls


class ContextTooLong(ValueError):
    """A request that does not fit a trajectory's prompt or response budget."""


@dataclass
class EpisodeTrajectory:
    """One conversation of an episode, in tokens: its prompt, then turns whose `response_mask` marks the policy's."""

    messages: list[dict]  # normalized (`normalize_message`), up to and including the last returned assistant message
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per response token: the version that sampled it, -1 context
    policy_versions: list[int] = field(default_factory=list)  # one per assistant turn: its first token's
    ended_with_eos: bool = True  # the last assistant turn ended at an EOS (else the template's closing is added)

    def append(
        self, ids: list[int], trained: bool, log_probs: list[float] | None = None, versions: list[int] | None = None
    ) -> None:
        if versions is not None and len(versions) != len(ids):
            raise ValueError(f"{len(ids)} sampled ids with {len(versions)} policy versions: one version per id")
        self.response_ids += ids
        self.response_mask += [int(trained)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)


@dataclass
class Episode:
    """One agent's run: its session, its trajectories and its budgets' counters."""

    token: str
    seed: int
    trajectories: list[EpisodeTrajectory] = field(default_factory=list)
    num_requests: int = 0
    num_generated_tokens: int = 0
    num_errors: int = 0  # requests answered with an error (bad request, budget, context)

    def request_seeds(self, number: int, n: int) -> list[int]:
        """The sample seeds of the `n` choices of this episode's request `number` (from 0, in arrival order)."""
        return [random.Random(f"{self.seed}:{number}:{choice}").getrandbits(31) for choice in range(n)]

    def extended_by(self, messages: list[dict]) -> EpisodeTrajectory | None:
        """The newest trajectory whose whole conversation `messages` begins with and adds to, if any."""
        for trajectory in reversed(self.trajectories):
            size = len(trajectory.messages)
            if len(messages) > size and messages[:size] == trajectory.messages:
                return trajectory
        return None


def normalize_message(message: dict) -> dict:
    """The parts of an OpenAI chat message that define the conversation (extra fields and nulls dropped)."""
    out = {"role": message["role"], "content": _content_text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "name": call["function"]["name"],
                "arguments": _json_or_text(call["function"].get("arguments", "{}")),
            }
            for call in message["tool_calls"]
        ]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name") is not None:
        out["name"] = message["name"]
    return out


def template_message(message: dict) -> dict:
    """A normalized message as Hugging Face chat templates take it (tool call arguments as objects)."""
    out = {key: value for key, value in message.items() if key != "tool_calls"}
    if "tool_calls" in message:
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in message["tool_calls"]
        ]
    return out


def assistant_message(text: str, call_id_prefix: str) -> dict:
    """The OpenAI assistant message of the policy's text: Hermes calls that parse become `tool_calls`."""
    calls, kept = [], []

    def take(match) -> str:
        parsed = parse_hermes_tool_calls(match.group(0))[0]
        if parsed.error:
            return match.group(0)  # a malformed block stays text: the agent sees what the policy wrote
        calls.append((parsed.name, parsed.arguments))
        return ""

    content = TOOL_CALL.sub(take, text)
    kept = [
        {"id": f"call_{call_id_prefix}_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(calls)
    ]
    message = {"role": "assistant", "content": content.strip() if kept else content}
    if kept:
        message["tool_calls"] = kept
    return message


def next_context(
    episode: Episode, messages: list[dict], turns: ChatTemplateTurns, eos_ids: list[int], limits: tuple[int, int]
) -> tuple[EpisodeTrajectory, list[int], int]:
    """The trajectory this request continues (or a new one), the ids to append before generating, and the room
    left for generated tokens; `limits` is (prompt_length, response_length)."""
    prompt_length, response_length = limits
    trajectory = episode.extended_by(messages)
    if trajectory is None:
        prompt_ids = turns.prompt_ids([template_message(m) for m in messages])
        if len(prompt_ids) > prompt_length:
            raise ContextTooLong(
                f"the rendered prompt is {len(prompt_ids)} tokens, more than the rollout's "
                f"prompt_length={prompt_length}"
            )
        return EpisodeTrajectory([], prompt_ids), [], response_length
    new = [template_message(m) for m in messages[len(trajectory.messages) :]]
    closing = turns.closing_rest if trajectory.ended_with_eos else turns.closing
    context = closing + turns.tool_turn_ids(new)
    room = response_length - len(trajectory.response_ids) - len(context)
    if room < 1:
        raise ContextTooLong(
            f"the conversation would pass the rollout's response_length={response_length} tokens of this trajectory"
        )
    return trajectory, context, room


def record_turn(
    episode: Episode,
    trajectory: EpisodeTrajectory,
    context: list[int],
    request_messages: list[dict],
    turn: tuple[list[int], list[float] | None, list[int], bool],
    reply: dict,
) -> None:
    """Append one sampled turn (`turn`: ids, log-probs, each id's policy version, ended at an EOS) to its trajectory
    (a new one joins the episode)."""
    ids, log_probs, versions, ended_with_eos = turn
    if not any(known is trajectory for known in episode.trajectories):
        episode.trajectories.append(trajectory)
    trajectory.append(context, trained=False)
    trajectory.append(ids, trained=True, log_probs=log_probs, versions=versions)
    trajectory.messages = list(request_messages) + [normalize_message(reply)]
    trajectory.policy_versions.append(versions[0] if versions else -1)
    trajectory.ended_with_eos = ended_with_eos
    episode.num_generated_tokens += len(ids)


def _content_text(content) -> str:
    """OpenAI content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def _json_or_text(arguments):
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
