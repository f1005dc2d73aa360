"""Rollout engines: prompts in, responses out, inside the worker processes that train.

`build_rollout` builds the engine named by `actor_rollout_ref.rollout.name` from its declaration in the
registry (`registry.py`: one `EngineSpec` per engine module, keyed by `(name, mode)`); every engine and wrapper
implements the same contract (`base.Rollout`). `rollout.mode=async` (the default) wraps the engine
in agent loops that drive it as a rollout server (`agent_loop.py`); `sync` generates the batch at once.
`generate_in_tp_group` is the worker-side step around it: gather the TP group's prompts, generate once
for the group with a shared RNG seed, and keep this rank's share.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from rlframe.config.keys import ROLLOUT
from rlframe.protocol import DataProto, all_gather_data_proto
from rlframe.workers.rollout import hf_rollout, sglang_rollout, vllm_rollout
from rlframe.workers.rollout.agent_loop import AgentLoopRollout
from rlframe.workers.rollout.base import (
    SEED_KEY,
    BaseRollout,
    Rollout,
    ServedModel,
    build_rollout_output,
    call_seed,
    check_prompts,
    response_metrics,
    seeded,
)
from rlframe.workers.rollout.config import RolloutConfig, uses_tool_agent
from rlframe.workers.rollout.multi_turn import build_multi_turn
from rlframe.workers.rollout.openai_agent import OpenAIAgents
from rlframe.workers.rollout.registry import engine_for, register
from rlframe.workers.rollout.sampling import SamplingParams
from rlframe.workers.rollout.tp import group_rank_and_size

# the built-in engines, one line each (an engine is a module exporting an `EngineSpec`; docs/rollout.md)
register(hf_rollout.SPEC)
register(vllm_rollout.SPEC)
register(sglang_rollout.SPEC)

__all__ = [
    "BaseRollout",
    "Rollout",
    "SamplingParams",
    "ServedModel",
    "build_rollout",
    "build_rollout_output",
    "check_prompts",
    "generate_in_tp_group",
    "run_in_tp_group",
]


def build_rollout(
    name: str,
    cfg: RolloutConfig,
    model: ServedModel | str,
    tokenizer,
    device_type: str,
    tp_group=None,
    *,
    chat_template_kwargs: dict | None = None,
) -> Rollout:
    """Build the engine `name` from the rollout's section `cfg` (`actor_rollout_ref.rollout`) for one worker process.

    `tp_group` is this rank's tensor-parallel process group (size `tensor_model_parallel_size`);
    None means TP=1. Initial weights are read from `model` (a `ServedModel`, or just its path); later ones
    come through `update_weights`. `model.lora_rank > 0` (a LoRA actor) sets vLLM up to serve its adapter;
    the HF and SGLang engines take merged weights and need nothing. `chat_template_kwargs`
    (`data.apply_chat_template_kwargs`) renders the turns of multi-turn rollouts.
    """
    spec = engine_for(name, str(cfg.mode))
    model = ServedModel(model) if isinstance(model, str) else model
    rollout = spec.build(cfg, model, tokenizer, device_type, tp_group)
    if rollout.vision is not None and not spec.capabilities.images:
        raise ValueError(f"{model.path} is a vision-language model, which {ROLLOUT}.name={name} cannot generate for")
    multi_turn = None
    if uses_tool_agent(cfg):  # rows may call tools: the multi-turn logic drives the engine
        multi_turn = build_multi_turn(rollout, tokenizer, chat_template_kwargs)
    openai_agents = None
    if cfg.agent.default_agent_loop == "openai_agent":  # the user's agent, through the OpenAI endpoint
        openai_agents = OpenAIAgents(rollout, tokenizer, chat_template_kwargs)
    if str(cfg.mode) == "async":  # agent loops on a rollout server (agent_loop.py, server.py)
        return AgentLoopRollout(rollout, int(cfg.agent.num_workers), multi_turn, openai_agents)
    return multi_turn or rollout  # sync: the whole batch at once (tool rows turn by turn)


def generate_in_tp_group(rollout: Rollout, prompts: DataProto, tp_group=None, keep_seeds: bool = False) -> DataProto:
    """Generate this rank's prompts together with its TP peers' and return this rank's share.

    Every TP rank must run the engine on identical input with identical RNG state (TP shards one
    model; different tokens would corrupt the all-reduces and different stopping steps would hang
    them). So the group's prompts are all-gathered in rank order (`run_in_tp_group`), and generation runs
    under a seed drawn by TP rank 0 (`call_seed`, with the group's DP index). With no group (TP=1) the same
    seeding applies. `keep_seeds`: the rows' sample seeds, drawn under that seed as the engine would draw
    them, come back in the rows (`SEED_KEY`), for a continuation of a row cut later (the rollout pool).
    """
    rank, size = group_rank_and_size(tp_group)
    dp_index = dist.get_rank() // size if dist.is_initialized() else 0
    seed = call_seed(dp_index)
    if size > 1:
        shared = [seed]
        dist.broadcast_object_list(shared, group_src=0, group=tp_group)
        seed = shared[0]

    def generate(rows: DataProto) -> DataProto:
        with seeded(seed):
            if keep_seeds:
                rows.non_tensor_batch[SEED_KEY] = np.array(rollout.sample_seeds(len(rows)), dtype=object)
            return rollout.generate_sequences(rows)

    output, share = run_in_tp_group(generate, prompts, tp_group)
    if size == 1:
        return share
    # length statistics describe this rank's share; timing and throughput the group's generation
    metrics = dict(output.meta_info["metrics"])
    eos_ids, _ = rollout.special_tokens_for(prompts.meta_info)
    metrics.update(response_metrics(share.batch["response_mask"], share.batch["responses"], eos_ids))
    share.meta_info = {"metrics": metrics}
    return share


def run_in_tp_group(run, rows: DataProto, tp_group=None) -> tuple[DataProto, DataProto]:
    """(`run` of the TP group's rows, all-gathered in rank order; this rank's share of it). Every rank of the group
    calls it, so the engine runs on identical input on every TP rank; without a group, both are `run(rows)`."""
    rank, size = group_rank_and_size(tp_group)
    if size == 1:
        output = run(rows)
        return output, output
    counts = [None] * size
    dist.all_gather_object(counts, len(rows), group=tp_group)
    output = run(all_gather_data_proto(rows, tp_group))
    start = sum(counts[:rank])
    return output, output.select_idxs(slice(start, start + counts[rank]))
