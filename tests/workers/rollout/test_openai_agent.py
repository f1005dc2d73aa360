"""`default_agent_loop=openai_agent`: a user's agent written with the `openai` package runs per row through the
endpoint, and the rows come out with the engine's sampled tokens and log-probs, `response_mask` marking exactly them.

The HF engine on the tiny model serves every request; the agents are written to a file as a user would write them.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from helpers.multi_turn import make_prompts
from helpers.rewards import make_batch
from helpers.rollout import load_tokenizer, rollout_config, teacher_forced_log_probs
from helpers.world import spawned_world

from rlframe.protocol import DataProto
from rlframe.reward.manager import AGENT_SCORE_KEY, NaiveRewardManager
from rlframe.workers.rollout import build_rollout, generate_in_tp_group
from rlframe.workers.rollout.base import VERSIONS_KEY
from rlframe.workers.rollout.openai_agent import AgentFailed

AGENTS = textwrap.dedent(
    """
    import asyncio
    import openai

    SEEN = {}  # row index -> the log-probs of each reply the agent received

    async def two_turns(base_url, sample):
        api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = list(sample["prompt"])
        replies = SEEN.setdefault(sample["extra_info"]["index"], [])
        for _ in range(2):
            answer = await api.chat.completions.create(model="policy", messages=messages, max_tokens=5, logprobs=True)
            replies.append([entry.logprob for entry in answer.choices[0].logprobs.content])
            messages += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        return {"score": float(len(messages)), "turns": 2.0}

    async def leaves_it_to_the_reward(base_url, sample):
        api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        await api.chat.completions.create(model="policy", messages=sample["prompt"], max_tokens=3)
        return None

    async def fails(base_url, sample):
        if sample["extra_info"]["index"] % 2:
            raise RuntimeError("the agent crashed")
        return 1.0

    async def sleeps(base_url, sample):
        await asyncio.sleep(30)
        return 1.0

    async def spends_its_budget(base_url, sample):
        api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        for _ in range(3):  # the third request answers 429: the agent's exception fails the episode
            await api.chat.completions.create(model="policy", messages=sample["prompt"], max_tokens=2)
        return 1.0
    """
)


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "agents.py"
    path.write_text(AGENTS)
    return str(path)


def openai_rollout(tiny_model_path, agent_file, name: str, *overrides):
    cfg = rollout_config(
        "data.max_prompt_length=64",
        "data.max_response_length=48",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
        f"actor_rollout_ref.rollout.agent.openai_agent.path={agent_file}",
        f"actor_rollout_ref.rollout.agent.openai_agent.name={name}",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        *overrides,
    )
    return build_rollout("hf", cfg, tiny_model_path, load_tokenizer(tiny_model_path), "cpu")


def rows(tiny_model_path, num: int):
    tokenizer = load_tokenizer(tiny_model_path)
    users = [f"question {i}" for i in range(num)]
    return make_prompts(
        tokenizer,
        users,
        data_source=np.array(["test"] * num, dtype=object),
        reward_model=np.array([{"ground_truth": "4"}] * num, dtype=object),
        extra_info=np.array([{"index": i} for i in range(num)], dtype=object),
    )


def test_rows_hold_exactly_the_sampled_tokens_of_a_two_turn_agent(tiny_model_path, agent_file):
    rollout = openai_rollout(tiny_model_path, agent_file, "two_turns")
    out = generate_in_tp_group(rollout, rows(tiny_model_path, 4))
    assert [r["score"] for r in out.non_tensor_batch[AGENT_SCORE_KEY]] == [5.0] * 4
    assert out.meta_info["metrics"]["openai_agent/failed_ratio"] == [0.0] * 4  # one value per episode
    assert out.meta_info["metrics"]["openai_agent/requests_per_episode"] == [2.0] * 4
    seen = rollout.openai_agents.function.__globals__["SEEN"]  # row index -> the log-probs of each reply
    prompt_width = out.batch["prompts"].shape[1]
    for row in range(4):
        length = int(out.batch["attention_mask"][row, prompt_width:].sum())
        mask = out.batch["response_mask"][row, :length].tolist()
        runs = [k for k, previous in zip(mask, [None] + mask) if k != previous]
        assert runs == [1, 0, 1], mask  # two sampled turns, the template's turn between them untrained
        trained = out.batch["rollout_log_probs"][row, :length][out.batch["response_mask"][row, :length].bool()]
        replies = seen[row]
        assert trained.tolist() == [p for reply in replies for p in reply]  # the very log-probs the agent received
        untrained = out.batch["rollout_log_probs"][row, :length][~out.batch["response_mask"][row, :length].bool()]
        assert untrained.abs().sum() == 0


def test_the_reward_function_scores_when_the_agent_returns_none(tiny_model_path, agent_file):
    rollout = openai_rollout(tiny_model_path, agent_file, "leaves_it_to_the_reward")
    out = generate_in_tp_group(rollout, rows(tiny_model_path, 2))
    assert list(out.non_tensor_batch[AGENT_SCORE_KEY]) == [None, None]
    assert out.batch["response_mask"].sum() > 0


def test_a_failing_agent_fails_its_episode_not_the_step(tiny_model_path, agent_file):
    rollout = openai_rollout(tiny_model_path, agent_file, "fails")
    out = generate_in_tp_group(rollout, rows(tiny_model_path, 4))
    results = list(out.non_tensor_batch[AGENT_SCORE_KEY])
    assert results[0] == 1.0 and results[2] == 1.0
    assert isinstance(results[1], AgentFailed) and "the agent crashed" in str(results[1])
    assert out.meta_info["metrics"]["openai_agent/failed_ratio"] == [0.0, 1.0, 0.0, 1.0]
    assert out.batch["response_mask"].sum() == 0  # no request: nothing to train


def test_timeouts_and_request_budgets_fail_the_episode(tiny_model_path, agent_file):
    slow = openai_rollout(
        tiny_model_path, agent_file, "sleeps", "actor_rollout_ref.rollout.agent.openai_agent.timeout_s=0.5"
    )
    [result] = generate_in_tp_group(slow, rows(tiny_model_path, 1)).non_tensor_batch[AGENT_SCORE_KEY]
    assert isinstance(result, AgentFailed) and "timed out after 0.5 s" in str(result)
    spender = openai_rollout(
        tiny_model_path, agent_file, "spends_its_budget", "actor_rollout_ref.rollout.agent.openai_agent.max_requests=2"
    )
    out = generate_in_tp_group(spender, rows(tiny_model_path, 1))
    [result] = out.non_tensor_batch[AGENT_SCORE_KEY]
    assert isinstance(result, AgentFailed) and "429" in str(result)
    assert out.meta_info["metrics"]["openai_agent/request_errors_per_episode"] == [1.0]


def test_the_reward_manager_takes_the_agents_results(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    data = make_batch(tokenizer, ["1", "2", "3", "4"], ["test"] * 4, ["1"] * 4)
    data.non_tensor_batch[AGENT_SCORE_KEY] = np.array(
        [None, 0.5, {"score": 2.0, "turns": 3.0}, AgentFailed("row 3: the agent failed: RuntimeError()")] + [0],
        dtype=object,
    )[:-1]
    scored_rows = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        scored_rows.append(solution_str)
        return 7.0

    out = NaiveRewardManager(tokenizer, compute_score=compute_score)(data, return_dict=True)
    assert scored_rows == ["1"]  # only the row whose agent left it to the reward function
    assert out["reward_extra_info"]["score"] == [7.0, 0.5, 2.0, 0.0]
    assert out["metrics"]["reward/num_scorer_errors"] == 1  # the failed agent counts like a failed scorer


def test_the_example_calculator_agent_runs_through_the_endpoint(tiny_model_path):
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "examples" / "openai_agent" / "calculator_agent.py"
    rollout = openai_rollout(tiny_model_path, str(example), "run_agent")
    out = generate_in_tp_group(rollout, rows(tiny_model_path, 2))
    assert list(out.non_tensor_batch[AGENT_SCORE_KEY]) == [None, None]  # the reward function scores the rows
    assert out.meta_info["metrics"]["openai_agent/failed_ratio"] == [0.0, 0.0]
    assert out.batch["response_mask"].sum() > 0
    calculate = rollout.openai_agents.function.__globals__["calculate"]
    assert calculate("123 * 45") == "5535" and calculate("__import__('os')").startswith("error")


class PushAfter:
    """The rollout pool's board in miniature: newer weights are announced at the engine's (asks + 1)-th question
    (`interrupt`, asked when a micro-batch starts and after each decoding step); `catch_up` loads `weights` (None:
    the engine keeps its own) and takes the announced version, as `VersionedRollout.catch_up` does."""

    def __init__(self, engine, asks: int, weights: dict | None = None):
        self.engine, self.asks, self.weights = engine, asks, weights
        self.asked = self.announced = self.version = 0

    def interrupt(self) -> bool:
        self.asked += 1
        if self.asked > self.asks:
            self.announced = 1
        return self.announced > self.version

    def catch_up(self) -> int:
        if self.weights is not None:
            self.engine.update_weights(self.weights.items())
        self.version = self.announced
        return self.version


def _two_turn_rows(rollout, prompts, push: PushAfter | None):
    """The two-turn agent's rows (the sampling seed drawn from the same RNG state each time) and its replies."""
    seen = rollout.openai_agents.function.__globals__["SEEN"]
    seen.clear()
    engine = rollout.unwrapped
    state = torch.get_rng_state()
    engine.interrupt, engine.catch_up = (push.interrupt, push.catch_up) if push else (None, None)
    try:
        out = generate_in_tp_group(rollout, prompts)
    finally:
        engine.interrupt = engine.catch_up = None
        torch.set_rng_state(state)
    return out, {row: [list(reply) for reply in replies] for row, replies in seen.items()}


def test_a_push_cuts_a_running_request_and_the_endpoint_continues_it_unseen_by_the_agent(tiny_model_path, agent_file):
    """Under unchanged weights the continued requests give the agent the very tokens of an uncut run (sampling is
    keyed by seed and position); the tokens before the cut carry the old version, those after it the new one."""
    rollout = openai_rollout(tiny_model_path, agent_file, "two_turns")
    prompts = rows(tiny_model_path, 4)
    whole, _ = _two_turn_rows(rollout, prompts, None)
    cut, replies = _two_turn_rows(rollout, prompts, PushAfter(rollout.unwrapped, asks=3))
    assert cut.meta_info["metrics"]["rollout/server_requests_cut"] >= 1
    assert cut.meta_info["metrics"]["openai_agent/failed_ratio"] == [0.0] * 4
    for key in ("responses", "response_mask", "input_ids", "attention_mask"):
        assert torch.equal(cut.batch[key], whole.batch[key]), key
    # a continuation's first token comes from a prefill of prompt + prefix, not a decoding step: the same value up
    # to the rounding of a differently shaped computation
    torch.testing.assert_close(cut.batch["rollout_log_probs"], whole.batch["rollout_log_probs"], rtol=0, atol=1e-5)
    mask = cut.batch["response_mask"].bool()
    versions = cut.batch[VERSIONS_KEY]
    assert (whole.batch[VERSIONS_KEY][mask] == 0).all() and (versions[~mask] == -1).all()
    for row in range(4):
        policy = versions[row][mask[row]].tolist()
        assert policy == sorted(policy) and policy.count(0) <= 3  # cut after 3 decoding steps at most
        trained = cut.batch["rollout_log_probs"][row][mask[row]].tolist()
        assert trained == [p for reply in replies[row] for p in reply]  # what the agent received, exactly
    assert (versions[mask] == 0).any() and (versions[mask] == 1).any()


def test_a_cut_request_continues_on_the_new_weights_with_each_tokens_version_and_log_prob(tiny_model_path, agent_file):
    """The new weights arrive mid-request: the tokens before the cut were sampled (and their log-probs computed) by
    the old weights, the rest by the new ones; the rows record which, token by token."""
    rollout = openai_rollout(tiny_model_path, agent_file, "two_turns")
    engine = rollout.unwrapped
    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    newer = {
        name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in before.items() if t.is_floating_point()
    }
    try:
        out, _ = _two_turn_rows(rollout, rows(tiny_model_path, 4), PushAfter(engine, asks=3, weights=newer))
        mask = out.batch["response_mask"].bool()
        versions = out.batch[VERSIONS_KEY]
        assert (versions[mask] == 0).any() and (versions[mask] == 1).any()
        recorded = out.batch["rollout_log_probs"]
        under_new = teacher_forced_log_probs(engine, out)
        engine.update_weights(before.items())
        under_old = teacher_forced_log_probs(engine, out)
        old, new = mask & (versions == 0), mask & (versions == 1)
        torch.testing.assert_close(recorded[old], under_old[old], rtol=0, atol=1e-5)
        torch.testing.assert_close(recorded[new], under_new[new], rtol=0, atol=1e-5)
    finally:
        engine.update_weights(before.items())


class TPPushAfter:
    """`PushAfter` on a TP replica, as `VersionedRollout` runs there: every rank asks the interrupt and TP rank 0's
    answer goes to all; `catch_up` loads `weights` on the rank that calls it and records the version it was asked
    for (None: the leader, which takes the newest announced)."""

    def __init__(self, engine, asks: int, weights: dict, group):
        self.engine, self.asks, self.weights, self.group = engine, asks, weights, group
        self.asked = self.version = 0
        self.asked_for: list[int | None] = []

    def interrupt(self) -> bool:
        import torch.distributed as dist

        self.asked += 1
        moved_on = torch.tensor([int(self.asked > self.asks and self.version < 1)])
        dist.broadcast(moved_on, group_src=0, group=self.group)
        return bool(moved_on.item())

    def catch_up(self, version: int | None = None) -> int:
        self.asked_for.append(version)
        self.engine.update_weights(self.weights.items())
        self.version = 1
        return self.version


def _newer_weights(model_path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return {name: t + 0.05 * torch.randn(t.shape, generator=gen) for name, t in model.state_dict().items()}


def _tp_cut_worker(rank: int, model_path: str, agent_file: str) -> dict:
    """One rank of a TP-2 replica running the two-turn agent; a push cuts its requests after 3 questions."""
    import torch.distributed as dist

    group = dist.group.WORLD
    cfg = rollout_config(
        "data.max_prompt_length=64",
        "data.max_response_length=48",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
        f"actor_rollout_ref.rollout.agent.openai_agent.path={agent_file}",
        "actor_rollout_ref.rollout.agent.openai_agent.name=two_turns",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    )
    rollout = build_rollout("hf", cfg, model_path, load_tokenizer(model_path), "cpu", tp_group=group)
    engine = rollout.unwrapped
    push = TPPushAfter(engine, 3, _newer_weights(model_path), group)
    engine.interrupt, engine.catch_up = push.interrupt, push.catch_up
    out = generate_in_tp_group(rollout, rows(model_path, 4).select_idxs(slice(2 * rank, 2 * rank + 2)), group)
    return {"asked_for": push.asked_for, "out": out}


@pytest.mark.slow
def test_on_a_tp_replica_the_peer_loads_the_weights_its_leader_continues_a_cut_request_on(tiny_model_path, agent_file):
    """rollout.tensor_model_parallel_size=2 on the rollout pool: the leader catches up to the announced weights to
    continue a cut request, and sends the version with its next engine call; the peer loads that version before
    the call. Every token after the cut has the log-prob of the new weights on the whole model: had the peer kept the
    old shards, the TP all-reduce would mix the two."""
    ranks = spawned_world(2).run(_tp_cut_worker, tiny_model_path, agent_file)
    assert [r["asked_for"] for r in ranks] == [[None], [1]]  # the leader takes the newest; the peer the leader's
    metrics = ranks[0]["out"].meta_info["metrics"]  # the leader's, which every rank returns
    assert metrics["rollout/server_requests_cut"] >= 1 and not any(metrics["openai_agent/failed_ratio"])
    out = DataProto.concat([r["out"] for r in ranks])
    mask, versions = out.batch["response_mask"].bool(), out.batch[VERSIONS_KEY]
    old, new = mask & (versions == 0), mask & (versions == 1)
    assert old.any() and new.any()
    engine = openai_rollout(tiny_model_path, agent_file, "two_turns").unwrapped  # TP 1, the reference
    under_old = teacher_forced_log_probs(engine, out)
    engine.update_weights(_newer_weights(tiny_model_path).items())
    under_new = teacher_forced_log_probs(engine, out)
    recorded = out.batch["rollout_log_probs"]
    torch.testing.assert_close(recorded[old], under_old[old], rtol=0, atol=1e-5)
    torch.testing.assert_close(recorded[new], under_new[new], rtol=0, atol=1e-5)
