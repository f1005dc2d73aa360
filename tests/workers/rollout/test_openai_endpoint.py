"""The OpenAI endpoint, driven by the real `openai` client and plain `httpx`, before the HF engine on the tiny model.

Each test opens its episodes on one endpoint whose generation goes through a `BatchingServer` served on a thread, as
the agent loops serve it; every request is recorded, and the recorded trajectories are checked token for token
against what the engine sampled.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from contextlib import contextmanager
from functools import partial

import httpx
import openai
import pytest
import torch
from helpers.rollout import load_tokenizer, rollout_config

from rlframe.workers.rollout import build_rollout
from rlframe.workers.rollout.agent_loop import _EventLoopThreads
from rlframe.workers.rollout.episodes import Episode
from rlframe.workers.rollout.openai_endpoint import EpisodeBudget, OpenAIEndpoint
from rlframe.workers.rollout.server import BatchingServer

MODEL = "tiny"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    cfg = rollout_config(
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.mode=sync",
        "data.max_prompt_length=256",
        "data.max_response_length=160",
    )
    engine = build_rollout("hf", cfg, tiny_model_path, load_tokenizer(tiny_model_path), "cpu")
    engine.test_tokenizer = load_tokenizer(tiny_model_path)
    return engine


@contextmanager
def serving(engine, num_episodes: int, budget: EpisodeBudget | None = None, script=None):
    """A rollout server on a thread for `num_episodes` episodes, and the endpoint in front of it."""
    params = engine.sampling_for({})
    eos_ids, pad_id = engine.special_tokens_for({})
    server = BatchingServer(engine, params, eos_ids, pad_id)
    if script is not None:  # the engine answers these texts instead of sampling (tool calls on a random model)
        server._run = partial(_scripted, server, iter(script), engine.test_tokenizer)
    thread = threading.Thread(target=server.serve, args=(num_episodes,), daemon=True)
    thread.start()
    limits = (engine.config.prompt_length, engine.config.response_length)
    endpoint = OpenAIEndpoint(
        partial(server.generate, away=True),
        engine.test_tokenizer,
        eos_ids,
        limits,
        MODEL,
        budget=budget or EpisodeBudget(),
    )
    endpoint.start()
    try:
        yield server, endpoint
    finally:
        endpoint.stop()
        server.close()
        thread.join(timeout=60)


@contextmanager
def episode(server, endpoint, seed: int = 0):
    """One episode: counted away from the server except while its requests wait, finished at the end."""
    record, base_url = endpoint.open_episode(seed)
    try:
        with server.away():
            yield record, base_url
    finally:
        endpoint.close_episode(record)
        server.finished()


def _scripted(server, texts, tokenizer, requests):
    from rlframe.workers.rollout.server import Completion

    out = []
    for _ in requests:
        ids = tokenizer.encode(next(texts), add_special_tokens=False) + [server.eos_ids[0]]
        out.append(Completion(ids, [-0.5] * len(ids), versions=[0] * len(ids)))
    return out


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


def engine_sample(engine, context: list[int], seed: int, max_tokens: int):
    """What the engine samples after `context` with `seed`, alone in its batch."""
    server = BatchingServer(engine, engine.sampling_for({}), *engine.special_tokens_for({}))
    from rlframe.workers.rollout.server import GenerationRequest

    return server._run([GenerationRequest(0, context, max_tokens, seed)])[0]


# ------------------------------------------------------------------------------------------ the API surface
def test_chat_completion_is_recorded_token_for_token(engine):
    with serving(engine, 1) as (server, endpoint), episode(server, endpoint, seed=7) as (record, base_url):

        async def run():
            async with client(base_url) as api:
                return await api.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=12,
                    logprobs=True,
                    temperature=1.0,
                )

        answer = asyncio.run(run())
    [trajectory] = record.trajectories
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and answer.model == MODEL
    sampled = [i for i, m in zip(trajectory.response_ids, trajectory.response_mask) if m]
    assert sampled == trajectory.response_ids and 0 < len(sampled) <= 12  # one turn: every response token sampled
    assert answer.usage.completion_tokens == len(sampled)
    assert [entry.logprob for entry in choice.logprobs.content] == trajectory.log_probs
    # exactly what the engine samples after the rendered prompt with the request's seed
    expected = engine_sample(engine, trajectory.prompt_ids, Episode("", 7).request_seeds(0, 1)[0], 12)
    assert expected.tokens == sampled
    torch.testing.assert_close(torch.tensor(expected.log_probs), torch.tensor(trajectory.log_probs))
    assert trajectory.policy_versions == [0]


def test_streaming_models_and_completions(engine):
    with serving(engine, 1) as (server, endpoint), episode(server, endpoint) as (record, base_url):

        async def run():
            async with client(base_url) as api:
                models = await api.models.list()
                stream = await api.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = [chunk async for chunk in stream]
                text = await api.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, n=2, logprobs=0)
                return models, chunks, text

        models, chunks, text = asyncio.run(run())
    assert [m.id for m in models.data] == [MODEL]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == record.trajectories[0].response_mask.count(1)
    assert content == endpoint.tokenizer.decode(_policy_text_ids(record.trajectories[0], endpoint.eos_ids))
    assert len(text.choices) == 2 and len(record.trajectories) == 3
    for choice, trajectory in zip(text.choices, record.trajectories[1:]):
        assert choice.logprobs.token_logprobs == trajectory.log_probs


def _policy_text_ids(trajectory, eos_ids):
    ids = trajectory.response_ids
    return ids[:-1] if ids and ids[-1] in eos_ids else ids


def test_tool_calls_come_back_in_openai_form_and_the_next_turn_extends_the_tokens(engine):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    script = [f"Let me compute. {call}", "It is 84."]
    with serving(engine, 1, script=script) as (server, endpoint), episode(server, endpoint) as (record, base_url):

        async def run():
            async with client(base_url) as api:
                messages = [{"role": "user", "content": "What is 12*7?"}]
                first = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
                message = first.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "84"})
                second = await api.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
                return first, second

        first, second = asyncio.run(run())
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content == "Let me compute."
    assert message.tool_calls[0].function.name == "calculator"
    assert json.loads(message.tool_calls[0].function.arguments) == {"expression": "12*7"}
    assert second.choices[0].message.content == "It is 84."
    [trajectory] = record.trajectories  # the second request extended the first
    tokenizer, eos = endpoint.tokenizer, endpoint.eos_ids[0]
    turn_1 = tokenizer.encode(script[0], add_special_tokens=False) + [eos]
    turn_2 = tokenizer.encode(script[1], add_special_tokens=False) + [eos]
    tool_turn = trajectory.response_ids[len(turn_1) : len(trajectory.response_ids) - len(turn_2)]
    assert trajectory.response_ids == turn_1 + tool_turn + turn_2  # the sampled ids, never re-tokenized
    assert trajectory.response_mask == [1] * len(turn_1) + [0] * len(tool_turn) + [1] * len(turn_2)
    assert "84" in tokenizer.decode(tool_turn) and tool_turn  # the template's tool turn, not trained
    assert trajectory.log_probs == [-0.5] * len(turn_1) + [0.0] * len(tool_turn) + [-0.5] * len(turn_2)


def forced(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("choice", ["required", forced("calculator")], ids=["required", "named"])
def test_a_forced_tool_call_writes_its_opening_and_trains_only_what_the_policy_sampled(engine, choice):
    opening = '<tool_call>\n{"name": "calculator", "arguments": ' if choice != "required" else "<tool_call>\n"
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
    script = [call[len(opening) :]]  # the engine samples the rest of the call
    with serving(engine, 1, script=script) as (server, endpoint), episode(server, endpoint) as (record, base_url):

        async def run():
            async with client(base_url) as api:
                messages = [{"role": "user", "content": "What is 12*7?"}]
                return await api.chat.completions.create(
                    model=MODEL, messages=messages, tools=[CALCULATOR], tool_choice=choice
                )

        answer = asyncio.run(run())
    [tool_call] = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and tool_call.function.name == "calculator"
    assert json.loads(tool_call.function.arguments) == {"expression": "12*7"}
    [trajectory] = record.trajectories
    tokenizer, eos = endpoint.tokenizer, endpoint.eos_ids[0]
    opening_ids = tokenizer.encode(opening, add_special_tokens=False)
    sampled = tokenizer.encode(script[0], add_special_tokens=False) + [eos]
    assert trajectory.response_ids == opening_ids + sampled
    assert trajectory.response_mask == [0] * len(opening_ids) + [1] * len(sampled)  # the opening is not trained
    assert answer.usage.completion_tokens == len(sampled)


def test_a_request_that_rewrites_history_starts_a_new_trajectory(engine):
    with serving(engine, 1) as (server, endpoint), episode(server, endpoint) as (record, base_url):

        async def run():
            async with client(base_url) as api:
                messages = [{"role": "user", "content": "Hi"}]
                first = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
                extended = messages + [
                    first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "More"},
                ]
                await api.chat.completions.create(model=MODEL, messages=extended, max_tokens=6)
                rewritten = messages + [{"role": "assistant", "content": "summary"}, {"role": "user", "content": "Go"}]
                await api.chat.completions.create(model=MODEL, messages=rewritten, max_tokens=6)

        asyncio.run(run())
    first, second = record.trajectories
    assert first.policy_versions == [0, 0] and second.policy_versions == [0]
    assert first.response_mask.count(0) > 0 and set(second.response_mask) == {1}


# ------------------------------------------------------------------------------------------ errors
def test_bad_requests_answer_openai_errors_and_the_endpoint_keeps_serving(engine):
    with serving(engine, 1) as (server, endpoint), episode(server, endpoint) as (record, base_url):
        url = f"{base_url}/chat/completions"
        hi = [{"role": "user", "content": "Hi"}]
        bad = [
            (b"{not json", 400, "invalid_json"),
            (json.dumps({"model": "gpt-4o", "messages": hi}).encode(), 404, "model_not_found"),
            (json.dumps({"model": MODEL, "messages": hi, "temperature": 7}).encode(), 400, "invalid_value"),
            (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "invalid_value"),
            (json.dumps({"model": MODEL, "messages": [{"content": "no role"}]}).encode(), 400, None),
            (json.dumps({"model": MODEL, "messages": hi, "top_logprobs": 3}).encode(), 400, "invalid_value"),
            (json.dumps({"model": MODEL, "messages": hi, "stop": ["", "x"]}).encode(), 400, "invalid_value"),
            (json.dumps({"model": MODEL, "messages": hi, "tool_choice": "required"}).encode(), 400, "invalid_value"),
            (
                json.dumps(
                    {"model": MODEL, "messages": hi, "tools": [CALCULATOR], "tool_choice": forced("search")}
                ).encode(),
                400,
                "invalid_value",
            ),
        ]
        for body, status, code in bad:
            answer = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
            assert answer.status_code == status, answer.text
            error = answer.json()["error"]
            assert error["message"] and error["type"] and error["code"] == code
        wrong = httpx.post(base_url.replace(record.token, "guess") + "/chat/completions", json={}, timeout=30)
        assert wrong.status_code == 404 and "error" in wrong.json()
        assert httpx.get(f"http://127.0.0.1:{endpoint.port}/v1/models", timeout=30).status_code == 404

        async def still_serving():
            async with client(base_url) as api:
                with pytest.raises(openai.BadRequestError):
                    await api.chat.completions.create(model=MODEL, messages=hi, max_tokens=0)
                return await api.chat.completions.create(model=MODEL, messages=hi, max_tokens=4)

        assert asyncio.run(still_serving()).choices[0].message.content is not None
    assert record.num_errors == len(bad) + 1 and record.num_requests == len(bad) + 2


def test_budgets_refuse_requests_with_429(engine):
    budget = EpisodeBudget(max_requests=2)
    with serving(engine, 1, budget) as (server, endpoint), episode(server, endpoint) as (record, base_url):

        async def run():
            async with client(base_url) as api:
                for _ in range(2):
                    await api.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2
                    )
                with pytest.raises(openai.RateLimitError) as refused:
                    await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "b"}])
                return refused.value

        error = asyncio.run(run())
    assert error.status_code == 429 and error.code == "episode_budget_exhausted" and record.num_requests == 3


# ------------------------------------------------------------------------------------------ concurrency, binding
@pytest.mark.slow
def test_32_concurrent_sessions_sample_like_one_at_a_time(engine):
    num = 32
    with serving(engine, num) as (server, endpoint):
        sessions = [episode(server, endpoint, seed=i) for i in range(num)]
        opened = [s.__enter__() for s in sessions]

        async def one(base_url: str):
            async with client(base_url) as api:
                return await api.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=6
                )

        async def run():
            return await asyncio.gather(*(one(base_url) for _, base_url in opened))

        try:
            asyncio.run(run())
        finally:
            for s in sessions:
                s.__exit__(None, None, None)
    assert max(server._batch_sizes) > 1  # batched together
    for seed, (record, _) in enumerate(opened):
        [trajectory] = record.trajectories
        expected = engine_sample(engine, trajectory.prompt_ids, Episode("", seed).request_seeds(0, 1)[0], 6)
        assert expected.tokens == trajectory.response_ids


def test_a_client_left_to_the_garbage_collector_does_not_strand_another_agents_answer(engine):
    """An agent that never closes its `openai` client, collected on another agent-loop thread while a second agent
    waits for its answer: the first client's connection must not take the second one's socket with it.

    Each connection used to stay open (keep-alive) after its answer. The collector then closed the idle socket
    (asyncio's transport finalizer) and the client's finalizer scheduled a close on the collecting thread's loop, which
    ran later and unregistered that descriptor number from the agents' loop: by then the second agent's new socket had
    it, so its answer was never read and the episode hung until `openai_agent.timeout_s`."""
    loops = _EventLoopThreads(2)  # 0: the agents' loop; 1: another agent-loop thread, where the collector runs
    gc.collect()  # earlier tests' garbage, collected now, on a thread without an event loop
    gc.disable()  # the collector runs below, where the race needs it
    try:
        with serving(engine, 2) as (server, endpoint):
            record, first_url = endpoint.open_episode(0)  # not counted away: the server waits for its finish

            async def leave_the_client():
                await client(first_url).models.list()  # the client, in a reference cycle, waits for the collector

            loops.submit(0, leave_the_client()).result(timeout=60)
            release = threading.Event()

            async def collect_and_hold():
                gc.collect()
                release.wait()  # the client's finalizer scheduled its close on this loop: it runs after this step

            collected = loops.submit(1, collect_and_hold())
            with episode(server, endpoint, seed=1) as (_, second_url):
                asking = loops.submit(
                    0,
                    client(second_url).chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
                    ),
                )
                deadline = time.monotonic() + 60
                while not server._waiting:  # the second agent now waits for its answer on its new socket
                    assert time.monotonic() < deadline and not asking.done(), asking
                    time.sleep(0.01)
                release.set()
                collected.result(timeout=60)
                loops.submit(1, asyncio.sleep(0.5)).result(timeout=60)  # the scheduled close has run
                endpoint.close_episode(record)
                server.finished()  # the first episode is done: the server answers the second
                answer = asking.result(timeout=60)  # stranded, it would wait for the client's own 600 s timeout
            assert answer.choices[0].message.content is not None
    finally:
        gc.enable()


def test_the_endpoint_listens_on_loopback_only_by_default(engine):
    with serving(engine, 0) as (_, endpoint):
        sockets = endpoint._server.servers[0].sockets
        assert all(s.getsockname()[0] == "127.0.0.1" for s in sockets)


# ------------------------------------------------------------------------------------------ token-exactness
@pytest.fixture(params=["tiny", "smollm2"])
def model_path(request):
    return request.getfixturevalue("tiny_model_path" if request.param == "tiny" else "smollm2_path")


@pytest.mark.slow
def test_a_two_turn_trajectory_trains_the_sampled_tokens_with_the_actors_log_probs(model_path):
    """The recorded trajectory holds the engine's samples, masked exactly; a plain forward of the same weights (the
    actor's computation) gives the rollout's log-probs on them, up to fp32 noise."""
    from transformers import AutoModelForCausalLM

    cfg = rollout_config(
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.mode=sync",
        "data.max_prompt_length=256",
        "data.max_response_length=160",
    )
    engine = build_rollout("hf", cfg, model_path, load_tokenizer(model_path), "cpu")
    engine.test_tokenizer = load_tokenizer(model_path)
    with serving(engine, 1) as (server, endpoint), episode(server, endpoint, seed=3) as (record, base_url):

        async def run():
            async with client(base_url) as api:
                messages = [{"role": "user", "content": "Name a colour."}]
                first = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
                messages += [
                    first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "Another?"},
                ]
                await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)

        asyncio.run(run())
    [trajectory] = record.trajectories
    mask = trajectory.response_mask
    runs = [k for k, previous in zip(mask, [None] + mask) if k != previous]
    assert runs == [1, 0, 1]
    # each turn is what the engine samples after exactly the context before it
    second = mask.index(1, mask.index(0))
    for start, end, number in ((0, mask.index(0), 0), (second, len(mask), 1)):
        context = trajectory.prompt_ids + trajectory.response_ids[:start]
        seed = Episode("", 3).request_seeds(number, 1)[0]
        expected = engine_sample(engine, context, seed, 8)
        assert expected.tokens == trajectory.response_ids[start:end]
    # the actor's log-probs of the trained tokens equal the rollout's
    actor = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    with torch.no_grad():
        logits = actor(ids).logits[0, len(trajectory.prompt_ids) - 1 : -1]
    actor_log_probs = torch.log_softmax(logits, -1).gather(1, ids[0, len(trajectory.prompt_ids) :, None])[:, 0]
    trained = torch.tensor(mask).bool()
    torch.testing.assert_close(actor_log_probs[trained], torch.tensor(trajectory.log_probs)[trained], atol=2e-4, rtol=0)


def test_an_engine_failure_answers_500_in_openai_shape_and_the_endpoint_keeps_serving(engine):
    from rlframe.workers.rollout.server import Completion

    calls = []

    async def generate(request):
        calls.append(request)
        if len(calls) == 1:
            raise RuntimeError("the rollout server stopped")
        return Completion([engine.eos_ids[0]], [-0.1], versions=[0])

    endpoint = OpenAIEndpoint(generate, engine.test_tokenizer, engine.eos_ids, (256, 160), MODEL)
    endpoint.start()
    try:
        _, base_url = endpoint.open_episode(0)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        failed = httpx.post(f"{base_url}/chat/completions", json=body, timeout=30)
        assert failed.status_code == 500 and "the rollout server stopped" in failed.json()["error"]["message"]
        served = httpx.post(f"{base_url}/chat/completions", json=body, timeout=30)
        assert served.status_code == 200 and served.json()["choices"][0]["finish_reason"] == "stop"
    finally:
        endpoint.stop()


# ------------------------------------------------------------------------------------------ an agent framework
def test_an_openai_agents_sdk_agent_calls_its_tool_and_its_episode_is_one_trajectory(engine):
    """examples/openai_agent/agents_sdk_agent.py: the OpenAI Agents SDK's requests (strict function tools, its own
    rendering of the assistant's tool call and the tool result) extend the recorded conversation token for token."""
    import importlib.util
    from pathlib import Path

    from rlframe.workers.rollout.openai_agent import MODEL_NAME

    path = Path(__file__).resolve().parents[3] / "examples" / "openai_agent" / "agents_sdk_agent.py"
    spec = importlib.util.spec_from_file_location("agents_sdk_agent", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    script = [call, "12*7 = 84"]
    sample = {"prompt": [{"role": "user", "content": "What is 12*7?"}], "data_source": "t", "extra_info": {}}
    with serving(engine, 1, script=script) as (server, endpoint), episode(server, endpoint) as (record, base_url):
        endpoint.model_name = MODEL_NAME  # the name the trainer's endpoint serves, which the example asks for
        assert asyncio.run(example.run_agent(base_url, sample)) is None
    [trajectory] = record.trajectories  # the SDK's second request extended the first
    tokenizer, eos = endpoint.tokenizer, endpoint.eos_ids[0]
    turns = [tokenizer.encode(text, add_special_tokens=False) + [eos] for text in script]
    tool_turn = trajectory.response_ids[len(turns[0]) : len(trajectory.response_ids) - len(turns[1])]
    assert trajectory.response_ids == turns[0] + tool_turn + turns[1]
    assert trajectory.response_mask == [1] * len(turns[0]) + [0] * len(tool_turn) + [1] * len(turns[1])
    assert "84" in tokenizer.decode(tool_turn)  # the calculator ran and its result is the template's tool turn
