"""An agent written only against the `openai` package: a calculator tool in the OpenAI tools format, called until
the model answers. rlframe trains the model under it (`actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent`,
docs/agents.md); the same function runs against any OpenAI-compatible server.
"""

import ast
import json
import operator

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 123 * 45"}},
            "required": ["expression"],
        },
    },
}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_TURNS = 3


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or what is wrong with it."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as error:
        return f"error: {error}"


async def run_agent(base_url: str, sample: dict):
    """Answer the row's question, calling the calculator as the model asks; the reward function scores the answer."""
    api = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = list(sample["prompt"])
    for _ in range(MAX_TURNS):
        try:
            answer = await api.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        except openai.BadRequestError as error:
            if error.code == "context_length_exceeded":
                break  # the conversation is as long as training allows: score what there is
            raise
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
    return None
