"""Engines plug in by registry: a toy engine declared and registered in this module alone runs through the config
checks, the rollout worker and the hybrid worker's generation step, and no code outside the engine modules and the
registry compares `rollout.name` with an engine's name (it asks the engine's declaration instead)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers.rollout import PROMPT_LEN, RESPONSE_LEN, load_tokenizer, make_prompts, one_process_rollout_worker

from rlframe.workers.rollout.base import VERSIONS_KEY, BaseRollout, Generated, Stop
from rlframe.workers.rollout.registry import engine_for, engine_names, register, unregister
from rlframe.workers.rollout.spec import Capabilities, EngineSpec

ROOT = Path(__file__).resolve().parents[3]
ROLLOUT = "actor_rollout_ref.rollout"
FIXED = [7, 8, 9]  # every response: these tokens, then EOS


# ------------------------------------------------------------------ the toy engine: one class, one declaration
class ToyRollout(BaseRollout):
    """Answers every prompt with FIXED and EOS, whatever the weights; counts the weight pushes it receives."""

    def __init__(self, config, served, tokenizer, device_type: str, tp_group=None):
        super().__init__(config, served, tokenizer, device_type, tp_group)
        self.weight_pushes = 0

    def _generate(self, prompts, params, eos_ids, pad_id, seeds):
        row = (FIXED + [eos_ids[0]])[: params.response_length]
        tokens = torch.tensor([row] * len(prompts), dtype=torch.long)
        stops = torch.full((len(prompts),), int(Stop.EOS), dtype=torch.int8)
        return Generated(tokens, torch.full((len(prompts),), len(row)), torch.zeros(tokens.shape), stops)

    def update_weights(self, named_tensors) -> None:
        for _ in named_tensors:
            pass
        self.weight_pushes += 1


TOY = EngineSpec(name="toy", build=ToyRollout, capabilities=Capabilities(images=False, tensor_parallel=False))


@pytest.fixture()
def toy_engine():
    register(TOY)
    yield TOY
    unregister("toy")


def expected_responses(num_rows: int, engine: BaseRollout) -> torch.Tensor:
    """FIXED, EOS, then padding to `data.max_response_length`, on every row."""
    row = (FIXED + [engine.eos_ids[0]])[:RESPONSE_LEN]
    return torch.tensor([row + [engine.pad_id] * (RESPONSE_LEN - len(row))] * num_rows)


# ------------------------------------------------------------------ through the registry
def test_a_registered_engine_is_a_choice_of_rollout_name_and_an_unknown_one_is_refused(toy_engine):
    from rlframe.trainer.config import compose, typed

    assert engine_names()[-1] == "toy" and engine_for("toy", "sync") is TOY
    typed(compose([f"{ROLLOUT}.name=toy"]))  # the config's choices are the registry's names
    unregister("toy")
    with pytest.raises(ValueError, match=r"rollout.name='toy' is not one of hf, vllm, sglang"):
        typed(compose([f"{ROLLOUT}.name=toy"]))
    register(TOY)


def test_an_engine_is_keyed_by_name_and_mode():
    from dataclasses import replace

    from rlframe.trainer.config import compose, typed

    register(replace(TOY, name="toy_sync", modes=("sync",)))
    try:
        assert engine_for("toy_sync", "sync").build is ToyRollout
        typed(compose([f"{ROLLOUT}.name=toy_sync", f"{ROLLOUT}.mode=sync"]))
        with pytest.raises(ValueError, match=r"name=toy_sync runs under .*mode sync, not 'async'"):
            typed(compose([f"{ROLLOUT}.name=toy_sync", f"{ROLLOUT}.mode=async"]))
    finally:
        unregister("toy_sync")


def test_the_checks_ask_the_declaration_not_the_name(toy_engine):
    from rlframe.config.schema import inactive_keys
    from rlframe.trainer.config import _separate_async_refusals, compose, typed

    cfg = typed(compose([f"{ROLLOUT}.name=toy"]))
    inactive = inactive_keys(cfg)  # no micro-batches, no CPU pooling declared: their keys are reported unread
    assert f"{ROLLOUT}.micro_batch_size" in inactive and f"{ROLLOUT}.pool_cpu_generation" in inactive
    # no partial rollout declared: a cut is refused on the rollout pool, a pool that does not cut runs it
    refused, setting, _ = _separate_async_refusals(cfg)[0]
    assert refused and setting == f"{ROLLOUT}.name=toy with {ROLLOUT}.partial_rollout=true"
    refused, _, _ = _separate_async_refusals(
        typed(compose([f"{ROLLOUT}.name=toy", f"{ROLLOUT}.partial_rollout=false"]))
    )[0]
    assert not refused


def test_what_the_toy_does_not_declare_is_refused_before_it_runs(toy_engine, tiny_vl_path):
    from helpers.rollout import rollout_config

    from rlframe.trainer.config import compose, typed
    from rlframe.workers.rollout import build_rollout

    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 with .*name=toy: this engine does not shard"):
        typed(compose([f"{ROLLOUT}.name=toy", f"{ROLLOUT}.tensor_model_parallel_size=2"]))
    cfg = rollout_config(f"{ROLLOUT}.name=toy")  # no images declared: a vision-language model is refused
    with pytest.raises(ValueError, match="vision-language model, which .*name=toy cannot generate for"):
        build_rollout("toy", cfg, tiny_vl_path, load_tokenizer(tiny_vl_path), "cpu")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_toy_engine_generates_through_the_rollout_worker(toy_engine, mode, tiny_model_path, tmp_path):
    overrides = (f"{ROLLOUT}.name=toy", f"{ROLLOUT}.mode={mode}")
    with one_process_rollout_worker(tiny_model_path, str(tmp_path / "store"), *overrides) as worker:
        assert isinstance(worker.engine, ToyRollout)
        out = worker.generate_sequences(make_prompts())
        assert torch.equal(out.batch["responses"], expected_responses(len(out), worker.engine))
        assert (out.batch["response_mask"].sum(-1) == len(FIXED) + 1).all()
        worker.load_weights(2, {"any.weight": torch.zeros(1)})
        assert worker.engine.weight_pushes == 1
        mask = out.batch["response_mask"].bool()
        stamped = worker.generate_sequences(make_prompts()).batch[VERSIONS_KEY]
        assert (stamped[mask] == 2).all() and (stamped[~mask] == -1).all()


def test_the_toy_engine_generates_through_build_rollout_and_the_tp_group_step(toy_engine, tiny_model_path):
    from helpers.rollout import rollout_config

    from rlframe.workers.rollout import build_rollout, generate_in_tp_group

    cfg = rollout_config(f"{ROLLOUT}.name=toy")
    rollout = build_rollout("toy", cfg, tiny_model_path, load_tokenizer(tiny_model_path), "cpu")
    out = generate_in_tp_group(rollout, make_prompts(width=PROMPT_LEN))
    assert torch.equal(out.batch["responses"], expected_responses(len(out), rollout.unwrapped))


# ------------------------------------------------------------------ no branch on the engine's name
# the modules that may name engines: the engines' own (their declaration and helpers) and the registry
ENGINE_MODULES = {
    "rlframe/workers/rollout/hf_rollout.py",
    "rlframe/workers/rollout/vllm_rollout.py",
    "rlframe/workers/rollout/vllm_cpu.py",
    "rlframe/workers/rollout/vllm_server.py",
    "rlframe/workers/rollout/sglang_rollout.py",
    "rlframe/workers/rollout/registry.py",
}
ENGINE_NAMES = {"hf", "vllm", "sglang", "trtllm"}


def _is_engine_name(node: ast.AST) -> bool:
    """A literal engine name, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant):
        return node.value in ENGINE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_engine_name(element) for element in node.elts)
    return False


def _is_rollout_name(node: ast.AST) -> bool:
    """`<...rollout...>.name`, e.g. `cfg.rollout.name`, `rollout.name`, `self.config.rollout.name`."""
    return isinstance(node, ast.Attribute) and node.attr == "name" and "rollout" in ast.unparse(node.value)


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, code) of every comparison of a rollout name or with an engine's name in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_engine_name(o) or _is_rollout_name(o) for o in operands):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_check_finds_the_branches_it_forbids():
    code = 'a = rollout.name == "vllm"\nb = cfg.x in ("hf", "vllm")\nc = r.name != "sglang"\nd = name == "hf_model"'
    assert [line for line, _ in name_comparisons(code)] == [1, 2, 3]


def test_no_rollout_name_comparison_outside_the_engine_modules_and_the_registry():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {code}"
        for path in sorted((ROOT / "rlframe").rglob("*.py"))
        if str(path.relative_to(ROOT)) not in ENGINE_MODULES
        for line, code in name_comparisons(path.read_text())
    ]
    assert not offenders, "ask the engine's declaration (registry.engine_for) instead:\n" + "\n".join(offenders)
