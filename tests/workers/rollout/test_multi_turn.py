"""Multi-turn rollouts with tools: parsing, tools that fail, the token layout, masks, limits, and the loss.

The rollout tests drive `MultiTurnRollout` with a scripted engine (replies chosen by the conversation so far)
and the tiny model's tokenizer and chat template, so every token of a trajectory is known in advance.
"""

from __future__ import annotations

import asyncio
import os
import textwrap

import numpy as np
import pytest
import torch
from helpers.multi_turn import (
    HOSTILE_SEEN,
    PROMPT_LEN,
    RESPONSE_LEN,
    HostileTool,
    ScriptedEngine,
    call,
    chatml_tool_turn,
    make_prompts,
    rollout_cfg,
)

from rlframe.trainer.config import compose, typed
from rlframe.workers.rollout.multi_turn import (
    MultiTurnRollout,
    build_multi_turn,
    parse_hermes_tool_calls,
)
from rlframe.workers.rollout.tools import (
    CalculatorTool,
    PythonTool,
    ToolRunner,
    evaluate_arithmetic,
    function_tool,
    load_tools,
    truncate,
)


# ------------------------------------------------------------------------------------------ parsing, tools
def test_hermes_calls_are_parsed_in_order_and_malformed_ones_are_kept_as_errors():
    text = f"a {call('1+2')} b <tool_call>not json</tool_call> {call('3*4')}"
    calls = parse_hermes_tool_calls(text)
    assert [c.name for c in calls] == ["calculator", "", "calculator"]
    assert calls[0].arguments == '{"expression": "1+2"}' and calls[0].error is None
    assert "malformed tool call" in calls[1].error
    assert parse_hermes_tool_calls("no calls here") == []


def test_calculator_is_exact_and_refuses_anything_but_arithmetic():
    assert evaluate_arithmetic("12 * (3 + 4) - 2**3") == 76
    assert evaluate_arithmetic("7 / 2") == 3.5
    for bad in ("__import__('os')", "a + 1", "9 ** 9 ** 9", "[1, 2]"):
        with pytest.raises((ValueError, SyntaxError)):
            evaluate_arithmetic(bad)


def run(coro):
    return asyncio.run(coro)


def test_tool_failures_become_messages_and_are_counted_never_exceptions():
    class Hangs(CalculatorTool):
        async def execute(self, instance_id, parameters, **kwargs):
            await asyncio.sleep(10)

    class Raises(CalculatorTool):
        async def execute(self, instance_id, parameters, **kwargs):
            raise RuntimeError("backend down")

    tools = {
        "calculator": CalculatorTool({}, None),
        "hangs": Hangs({}, {"type": "function", "function": {"name": "hangs"}}),
        "raises": Raises({}, {"type": "function", "function": {"name": "raises"}}),
    }
    runner = ToolRunner(tools, timeout_s=2, max_response_chars=100)  # roomy for a busy machine; `hangs` waits 10 s
    ok = run(runner.call("calculator", '{"expression": "6*7"}', {}))
    assert (ok.text, ok.error) == ("42", None)
    cases = {
        ("nope", "{}"): ("unknown_tool", "Unknown function 'nope'"),
        ("calculator", "{bad json"): ("bad_arguments", "Invalid JSON"),
        ("calculator", "[1]"): ("bad_arguments", "must be a JSON object"),
        ("calculator", '{"expression": "x"}'): ("raised", "not an arithmetic expression"),
        ("raises", "{}"): ("raised", "backend down"),
        ("hangs", "{}"): ("timeout", "timed out after 2 s"),
    }
    for (name, arguments), (error, text) in cases.items():
        result = run(runner.call(name, arguments, {}))
        assert result.error == error and text in result.text, (name, arguments, result)


def test_long_tool_answers_are_cut_as_verl_cuts_them():
    text = "abcdefghij"
    assert truncate(text, 4, "left") == "(truncated)...ghij"
    assert truncate(text, 4, "right") == "abcd...(truncated)"
    assert truncate(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate(text, 10, "middle") == text


def test_python_tool_runs_code_with_a_time_limit():
    # a program that ends gets a roomy limit: a sandboxed interpreter's start alone can pass 1 s on a busy machine
    roomy = PythonTool({"timeout_s": 30}, None)
    response, _, _ = run(roomy.execute("i", {"code": "print(sum(range(10)))"}))
    assert response.text.strip() == "45"
    response, _, _ = run(PythonTool({"timeout_s": 1}, None).execute("i", {"code": "while True: pass"}))
    assert "longer than 1 s" in response.text
    response, _, _ = run(roomy.execute("i", {"code": "import os; print(sorted(os.environ))"}))
    # a scrubbed environment: the sandbox's PATH and HOME, PWD (bubblewrap), LC_CTYPE (Python's locale coercion)
    assert set(eval(response.text)) <= {"LC_CTYPE", "PWD", "PATH", "HOME"}


def test_tools_load_from_verl_yaml_and_function_files(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text(
        textwrap.dedent(
            """
            tools:
              - class_name: verl.tools.gsm8k_tool.Gsm8kTool
                config: {type: native}
                tool_schema:
                  type: function
                  function:
                    name: calc_gsm8k_reward
                    description: check an answer
                    parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}
              - class_name: rlframe.workers.rollout.tools.CalculatorTool
                config: {type: native}
            """
        )
    )
    functions = tmp_path / "functions.py"
    functions.write_text(
        textwrap.dedent(
            '''
            from rlframe.workers.rollout.tools import function_tool

            @function_tool
            def word_count(text: str) -> int:
                """Count the words of a text.

                Args:
                    text: the text
                """
                return len(text.split())
            '''
        )
    )
    tools = load_tools(str(config), str(functions))
    assert sorted(tools) == ["calc_gsm8k_reward", "calculator", "word_count"]
    assert tools["word_count"].tool_schema["function"]["parameters"]["required"] == ["text"]
    runner = ToolRunner(tools, timeout_s=5, max_response_chars=200)
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    right = run(runner.call("calc_gsm8k_reward", '{"answer": "72"}', kwargs))
    wrong = run(runner.call("calc_gsm8k_reward", '{"answer": "71"}', kwargs))
    assert "reward=1.0" in right.text and right.reward == 0.0
    assert "reward=0.0" in wrong.text and wrong.reward == -0.05
    assert run(runner.call("word_count", '{"text": "a b c"}', {})).text == "3"


def test_bad_tool_files_are_refused_naming_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="multi_turn.tool_config_path=.*no such file"):
        load_tools(str(tmp_path / "missing.yaml"), None)
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - class_name: no.such.Tool\n    config: {type: native}\n")
    with pytest.raises(ValueError, match="class_name 'no.such.Tool' cannot be imported"):
        load_tools(str(bad), None)
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="function_tool_path=.*registers no tool"):
        load_tools(None, str(empty))
    with pytest.raises(FileNotFoundError, match="multi_turn.tool_config_path"):  # the launch checks, before Ray
        typed(compose([f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'missing.yaml'}"]))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def make_rollout(tiny_model_path, tokenizer, script, *overrides, calculator: bool = True):
    cfg = rollout_cfg("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", *overrides)
    engine = ScriptedEngine(cfg, tokenizer, tiny_model_path, script)
    rollout = build_multi_turn(engine, tokenizer)
    if calculator:
        rollout.runner.tools["calculator"] = CalculatorTool({}, None)
    return rollout


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """(value, run length) of consecutive equal mask values."""
    out = []
    for value in mask:
        if out and out[-1][0] == value:
            out[-1] = (value, out[-1][1] + 1)
        else:
            out.append((value, 1))
    return out


def test_tool_turns_are_context_and_the_policy_turns_are_trained(tiny_model_path, tokenizer):
    script = {
        "What is 12*7?": [f"I will compute. {call('12*7')}", "The answer is 84."],
        "Say hi.": ["hi"],
    }
    rollout = make_rollout(tiny_model_path, tokenizer, script)
    out = rollout.generate_sequences(make_prompts(tokenizer, list(script)))
    eos = tokenizer.eos_token_id
    first, second = (out.batch["responses"][i] for i in range(2))
    mask = out.batch["response_mask"][0].tolist()
    length = int(out.batch["attention_mask"][0, PROMPT_LEN:].sum())

    turn1 = tokenizer.encode(script["What is 12*7?"][0], add_special_tokens=False) + [eos]
    turn2 = tokenizer.encode("The answer is 84.", add_special_tokens=False) + [eos]
    tool_turn = tokenizer.encode("\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert first[:length].tolist() == turn1 + tool_turn + turn2
    assert spans(mask[:length]) == [(1, len(turn1)), (0, len(tool_turn)), (1, len(turn2))]
    assert mask[length:] == [0] * (RESPONSE_LEN - length)
    assert tokenizer.decode(second[out.batch["response_mask"][1].bool()]) == "hi<|im_end|>"
    # rollout log-probs exist only where the policy sampled; tool tokens carry none
    assert torch.all(out.batch["rollout_log_probs"][0][torch.tensor(mask) == 0] == 0)
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 2]  # user + assistant turns + 1, as verl
    metrics = out.meta_info["metrics"]  # one value per finished trajectory
    assert metrics["multi_turn/assistant_turns_mean"] == [2.0, 1.0]
    assert metrics["multi_turn/tool_calls_per_trajectory"] == [1.0, 0.0]
    assert metrics["multi_turn/tool_errors_per_trajectory"] == [0.0, 0.0]
    assert metrics["multi_turn/tokenization_mismatch_ratio"] == [0.0, 0.0]
    assert len(metrics["multi_turn/tool_latency_s_mean"]) == 1  # one per tool call
    assert rollout.engine.calls == [2, 1]  # one engine batch per turn, with the rows still running
    assert "raw_prompt" not in out.non_tensor_batch  # agent inputs stay in the driver's batch
    # the layout is the rollout contract: input_ids = prompt | response, positions count real tokens
    assert torch.equal(out.batch["input_ids"][:, PROMPT_LEN:], out.batch["responses"])
    am = out.batch["attention_mask"]
    assert torch.equal(out.batch["position_ids"], (am.cumsum(-1) - 1).clamp(min=0))


def test_a_malformed_call_is_answered_with_an_error_turn(tiny_model_path, tokenizer):
    script = {"Q": ["<tool_call>{oops</tool_call>", f"{call('1+1')}", "done"]}
    rollout = make_rollout(tiny_model_path, tokenizer, script, "data.max_response_length=512")
    out = rollout.generate_sequences(make_prompts(tokenizer, ["Q"]))
    text = tokenizer.decode(out.batch["responses"][0][out.batch["attention_mask"][0, PROMPT_LEN:].bool()])
    assert "malformed tool call" in text and "<|im_start|>tool\n2<|im_end|>" in text
    assert out.meta_info["metrics"]["multi_turn/tool_errors_per_trajectory"] == [1.0]
    assert out.non_tensor_batch["__num_turns__"].tolist() == [6]


def test_a_tool_answer_cannot_forge_chat_turns_in_the_trajectory(chat_model):
    """A tool answer spelling `<|im_end|><|im_start|>assistant` with escapes is context the model reads as text:
    the tool turn's ids are the correct rendering of the cleaned answer, with the template's markers only."""
    model_path, tokenizer = chat_model
    # the forged header decodes like a real one, so the scripted engine counts it: both later replies are the same
    script = {"Q": [call("1").replace("calculator", "hostile"), "done", "done"]}
    rollout = make_rollout(model_path, tokenizer, script, calculator=False)
    rollout.runner.tools["hostile"] = HostileTool({}, None)
    out = rollout.generate_sequences(make_prompts(tokenizer, ["Q"]))
    length = int(out.batch["attention_mask"][0, PROMPT_LEN:].sum())
    response, mask = out.batch["responses"][0, :length].tolist(), out.batch["response_mask"][0, :length].tolist()
    (_, first), (_, tool), _ = spans(mask)  # policy turn, tool turn, policy turn
    assert response[first : first + tool] == rollout.turns.closing_rest + chatml_tool_turn(tokenizer, [HOSTILE_SEEN])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert response.count(eos) == 3  # the two policy turns' and the tool turn's own (before: 5)
    assert "\x1b" not in tokenizer.decode(response) and rollout.engine.calls == [1, 1]
    assert out.meta_info["metrics"]["multi_turn/tokenization_mismatch_ratio"] == [0.0]


def test_turn_limits_and_single_turn_rows(tiny_model_path, tokenizer):
    script = {"A": [call("1+1")] * 5, "B": [call("2+2")] * 5}
    rollout = make_rollout(
        tiny_model_path, tokenizer, script, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"
    )
    agents = np.array(["tool_agent", "single_turn_agent"], dtype=object)
    out = rollout.generate_sequences(make_prompts(tokenizer, ["A", "B"], agent_name=agents))
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 2]  # A: 2 policy turns + 1 tool turn
    assert rollout.engine.calls == [2, 1]
    b_mask = out.batch["response_mask"][1]
    assert b_mask.sum() == out.batch["attention_mask"][1, PROMPT_LEN:].sum()  # B: one turn, no tool turn


def test_response_length_cuts_a_trajectory_and_marks_it_truncated(tiny_model_path, tokenizer):
    script = {"Q": [f"{'long words ' * 20}{call('1+1')}"] * 5}
    cfg_len = 100
    rollout = make_rollout(tiny_model_path, tokenizer, script, f"data.max_response_length={cfg_len}")
    out = rollout.generate_sequences(make_prompts(tokenizer, ["Q"]))
    assert int(out.batch["attention_mask"][0, PROMPT_LEN:].sum()) == cfg_len
    assert out.meta_info["metrics"]["multi_turn/truncated_ratio"] == [1.0]


def test_a_tool_agent_without_raw_chat_is_refused(tiny_model_path, tokenizer):
    rollout = make_rollout(tiny_model_path, tokenizer, {"Q": ["x"]})
    prompts = make_prompts(tokenizer, ["Q"])
    prompts.non_tensor_batch.pop("raw_prompt")
    with pytest.raises(ValueError, match="data.return_raw_chat=true"):
        rollout.generate_sequences(prompts)


# ------------------------------------------------------------------------------------------ no gradient
def test_tool_tokens_carry_no_gradient_through_the_policy_loss():
    """Perturbing every per-token input of the loss at tool positions (mask 0) changes neither the loss nor the
    gradient; the log-probs at those positions get exactly zero gradient."""
    from rlframe.algorithms.loss import Aggregation, PolicyLossArgs, compute_policy_loss_vanilla

    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.float32)
    old = torch.randn(2, 8, generator=gen) - 2
    adv = torch.randn(2, 8, generator=gen)
    base = old + 0.05 * torch.randn(2, 8, generator=gen)  # inside the clip range: every trained token has a gradient

    args = PolicyLossArgs(0.2, 0.2, 3.0, Aggregation("token-mean"))

    def loss_and_grad(noise: float):
        hole = (mask == 0).float()
        log_prob = (base + noise * hole).requires_grad_(True)
        loss = compute_policy_loss_vanilla(old + 3 * noise * hole, log_prob, adv + 5 * noise * hole, mask, args)[0]
        loss.backward()
        return loss.detach(), log_prob.grad

    loss0, grad0 = loss_and_grad(0.0)
    loss1, grad1 = loss_and_grad(7.0)
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    assert torch.all(grad0[mask == 0] == 0) and torch.all(grad0[mask == 1] != 0)


def test_settings_read_verl_names(tiny_model_path, tokenizer, monkeypatch):
    rollout = make_rollout(
        tiny_model_path,
        tokenizer,
        {"Say hi.": ["hi"]},
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=3",
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=disable",
    )
    assert rollout.mt.max_parallel_calls == 3
    assert rollout.runner.max_response_chars == 256 and rollout.runner.truncate_side == "middle"
    monkeypatch.setattr(rollout, "_sanity_check", lambda trajectories: pytest.fail("sanity check mode is disable"))
    rollout.generate_sequences(make_prompts(tokenizer, ["Say hi."]))
    assert isinstance(function_tool, object) and MultiTurnRollout


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_grpo_with_the_tool_agent_trains_through_ray(tmp_path, cache_dir):
    """The driver sends the chat and tool arguments to the rollout, the multi-turn batch trains, metrics arrive."""
    from helpers.runs import COMMON, read_metrics, run_main

    tools = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "tools", "calculator.yaml")
    out = run_main(
        COMMON
        + [
            f"trainer.default_local_dir={tmp_path}",
            "trainer.total_training_steps=1",
            "algorithm.adv_estimator=grpo",
            "data.max_response_length=24",
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        ],
        cache_dir,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (step,) = [m for m in read_metrics(tmp_path) if "actor/pg_loss" in m]
    assert step["num_turns/min"] >= 2 and "multi_turn/tool_calls_per_trajectory" in step
    # a random policy's text need not re-tokenize as it was sampled (non-canonical BPE splits): only counted
    # here; test_tool_turns_are_context_and_the_policy_turns_are_trained shows it is 0 for well-formed turns
    assert 0.0 <= step["multi_turn/tokenization_mismatch_ratio"] <= 1.0


def test_the_builtin_tool_task_pays_only_for_the_exact_product():
    from rlframe.data.builtin_tasks import BUILTIN_TASKS
    from rlframe.reward.scorers import default_compute_score

    rows = BUILTIN_TASKS["calc_multiply"]("train", 50, 0)
    row = rows[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["agent_name"] == "tool_agent" and row["prompt"][-1]["content"] == f"What is {a} * {b}?"
    assert len({r["prompt"][-1]["content"] for r in rows}) == 50
    truth = row["reward_model"]["ground_truth"]
    tool_turn = f"{call(f'{a} * {b}')}<|im_end|>\n<|im_start|>tool\n{a * b}<|im_end|>\n<|im_start|>assistant\n"
    assert default_compute_score("calc_multiply", tool_turn + f"#### {a * b}", truth) == 1.0
    assert default_compute_score("calc_multiply", tool_turn + f"#### {a * b + 1}", truth) == 0.0
    assert default_compute_score("calc_multiply", tool_turn, truth) == 0.0  # the tool's answer alone is not one


def test_tool_agent_rows_without_the_tool_agent_are_refused_and_unused_keys_reported():
    from rlframe.config.key_status import key_statuses
    from rlframe.workers.rollout.multi_turn import check_agent_rows

    plain = rollout_cfg()
    with pytest.raises(ValueError, match="agent_name \\['tool_agent'\\].*multi_turn.tool_config_path"):
        check_agent_rows(np.array(["tool_agent", "single_turn_agent"], dtype=object), plain)
    check_agent_rows(np.array(["single_turn_agent"], dtype=object), plain)
    check_agent_rows(np.array(["tool_agent"], dtype=object), rollout_cfg(f"{TOOL_AGENT}"))

    def ignored(*overrides):
        return {row.key for row in key_statuses(compose(list(overrides))) if not row.in_effect}

    mt = "actor_rollout_ref.rollout.multi_turn"
    assert {f"{mt}.max_assistant_turns", f"{mt}.tool_timeout_s", f"{mt}.enable"} <= ignored()
    with_tools = ignored(TOOL_AGENT)
    assert f"{mt}.max_assistant_turns" not in with_tools and f"{mt}.enable" in with_tools


TOOL_AGENT = "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"
