"""Multi-turn rollouts with tool calls, on any engine: generate, run the tools, append their answers, repeat.

One row is one trajectory (the driver repeats prompts `n` times). Each turn the engine generates for every
still-active row at once (`BaseRollout._generate` on a left-padded batch), so the HF and vLLM engines both
serve it unchanged. Per row, a turn goes:

1. the policy's tokens are appended with `response_mask = 1` (and their engine log-probs);
2. its text is searched for tool calls (`format: hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`);
   none, or a limit reached (`max_assistant_turns`, `max_user_turns`, `response_length`), ends the trajectory;
3. the calls (at most `max_parallel_calls`) run concurrently through `ToolRunner` (timeouts and tool errors
   become messages to the model), and the tool turn is appended with `response_mask = 0`: the tokens the chat
   template renders after the policy's end-of-turn token and for the `tool` messages, up to the next
   assistant header. Those tokens are context, never trained: losses, KL, entropy and advantages all
   weight tokens by `response_mask`.

The tool turn's tokens come from the chat template itself: the template renders a fixed conversation that
ends with an assistant turn, then the same conversation plus the tool messages and the generation prompt;
the difference is the tool turn (verl's "continuous token" idea). The part of the assistant turn's closing
that generation does not produce (ChatML's newline after `<|im_end|>`) is found the same way. What a `tool`
message holds is tokenized as text (`tool_text`): a tool cannot write chat structure into the trajectory.

`tokenization_sanity_check_mode` (verl's name): `strict` re-renders each finished conversation with the
chat template in one go and counts the trajectories whose ids differ from the turn-by-turn ids
(`multi_turn/tokenization_mismatch_ratio`; a warning once); `disable` skips it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import torch

from rlframe.models.vision import MULTIMODAL_KEYS, images_of, mrope_position_ids, row_images
from rlframe.protocol import DataProto
from rlframe.workers.rollout.base import (
    TRAJECTORY_KEY,
    BaseRollout,
    Rollout,
    Stop,
    check_prompts,
    clip_row,
    mark_rollout_state,
    policy_version,
)
from rlframe.workers.rollout.config import uses_tool_agent
from rlframe.workers.rollout.sampling import SamplingParams
from rlframe.workers.rollout.tool_text import AddedTokens, encode_pieces, split_rendering
from rlframe.workers.rollout.tools import ToolCallResult, ToolRunner

logger = logging.getLogger(__name__)
KEY = "actor_rollout_ref.rollout.multi_turn"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PROBE_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_PROBE_USER = {"role": "user", "content": "Use the tool."}
_PROBE_ASSISTANT_TEXT = "Calling the tool."
_PROBE_TOOL_TEXT = "The answer is 42."


# dataset columns a tool agent reads: the chat messages, `extra_info.tools_kwargs`, the row's agent
AGENT_INPUT_KEYS = ("raw_prompt", "extra_info", "agent_name")


def check_agent_rows(agent_names, rollout_cfg) -> None:
    """Refuse rows that ask for the tool agent when the rollout was built without it (no tools, default agent
    single_turn_agent): they would silently run single-turn."""
    if agent_names is None or uses_tool_agent(rollout_cfg) or rollout_cfg.agent.default_agent_loop == "openai_agent":
        return  # the agent loops check the rows themselves
    asking = sorted({str(name) for name in agent_names} - {"single_turn_agent"})
    if asking:
        raise ValueError(
            f"dataset rows name agent_name {asking}, but no tools are configured and "
            f"actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent; set {KEY}.tool_config_path or "
            f"{KEY}.function_tool_path (or agent.default_agent_loop=tool_agent) so the tool agent runs"
        )


def build_multi_turn(engine: BaseRollout, tokenizer, chat_template_kwargs: dict | None = None) -> MultiTurnRollout:
    """The tool-agent rollout around `engine`, from its section's `multi_turn` and `agent` keys.

    `chat_template_kwargs` is `data.apply_chat_template_kwargs`: every turn is rendered with it.
    """
    from rlframe.workers.rollout.tools import load_tools

    multi_turn = engine.config.multi_turn
    tools = load_tools(multi_turn.tool_config_path, multi_turn.function_tool_path)
    return MultiTurnRollout(engine, tokenizer, tools, chat_template_kwargs)


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in the policy's text; `error` when the call itself is malformed."""

    name: str
    arguments: str  # JSON text of the arguments object
    error: str | None = None


def parse_hermes_tool_calls(text: str) -> list[ParsedCall]:
    """Hermes-format calls in order; a block that is not `{"name": str, "arguments": object}` JSON is kept
    as a malformed call so the model is told what was wrong."""
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            payload = json.loads(block)
            name, arguments = payload["name"], payload.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name is not a string")
            calls.append(ParsedCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            calls.append(ParsedCall("", "", error=f"malformed tool call {block.strip()[:200]!r}: {err}"))
    return calls


@dataclass
class Trajectory:
    """One row's conversation as it grows: messages, token ids, and which tokens the policy produced."""

    messages: list[dict]
    prompt_ids: list[int]
    tools_kwargs: dict
    seed: int  # the sample's seed: with the position it fills, it keys each token's random draw
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_latencies_s: list[float] = field(default_factory=list)  # one per tool call
    single_turn: bool = False  # a single_turn_agent row: one generation, its text never parsed for calls
    images: dict = field(default_factory=dict)  # a vision-language row's image fields (rlframe.models.vision)
    pending: list[ParsedCall] = field(default_factory=list)  # this turn's tool calls, not yet run (each runs once)
    versions: list[int] = field(default_factory=list)  # per response token: the policy version that sampled it, or -1
    turn_start: int = 0  # where the assistant turn under way starts in response_ids (a cut turn goes on from there)
    stop: Stop = Stop.EOS  # why the last turn ended (LENGTH also when a tool turn filled the budget)
    interrupted: bool = False  # cut by newer weights inside or before a turn: continued later from this state
    done: bool = False
    truncated: bool = False

    def append(self, ids: list[int], trained: bool, log_probs: list[float] | None = None, version: int = -1) -> None:
        """Policy tokens (`trained`, sampled by `version`) or context tokens (version -1, like padding)."""
        self.response_ids += ids
        self.response_mask += [int(trained)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.versions += [version if trained else -1] * len(ids)


class ChatTemplateTurns:
    """Token ids of the turns the chat template adds around the policy's own text.

    Every rendering goes through `tool_text`: what a `tool` message holds is tokenized as text (no control token
    comes out of it), the template's own markers stay special, and the rest is the plain encode of the rendering.
    """

    def __init__(self, tokenizer, tools: list[dict] | None, eos_ids: list[int], template_kwargs: dict | None = None):
        self.tokenizer, self.tools = tokenizer, tools or None
        self.template_kwargs = dict(template_kwargs or {})  # data.apply_chat_template_kwargs
        source = tokenizer.get_chat_template(self.template_kwargs.get("chat_template"), self.tools)
        self.added = AddedTokens.of(tokenizer, source)
        probe = [_PROBE_SYSTEM, _PROBE_USER, {"role": "assistant", "content": _PROBE_ASSISTANT_TEXT}]
        self._probe = probe
        self._check_exact(probe + [{"role": "tool", "content": _PROBE_TOOL_TEXT}])
        rendered = self._render_text(probe, add_generation_prompt=False)
        after = rendered[rendered.rindex(_PROBE_ASSISTANT_TEXT) + len(_PROBE_ASSISTANT_TEXT) :]
        self.closing = closing = self.encode(after)  # e.g. ChatML: <|im_end|> "\n"
        # generation stops at an EOS; the rest of the template's closing is context added after it
        self.closing_rest = closing[1:] if closing and closing[0] in eos_ids else closing

    def _check_exact(self, messages: list[dict]) -> None:
        """Refuse a tokenizer for which tokenizing the rendering piece by piece is not its plain encode."""
        pieces = split_rendering(partial(self._render_text, add_generation_prompt=True), messages)
        text = "".join(piece for piece, _ in pieces)
        plain = list(self.tokenizer.encode(text, add_special_tokens=False))
        if encode_pieces(self.tokenizer, self.added, pieces) != plain:
            raise ValueError(
                f"{type(self.tokenizer).__name__}: tokenizing a chat rendering between its added tokens gives other "
                "ids than tokenizing it whole (a pre-tokenizer that adds a prefix space to every piece?), so rlframe "
                "cannot keep tool answers as plain text with this tokenizer"
            )

    def _render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def _render_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        pieces = split_rendering(partial(self._render_text, add_generation_prompt=add_generation_prompt), messages)
        return encode_pieces(self.tokenizer, self.added, pieces)

    def encode(self, text: str) -> list[int]:
        """The ids of text the template wrote."""
        return encode_pieces(self.tokenizer, self.added, [(text, False)])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt: the conversation so far with the tools and the assistant header."""
        return self._render_ids(messages, add_generation_prompt=True)

    def tool_turn_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens between the policy's closing and its next turn: tool messages + assistant header."""
        base = self._render_text(self._probe, add_generation_prompt=False)
        render = partial(self._render_text, add_generation_prompt=True)
        (first, _), *rest = split_rendering(render, self._probe + tool_messages)
        if not first.startswith(base):
            raise ValueError("the chat template renders earlier messages differently once tool messages follow")
        return encode_pieces(self.tokenizer, self.added, [(first[len(base) :], False), *rest])

    def whole_conversation_ids(self, messages: list[dict]) -> list[int]:
        """The finished conversation rendered in one go (for the tokenization sanity check)."""
        return self._render_ids(messages, add_generation_prompt=False)


class MultiTurnRollout(Rollout):
    """Wraps an engine: `generate_sequences` runs multi-turn tool trajectories; weights and memory pass through
    (`Rollout`'s methods, on `unwrapped`)."""

    def __init__(self, engine: BaseRollout, tokenizer, tools: dict, chat_template_kwargs: dict | None = None):
        """`engine.config.multi_turn` sets the limits, `engine.config.agent.default_agent_loop` the rows' default."""
        self.engine, self.tokenizer, self.config = engine, tokenizer, engine.config
        self.mt = mt = engine.config.multi_turn
        self.runner = ToolRunner(tools, mt.tool_timeout_s, mt.max_tool_response_length, mt.tool_response_truncate_side)
        schemas = [tool.tool_schema for tool in tools.values()]
        self.turns = ChatTemplateTurns(tokenizer, schemas, engine.eos_ids, chat_template_kwargs)
        self._warned_mismatch = False

    @property
    def unwrapped(self) -> BaseRollout:
        return self.engine

    runs_trajectories = True

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Rows with `raw_prompt` (chat messages) in; the rollout contract out, with holes in `response_mask`."""
        check_prompts(prompts, self.config.prompt_length)
        if "raw_prompt" not in prompts.non_tensor_batch:
            raise ValueError(f"{KEY}.enable=true needs the chat messages of each prompt: set data.return_raw_chat=true")
        seeds = self.engine.seeds_for(prompts)
        trajectories = [self.start_trajectory(row, prompts, seeds[row]) for row in range(len(prompts))]
        return self.continue_trajectories(prompts, trajectories)

    @torch.no_grad()
    def continue_trajectories(self, rows: DataProto, trajectories: list[Trajectory]) -> DataProto:
        """Run trajectories (new ones, or cut ones from their state) turn by turn until each is done or cut.

        The turns of all running trajectories go to the engine as one batch; then the tool calls of the turns that
        ended run, once each (`pending` is emptied when their tool turn is appended). A trajectory the interrupt cut
        stops here with its state (`interrupted`)."""
        params = self.engine.sampling_for(rows.meta_info)
        eos_ids, pad_id = self.engine.special_tokens_for(rows.meta_info)
        version = policy_version(rows.meta_info)
        start = time.perf_counter()
        for trajectory in trajectories:
            trajectory.interrupted = False
        while True:
            waiting = [t for t in trajectories if t.pending and not t.done]  # turns that ended with calls
            if waiting:
                asyncio.run(self._run_tools(waiting))
            active = [t for t in trajectories if not (t.done or t.interrupted)]
            if not active:
                break
            self._generate_turn(active, params, eos_ids, pad_id, version)
        return self.finish(rows, trajectories, params.response_length, pad_id, time.perf_counter() - start)

    def finish(self, prompts: DataProto, trajectories: list, response_length: int, pad_id: int, elapsed: float):
        """Finished trajectories in the rollout contract, with the sanity check and the metrics."""
        checked = self.mt.tokenization_sanity_check_mode != "disable"
        mismatched = self._sanity_check(trajectories) if checked else [False] * len(trajectories)
        out = self._layout(prompts, trajectories, response_length, pad_id, prompts.batch["input_ids"].device)
        out.meta_info["metrics"] = self._metrics(trajectories, mismatched, out, elapsed)
        return out

    def start_trajectory(self, row: int, prompts: DataProto, seed: int) -> Trajectory:
        messages = [dict(m) for m in prompts.non_tensor_batch["raw_prompt"][row]]
        extra = prompts.non_tensor_batch.get("extra_info")
        extra = extra[row] if extra is not None else None
        tools_kwargs = (extra or {}).get("tools_kwargs", {}) if isinstance(extra, dict) else {}
        agents = prompts.non_tensor_batch.get("agent_name")
        agent = str(agents[row]) if agents is not None else str(self.config.agent.default_agent_loop)
        if agent not in ("single_turn_agent", "tool_agent"):
            raise ValueError(f"row {row}: agent_name={agent!r}; rlframe has single_turn_agent and tool_agent")
        images = row_images(prompts, row)
        ids = self._with_image_tokens(self.turns.prompt_ids(messages), images)
        if len(ids) > self.config.prompt_length:
            raise ValueError(
                f"row {row}: the prompt rendered with the tools' schemas is {len(ids)} tokens, more than "
                f"actor_rollout_ref.rollout.prompt_length={self.config.prompt_length} (= data.max_prompt_length); "
                "raise data.max_prompt_length or shorten the tool descriptions"
            )
        single = agent == "single_turn_agent"
        return Trajectory(messages, ids, dict(tools_kwargs or {}), seed, single_turn=single, images=images)

    def _with_image_tokens(self, ids: list[int], images: dict) -> list[int]:
        """A rendered conversation's ids with each image's pad repeated for its grid, as the dataset lays prompts
        out (the chat template writes one pad per image)."""
        inputs = images.get("multi_modal_inputs")
        if self.engine.vision is None or not inputs:
            return ids
        return self.engine.vision.expand(ids, inputs.get("image_grid_thw"))

    def _generate_turn(
        self, active: list[Trajectory], params: SamplingParams, eos_ids: list[int], pad_id: int, version: int
    ):
        """One assistant turn (or the rest of a cut one) for every active trajectory, as one engine batch."""
        budgets = [self.budget(t) for t in active]
        contexts = [t.prompt_ids + t.response_ids for t in active]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(active), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(active), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context) :] = torch.tensor(context)
            mask[row, width - len(context) :] = 1
        batch = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
            images_of([t.images for t in active]),  # every turn's context holds the first turn's images
        )
        turn_params = replace(params, response_length=max(budgets))
        seeds = [t.seed for t in active]
        tokens, lengths, log_probs, stops = self.engine._generate(batch, turn_params, eos_ids, pad_id, seeds)
        for row, trajectory in enumerate(active):
            new = tokens[row, : int(lengths[row])].tolist()
            row_log_probs = log_probs[row].tolist() if log_probs is not None else None
            self.take_turn(trajectory, new, row_log_probs, eos_ids, Stop(int(stops[row])), version)

    def budget(self, trajectory: Trajectory) -> int:
        """Response tokens this trajectory may still generate."""
        return self.config.response_length - len(trajectory.response_ids)

    def take_turn(
        self,
        trajectory: Trajectory,
        new: list[int],
        log_probs: list[float] | None,
        eos_ids: list[int],
        stop: Stop,
        version: int,
    ):
        """Append one policy turn's generated ids (cut to the budget, sampled by `version`) and find its tool calls,
        or end the trajectory. An interrupted turn keeps its tokens and waits, unfinished, for its continuation:
        nothing of it is parsed or run until it ends."""
        new, stop = clip_row(new, self.budget(trajectory), stop, eos_ids)
        trajectory.append(new, True, log_probs[: len(new)] if log_probs is not None else None, version)
        if stop == Stop.INTERRUPTED:
            trajectory.interrupted = True
            return
        ended, turn = stop == Stop.EOS, trajectory.response_ids[trajectory.turn_start :]
        trajectory.stop = stop
        trajectory.assistant_turns += 1
        text = self.tokenizer.decode(turn[:-1] if ended else turn, skip_special_tokens=False)
        trajectory.messages.append({"role": "assistant", "content": text})
        trajectory.pending = parse_hermes_tool_calls(text) if ended and not trajectory.single_turn else []
        trajectory.truncated = not ended and len(trajectory.response_ids) >= self.config.response_length
        if not trajectory.pending or self._at_limit(trajectory):
            trajectory.done = True

    def _at_limit(self, trajectory: Trajectory) -> bool:
        mt = self.mt
        if mt.max_assistant_turns and trajectory.assistant_turns >= mt.max_assistant_turns:
            return True
        if mt.max_user_turns and trajectory.user_turns >= mt.max_user_turns:
            return True
        return len(trajectory.response_ids) >= self.config.response_length

    async def _run_tools(self, trajectories: list[Trajectory]) -> None:
        """Every pending call of every trajectory, concurrently; then each tool turn is appended."""
        jobs = [self.tool_turn(t) for t in trajectories]
        for trajectory, results in zip(trajectories, await asyncio.gather(*jobs)):
            self.append_tool_turn(trajectory, results)

    def append_tool_turn(self, trajectory: Trajectory, results: list[ToolCallResult]) -> None:
        """Append the tool turn (mask 0) for this turn's results; a limit or the response budget ends it."""
        tool_messages = [{"role": "tool", "content": r.text} for r in results]
        context = self.turns.closing_rest + self.turns.tool_turn_ids(tool_messages)
        room = self.budget(trajectory)
        trajectory.append(context[:room], trained=False)
        trajectory.pending, trajectory.turn_start = [], len(trajectory.response_ids)  # these calls never run again
        trajectory.messages += tool_messages
        trajectory.user_turns += 1
        trajectory.tool_calls += len(results)
        trajectory.tool_errors += sum(r.error is not None for r in results)
        trajectory.tool_latencies_s += [r.latency_s for r in results]
        if len(context) >= room or self._at_limit(trajectory):
            trajectory.done, trajectory.truncated = True, len(context) >= room
            trajectory.stop = Stop.LENGTH if trajectory.truncated else trajectory.stop

    async def tool_turn(self, trajectory: Trajectory) -> list[ToolCallResult]:
        """This turn's pending calls (at most max_parallel_calls), run concurrently."""
        calls = trajectory.pending[: self.mt.max_parallel_calls]
        return await asyncio.gather(*(self._one_call(call, trajectory.tools_kwargs) for call in calls))

    async def _one_call(self, call: ParsedCall, tools_kwargs: dict) -> ToolCallResult:
        if call.error:
            return ToolCallResult(call.error, error="malformed_call")
        return await self.runner.call(call.name, call.arguments, tools_kwargs)

    def _sanity_check(self, trajectories: list[Trajectory]) -> list[bool]:
        """For each trajectory, whether its turn-by-turn ids differ from its conversation rendered in one go."""
        mismatched = []
        for t in trajectories:
            if t.interrupted or t.truncated or t.messages[-1]["role"] != "assistant":
                mismatched.append(False)  # a cut conversation, or one stopped after a tool turn, has no whole rendering
                continue
            whole = self._with_image_tokens(self.turns.whole_conversation_ids(t.messages), t.images)
            mismatched.append(whole != t.prompt_ids + t.response_ids + self.turns.closing_rest)
        mismatches = sum(mismatched)
        if mismatches and not self._warned_mismatch:
            self._warned_mismatch = True
            logger.warning(
                "multi-turn: %d of %d trajectories tokenize differently turn by turn than as one conversation "
                "(the chat template re-renders some turn differently); training uses the turn-by-turn ids, which "
                "are what the policy saw. Set %s.tokenization_sanity_check_mode=disable to skip this check.",
                mismatches,
                len(trajectories),
                KEY,
            )
        return mismatched

    def _layout(self, prompts, trajectories, response_length: int, pad_id: int, device) -> DataProto:
        """Left-padded prompts and right-padded responses: the rollout contract, with holes in response_mask."""
        num, prompt_length = len(trajectories), self.config.prompt_length
        prompt = torch.full((num, prompt_length), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((num, prompt_length), dtype=torch.long)
        response = torch.full((num, response_length), pad_id, dtype=torch.long)
        response_attention = torch.zeros((num, response_length), dtype=torch.long)
        response_mask = torch.zeros((num, response_length), dtype=torch.long)
        log_probs = torch.zeros((num, response_length), dtype=torch.float32)
        versions = torch.full((num, response_length), -1, dtype=torch.int32)
        for row, t in enumerate(trajectories):
            prompt[row, prompt_length - len(t.prompt_ids) :] = torch.tensor(t.prompt_ids)
            prompt_mask[row, prompt_length - len(t.prompt_ids) :] = 1
            length = len(t.response_ids)
            response[row, :length] = torch.tensor(t.response_ids, dtype=torch.long)
            response_attention[row, :length] = 1
            response_mask[row, :length] = torch.tensor(t.response_mask)
            log_probs[row, :length] = torch.tensor(t.log_probs)
            versions[row, :length] = torch.tensor(t.versions, dtype=torch.int32)
        input_ids, attention_mask = (
            torch.cat([prompt, response], dim=-1),
            torch.cat([prompt_mask, response_attention], -1),
        )
        tensors = {
            "prompts": prompt,
            "responses": response,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": self._positions(input_ids, attention_mask, trajectories),
            "response_mask": response_mask,
        }
        if self.config.calculate_log_probs:
            tensors["rollout_log_probs"] = log_probs * response_mask
        # the driver's batch keeps the agent's inputs and the images
        non_tensor = {
            k: v for k, v in prompts.non_tensor_batch.items() if k not in AGENT_INPUT_KEYS and k not in MULTIMODAL_KEYS
        }
        non_tensor["__num_turns__"] = np.array([t.assistant_turns + t.user_turns + 1 for t in trajectories])
        # a cut trajectory's state travels with its row to the driver and back to `continue_trajectories`
        states = np.empty(num, dtype=object)
        for row, t in enumerate(trajectories):
            states[row] = t if t.interrupted else None
        non_tensor[TRAJECTORY_KEY] = states
        out = DataProto.from_dict({k: v.to(device) for k, v in tensors.items()}, non_tensor)
        stops = torch.tensor([int(Stop.INTERRUPTED if t.interrupted else t.stop) for t in trajectories])
        return mark_rollout_state(out, stops, versions)

    def _positions(self, ids: torch.Tensor, attention_mask: torch.Tensor, trajectories: list) -> torch.Tensor:
        """[B, seqlen] text positions; a vision-language model's rows get [B, 4, seqlen] (tool turns are text)."""
        if self.engine.vision is None:
            return (attention_mask.cumsum(-1) - 1).clamp(min=0)
        grids = [(t.images.get("multi_modal_inputs") or {}).get("image_grid_thw") for t in trajectories]
        rows = zip(ids, attention_mask, grids)
        return torch.stack([mrope_position_ids(i, m, grid, self.engine.vision) for i, m, grid in rows])

    @staticmethod
    def _metrics(trajectories: list[Trajectory], mismatched: list[bool], out: DataProto, elapsed: float) -> dict:
        """The call's throughput, and the `multi_turn/*` metrics as lists: one value per trajectory that finished in
        this call (a cut one is counted once, whole, in the call that finishes it), `tool_latency_s_mean` one per
        tool call of those. The driver's mean over a step's calls and DP ranks (`reduce_metrics` of the merged
        lists) is then the mean over every trajectory they finished; a call that finished none (all cut) reports
        none, rather than a mean of 0 that would weigh in like any other call's."""
        trained = int(out.batch["response_mask"].sum())
        metrics = {"timing_s/generate": elapsed, "perf/rollout_tokens_per_s": trained / max(elapsed, 1e-9)}
        finished = [(t, m) for t, m in zip(trajectories, mismatched) if not t.interrupted]
        if finished:
            metrics["multi_turn/assistant_turns_mean"] = [float(t.assistant_turns) for t, _ in finished]
            metrics["multi_turn/tool_calls_per_trajectory"] = [float(t.tool_calls) for t, _ in finished]
            metrics["multi_turn/tool_errors_per_trajectory"] = [float(t.tool_errors) for t, _ in finished]
            metrics["multi_turn/truncated_ratio"] = [float(t.truncated) for t, _ in finished]
            metrics["multi_turn/tokenization_mismatch_ratio"] = [float(m) for _, m in finished]
        latencies = [latency for t, _ in finished for latency in t.tool_latencies_s]
        if latencies:
            metrics["multi_turn/tool_latency_s_mean"] = latencies
        return metrics
