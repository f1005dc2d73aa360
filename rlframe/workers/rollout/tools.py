"""Tools a policy can call during a multi-turn rollout, loaded the way verl's configs name them.

Two kinds, as in verl 0.9.1:

- **Class tools** (`rollout.multi_turn.tool_config_path`, verl's YAML: a `tools:` list of `class_name`,
  `config`, `tool_schema`): a class with verl's lifecycle — `create(instance_id, create_kwargs=...)`,
  `execute(instance_id, parameters) -> (response, step reward, metrics)`, `calc_reward`, `release`. Per-row
  arguments come from the dataset's `extra_info.tools_kwargs[tool_name]` (`create_kwargs`, ...).
  verl's own demo classes are mapped to rlframe's equivalents (`VERL_CLASS_EQUIVALENTS`).
- **Function tools** (`rollout.multi_turn.function_tool_path`, a Python file): plain functions decorated
  with `@function_tool`; the JSON schema comes from the type hints and the Google-style docstring
  (transformers' `get_json_schema`, the same source as verl).

`ToolRunner.call` runs one parsed call: an unknown tool, arguments that are not a JSON object, a tool that
raises or that runs past `timeout_s` each become an error *message to the model* (and a count in the
metrics), never an exception that stops the run. Every answer loses its ANSI escapes and shows its other control
characters as escapes (`tool_text.visible_text`). Long outputs are cut to `max_tool_response_length`
characters on `tool_response_truncate_side` (left | middle | right), as verl does.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import operator
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlframe.workers.rollout.sandbox import SandboxLimits, resolve_isolation, run_python
from rlframe.workers.rollout.tool_text import visible_text

TOOL_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
FUNCTION_TOOL_KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"


@dataclass
class ToolResponse:
    """What a tool gives back to the conversation (text only: rlframe trains text models)."""

    text: str = ""


@dataclass
class ToolCallResult:
    """One executed call: the text the model will read, the tool's step reward, and what went wrong."""

    text: str
    reward: float = 0.0
    error: str | None = None  # unknown_tool | bad_arguments | raised | timeout
    latency_s: float = 0.0


def string_function_schema(name: str, description: str, parameter: str, parameter_description: str) -> dict:
    """The OpenAI function schema of a tool that takes one required string parameter."""
    properties = {parameter: {"type": "string", "description": parameter_description}}
    parameters = {"type": "object", "properties": properties, "required": [parameter]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


class BaseTool:
    """verl's tool lifecycle; subclass and override `execute` (and `create`/`calc_reward`/`release`)."""

    def __init__(self, config: dict, tool_schema: dict | None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or self.default_schema()
        if not self.tool_schema:
            raise ValueError(f"{type(self).__name__}: no tool_schema given and the class has no default_schema()")
        self.name = self.tool_schema["function"]["name"]

    def default_schema(self) -> dict | None:
        """The OpenAI function schema used when the config gives none."""
        return None

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[Any, float, dict]:
        raise NotImplementedError(f"{type(self).__name__}.execute")

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


@dataclass
class FunctionTool:
    """A plain (sync or async) function exposed as a tool; stateless, no lifecycle."""

    name: str
    fn: Callable[..., Any]
    tool_schema: dict

    async def call(self, parameters: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**parameters)
        return await asyncio.to_thread(self.fn, **parameters)


_FUNCTION_TOOLS: dict[str, FunctionTool] = {}


def function_tool(name: str | Callable | None = None, *, schema: dict | None = None):
    """Register a function as a tool: `@function_tool`, `@function_tool("name")` or with an explicit `schema`.

    Without `schema` the function needs type hints and a Google-style docstring with an `Args:` block.
    """

    def register(fn: Callable, tool_name: str | None) -> Callable:
        if schema is not None:
            built = schema
        else:
            from transformers.utils import get_json_schema

            built = get_json_schema(fn)
        tool_name = tool_name or built["function"]["name"]
        built = {**built, "function": {**built["function"], "name": tool_name}}
        _FUNCTION_TOOLS[tool_name] = FunctionTool(tool_name, fn, built)
        return fn

    if callable(name):
        return register(name, None)
    return lambda fn: register(fn, name)


# ----------------------------------------------------------------------------------------- built-in tools
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_RESULT_BITS = 4096  # default cap on every integer an expression computes (about 1,233 decimal digits)
MAX_EXPRESSION_CHARS = 2000  # with the bit cap, bounds the time of one evaluation
# nesting depth: an explicit bound, not Python's recursion limit, which other libraries of the process may raise
MAX_NESTING = 500  # under the default recursion limit (1000) with room for the caller's frames


def evaluate_arithmetic(expression: str, max_bits: int = MAX_RESULT_BITS) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); anything else raises.

    Every intermediate integer is bounded: its size is estimated *before* it is computed (`(2**64)**64` would
    otherwise allocate gigabytes and hold the thread for seconds), and an expression that would pass `max_bits`
    is refused. Floats overflow to an OverflowError on their own.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(expression)} characters is too long (at most {MAX_EXPRESSION_CHARS})")

    def value(node: ast.AST, depth: int):
        if depth > MAX_NESTING:
            raise RecursionError
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return _bounded(node.value, _bits(node.value), max_bits)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left, depth + 1), value(node.right, depth + 1)
            _bounded(None, _result_bits(node.op, left, right), max_bits)
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand, depth + 1))
        raise ValueError(f"not an arithmetic expression: {ast.unparse(node)!r}")

    try:
        return value(ast.parse(expression.strip(), mode="eval").body, 0)
    except RecursionError:  # ours past MAX_NESTING, or the parser's own
        raise ValueError(f"expression is nested too deeply (more than {MAX_NESTING} levels)") from None


def _bits(number: int | float) -> int:
    return abs(number).bit_length() if isinstance(number, int) else 0


def _result_bits(op: ast.operator, left: int | float, right: int | float) -> int:
    """An upper bound on the bit length of `left op right` when both are integers (0 when the result is a float)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0
    if isinstance(op, (ast.Add, ast.Sub)):
        return max(_bits(left), _bits(right)) + 1
    if isinstance(op, ast.Mult):
        return _bits(left) + _bits(right)
    if isinstance(op, ast.Pow):
        if right < 0 or abs(left) <= 1:
            return 1  # a float, or 0 / 1 / -1
        return int(min(right, 2**62) * math.log2(abs(left))) + 1  # |left| >= 2: 2**62 is past any cap
    return max(_bits(left), _bits(right))  # / // %: never larger than the larger operand


def _bounded(number, bits: int, max_bits: int):
    if bits > max_bits:
        raise ValueError(f"the result would have about {bits} bits, more than the limit of {max_bits}")
    return number


class CalculatorTool(BaseTool):
    """`calculator(expression)`: evaluates arithmetic exactly (integers stay integers).

    Every integer it computes is capped at `config.max_bits` (default 4096), and it runs on a worker thread, so
    the event loop of the agent loop stays free and the tool timeout can answer.
    """

    def __init__(self, config: dict, tool_schema: dict | None):
        super().__init__(config, tool_schema)
        self.max_bits = _positive(self.config, "max_bits", MAX_RESULT_BITS, int, f"{type(self).__name__} config")

    def default_schema(self) -> dict:
        return string_function_schema(
            "calculator", "Evaluate an arithmetic expression, e.g. '(12 + 7) * 3'.", "expression", "the expression"
        )

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[Any, float, dict]:
        expression = str(parameters.get("expression", ""))
        result = await asyncio.to_thread(evaluate_arithmetic, expression, self.max_bits)
        if isinstance(result, float) and result.is_integer():
            result = int(result)
        return ToolResponse(text=str(result)), 0.0, {}


class PythonTool(BaseTool):
    """`python(code)`: runs code in a fresh isolated interpreter (`-I`, no environment, a temporary folder).

    `rlframe.workers.rollout.sandbox` contains it: as an unprivileged user (`sandbox_user` when the trainer is
    root), in bubblewrap's namespaces under a seccomp filter, in pids and memory cgroups where they can be made,
    with rlimits; the whole process tree killed on every exit path and the output read in chunks and capped. Where
    that sandbox cannot be had the tool refuses to load, unless `sandbox: none`. Keys of the tool's `config`:
    `timeout_s` (5), `memory_mb` (256), `max_output_chars` (4096), `max_processes` (64, processes + threads),
    `disk_mb` (64, the writable tmpfs), `sandbox` (auto | bwrap | none), `sandbox_user` (null: `rlframe-sandbox`
    when the trainer is root).
    """

    def __init__(self, config: dict, tool_schema: dict | None):
        super().__init__(config, tool_schema)
        where = f"{type(self).__name__} config"
        self.limits = SandboxLimits(
            timeout_s=_positive(self.config, "timeout_s", 5, float, where),
            memory_mb=_positive(self.config, "memory_mb", 256, int, where),
            max_output_bytes=4 * _positive(self.config, "max_output_chars", 4096, int, where),  # UTF-8: <= 4 B/char
            max_processes=_positive(self.config, "max_processes", 64, int, where),
            disk_mb=_positive(self.config, "disk_mb", 64, int, where),
        )
        self.max_output_chars = self.limits.max_output_bytes // 4
        user = self.config.get("sandbox_user")
        self.isolation = resolve_isolation(str(self.config.get("sandbox", "auto")), user and str(user), where)

    def default_schema(self) -> dict:
        return string_function_schema("python", "Run Python code and return what it prints.", "code", "the program")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[Any, float, dict]:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rlframe_python_tool_", ignore_cleanup_errors=True) as folder:
            folder = os.path.realpath(folder)
            result = await run_python(str(parameters.get("code", "")), folder, self.limits, self.isolation)
        output = result.output.decode("utf-8", errors="replace")
        notes = []
        if result.truncated or len(output) > self.max_output_chars:
            notes.append(f"(output truncated to {self.max_output_chars} characters)")
        if result.timed_out:
            notes.append(f"error: the program ran longer than {self.limits.timeout_s:g} s and was killed")
        elif result.out_of_memory:
            notes.append("error: the program used more memory than it may and was killed")
        elif result.exit_status:
            notes.append(f"(exit status {result.exit_status})")
        text = "\n".join([output[: self.max_output_chars], *notes]) if output else "\n".join(notes)
        return ToolResponse(text=text), 0.0, {}


def _positive(config: dict, key: str, default, kind: type, where: str):
    """`config[key]` as a positive `kind`, or a ValueError naming the key and the value."""
    value = config.get(key, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number <= 0 or isinstance(value, bool):
        raise ValueError(f"{where}: {key}={value!r} must be a positive {kind.__name__}")
    return number


class Gsm8kAnswerTool(BaseTool):
    """verl's GSM8K demo tool: the model submits an answer, the tool says whether it is right.

    Reward: the GSM8K scorer (flexible, format score 0) of `#### <answer>` against `create_kwargs.ground_truth`;
    the step reward is -0.05 when a submission does not improve on the previous one, as in verl's demo.
    """

    def __init__(self, config: dict, tool_schema: dict | None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict] = {}

    def default_schema(self) -> dict:
        return string_function_schema(
            "calc_gsm8k_reward",
            "Check an answer to the math problem (1.0 if correct, else 0.0).",
            "answer",
            "the answer, digits only",
        )

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        truth = kwargs.get("ground_truth", kwargs.get("create_kwargs", {}).get("ground_truth"))
        self._instances[instance_id] = {"answer": "", "ground_truth": truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[Any, float, dict]:
        answer = str(parameters.get("answer", ""))
        state = self._instances[instance_id]
        state["answer"] = answer if answer.startswith("#### ") else f"#### {answer}"
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        from rlframe.reward.scorers import gsm8k_score

        state = self._instances[instance_id]
        return float(gsm8k_score(state["answer"], str(state["ground_truth"]), method="flexible"))

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


BUILTIN_TOOLS = {
    "rlframe.workers.rollout.tools.CalculatorTool": CalculatorTool,
    "rlframe.workers.rollout.tools.PythonTool": PythonTool,
    "rlframe.workers.rollout.tools.Gsm8kAnswerTool": Gsm8kAnswerTool,
}
# verl's demo tool classes (verl is not a dependency) -> rlframe's tool with the same behaviour
VERL_CLASS_EQUIVALENTS = {"verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kAnswerTool}


# ----------------------------------------------------------------------------------------- loading
def _import_class(class_name: str, where: str):
    if class_name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[class_name]
    if class_name in VERL_CLASS_EQUIVALENTS:
        return VERL_CLASS_EQUIVALENTS[class_name]
    module_name, _, attr = class_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        known = sorted([*BUILTIN_TOOLS, *VERL_CLASS_EQUIVALENTS])
        raise ValueError(
            f"{where}: class_name {class_name!r} cannot be imported ({err}); give an importable "
            f"module.Class, or one of {known}"
        ) from None


def load_tool_config(path: str) -> list[BaseTool]:
    """Instantiate the tools of a verl-format tool config YAML."""
    import yaml

    where = f"{TOOL_CONFIG_KEY}={path}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where}: no such file")
    with open(path) as handle:
        spec = yaml.safe_load(handle) or {}
    entries = spec.get("tools")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a top-level `tools:` list of {{class_name, config, tool_schema}}")
    tools = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ValueError(f"{where}: tools[{index}] has no class_name")
        config = dict(entry.get("config") or {})
        kind = config.get("type", "native")
        if kind != "native":
            raise ValueError(f"{where}: tools[{index}].config.type={kind!r}; only 'native' tools are supported")
        tool_class = _import_class(str(entry["class_name"]), f"{where}: tools[{index}]")
        try:
            tools.append(tool_class(config, entry.get("tool_schema")))
        except ValueError as err:  # a bad config value: name the file and the entry
            raise ValueError(f"{where}: tools[{index}]: {err}") from None
    return tools


def load_function_tools(path: str) -> list[FunctionTool]:
    """Run a Python file and return the tools its `@function_tool` decorators registered."""
    where = f"{FUNCTION_TOOL_KEY}={path}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where}: no such file")
    before = set(_FUNCTION_TOOLS)
    name = "rlframe_function_tools_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    found = [tool for key, tool in _FUNCTION_TOOLS.items() if key not in before or tool.fn.__module__ == name]
    if not found:
        raise ValueError(f"{where}: the file registers no tool; decorate functions with @function_tool")
    return found


def load_tools(tool_config_path: str | None, function_tool_path: str | None) -> dict[str, BaseTool | FunctionTool]:
    """Every configured tool by name; two tools with one name are refused."""
    tools: list = []
    if tool_config_path:
        tools += load_tool_config(tool_config_path)
    if function_tool_path:
        tools += load_function_tools(function_tool_path)
    by_name: dict[str, BaseTool | FunctionTool] = {}
    for tool in tools:
        if tool.name in by_name:
            raise ValueError(
                f"two tools are named {tool.name!r} ({TOOL_CONFIG_KEY} / {FUNCTION_TOOL_KEY}); names must be unique"
            )
        by_name[tool.name] = tool
    return by_name


# ----------------------------------------------------------------------------------------- running
def truncate(text: str, limit: int, side: str) -> str:
    """verl's cut of a long tool response: keep `limit` characters on the given side(s)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


@dataclass
class ToolRunner:
    """Executes parsed tool calls for one trajectory's turn, turning every failure into a message."""

    tools: dict[str, BaseTool | FunctionTool]
    timeout_s: float
    max_response_chars: int
    truncate_side: str = "middle"
    stats: dict[str, float] = field(default_factory=dict)

    async def call(self, name: str, arguments: str, tools_kwargs: dict) -> ToolCallResult:
        """Run one call; never raises for the tool's or the model's mistakes."""
        start = time.perf_counter()
        result = await self._call(name, arguments, tools_kwargs)
        result.latency_s = time.perf_counter() - start
        # cleaned before the cut, so the limit bounds the text the model reads
        result.text = truncate(visible_text(result.text), self.max_response_chars, self.truncate_side)
        return result

    async def _call(self, name: str, arguments: str, tools_kwargs: dict) -> ToolCallResult:
        tool = self.tools.get(name)
        if tool is None:
            known = sorted(self.tools)
            return ToolCallResult(f"Unknown function {name!r}. Available tools: {known}", error="unknown_tool")
        try:
            parameters = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as err:
            return ToolCallResult(f"Invalid JSON in arguments for {name!r}: {err}", error="bad_arguments")
        if not isinstance(parameters, dict):
            return ToolCallResult(f"Arguments for {name!r} must be a JSON object", error="bad_arguments")
        try:
            return await asyncio.wait_for(self._execute(tool, parameters, tools_kwargs.get(name, {})), self.timeout_s)
        except asyncio.TimeoutError:
            return ToolCallResult(f"Error: tool {name!r} timed out after {self.timeout_s:g} s", error="timeout")
        except Exception as err:  # the tool's own bug or a bad argument value: the model reads it
            return ToolCallResult(f"Error executing tool {name!r}: {type(err).__name__}: {err}", error="raised")

    @staticmethod
    async def _execute(tool, parameters: dict, kwargs: dict) -> ToolCallResult:
        if isinstance(tool, FunctionTool):
            raw = await tool.call(parameters)
            return ToolCallResult(raw.text if isinstance(raw, ToolResponse) else str(raw))
        instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
        try:
            response, reward, _ = await tool.execute(instance_id, parameters, **kwargs.get("execute_kwargs", {}))
        finally:
            await tool.release(instance_id)
        text = response.text if isinstance(response, ToolResponse) else str(response)
        return ToolCallResult(text or "", float(reward or 0.0))
