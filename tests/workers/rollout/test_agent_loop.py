"""rollout.mode=async: agent loops on a rollout server give the synchronous rollout's samples, whatever the batching.

The single-turn tests run the HF engine on the tiny model: the same seed gives the same tokens and log-probs
in both modes and for every `agent.num_workers`. The tool-agent tests use `test_multi_turn`'s scripted engine
and the calculator, so every trajectory is known in advance.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from helpers.agent_loop import KEYS
from helpers.multi_turn import (
    HOSTILE_SEEN,
    HostileTool,
    ScriptedEngine,
    SteppedEngine,
    call,
    chatml_tool_turn,
    make_prompts,
    rollout_cfg,
)
from helpers.rollout import load_tokenizer, rollout_config
from helpers.rollout import make_prompts as make_token_prompts
from helpers.world import spawned_world

from rlframe.workers.rollout import build_rollout, generate_in_tp_group
from rlframe.workers.rollout.agent_loop import AgentLoopRollout
from rlframe.workers.rollout.base import STOP_KEY, Stop
from rlframe.workers.rollout.multi_turn import build_multi_turn
from rlframe.workers.rollout.tools import CalculatorTool


def hf(tiny_model_path, *overrides):
    cfg = rollout_config("actor_rollout_ref.rollout.calculate_log_probs=true", *overrides)
    return build_rollout("hf", cfg, tiny_model_path, load_tokenizer(tiny_model_path), "cpu")


def sample(rollout, prompts, seed: int = 3):
    torch.manual_seed(seed)
    return generate_in_tp_group(rollout, prompts)


def assert_same_samples(a, b):
    for key in KEYS:
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert list(a.non_tensor_batch["uid"]) == list(b.non_tensor_batch["uid"])


# ------------------------------------------------------------------------------------------ single turn
def test_async_single_turn_reproduces_the_sync_rollout_for_every_num_workers(tiny_model_path):
    sync = hf(tiny_model_path, "actor_rollout_ref.rollout.mode=sync")
    assert not isinstance(sync, AgentLoopRollout)
    prompts = make_token_prompts(lengths=(8, 3, 5, 1, 7, 2, 6), seed=5)
    expected = sample(sync, prompts)
    assert expected.batch["response_mask"].sum() > 0
    for workers in (1, 3, 8):
        rollout = hf(tiny_model_path, f"actor_rollout_ref.rollout.agent.num_workers={workers}")
        assert isinstance(rollout, AgentLoopRollout) and rollout.num_workers == workers
        out = sample(rollout, prompts)
        assert_same_samples(out, expected)  # token for token, log-probs bit for bit
        metrics = out.meta_info["metrics"]
        assert metrics["rollout/server_tokens_per_s"] > 0 and metrics["rollout/server_batch_size_mean"] > 0
        assert 0 <= metrics["rollout/server_queue_time_s/mean"] <= metrics["rollout/server_queue_time_s/max"]
        assert (
            metrics["response_length/truncated_ratio"]
            == expected.meta_info["metrics"]["response_length/truncated_ratio"]
        )
    greedy = make_token_prompts(seed=6, do_sample=False)
    assert_same_samples(sample(hf(tiny_model_path), greedy), sample(sync, greedy))
    assert not torch.equal(sample(sync, prompts, seed=4).batch["responses"], expected.batch["responses"])


def test_a_rows_tokens_do_not_depend_on_its_batch(tiny_model_path):
    """The per-sample seeds key every draw: the same rows in another order and other micro-batches sample alike."""
    engine = hf(tiny_model_path, "actor_rollout_ref.rollout.mode=sync")
    prompts = make_token_prompts(lengths=(8, 3, 5, 1, 7, 2), seed=7)
    params, seeds = engine.sampling_for({}), [11, 22, 33, 44, 55, 66]
    tokens, lengths, log_probs, _ = engine._generate(prompts, params, engine.eos_ids, engine.pad_id, seeds)
    order = [5, 2, 0, 4, 1, 3]
    engine.config = rollout_config("actor_rollout_ref.rollout.micro_batch_size=4")
    shuffled = prompts.select_idxs(order)
    again, again_lengths, again_log_probs, _ = engine._generate(
        shuffled, params, engine.eos_ids, engine.pad_id, [seeds[i] for i in order]
    )
    assert torch.equal(again, tokens[order]) and torch.equal(again_lengths, lengths[order])
    # other batch shapes change the fp32 sums a little, never the tokens
    torch.testing.assert_close(again_log_probs, log_probs[order], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ tool agent
SCRIPT = {
    "What is 12*7?": [f"I will compute. {call('12*7')}", "The answer is 84."],
    "Add twice.": [call("1+1"), call("2+2"), "4"],
    "Say hi.": ["hi"],
    "Bad call.": ["<tool_call>{oops</tool_call>", "sorry"],
}


def tool_rollouts(tiny_model_path, tokenizer, *overrides):
    cfg = rollout_cfg("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", *overrides)
    engine = ScriptedEngine(cfg, tokenizer, tiny_model_path, SCRIPT)
    multi_turn = build_multi_turn(engine, tokenizer)
    multi_turn.runner.tools["calculator"] = CalculatorTool({}, None)
    return engine, multi_turn


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def test_async_tool_agent_reproduces_the_turn_synchronous_loop(tiny_model_path, tokenizer):
    users = list(SCRIPT) * 2
    agents = np.array(["tool_agent"] * 7 + ["single_turn_agent"], dtype=object)
    _, sync = tool_rollouts(tiny_model_path, tokenizer)
    expected = sync.generate_sequences(make_prompts(tokenizer, users, agent_name=agents))
    for workers in (1, 3, 8):
        engine, multi_turn = tool_rollouts(tiny_model_path, tokenizer)
        out = AgentLoopRollout(engine, workers, multi_turn).generate_sequences(
            make_prompts(tokenizer, users, agent_name=agents)
        )
        assert_same_samples(out, expected)
        assert out.non_tensor_batch["__num_turns__"].tolist() == expected.non_tensor_batch["__num_turns__"].tolist()
        for name in ("tool_calls_per_trajectory", "tool_errors_per_trajectory", "assistant_turns_mean"):
            assert out.meta_info["metrics"][f"multi_turn/{name}"] == expected.meta_info["metrics"][f"multi_turn/{name}"]
        assert sum(engine.calls) == sum(sync.engine.calls)  # one request per policy turn


def test_a_slow_tool_holds_back_only_its_own_trajectory(tiny_model_path, tokenizer):
    class Slow(CalculatorTool):
        async def execute(self, instance_id, parameters, **kwargs):
            await asyncio.sleep(2.0)
            return await super().execute(instance_id, parameters, **kwargs)

    script = {"Slow.": [call("3*3").replace("calculator", "slow"), "9"], "Fast.": [call("1+1"), call("2+2"), "4"]}
    cfg = rollout_cfg("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", "data.max_response_length=512")
    engine = ScriptedEngine(cfg, tokenizer, tiny_model_path, script)
    multi_turn = build_multi_turn(engine, tokenizer)
    multi_turn.runner.tools.update(calculator=CalculatorTool({}, None), slow=Slow({}, None))
    out = AgentLoopRollout(engine, 2, multi_turn).generate_sequences(make_prompts(tokenizer, list(script)))
    # turn 1 together; Fast's two next turns while Slow's tool runs; then Slow's answer (sync: [2, 2, 1])
    assert engine.calls == [2, 1, 1, 1]
    metrics = out.meta_info["metrics"]
    assert metrics["multi_turn/tool_errors_per_trajectory"] == [0.0, 0.0]
    assert metrics["multi_turn/truncated_ratio"] == [0.0, 0.0]


def test_a_tool_answer_cannot_forge_chat_turns_in_async_trajectories(chat_model):
    """The agent loop's workers (each with its own tokenizer copy) tokenize a forged tool answer as text, as the
    turn-synchronous loop does: same trajectories, and the tool turn holds only the template's markers."""
    model_path, tokenizer = chat_model
    # the forged header decodes like a real one, so the scripted engine counts it: both later replies are the same
    script = {"Q": [call("1").replace("calculator", "hostile"), "done", "done"], "Say hi.": ["hi"]}
    cfg = rollout_cfg("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent")
    rollouts = []
    for _ in range(2):
        multi_turn = build_multi_turn(ScriptedEngine(cfg, tokenizer, model_path, script), tokenizer)
        multi_turn.runner.tools["hostile"] = HostileTool({}, None)
        rollouts.append(multi_turn)
    sync, agent = rollouts
    expected = sync.generate_sequences(make_prompts(tokenizer, list(script)))
    out = AgentLoopRollout(agent.engine, 2, agent).generate_sequences(make_prompts(tokenizer, list(script)))
    assert_same_samples(out, expected)
    mask = out.batch["response_mask"][0].tolist()
    first = mask.index(0)  # the tool turn: from the first context token to the next policy token
    tool = mask.index(1, first) - first
    tool_turn = out.batch["responses"][0, first : first + tool].tolist()
    assert tool_turn == agent.turns.closing_rest + chatml_tool_turn(tokenizer, [HOSTILE_SEEN])
    assert out.meta_info["metrics"]["multi_turn/tokenization_mismatch_ratio"] == [0.0, 0.0]


def test_an_engine_error_reaches_the_caller_and_no_agent_hangs(tiny_model_path, tokenizer):
    engine, multi_turn = tool_rollouts(tiny_model_path, tokenizer)
    calls = []

    def broken(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("engine died")
        return ScriptedEngine._generate(engine, *args)

    engine._generate = broken
    with pytest.raises(RuntimeError, match="engine died"):
        AgentLoopRollout(engine, 2, multi_turn).generate_sequences(make_prompts(tokenizer, list(SCRIPT)))


def test_the_agent_loop_workers_are_started_once_and_survive_an_engine_error(tiny_model_path, tokenizer):
    import threading

    def agent_threads() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("agent-loop-")}

    before = agent_threads()
    engine, multi_turn = tool_rollouts(tiny_model_path, tokenizer)
    rollout = AgentLoopRollout(engine, 3, multi_turn)
    first = rollout.generate_sequences(make_prompts(tokenizer, list(SCRIPT)))
    started = agent_threads() - before
    assert len(started) == 3 and all(t.is_alive() for t in started)
    real = engine._generate
    engine._generate = lambda *args: (_ for _ in ()).throw(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        rollout.generate_sequences(make_prompts(tokenizer, list(SCRIPT)))
    engine._generate = real
    again = rollout.generate_sequences(make_prompts(tokenizer, list(SCRIPT)))
    assert agent_threads() - before == started  # the same threads served all three generations
    assert torch.equal(again.batch["responses"], first.batch["responses"])


# ------------------------------------------------------------------------------------------ vLLM's server
def test_the_vllm_server_batches_continuously_and_gives_the_turn_synchronous_samples(tiny_model_path, tokenizer):
    users = list(SCRIPT) * 2
    agents = np.array(["tool_agent"] * 7 + ["single_turn_agent"], dtype=object)
    _, sync = tool_rollouts(tiny_model_path, tokenizer)
    expected = sync.generate_sequences(make_prompts(tokenizer, users, agent_name=agents))
    cfg = rollout_cfg("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent")
    engine = SteppedEngine(cfg, tokenizer, tiny_model_path, SCRIPT)
    multi_turn = build_multi_turn(engine, tokenizer)
    multi_turn.runner.tools["calculator"] = CalculatorTool({}, None)
    out = AgentLoopRollout(engine, 3, multi_turn).generate_sequences(make_prompts(tokenizer, users, agent_name=agents))
    assert_same_samples(out, expected)
    assert engine.steps[0] == len(users)  # an idle engine starts with every first turn, as LLM.generate would
    assert max(engine.joined_running) > 0  # a later turn joined requests that were already generating
    assert out.meta_info["metrics"]["rollout/server_batch_size_mean"] > 0


class LeaderCut:
    """An interrupt as `VersionedRollout` asks it on a TP group: every rank asks, TP rank 0's answer (True from its
    `after`-th question on) is broadcast to all."""

    def __init__(self, after: int, group):
        self.after, self.group, self.asked = after, group, 0

    def __call__(self) -> bool:
        import torch.distributed as dist

        self.asked += 1
        answer = torch.tensor([int(self.asked > self.after)])
        dist.broadcast(answer, group_src=0, group=self.group)
        return bool(answer.item())


def _tp_server_worker(rank: int, model_path: str, cut_after: int | None) -> dict:
    """One TP rank of a vLLM-server replica on the scripted engine: the tool agent's trajectories, cut when rank 0
    says so (`cut_after` questions in; None: never asked)."""
    import torch.distributed as dist

    tokenizer = load_tokenizer(model_path)
    group = dist.group.WORLD
    cfg = rollout_cfg(
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    )
    engine = SteppedEngine(cfg, tokenizer, model_path, SCRIPT, tp_group=group)
    multi_turn = build_multi_turn(engine, tokenizer)
    multi_turn.runner.tools["calculator"] = CalculatorTool({}, None)
    engine.interrupt = None if cut_after is None else LeaderCut(cut_after, group)
    out = AgentLoopRollout(engine, 3, multi_turn).generate_sequences(make_prompts(tokenizer, list(SCRIPT)))
    return {
        "added": engine.added,
        "steps": engine.steps,
        "aborted": engine.aborted,
        "left_running": sorted(engine.queue),
        "asked": None if cut_after is None else engine.interrupt.asked,
        "cut_rows": int((out.batch[STOP_KEY] == Stop.INTERRUPTED).sum()),
        "responses": out.batch["responses"],
    }


@pytest.mark.slow
def test_a_tp_replicas_vllm_server_peers_step_and_abort_with_the_leader(tiny_model_path):
    """rollout.tensor_model_parallel_size=2 under the vLLM server: the peer adds the leader's requests before the
    same steps (`VLLMServer.follow`) and, under partial rollout, asks the interrupt with it at each turn of the loop,
    so a cut aborts the same requests before the same step on both ranks and nothing is left running."""
    whole, cut = (spawned_world(2).run(_tp_server_worker, tiny_model_path, after) for after in (None, 3))
    for ranks in (whole, cut):
        leader, peer = ranks
        for key in ("added", "steps", "aborted", "left_running", "asked", "cut_rows"):
            assert leader[key] == peer[key], key
        assert torch.equal(leader["responses"], peer["responses"])  # the leader's output, on every rank
        assert leader["left_running"] == []
    assert whole[0]["aborted"] == [] and whole[0]["cut_rows"] == 0
    assert cut[0]["aborted"] and cut[0]["cut_rows"] > 0  # cut while the first turns generated


# ------------------------------------------------------------------------------------------ the key
def test_mode_is_verls_key_with_its_default_and_sync_is_rlframes_own():
    from rlframe.config.key_status import key_statuses
    from rlframe.config.verl_keys import verl_defaults
    from rlframe.trainer.config import compose, typed

    assert verl_defaults()["actor_rollout_ref.rollout.mode"] == "async" == rollout_cfg().mode
    assert typed(compose(["actor_rollout_ref.rollout.mode=sync"])).actor_rollout_ref.rollout.mode == "sync"
    with pytest.raises(ValueError, match="rollout.mode='server' is not one of async, sync"):
        typed(compose(["actor_rollout_ref.rollout.mode=server"]))

    def ignored(*overrides):
        return {row.key for row in key_statuses(compose(list(overrides))) if not row.in_effect}

    workers = "actor_rollout_ref.rollout.agent.num_workers"
    assert workers not in ignored() and workers in ignored("actor_rollout_ref.rollout.mode=sync")
    with pytest.raises(ValueError, match="num_workers=0"):
        typed(compose([f"{workers}=0"]))
