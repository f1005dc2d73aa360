"""separate_async's plan (rlframe/trainer/async_plan.py): the pools, η and L, the sequences in flight and their
bytes, the weight copy per push, and which objective runs; and the launch warning of an uncorrected stale update."""

import io

import pytest
import torch
from helpers.small_config import SMALL

from rlframe.config.key_status import launch_warnings, warn_at_launch
from rlframe.protocol import DataProto
from rlframe.trainer.async_plan import ROLLOUT_TENSORS, exported_parameters, make_async_plan
from rlframe.trainer.config import compose, lookahead, staleness_bound, typed
from rlframe.trainer.main_ppo import check_config

# SMALL (train_batch_size 8, n 4, prompts 64, responses 16, 2 training processes) on 1 × 1 rollout process;
# 8 = parameter_sync_step 2 × ppo_mini_batch_size 4
ASYNC = [
    *SMALL,
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.separate_async.parameter_sync_step=2",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
]
RC = "algorithm.rollout_correction"


def async_plan(*overrides):
    _, cfg, _, plan = check_config([*ASYNC, *overrides], check_files=False)
    return make_async_plan(cfg, plan)


@pytest.mark.parametrize(
    "threshold,warmup,eta,ahead", [(1, 1, 0, 0), (2, 1, 1, 1), (2, 3, 1, 1), (8, 1, 7, 1), (5, 3, 4, 3), (4, 0, 3, 0)]
)
def test_eta_is_threshold_minus_one_and_lookahead_the_smaller_of_warmup_and_eta(threshold, warmup, eta, ahead):
    v1 = typed(
        compose(
            [
                f"trainer.v1.sampler.max_off_policy_threshold={threshold}",
                f"trainer.v1.separate_async.num_warmup_batches={warmup}",
            ]
        )
    ).trainer.v1
    assert (staleness_bound(v1), lookahead(v1)) == (eta, ahead)


def test_the_plan_counts_pools_in_flight_sequences_and_their_bytes():
    ap = async_plan("trainer.v1.sampler.max_off_policy_threshold=3", "trainer.v1.separate_async.num_warmup_batches=2")
    assert (ap.training_processes, ap.training_roles) == (2, ("actor", "rollout (validation)"))
    assert (ap.rollout_processes, ap.rollout_engine, ap.rollout_tp, ap.rollout_replicas) == (1, "hf", 1, 1)
    assert (ap.staleness_bound, ap.lookahead) == (2, 2)
    assert (ap.in_flight_groups, ap.groups_per_call) == (3 * ap.train_batch_size, ap.train_batch_size)
    assert ap.in_flight_sequences == 3 * 8 * 4  # (1 + L) × train_batch_size × rollout.n
    assert (ap.bytes_per_prompt_token, ap.bytes_per_response_token) == (32, 48)
    assert ap.bytes_per_sequence == 32 * 64 + 48 * 16
    assert ap.in_flight_bytes == 96 * ap.bytes_per_sequence
    assert ap.objective == "uncorrected"
    no_log_probs = async_plan("actor_rollout_ref.rollout.calculate_log_probs=false")
    assert "rollout_log_probs" not in no_log_probs.rollout_tensors
    assert no_log_probs.bytes_per_sequence == 32 * 64 + 44 * 16
    gae = async_plan("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true")
    assert gae.training_roles == ("actor", "rollout (validation)", "ref", "critic")


def test_rollout_tensor_table_matches_what_the_rollout_returns():
    """ROLLOUT_TENSORS is what a generated batch holds once the driver has it, byte for byte."""
    from rlframe.workers.rollout.base import STOP_KEY, build_rollout_output, mark_rollout_state

    prompt_len, response_len, rows = 5, 7, 3
    mask = torch.ones(rows, prompt_len, dtype=torch.long)
    prompts = DataProto.from_dict(
        {
            "input_ids": torch.ones(rows, prompt_len, dtype=torch.long),
            "attention_mask": mask,
            "position_ids": mask.cumsum(-1) - 1,
        }
    )
    generated, lengths = torch.ones(rows, 4, dtype=torch.long), torch.full((rows,), 4)
    out = build_rollout_output(prompts, generated, lengths, response_len, [2], 0, torch.zeros(rows, 4))
    mark_rollout_state(out, torch.zeros(rows), torch.zeros(rows, response_len))  # as every rollout marks its rows
    out.pop(batch_keys=[STOP_KEY])  # read and dropped by the driver as a call returns (PooledSource._collect)
    per_row = {name: tensor.element_size() * tensor[0].numel() for name, tensor in out.batch.items()}
    expected = {name: p * prompt_len + r * response_len for name, _, p, r in ROLLOUT_TENSORS}
    assert per_row == expected


def test_the_weight_copy_counts_the_actors_state_dict_in_its_dtype():
    from transformers import AutoModelForCausalLM

    ap = async_plan()
    model = AutoModelForCausalLM.from_pretrained(check_config(ASYNC, check_files=False)[1].actor_rollout_ref.model.path)
    assert ap.weight_parameters == sum(t.numel() for t in model.state_dict().values())
    assert (ap.weight_dtype, ap.weight_push_bytes) == ("fp32", 4 * ap.weight_parameters)
    bf16 = async_plan("actor_rollout_ref.actor.fsdp_config.model_dtype=bf16")
    assert bf16.weight_push_bytes == 2 * ap.weight_parameters


def test_a_lora_push_is_the_merged_weights_for_hf_and_the_adapter_for_vllm():
    from rlframe.explain.formatting import format_pools

    lora = "actor_rollout_ref.model.lora_rank=8"
    assert async_plan().weight_form == "full"
    assert async_plan(lora).weight_form == "lora_merged"
    merged = async_plan(lora)
    assert merged.weight_form == "lora_merged"
    assert "the LoRA actor's merged weights" in format_pools(merged)
    adapter = async_plan(lora, "actor_rollout_ref.rollout.name=vllm")
    assert adapter.weight_form == "lora_adapter"
    assert "the LoRA adapter alone" in format_pools(adapter)


def test_no_config_json_means_no_parameter_count(tmp_path):
    assert exported_parameters(str(tmp_path)) is None
    assert exported_parameters(None) is None


@pytest.mark.parametrize(
    "overrides,objective",
    [
        ([], "uncorrected"),
        (["trainer.v1.separate_async.num_warmup_batches=0"], "on_policy"),
        (["trainer.v1.sampler.max_off_policy_threshold=1"], "on_policy"),
        ([f"{RC}.rollout_is=token"], "decoupled"),
        ([f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.5_2.0"], "decoupled"),
        ([f"{RC}.bypass_mode=true"], "bypass"),
    ],
)
def test_the_objective_and_the_launch_warning_of_an_uncorrected_stale_update(overrides, objective):
    overrides = [*ASYNC, *overrides]
    assert async_plan(*overrides[len(ASYNC) :]).objective == objective
    warned = [line for line in launch_warnings(compose(overrides), overrides) if "behaviour correction" in line]
    if objective != "uncorrected":
        assert warned == []
        return
    (line,) = warned
    for fragment in (
        "rlframe: warning: trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.num_warmup_batches=1",
        "η = trainer.v1.sampler.max_off_policy_threshold − 1 = 7) = 1 policy version(s)",
        f"{RC}.rollout_is=null, {RC}.rollout_rs=null, {RC}.bypass_mode=false",
        "PPO around π_prox",
        "biased",
        f"set {RC}.rollout_is=token (verl's decoupled mode",
    ):
        assert fragment in line, fragment
    stream = io.StringIO()
    assert line in warn_at_launch(compose(overrides), overrides, stream) and line in stream.getvalue()


def test_the_warnings_fix_asks_for_the_engines_log_probs_when_they_are_off():
    overrides = [*ASYNC, "actor_rollout_ref.rollout.calculate_log_probs=false"]
    (line,) = [w for w in launch_warnings(compose(overrides), overrides) if "behaviour correction" in w]
    assert f"{RC}.rollout_is=token with actor_rollout_ref.rollout.calculate_log_probs=true" in line


def test_sync_has_no_async_plan_and_no_staleness_warning():
    _, cfg, _, plan = check_config(SMALL, check_files=False)
    assert make_async_plan(cfg, plan) is None
    overrides = [*SMALL, "trainer.v1.sampler.max_off_policy_threshold=3"]
    assert not any("behaviour correction" in line for line in launch_warnings(compose(overrides), overrides))


def test_rlframe_train_prints_the_warning_before_ray_starts(capsys):
    from rlframe.trainer.main_ppo import prepare

    prepare(ASYNC)
    assert "rlframe: warning: trainer.v1.trainer_mode=separate_async trains samples up to L" in capsys.readouterr().err
