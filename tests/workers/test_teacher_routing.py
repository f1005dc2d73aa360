"""Several distillation teachers, each row scored by the teacher its `teacher_key` field names (verl 0.9.1's
multi-teacher routing), exact against each teacher's own pass over every row, in one process and under DP = 2
with FSDP2, where one rank holds no row of a teacher and the ranks hold different numbers of each teacher's rows
(the pads that keep the FSDP collectives in step: rlframe.workers.teachers).
"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers.equivalence import NUM_SEQS
from helpers.fsdp_harness import Scenario, make_batch, make_role, scenario_dims, single_dims
from helpers.world import spawned_world
from transformers import AutoConfig

from rlframe.workers.teachers import Teachers, padded, route

# rows 0-3 are DP rank 0's, rows 4-7 rank 1's: rank 1 holds no row of teacher "b"
SOURCES = ["a", "b", "b", "a", "a", "a", "a", "a"]
TOPK = 3


def test_rows_go_to_the_teacher_their_field_names_and_an_unknown_value_is_refused():
    assert route(["a", "b", "a", 3], ["a", "b", "3"], "data_source") == {"a": [0, 2], "b": [1], "3": [3]}
    assert route(["a"], ["a", "b"], "data_source") == {"a": [0], "b": []}
    with pytest.raises(ValueError, match=r"row 1: data_source='c' \(distillation.teacher_key\) routes to no teacher"):
        route(["a", "c"], ["a", "b"], "data_source")


def test_a_teachers_rows_are_padded_with_copies_of_one_of_them():
    assert padded([3, 5], 4) == [3, 5, 3, 3]
    assert padded([], 2) == [0, 0]
    assert padded([1], 1) == [1]


@pytest.fixture(scope="module")
def teacher_paths(tiny_model_path, tmp_path_factory):
    """Two teachers that disagree: the tiny model with different N(0, 0.05²) noise on every weight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = {}
    for seed, name in enumerate(("a", "b")):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
        folder = tmp_path_factory.mktemp(f"teacher_{name}")
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
        paths[name] = str(folder)
    return paths


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    out = make_batch(AutoConfig.from_pretrained(tiny_model_path).vocab_size, NUM_SEQS)
    out.non_tensor_batch["data_source"] = np.array(SOURCES, dtype=object)
    return out


def teachers_of(sc: Scenario, paths: dict, topk: int, dims=None, mesh=None) -> Teachers:
    """The scenario's teachers as a worker builds them: frozen, FSDP-wrapped unless `sc.strategy` is none."""
    from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
    from rlframe.workers.model_loading import ModelSpec, load_hf_model

    models = {}
    for key, path in paths.items():
        module = load_hf_model(ModelSpec(path=path, role="actor", dtype=sc.dtype, use_remove_padding=True))
        if sc.strategy != "none":
            module = wrap_fsdp(module, FSDPSpec(sc.strategy, sc.dtype, sc.dtype, False, True, False), mesh, "cpu")
        module.requires_grad_(False)
        models[key] = make_role(sc, NUM_SEQS, module, None, dims or single_dims(sc))
    return Teachers(models, "data_source", topk, None if dims is None else dims.dp_group)


def each_teacher_on_every_row(paths: dict, batch, topk: int) -> dict[str, dict[str, torch.Tensor]]:
    """The reference: each teacher alone, one process, unsharded, padded, one micro-batch, over every row."""
    sc = Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS)
    return {key: teachers_of(sc, {None: path}, topk).score(batch) for key, path in paths.items()}


def assert_routed(got: dict, alone: dict, sources: list[str]) -> None:
    for name, values in got.items():
        expected = torch.stack([alone[source][name][row] for row, source in enumerate(sources)])
        if name == "teacher_topk_ids":
            assert torch.equal(values, expected), name
        else:
            torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(alone["a"][name], alone["b"][name])  # the teachers disagree: routing shows


CUTS = {
    "micro_1": Scenario(strategy="none", micro_batch_size=1),
    "dynamic_budget_24": Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=24),
}


@pytest.mark.parametrize("topk", [0, TOPK], ids=["log_probs", "topk"])
@pytest.mark.parametrize("cut", list(CUTS))
def test_each_row_gets_its_own_teachers_outputs_in_one_process(teacher_paths, batch, cut, topk):
    alone = each_teacher_on_every_row(teacher_paths, batch, topk)
    assert_routed(teachers_of(CUTS[cut], teacher_paths, topk).score(batch), alone, SOURCES)


def _rank_scores(rank: int, sc: Scenario, paths: dict, batch, topk: int) -> dict:
    dims = scenario_dims(sc)
    return teachers_of(sc, paths, topk, dims, dims.fsdp_mesh).score(batch.chunk(sc.dp)[dims.dp_rank])


@pytest.mark.slow
@pytest.mark.parametrize("topk", [0, TOPK], ids=["log_probs", "topk"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["micro_1", "dynamic_budget_24"])
def test_routing_is_exact_under_dp2_fsdp2_with_a_rank_holding_no_row_of_a_teacher(teacher_paths, batch, dynamic, topk):
    sc = replace(Scenario(world=2, micro_batch_size=1), use_dynamic_bsz=dynamic, max_token_len=24)
    ranks = spawned_world(2).run(_rank_scores, sc, teacher_paths, batch, topk)
    got = {name: torch.cat([out[name] for out in ranks]) for name in ranks[0]}
    assert_routed(got, each_teacher_on_every_row(teacher_paths, batch, topk), SOURCES)
