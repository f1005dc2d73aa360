"""The calculator agent again, written with a framework: the OpenAI Agents SDK (`pip install openai-agents`), whose
chat-completions model takes any OpenAI-compatible server. rlframe trains the model under it exactly as under
`calculator_agent.py` (`actor_rollout_ref.rollout.agent.openai_agent.path=agents_sdk_agent.py`,
`...openai_agent.name=run_agent`; docs/agents.md): the SDK's requests reach the endpoint, which records them.
"""

import importlib.util
from pathlib import Path

import openai
from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

# rlframe loads an agent file by its path, so its folder is not importable: take the expression evaluator and the
# turn limit from the sibling file by path too
_spec = importlib.util.spec_from_file_location("calculator_agent", Path(__file__).with_name("calculator_agent.py"))
_calculator_agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_calculator_agent)
MAX_TURNS, calculate = _calculator_agent.MAX_TURNS, _calculator_agent.calculate


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: e.g. 123 * 45
    """
    return calculate(expression)


async def run_agent(base_url: str, sample: dict):
    """Answer the row's question, calling the calculator as the model asks; the reward function scores the answer."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = Agent(name="solver", tools=[calculator], model=model)
    # the SDK's traces go to OpenAI's servers unless disabled; the row's messages are the first request's input
    run_config = RunConfig(tracing_disabled=True)
    try:
        await Runner.run(agent, list(sample["prompt"]), max_turns=MAX_TURNS, run_config=run_config)
    except MaxTurnsExceeded:
        pass  # the model kept calling the calculator: score what it wrote
    except openai.BadRequestError as error:
        if error.code != "context_length_exceeded":
            raise  # the conversation is as long as training allows: score what there is
    return None
