"""`rlframe explain` (`rlframe/explain/`): the design's worked example, balancing across DP ranks, lengths from files,
and the command's output and errors."""

import json
import os
import subprocess
import sys

import pytest
from helpers.small_config import SMALL

from rlframe.batch_plan import make_batch_plan
from rlframe.explain.cli import main
from rlframe.explain.simulation import (
    balance_ranks,
    dynamic_micro_batches,
    sequence_lengths,
    simulate,
    static_micro_batches,
)
from rlframe.trainer.config import compose

WORKED_EXAMPLE = [800, 6500, 1200, 4000, 9000, 2500, 1500, 7500]


def loads(seqlens, groups):
    return [sum(seqlens[i] for i in group) for group in groups]


def test_worked_example_static_micro_size_2_gives_four_micro_batches():
    groups = static_micro_batches(WORKED_EXAMPLE, 2)
    assert loads(WORKED_EXAMPLE, groups) == [7300, 5200, 11500, 9000]


def test_worked_example_dynamic_13312_budget_gives_three_balanced_micro_batches():
    local_counts, (groups,) = dynamic_micro_batches([WORKED_EXAMPLE], max_token_len=13312)
    assert local_counts == [3] and len(groups) == 3  # ceil(33000 / 13312) = 3
    group_loads = loads(WORKED_EXAMPLE, groups)
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert max(group_loads) <= 13312
    assert max(group_loads) <= 1.1 * min(group_loads)


def test_dynamic_micro_batch_count_is_the_max_over_ranks():
    short, long = [100] * 8, [900] * 8
    local_counts, groups = dynamic_micro_batches([short, long], max_token_len=1000)
    assert local_counts[0] < local_counts[1]
    assert [len(g) for g in groups] == [local_counts[1]] * 2
    assert all(g for rank in groups for g in rank)  # every micro-batch non-empty


def test_balancing_16_mixed_lengths_over_4_ranks_narrows_max_min_ratio():
    seqlens = sorted([120, 3000, 450, 8000, 60, 2200, 5100, 700, 90, 6400, 1500, 300, 7200, 40, 2600, 980])

    def ratio(ranks):
        totals = [sum(seqlens[i] for i in r) for r in ranks]
        return max(totals) / min(totals)

    before = balance_ranks(seqlens, 4, balance=False)
    after = balance_ranks(seqlens, 4, hidden_size=64, balance=True)
    assert sorted(i for r in after for i in r) == list(range(16)) and all(len(r) == 4 for r in after)
    assert ratio(after) < ratio(before)
    assert ratio(after) < 1.5 < ratio(before)


@pytest.fixture(scope="module")
def dynamic_plan():
    return make_batch_plan(
        compose(
            [
                *SMALL,
                "trainer.n_gpus_per_node=4",
                "data.train_batch_size=16",
                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160",
            ]
        )
    )


def test_simulation_reports_balance_and_micro_batches_within_budget(dynamic_plan):
    seqlens, _ = sequence_lengths("bimodal", dynamic_plan, seed=3)
    assert len(seqlens) == 64 and seqlens.max() <= 80
    sim = simulate(dynamic_plan, seqlens, hidden_size=64)
    b = sim["balance"]
    assert len(b["after"]["rank_tokens"]) == 4 and sum(b["after"]["rank_tokens"]) == sum(seqlens)
    assert b["after"]["max_min_ratio"] <= b["before"]["max_min_ratio"]
    assert len(sim["actor_update"]) == dynamic_plan.actor.num_mini_batches
    for p in sim["actor_update"] + [sim["old_log_prob"]]:
        assert p["micro_batches"] == max(p["local_micro_batches"])
        assert p["largest_micro_batch_tokens"] <= p["max_token_len"] and p["over_budget"] == 0


def test_lengths_from_jsonl_parquet_and_metrics_folder(tmp_path, dynamic_plan):
    import pandas as pd

    (tmp_path / "lengths.jsonl").write_text("\n".join(json.dumps({"response_length": i % 16}) for i in range(100)))
    seqlens, source = sequence_lengths(str(tmp_path / "lengths.jsonl"), dynamic_plan)
    assert len(seqlens) == 64 and "last 64 of 100" in source
    pd.DataFrame({"response_length": [5, 10], "prompt_length": [30, 40]}).to_parquet(tmp_path / "l.parquet")
    seqlens, _ = sequence_lengths(str(tmp_path / "l.parquet"), dynamic_plan)
    assert list(seqlens[:4]) == [35, 50, 35, 50]  # fewer recorded than needed: cycled
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        json.dumps(
            {
                "step": 7,
                "response_length/mean": 9.0,
                "response_length/min": 2.0,
                "response_length/max": 16.0,
                "response_length/clip_ratio": 0.25,
                "prompt_length/mean": 40.0,
                "prompt_length/min": 30.0,
                "prompt_length/max": 60.0,
            }
        )
        + "\n"
    )
    seqlens, source = sequence_lengths(str(run), dynamic_plan)
    assert len(seqlens) == 64 and "step 7" in source and 32 <= seqlens.min() and seqlens.max() <= 76
    (tmp_path / "empty.jsonl").write_text(json.dumps({"other": 1}) + "\n")
    with pytest.raises(ValueError, match="response_length"):
        sequence_lengths(str(tmp_path / "empty.jsonl"), dynamic_plan)


def test_explain_small_config_prints_flow_and_keys(capsys):
    assert main([*SMALL, "--lengths", "uniform"]) == 0
    out = capsys.readouterr().out
    for fragment in (
        "world_size = nnodes 1 × n_gpus_per_node 2 = 2 workers",
        "train_batch_size 8 prompts × n 4 = 32 sequences",
        "ppo_mini_batch_size 4 prompts × n 4 = 16 sequences / dp 2 = 8 per DP rank",
        "8 / ppo_micro_batch_size_per_gpu 2 = 4 gradient-accumulation steps",
        "critic.*",
        "IGNORED",
        "before (dispatch order)",
        "after (Karmarkar–Karp)",
        "attention packed rows on cpu, float32: torch SDPA per sequence",  # the kernel distributed/attention.py picks
    ):
        assert fragment in out
    assert "pools and staleness" not in out  # sync: no second pool, nothing stale


def test_explain_explains_a_multi_turn_config(capsys):
    tools = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tools", "calculator.yaml")
    overrides = [
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        "actor_rollout_ref.rollout.agent.num_workers=4",
    ]
    assert main([*SMALL, *overrides]) == 0
    out = capsys.readouterr().out
    for fragment in (
        "── agent loop",
        "each of the 2 generation groups runs 4 agent-loop threads over its 16 trajectories (≤ 4 each)",
        "tool_agent for rows without agent_name; tools: calculator",
        "assistant turns ≤ 3, tool turns no limit",
        "tool turns and template tokens are attended to but get response_mask 0",
    ):
        assert fragment in out, fragment
    assert main([*SMALL, *overrides, "actor_rollout_ref.rollout.mode=sync"]) == 0
    out = capsys.readouterr().out
    assert "mode      sync: the whole batch is generated at once, tool rows turn by turn" in out
    assert "agent-loop threads" not in out


def test_explain_explains_an_openai_agent_config(capsys):
    agent = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "openai_agent", "calculator_agent.py")
    overrides = [
        "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
        f"actor_rollout_ref.rollout.agent.openai_agent.path={agent}",
        "actor_rollout_ref.rollout.agent.openai_agent.name=run_agent",
        "actor_rollout_ref.rollout.agent.openai_agent.max_requests=6",
    ]
    assert main([*SMALL, *overrides]) == 0
    out = capsys.readouterr().out
    for fragment in (
        "openai_agent: `await run_agent(base_url, sample)`",
        "OpenAI endpoint on 127.0.0.1",
        "per episode ≤ 600 s, ≤ 6 requests, no generated tokens limit",
        "default_agent_loop=openai_agent: no tool agent runs",
    ):
        assert fragment in out, fragment


def test_explain_json_and_warnings(capsys):
    assert (
        main(
            [
                "--format",
                "json",
                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                "--lengths",
                "bimodal",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["actor"]["max_token_len"] == 16384  # verl's default budget
    assert report["warnings"] == [
        "rlframe: warning: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 has "
        "no effect: actor_rollout_ref.actor.use_dynamic_bsz=true: actor update "
        "micro-batches are cut by actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    ]
    assert report["simulation"]["balance"]["dp_size"] == 2
    assert report["model"]["hidden_size"] == 64
    assert "async" not in report  # sync


def test_explain_shows_pools_and_staleness_under_separate_async(capsys):
    overrides = [
        *SMALL,
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.sampler.max_off_policy_threshold=3",
        "trainer.v1.separate_async.num_warmup_batches=1",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
    ]
    assert main(overrides) == 0
    text = capsys.readouterr().out
    section = text.split("── pools and staleness ")[1].split("── algorithm")[0]
    for fragment in (
        "training  nnodes 1 × n_gpus_per_node 2 = 2 processes, each: actor, rollout (validation)",
        "actor_rollout_ref.rollout.nnodes 1 × n_gpus_per_node 1 = 1 process: hf, tp 1, 1 replica",
        "η = trainer.v1.sampler.max_off_policy_threshold 3 − 1 = 2",
        "L = min(trainer.v1.separate_async.num_warmup_batches 1, η 2) = 1: the rollout pool generates up to 1 batch",
        "stay within (L + 1) × 8 = 16 (AReaL's rule); each generate call takes ⌈8 / 1⌉ = 8 groups",
        "max_off_policy_strategy=drop: a finished group older than η is never trained",
        "in flight ≤ 16 groups = 64 sequences (sync: 32), each ≤ 64 + 16 tokens",
        "≈ 176.0 KiB of rollout tensors",  # 64 × 2816 bytes
        "64 × (32 × 64 + 48 × 16 = 2,816 bytes)",
        "counted: prompts, responses, input_ids, attention_mask, position_ids, response_mask (int64), "
        "rollout_log_probs (fp32), rollout_versions (int32). Not counted:",
        "126,400 parameters × 4 bytes (actor_rollout_ref.actor.fsdp_config.model_dtype=fp32) = 493.8 KiB per copy",
        "objective uncorrected",
    ):
        assert fragment in section, fragment
    warnings = text.split("── warnings ")[1]
    assert "trainer.v1.trainer_mode=separate_async trains samples up to L" in warnings
    assert main(["--format", "json", *overrides]) == 0
    report = json.loads(capsys.readouterr().out)
    pools = report["async"]
    assert (pools["staleness_bound"], pools["lookahead"], pools["in_flight_sequences"]) == (2, 1, 64)
    assert (pools["in_flight_groups"], pools["groups_per_call"]) == (16, 8)
    assert (pools["in_flight_bytes"], pools["weight_push_bytes"]) == (64 * 2816, 4 * 126400)
    assert any("trainer.v1.trainer_mode=separate_async trains samples" in w for w in report["warnings"])
    assert "Ray's object store (actor_rollout_ref.rollout.checkpoint_engine.backend=naive" in section
    assert pools["push_backend"] == "naive"


def test_explain_reports_the_collective_weight_push_and_its_buckets(capsys):
    engine = "actor_rollout_ref.rollout.checkpoint_engine"
    overrides = [
        *SMALL,
        "trainer.device=cpu",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "actor_rollout_ref.rollout.nnodes=1",
        f"{engine}.backend=nccl",
        f"{engine}.update_weights_bucket_megabytes=64",
    ]
    assert main(overrides) == 0
    section = capsys.readouterr().out.split("── pools and staleness ")[1].split("── algorithm")[0]
    assert (
        f"to every rollout process over a process group of their own ({engine}.backend=nccl over gloo), in buckets "
        f"of 64 MB ({engine}.update_weights_bucket_megabytes); the broadcast runs behind the next step" in section
    )
    assert main(["--format", "json", *overrides]) == 0
    pools = json.loads(capsys.readouterr().out)["async"]
    assert (pools["push_backend"], pools["push_bucket_megabytes"]) == ("nccl over gloo", 64)


def test_explain_shows_the_colocate_async_schedule_on_the_training_processes(capsys):
    overrides = [
        *SMALL,
        "trainer.v1.trainer_mode=colocate_async",
        "trainer.v1.sampler.max_off_policy_threshold=3",
        "trainer.v1.colocate_async.num_warmup_batches=1",
    ]
    assert main(overrides) == 0
    text = capsys.readouterr().out
    section = text.split("── pools and staleness ")[1].split("── algorithm")[0]
    for fragment in (
        "training  nnodes 1 × n_gpus_per_node 2 = 2 processes, each: actor, rollout (validation)",
        "the training processes' own engines (hf, tp 1) as one replica, each generate call split over the 2 processes",
        "η = trainer.v1.sampler.max_off_policy_threshold 3 − 1 = 2",
        "L = min(trainer.v1.colocate_async.num_warmup_batches 1, η 2) = 1: the training processes' engines generate "
        "up to 1 batch ahead",
        "stay within (L + 1) × 8 = 16 (AReaL's rule); each generate call takes ⌈8 / 1⌉ = 8 groups",
        "once a step's batch is sampled, what generates ahead stops at its next decoding step",
        "in flight ≤ 16 groups = 64 sequences (sync: 32)",
        "syncs its actor's weights into its own engine in place",
        "objective uncorrected",
    ):
        assert fragment in section, fragment
    assert "rollout pool" not in section.split("counted:")[0]
    warnings = text.split("── warnings ")[1]
    assert "trainer.v1.trainer_mode=colocate_async trains samples up to L" in warnings
    assert main(["--format", "json", *overrides]) == 0
    pools = json.loads(capsys.readouterr().out)["async"]
    assert (pools["mode"], pools["lookahead"], pools["rollout_replicas"], pools["weight_push_bytes"]) == (
        "colocate_async",
        1,
        1,
        None,
    )


def test_pools_say_the_weight_copy_per_parameter_when_the_model_is_not_readable():
    from dataclasses import replace

    from rlframe.explain.formatting import format_pools
    from rlframe.trainer.async_plan import make_async_plan
    from rlframe.trainer.main_ppo import check_config

    async_keys = ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=1"]
    overrides = [*SMALL, *async_keys, "trainer.v1.separate_async.parameter_sync_step=2"]
    _, cfg, _, plan = check_config([*overrides, "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"], False)
    text = format_pools(replace(make_async_plan(cfg, plan), weight_parameters=None, weight_push_bytes=None))
    assert (
        "2 bytes per parameter (actor_rollout_ref.actor.fsdp_config.model_dtype=bf16) per copy; the model's "
        "config.json is not readable here" in text
    )


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
def test_explain_bad_config_exits_nonzero_with_the_trainers_message():
    overrides = ["trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.ppo_mini_batch_size=1"]
    with pytest.raises(ValueError) as trainer_error:
        make_batch_plan(compose(overrides))
    out = subprocess.run(
        [sys.executable, "-m", "rlframe.cli", "explain", *overrides], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert str(trainer_error.value) in out.stderr
    assert "actor_rollout_ref.actor.ppo_mini_batch_size" in out.stderr


def test_cli_help_and_unknown_command(capsys):
    from rlframe.cli import main as cli_main

    assert cli_main(["--help"]) == 0 and "explain" in capsys.readouterr().out
    assert cli_main(["bogus"]) == 2


def test_the_algorithm_section_says_what_the_distillation_term_is():
    from rlframe.explain.formatting import format_algorithm
    from rlframe.trainer.config import typed

    teacher = "distillation.teacher_models.teacher_model.model_path=/models/teacher"
    assert "distill" not in format_algorithm(typed(compose([])))
    pg_topk = [
        "distillation.enabled=true",
        teacher,
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
        "distillation.distillation_loss.topk=8",
        "distillation.distillation_loss.use_policy_gradient=true",
        "distillation.distillation_loss.use_task_rewards=false",
    ]
    assert format_algorithm(typed(compose(pg_topk))).splitlines()[-1] == (
        "distill    forward_kl_topk (top 8) to the teacher /models/teacher at T = 1, as a policy-gradient reward, alone"
    )
    named = [
        "distillation.enabled=true",
        "+distillation.teacher_models.gsm.model_path=/models/math",
        "+distillation.teacher_models.gsm.key=gsm8k",
        "+distillation.teacher_models.geo.model_path=/models/geometry",
        "+distillation.teacher_models.geo.key=geometry3k",
    ]
    assert format_algorithm(typed(compose(named))).splitlines()[-1] == (
        "distill    k3 to the teachers by data_source (gsm8k → /models/math, geometry3k → /models/geometry) at "
        "T = 1, back-propagated, added × 1.0 to the task loss"
    )
