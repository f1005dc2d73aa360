"""A tool agent's trajectory cut by newer weights, inside a turn or between turns, and continued from its state.

The scripted engine decodes one token per step and asks its `interrupt` before the first step and after each one, as
the HF engine does; a cut turn's context makes it go on with the rest of its reply. A counting calculator tells how
often a tool ran. Both rollout modes: `mode=sync` (`MultiTurnRollout`) and `mode=async` (`AgentLoopRollout`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.multi_turn import ScriptedEngine, call, make_prompts, rollout_cfg
from helpers.rollout import CutAfter, load_tokenizer

from rlframe.protocol import DataProto
from rlframe.workers.rollout.agent_loop import AgentLoopRollout
from rlframe.workers.rollout.base import STOP_KEY, TRAJECTORY_KEY, VERSIONS_KEY, Stop
from rlframe.workers.rollout.multi_turn import build_multi_turn
from rlframe.workers.rollout.tools import CalculatorTool

SCRIPT = {"What is 12*7?": [f"I will compute. {call('12*7')}", "The answer is 84."], "Say hi.": ["hi"]}
USERS = list(SCRIPT)
TOKENS = ("responses", "response_mask", "input_ids", "attention_mask", "position_ids", VERSIONS_KEY)


class CountingCalculator(CalculatorTool):
    """The calculator, counting its runs."""

    runs = 0

    async def execute(self, instance_id, parameters, **kwargs):
        type(self).runs += 1
        return await super().execute(instance_id, parameters, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def rollout(tiny_model_path, tokenizer, mode: str):
    cfg = rollout_cfg(
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    )
    engine = ScriptedEngine(cfg, tokenizer, tiny_model_path, SCRIPT)
    multi_turn = build_multi_turn(engine, tokenizer)
    multi_turn.runner.tools["calculator"] = CountingCalculator({}, None)
    return multi_turn if mode == "sync" else AgentLoopRollout(engine, 2, multi_turn)


def first_turn_tokens(tokenizer) -> int:
    return len(tokenizer.encode(SCRIPT[USERS[0]][0], add_special_tokens=False)) + 1  # and its EOS


def generate(agent, tokenizer, interrupt=None, version: int = 0) -> DataProto:
    agent.unwrapped.interrupt = interrupt
    try:
        prompts = make_prompts(tokenizer, USERS)
        prompts.meta_info["policy_version"] = version
        return agent.generate_sequences(prompts)
    finally:
        agent.unwrapped.interrupt = None


def continue_cut(agent, out: DataProto, version: int) -> DataProto:
    """What the rollout worker does with the rows the driver sends back: continue their trajectories."""
    cut = out.batch[STOP_KEY] == Stop.INTERRUPTED
    rows = out.select_idxs(torch.nonzero(cut).flatten())
    rows.meta_info = {"policy_version": version}
    return agent.continue_trajectories(rows, list(rows.non_tensor_batch[TRAJECTORY_KEY]))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("where", ["inside-a-turn", "between-turns"])
def test_a_cut_trajectory_continued_on_the_same_weights_is_the_uncut_one_and_runs_its_tool_once(
    tiny_model_path, tokenizer, mode, where
):
    CountingCalculator.runs = 0
    whole = generate(rollout(tiny_model_path, tokenizer, mode), tokenizer)
    assert CountingCalculator.runs == 1
    assert whole.batch[STOP_KEY].tolist() == [Stop.EOS, Stop.EOS]

    CountingCalculator.runs = 0
    agent = rollout(tiny_model_path, tokenizer, mode)
    # asked before the first step and after each: 3 tokens into the first turn, or just before the second turn
    calls = 3 if where == "inside-a-turn" else first_turn_tokens(tokenizer) + 1
    cut = generate(agent, tokenizer, CutAfter(calls))
    assert cut.batch[STOP_KEY].tolist() == [Stop.INTERRUPTED, Stop.EOS]  # "Say hi." finished before the cut
    assert list(cut.non_tensor_batch[TRAJECTORY_KEY][1:]) == [None]
    state = cut.non_tensor_batch[TRAJECTORY_KEY][0]
    assert state.interrupted and not state.pending and not state.done
    if where == "inside-a-turn":
        assert len(state.response_ids) == 3 and state.assistant_turns == 0 and CountingCalculator.runs == 0
    else:
        assert state.assistant_turns == 1 and state.tool_calls == 1 and CountingCalculator.runs == 1
    continued = continue_cut(agent, cut, version=0)
    assert CountingCalculator.runs == 1  # the call ran once, before or after the cut, never again
    assert continued.batch[STOP_KEY].tolist() == [Stop.EOS]
    assert list(continued.non_tensor_batch[TRAJECTORY_KEY]) == [None]
    for key in (*TOKENS, "rollout_log_probs"):
        assert torch.equal(continued.batch[key][0], whole.batch[key][0]), key
    assert continued.non_tensor_batch["__num_turns__"][0] == whole.non_tensor_batch["__num_turns__"][0]
    assert torch.equal(cut.batch["responses"][1], whole.batch["responses"][1])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_policy_token_carries_the_version_that_sampled_it_and_context_tokens_minus_one(
    tiny_model_path, tokenizer, mode
):
    agent = rollout(tiny_model_path, tokenizer, mode)
    cut = generate(agent, tokenizer, CutAfter(3), version=4)
    continued = continue_cut(agent, cut, version=5)
    versions, mask = continued.batch[VERSIONS_KEY][0], continued.batch["response_mask"][0].bool()
    real = int(continued.batch["attention_mask"][0, -continued.batch["responses"].shape[1] :].sum())
    assert (versions[:3] == 4).all()  # the first turn's tokens before the cut
    assert (versions[3:real][mask[3:real]] == 5).all()  # every policy token after it
    assert (versions[~mask] == -1).all()  # the tool turn and the padding
    assert (~mask[3:real]).any()  # a tool turn lies in between
    np.testing.assert_array_equal(cut.batch[VERSIONS_KEY][1][cut.batch["response_mask"][1].bool()].numpy(), 4)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_steps_multi_turn_metrics_are_the_mean_over_the_trajectories_its_calls_finished(
    tiny_model_path, tokenizer, mode
):
    """As the driver collects a step's calls under partial rollout: a generation cut before any trajectory finished (the
    batch ahead, cut at colocate_async's sample end) reports no `multi_turn/*` value, the call that continues the cut
    trajectories counts each once with all its turns, and every call's and DP rank's values, merged as the driver merges
    them, give the mean over the trajectories (before: the cut call reported 0 turns and each rank's and call's mean
    weighed the same, whatever its number of trajectories)."""
    from rlframe.trainer.metrics import reduce_metrics
    from rlframe.trainer.rollout_stage import merged_metrics

    agent = rollout(tiny_model_path, tokenizer, mode)
    ahead = generate(agent, tokenizer, CutAfter(1))  # one decoding step: no trajectory finished
    assert ahead.batch[STOP_KEY].tolist() == [Stop.INTERRUPTED, Stop.INTERRUPTED]
    assert not [key for key in ahead.meta_info["metrics"] if key.startswith("multi_turn/")]
    continued = continue_cut(agent, ahead, version=1)  # "What is 12*7?" in 2 turns, "Say hi." in 1
    assert continued.meta_info["metrics"]["multi_turn/assistant_turns_mean"] == [2.0, 1.0]
    other_rank = rollout(tiny_model_path, tokenizer, mode).generate_sequences(make_prompts(tokenizer, ["Say hi."]))
    ranks = DataProto.concat([continued, other_rank])  # a call's DP ranks, as dispatch gathers them
    step = reduce_metrics(merged_metrics([ahead.meta_info["metrics"], ranks.meta_info["metrics"]]))
    assert step["multi_turn/assistant_turns_mean"] == pytest.approx((2 + 1 + 1) / 3)
    assert step["multi_turn/tool_calls_per_trajectory"] == pytest.approx(1 / 3)
    assert step["multi_turn/truncated_ratio"] == 0.0


# ------------------------------------------------------------------------------------------ the HF engine, for real
@pytest.fixture(scope="module", params=["sync", "async"])
def tool_worker(request, tiny_model_path, tmp_path_factory):
    from pathlib import Path

    from helpers.rollout import one_process_rollout_worker

    tools = Path(__file__).parents[3] / "examples" / "tools" / "calculator.yaml"
    rendezvous = str(tmp_path_factory.mktemp("rendezvous") / "store")
    with one_process_rollout_worker(
        tiny_model_path,
        rendezvous,
        "data.max_prompt_length=256",
        "data.max_response_length=12",
        "data.return_raw_chat=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.rollout.mode={request.param}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
    ) as worker:
        yield worker


def test_a_trajectory_cut_inside_a_turn_on_the_hf_engine_continues_to_the_uncut_one(tool_worker, tokenizer):
    """The rollout worker's own path: `generate_sequences` cut by the interrupt after 3 decoding steps, the cut rows'
    trajectories continued by `continue_sequences` on the same weights (the tiny model calls no tool)."""
    users = ["What is 3+4?", "Name a color.", "Count to three."]
    state = torch.get_rng_state()
    whole = tool_worker.generate_sequences(make_prompts(tokenizer, users))
    torch.set_rng_state(state)
    tool_worker.engine.interrupt = CutAfter(3)
    try:
        cut = tool_worker.generate_sequences(make_prompts(tokenizer, users))
    finally:
        tool_worker.engine.interrupt = None
    flags = cut.batch[STOP_KEY] == Stop.INTERRUPTED
    assert flags.any() and (cut.batch["response_mask"].sum(-1)[flags] == 3).all()
    rows = cut.select_idxs(torch.nonzero(flags).flatten())
    continued = tool_worker.continue_sequences(rows)
    assert not (continued.batch[STOP_KEY] == Stop.INTERRUPTED).any()
    expected = whole.select_idxs(torch.nonzero(flags).flatten())
    for key in TOKENS:  # every token, mask, position and version bit for bit
        assert torch.equal(continued.batch[key], expected.batch[key]), key
    # the log-probs up to the rounding of other computations (measured: 1 ulp, ~5e-7): the first token after the cut
    # comes from a prefill of the context, not a decoding step, and the continuation's batch holds fewer rows, so
    # other padding (test_partial_rollout.py and rollout/pool.py say the same of single-turn rows)
    torch.testing.assert_close(
        continued.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], rtol=0, atol=1e-5
    )
