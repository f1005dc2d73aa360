"""The asynchronous trainer modes end to end against the sync loop: separate_async (1 training + 1 rollout process)
and colocate_async (the training process's own engine).

The runs go in-process through `prepare` → `create_worker_groups` → the trainer, on one small Ray cluster shared
by the module, so each test can read the actor's final parameters before the workers go (`export_weights`).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.runs import COMMON, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BASE = [
    *COMMON,
    "trainer.n_gpus_per_node=1",
    "trainer.total_training_steps=3",
    "trainer.test_freq=2",
    "trainer.v1.separate_async.parameter_sync_step=2",  # train_batch_size 4 = 2 mini-batches of 2
]
SEPARATE = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
]
COLOCATE = ["trainer.v1.trainer_mode=colocate_async"]
MODES = {"separate_async": SEPARATE, "colocate_async": COLOCATE}
# separate_async with the weights broadcast over a process group of their own (gloo on CPU) instead of Ray's store
COLLECTIVE = {"separate_async_nccl": [*SEPARATE, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]}
# clocks, throughput, the host's memory, and what only the async loop logs
NOT_COMPARED = ("timing_", "perf/", "rollout/server_", "time", "memory/", "training/off_policy/", "async/")
STALENESS = "training/off_policy/trajectory_staleness"
# the tool agent with the calculator, the agent loops (rollout.mode=async) or the turn-synchronous loop (sync)
# one TP group of 2 processes: the hybrid engine's in the sync run, the rollout pool's replica in the async one
TP2 = [
    *(key for key in BASE if not key.startswith("trainer.n_gpus_per_node=")),
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
]
TP2_SEPARATE = [
    *(key for key in SEPARATE if "n_gpus_per_node" not in key),
    "actor_rollout_ref.rollout.n_gpus_per_node=2",
]
TP2_MODES = {"separate_async": TP2_SEPARATE, "colocate_async": COLOCATE}  # the pool's replica, or the training group
CALCULATOR = Path(__file__).parents[2] / "examples" / "tools" / "calculator.yaml"
TOOL_AGENT = [
    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={CALCULATOR}",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
]
ENGINE_LOG_PROBS = (
    "rollout_corr/",
    "training/rollout_probs_diff",
    "training/rollout_actor_probs_pearson_corr",
)  # the rollout engine's log-probs against the actor's
OPENAI_AGENT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "agents", "two_turns.py"
)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    import ray

    from rlframe.single_controller.ray import init_ray

    cache = os.environ.get("RLFRAME_CACHE")
    os.environ["RLFRAME_CACHE"] = str(tmp_path_factory.mktemp("rlframe_cache"))
    init_ray(num_cpus=4, include_dashboard=False)  # up to 2 training + 2 rollout processes (TP 2 replicas)
    yield
    ray.shutdown()
    if cache is None:
        os.environ.pop("RLFRAME_CACHE")
    else:
        os.environ["RLFRAME_CACHE"] = cache


def train_in_process(overrides: list[str]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """(the run's logged metrics, the actor's final parameters by HF name)."""
    from rlframe.trainer.launch import create_worker_groups
    from rlframe.trainer.main_ppo import prepare
    from rlframe.trainer.ray_trainer import RayPPOTrainer

    run = prepare(overrides)
    groups = create_worker_groups(run.cfg, run.plan, run.schedule_steps)
    try:
        RayPPOTrainer(run, groups).fit()
        weights = groups.actor_rollout.export_weights()
    finally:
        groups.shutdown()
    return read_metrics(run.cfg.trainer.default_local_dir), weights


def times_trained(dumps, steps) -> Counter:
    """How many of `steps` trained each prompt (by its index), from the rollout dumps; each step must hold
    train_batch_size = 4 prompts of n = 2 samples."""
    trained = Counter()
    for step in steps:
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        counts = Counter(row["index"] for row in rows)
        assert len(counts) == 4 and set(counts.values()) == {2}
        trained.update(counts.keys())
    return trained


def cut_run(tmp_path, monkeypatch, overrides: list[str], response_length: int | None = 24) -> list[dict]:
    """η = 1 with partial rollout for 4 steps, decoding slowed from the 5th token (~0.12 s a token) so that cuts land
    while generation runs: the run's metrics, checked for what every such run must hold (every trained token at most
    η versions old, and every prompt trained exactly once). `overrides`: the base, the mode and the case's keys.

    Under colocate_async the batch ahead starts generating only once the step's own batch is back, and is cut as soon
    as the driver has scored that batch: a scorer of ~0.1 s a sample gives it time to sample tokens before the cut
    (with the default scorer's milliseconds, the cut lands before the first token and no row spans two versions)."""
    monkeypatch.setenv("RLFRAME_DELAY_AT", "rollout.decode:5:0.1-0.14")
    dumps = tmp_path / "rollouts"
    length = [] if response_length is None else [f"data.max_response_length={response_length}"]
    scorer = []
    if COLOCATE[0] in overrides:
        path = tmp_path / "slow_scorer.py"
        path.write_text(
            "import time\n"
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    time.sleep(0.1)\n"
            "    return float(len(solution_str) % 2)\n"
        )
        scorer = [f"custom_reward_function.path={path}"]
    metrics, _ = train_in_process(
        [
            *overrides,
            *length,
            *scorer,
            "trainer.total_training_steps=4",
            "trainer.test_freq=-1",
            "trainer.v1.sampler.max_off_policy_threshold=2",  # η = 1
            f"trainer.rollout_data_dir={dumps}",
            f"trainer.default_local_dir={tmp_path / 'async'}",
        ]
    )
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert max(m[f"{STALENESS}_worst/max"] for m in metrics) <= 1
    trained = times_trained(dumps, (1, 2, 3, 4))
    assert len(trained) == 16 and set(trained.values()) == {1}
    return metrics


def without(metrics: list[dict], prefixes: tuple[str, ...]) -> list[dict]:
    return [{k: v for k, v in line.items() if not k.startswith(prefixes)} for line in metrics]


def compared(metrics: list[dict]) -> list[dict]:
    return without(metrics, NOT_COMPARED)


@pytest.fixture(scope="module")
def sync_runs(ray_cluster, tmp_path_factory):
    """The sync run of BASE plus an algorithm's overrides, trained once per module: (its metrics, its weights)."""
    runs = {}

    def run(algorithm: tuple[str, ...]):
        if algorithm not in runs:
            folder = tmp_path_factory.mktemp("sync")
            runs[algorithm] = train_in_process([*BASE, *algorithm, f"trainer.default_local_dir={folder}"])
        return runs[algorithm]

    return run


ALGORITHMS = {
    "grpo": [],
    # PPO with a critic: its fresh value head draws from the process RNG the rollout's seeds come from
    "gae": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "critic.ppo_micro_batch_size_per_gpu=2"],
    # DAPO: a sync round of gen_batch_size = train_batch_size prompts reads what one take of B groups does
    "dapo": [
        "data.gen_batch_size=4",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=seq_reward",
        "reward_model.reward_manager=dapo",  # its overlong penalty makes a group's scores differ by length
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.max_resp_len=8",
    ],
    # ReMax: each admission chunk's greedy baseline call runs just before its samples, as in the sync loop
    "remax": ["algorithm.adv_estimator=remax"],
    # LoRA: the rollout pool's hf engine takes the merged weights each push, the hybrid engine its own sync
    "lora": ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"],
    # the tool agent with the calculator, on the agent loops or turn-synchronous: a cut trajectory continues from its
    # state
    "tool_agent": [*TOOL_AGENT, "actor_rollout_ref.rollout.mode=async"],
    "tool_agent_turn_sync": [*TOOL_AGENT, "actor_rollout_ref.rollout.mode=sync"],
}
POOL_ONLY = {  # what runs under separate_async and colocate_async refuses (docs/async.md)
    # your own agent through the OpenAI endpoint (its episodes are not cut by a push: partial_rollout=false)
    "openai_agent": [
        "data.max_response_length=64",
        "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
        f"actor_rollout_ref.rollout.agent.openai_agent.path={OPENAI_AGENT}",
        "actor_rollout_ref.rollout.agent.openai_agent.name=agent",
        "actor_rollout_ref.rollout.partial_rollout=false",
    ],
}
BUCKETS = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1"
PROFILED = [
    "global_profiler.tool=torch",
    "global_profiler.steps=[2]",
    "actor_rollout_ref.actor.profiler.enable=true",  # the rollout pool's profiler follows it (verl's default)
]
ETA0_CASES = [
    *(pytest.param(overrides, mode, id=f"{name}-{mode}") for name, overrides in ALGORITHMS.items() for mode in MODES),
    *(pytest.param(overrides, "separate_async", id=f"{name}-separate_async") for name, overrides in POOL_ONLY.items()),
    # the collective push: full tensors, and a LoRA actor's merged weights (the tiny model: one bucket of 1 MB)
    *(
        pytest.param([*overrides, BUCKETS], "separate_async_nccl", id=f"{name}-separate_async_nccl")
        for name, overrides in (("grpo", ALGORITHMS["grpo"]), ("lora", ALGORITHMS["lora"]))
    ),
]


@pytest.mark.parametrize("algorithm,mode", ETA0_CASES)
def test_eta0_in_either_async_mode_gives_the_sync_run_bitwise(ray_cluster, sync_runs, tmp_path, algorithm, mode):
    """η = 0 trains what the sync run trains, bit for bit. The GRPO runs are also profiled on step 2 (its generation
    runs inside the step's window at η = 0): the generating processes write their traces beside the training one's,
    and profiling changes no number."""
    push = [key for key in algorithm if key.startswith("actor_rollout_ref.rollout.checkpoint_engine.")]
    algorithm = [key for key in algorithm if key not in push]  # the sync run has no push
    sync_metrics, sync_weights = sync_runs(tuple(algorithm))
    profiled = not algorithm and mode in MODES
    async_metrics, async_weights = train_in_process(
        [
            *BASE,
            *algorithm,
            *push,
            *{**MODES, **COLLECTIVE}[mode],
            "trainer.v1.sampler.max_off_policy_threshold=1",  # η = 0: every batch generated by the latest weights
            f"trainer.default_local_dir={tmp_path / 'async'}",
            *(PROFILED + [f"global_profiler.save_path={tmp_path / 'traces'}"] if profiled else []),
        ]
    )
    if profiled:
        assert_profiled(tmp_path / "traces", mode)
    assert [m["step"] for m in sync_metrics] == [1, 2, 3]
    if "algorithm.filter_groups.enable=true" in algorithm:  # the pool's takes went through the filter
        assert all("train/filter_groups/kept_prompts" in m for m in async_metrics)
    if TOOL_AGENT[0] in algorithm:  # the tool agent generated on the pool
        assert all("multi_turn/assistant_turns_mean" in m for m in async_metrics)
    if "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent" in algorithm:  # two requests, one trajectory
        assert all(m["openai_agent/requests_per_episode"] == 2 for m in async_metrics if "actor/pg_loss" in m)
        assert all(m["openai_agent/failed_ratio"] == 0 for m in async_metrics if "actor/pg_loss" in m)
    if "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent" in algorithm:
        # the endpoint batches requests as they arrive over HTTP, so the engine's own log-probs differ in the last
        # float bits between any two runs (two sync runs too); the tokens, keyed by seed and position, and the
        # update, which reads the actor's log-probs, are bitwise the same
        sync_metrics, async_metrics = without(sync_metrics, ENGINE_LOG_PROBS), without(async_metrics, ENGINE_LOG_PROBS)
    assert compared(async_metrics) == compared(sync_metrics)
    if mode in COLLECTIVE:  # the weights went over the push group: each step reports the broadcast before its own
        assert all(m["async/weight_push/bytes"] > 0 for m in async_metrics[1:])
    assert "val-core/countdown_add/reward/mean@1" in async_metrics[1]  # validation ran (test_freq=2) and agreed
    assert [m[f"{STALENESS}/max"] for m in async_metrics] == [0, 0, 0]
    assert [m["async/in_flight_groups"] for m in async_metrics] == [0, 0, 0]  # nothing generated ahead
    assert [m["async/in_flight_groups/max"] for m in async_metrics] == [4, 4, 4]  # (L + 1) · B with L = 0
    assert sync_weights.keys() == async_weights.keys()
    assert all(torch.equal(sync_weights[name], async_weights[name]) for name in sync_weights)


@pytest.fixture(scope="module")
def sync_tp2_run(ray_cluster, tmp_path_factory):
    """The sync run with the hybrid engine's TP group of 2: the reference of both async modes' TP 2 runs."""
    return train_in_process([*TP2, f"trainer.default_local_dir={tmp_path_factory.mktemp('sync_tp2')}"])


@pytest.mark.parametrize("mode", TP2_MODES)
def test_eta0_with_a_tp2_replica_gives_the_sync_tp2_run_bitwise(ray_cluster, sync_tp2_run, tmp_path, mode):
    """The replica is a TP group of 2 processes (the rollout pool's, or under colocate_async the training processes'
    own engines); the sync run generates with the hybrid engine's TP group of 2. Same rows per TP rank, same seed (TP
    rank 0's, replica index 0): the same samples, bit for bit."""
    sync_metrics, sync_weights = sync_tp2_run
    async_metrics, async_weights = train_in_process(
        [
            *TP2,
            *TP2_MODES[mode],
            "trainer.v1.sampler.max_off_policy_threshold=1",  # η = 0
            f"trainer.default_local_dir={tmp_path / 'async'}",
        ]
    )
    assert [m["step"] for m in sync_metrics] == [1, 2, 3]
    assert compared(async_metrics) == compared(sync_metrics)
    assert [m[f"{STALENESS}/max"] for m in async_metrics] == [0, 0, 0]
    assert sync_weights.keys() == async_weights.keys()
    assert all(torch.equal(sync_weights[name], async_weights[name]) for name in sync_weights)


@pytest.mark.parametrize(
    "agent,mode",
    [
        ([], "separate_async"),
        ([*TOOL_AGENT, "actor_rollout_ref.rollout.mode=async"], "separate_async"),
        ([], "colocate_async"),
    ],
    ids=["single_turn", "tools", "single_turn-colocate_async"],
)
def test_partial_rollout_cuts_a_tp2_replica_on_every_tp_rank_at_once_and_trains_every_prompt_once(
    ray_cluster, tmp_path, monkeypatch, agent, mode
):
    """η = 1 with partial rollout on a TP 2 replica, decoding slowed so that pushes land mid-generation: TP rank 0
    asks the board and both ranks stop at the same step (else the next all-reduce hangs); the cut rows (or the tool
    agent's trajectories, whose TP peer follows the agent loops' engine calls) continue on the same TP group within
    the bound, and every prompt is trained exactly once."""
    metrics = cut_run(tmp_path, monkeypatch, [*TP2, *TP2_MODES[mode], *agent])
    assert sum(m["async/interrupted_samples"] for m in metrics) > 0
    assert max(m["training/off_policy/trajectory_spans/max"] for m in metrics) == 2


def assert_profiled(traces: Path, mode: str) -> None:
    """global_profiler.tool=torch on step 2: under separate_async the training process and the rollout pool's process
    each wrote a trace into save_path, the pool's named after its role and holding its generate calls; under
    colocate_async the training process's one trace holds its engine's generate calls beside the update."""
    names = sorted(path.name for path in traces.iterdir())
    expected = {"separate_async": ["actor_rollout_ref", "rollout"], "colocate_async": ["actor_rollout_ref"]}[mode]
    assert [name.split("_pid")[0] for name in names] == [f"{role}_step2_rank0-of-1" for role in expected]
    with gzip.open(traces / names[-1], "rt") as trace:
        text = trace.read()
    assert '"rollout_generate"' in text
    if mode == "colocate_async":
        assert '"actor_update"' in text


def test_eta1_trains_one_step_off_and_every_prompt_once(ray_cluster, tmp_path):
    dumps = tmp_path / "rollouts"
    metrics, _ = train_in_process(
        [
            *BASE,
            *SEPARATE,
            "actor_rollout_ref.rollout.partial_rollout=false",  # a push waits for the generation running
            "trainer.total_training_steps=4",
            "trainer.test_freq=-1",
            "trainer.v1.sampler.max_off_policy_threshold=2",  # η = 1
            "trainer.v1.separate_async.num_warmup_batches=1",
            f"trainer.rollout_data_dir={dumps}",
            f"trainer.default_local_dir={tmp_path / 'async'}",
        ]
    )
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # step 1 trains the batch generated by the initial weights; every later one a batch a version behind
    assert [m[f"{STALENESS}/mean"] for m in metrics] == [0, 1, 1, 1]
    assert [m[f"{STALENESS}/max"] for m in metrics] == [0, 1, 1, 1]
    # the next batch generates on the rollout pool while each step but the last trains
    assert [m["async/in_flight_groups"] for m in metrics] == [4, 4, 4, 0]
    assert max(m["async/in_flight_groups/max"] for m in metrics) == 8  # (L + 1) · B
    assert sum(m["training/off_policy/evicted_samples"] for m in metrics) == 0
    steps_of = {}
    for step in (1, 2, 3, 4):
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        counts = Counter(row["index"] for row in rows)
        assert len(counts) == 4 and set(counts.values()) == {2}  # train_batch_size prompts, n samples each
        for index in counts:
            steps_of.setdefault(index, []).append(step)
    assert len(steps_of) == 16 and all(len(steps) == 1 for steps in steps_of.values())  # each prompt trained once


def test_partial_rollout_cuts_the_generation_a_push_finds_running_and_trains_every_token_within_the_bound(
    ray_cluster, tmp_path, monkeypatch
):
    """η = 1, partial rollout on, responses of 24 tokens at ~0.12 s a token: the groups of step k + 1 are still
    generating when step k pushes its weights, so their rows are cut and continued on the new weights. Every trained
    token is at most η versions old, cut rows span two versions, and every prompt is trained exactly once."""
    metrics = cut_run(tmp_path, monkeypatch, [*BASE, *SEPARATE])
    assert sum(m["async/interrupted_samples"] for m in metrics) > 0
    assert max(m["training/off_policy/trajectory_spans/max"] for m in metrics) == 2
    # a cut row's newest tokens come from the weights its step starts from
    assert min(m[f"{STALENESS}/min"] for m in metrics[1:]) == 0


@pytest.mark.parametrize("mode", MODES)
def test_remax_baselines_come_from_their_groups_admission_version_when_a_push_cuts_the_samples(
    ray_cluster, tmp_path, monkeypatch, mode
):
    """ReMax at η = 1 with partial rollout, decoding slowed so that each push finds the next groups generating: their
    samples are cut and continued on the new weights, while each group's greedy baseline, generated just before its
    samples and never cut, comes from the weights the group was admitted under (the driver checks each row's version
    against its group's admission and raises otherwise). So every step's baselines are exactly as stale as its
    groups' admissions, one version older than the samples' newest tokens."""
    metrics = cut_run(tmp_path, monkeypatch, [*BASE, *MODES[mode], "algorithm.adv_estimator=remax"])
    assert sum(m["async/interrupted_samples"] for m in metrics) > 0
    # one-step-off: step 1 trains groups admitted at version 0, step k > 1 groups admitted at version k - 2
    assert [m["async/remax_baseline_staleness/max"] for m in metrics] == [0, 1, 1, 1]
    assert [m["async/remax_baseline_staleness/min"] for m in metrics] == [0, 1, 1, 1]
    # while samples of those groups were cut and finished on the next weights (σ = 0 from their newest tokens)
    assert min(m[f"{STALENESS}/min"] for m in metrics[1:]) == 0


@pytest.mark.parametrize(
    "trainer_mode,mode", [("separate_async", "async"), ("separate_async", "sync"), ("colocate_async", "async")]
)
def test_partial_rollout_cuts_tool_agent_trajectories_and_continues_them_within_the_bound(
    ray_cluster, tmp_path, monkeypatch, trainer_mode, mode
):
    """The tool agent at η = 1 with partial rollout (on the rollout pool, or on the training processes' engines),
    decoding slowed so that cuts land while trajectories generate: they are cut (inside a turn, or before their next
    one) and continued from their state on the new weights. Every trained token is at most η versions old and every
    prompt is trained exactly once."""
    overrides = [*BASE, *MODES[trainer_mode], *TOOL_AGENT, f"actor_rollout_ref.rollout.mode={mode}"]
    metrics = cut_run(tmp_path, monkeypatch, overrides)
    assert sum(m["async/interrupted_samples"] for m in metrics) > 0
    assert max(m["training/off_policy/trajectory_spans/max"] for m in metrics) == 2  # cut trajectories span two
    assert all("multi_turn/assistant_turns_mean" in m for m in metrics)  # the tool agent generated them
    # a trajectory has at least one policy turn: a generation cut before any trajectory finished adds no 0 to the mean
    assert all(m["multi_turn/assistant_turns_mean"] >= 1 for m in metrics)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_push_cuts_an_openai_agents_requests_and_the_endpoint_continues_them_within_the_bound(
    ray_cluster, tmp_path, monkeypatch, tp
):
    """Your own agent on the rollout pool at η = 1 with partial rollout, decoding slowed so that pushes land while its
    requests generate: the replica loads the pushed weights itself and continues the cut requests in the same call
    (the agent only waits longer; on a TP 2 replica TP rank 0 loads them and its peer the same version, at the next
    engine call), so episodes span two versions, every trained token is at most η versions old and every prompt is
    trained exactly once."""
    agent = [key for key in POOL_ONLY["openai_agent"] if "partial_rollout" not in key]  # its own response length
    layout = [*BASE, *SEPARATE] if tp == 1 else [*TP2, *TP2_SEPARATE]
    metrics = cut_run(tmp_path, monkeypatch, [*layout, *agent], response_length=None)
    assert sum(m["rollout/server_requests_cut"] for m in metrics) > 0
    assert sum(m["async/interrupted_samples"] for m in metrics) == 0  # no episode came back cut
    assert max(m["training/off_policy/trajectory_spans/max"] for m in metrics) == 2
    assert all(m["openai_agent/failed_ratio"] == 0 for m in metrics)


def test_streaming_groups_over_two_replicas_finishing_out_of_order_stay_within_the_bound(
    ray_cluster, tmp_path, monkeypatch
):
    """Two rollout replicas, chunks of 2 groups, replica 1 slower by seconds per call: groups finish out of order, a
    step trains the oldest finished ones, replica 1's older groups fall behind and are evicted, and under
    `regenerate` their prompts are generated again, so every prompt is still trained exactly once."""
    monkeypatch.setenv("RLFRAME_DELAY_AT", "rollout.generate:3:2.5-3.5:1")
    dumps = tmp_path / "rollouts"
    metrics, _ = train_in_process(
        [
            *BASE,
            *SEPARATE,
            "actor_rollout_ref.rollout.n_gpus_per_node=2",
            "trainer.total_training_steps=6",
            "trainer.test_freq=-1",
            "trainer.v1.sampler.max_off_policy_threshold=2",  # η = 1
            "trainer.v1.sampler.max_off_policy_strategy=regenerate",
            f"trainer.rollout_data_dir={dumps}",
            f"trainer.default_local_dir={tmp_path / 'async'}",
        ]
    )
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert max(m[f"{STALENESS}/max"] for m in metrics) <= 1
    assert max(m["async/in_flight_groups/max"] for m in metrics) <= 8  # (L + 1) · B
    trained = times_trained(dumps, range(1, 7))
    assert len(trained) == 24 and set(trained.values()) == {1}  # an evicted group's prompt is trained later, once
    # how many fall behind depends on the machine's speed (here 8 of 24 in a quiet run); what they cost is logged
    for m in metrics:
        assert (m["async/tokens_never_trained"] > 0) == (m["training/off_policy/evicted_samples"] > 0)
    assert all(m["async/rollout_pool/idle_s"] >= 0 for m in metrics)
    assert sum(m["async/rollout_pool/idle_s"] for m in metrics) > 0  # replica 0 waits while the step trains


@pytest.mark.parametrize("processes", [1, 2])
def test_colocate_async_cuts_what_generates_ahead_once_a_batch_is_sampled_and_trains_every_prompt_once(
    ray_cluster, tmp_path, monkeypatch, processes
):
    """colocate_async, η = 1, responses of 24 tokens at ~0.12 s a token: the engine that generated a step's batch goes
    on with the next batch while the driver scores (a scorer of ~0.1 s a sample); once the step's batch is sampled
    that generation is cut (before the step trains on the same processes; with 2, each cuts its own share) and its
    rows continue on the new weights. Every trained token is at most η versions old, cut rows span two versions, and
    every prompt is trained once."""
    metrics = cut_run(tmp_path, monkeypatch, [*BASE, *COLOCATE, f"trainer.n_gpus_per_node={processes}"])
    assert [m[f"{STALENESS}_worst/max"] for m in metrics][1:] == [1, 1, 1]  # the batch generated one step ahead
    assert sum(m["async/interrupted_samples"] for m in metrics) > 0
    assert max(m["training/off_policy/trajectory_spans/max"] for m in metrics) == 2
    # a cut row's newest tokens come from the weights its step starts from
    assert min(m[f"{STALENESS}/min"] for m in metrics[1:]) == 0
    assert [m["async/in_flight_groups"] for m in metrics] == [4, 4, 4, 0]  # L = 1 batch ahead, none after the last
    assert max(m["async/in_flight_groups/max"] for m in metrics) == 8  # (L + 1) · B
    assert not any("async/rollout_pool/idle_s" in m for m in metrics)  # no rollout pool


def _trained_prompts(dumps, steps) -> dict[int, set]:
    """{step: the prompt indices it trained}, from the rollout dumps."""
    return {s: {json.loads(line)["index"] for line in (dumps / f"{s}.jsonl").read_text().splitlines()} for s in steps}


def _uids(dumps, steps) -> dict[int, set]:
    """{prompt index: the uids of the groups that trained it in `steps`}: a group generated again gets a new uid."""
    uids: dict[int, set] = {}
    for s in steps:
        for line in (dumps / f"{s}.jsonl").read_text().splitlines():
            row = json.loads(line)
            uids.setdefault(row["index"], set()).add(row["uid"])
    return uids


def _kept_finished(checkpoint) -> list[int]:
    """The prompt indices of the groups `checkpoint` keeps finished (responses and all), oldest first."""
    from rlframe.trainer.checkpointing import load_data

    entry = load_data(str(checkpoint / "data.pt"))["driver"].get("finished_groups")
    return [int(i) for i in entry["prompts"]["fields"]["index"]] if entry and entry["versions"] else []


FOUR_STEPS = [*BASE, "trainer.total_training_steps=4", "trainer.test_freq=-1"]
ETA1 = ["trainer.v1.sampler.max_off_policy_threshold=2"]  # η = 1


@pytest.fixture(scope="module", params=list(MODES))
def eta1_saved_at_step_2(request, ray_cluster, tmp_path_factory):
    """η = 1 under either async mode, four steps, a checkpoint at step 2 (when the groups of steps 3 and 4 are
    generating or finished): (the mode, the run's folder, its metrics)."""
    first = tmp_path_factory.mktemp(f"eta1_first_{request.param}")
    metrics, _ = train_in_process(
        [
            *FOUR_STEPS,
            *MODES[request.param],
            *ETA1,
            "trainer.save_freq=2",
            f"trainer.rollout_data_dir={first / 'dumps'}",
            f"trainer.default_local_dir={first}",
        ]
    )
    return request.param, first, metrics


def resumed_from_step_2(first, resumed, overrides: list[str]) -> list[dict]:
    """A run with `overrides` resumed from `first`'s global_step_2 into the folder `resumed`: its metrics."""
    metrics, _ = train_in_process(
        [
            *overrides,
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={first / 'global_step_2'}",
            f"trainer.rollout_data_dir={resumed / 'dumps'}",
            f"trainer.default_local_dir={resumed}",
        ]
    )
    return metrics


@pytest.mark.parametrize("resumed_mode", list(MODES))
def test_a_checkpoint_keeps_the_prompts_in_flight_and_a_run_resumed_in_either_async_mode_trains_them(
    eta1_saved_at_step_2, tmp_path, resumed_mode
):
    """η = 1: when step 2 saves, the groups of steps 3 and 4 are generating or finished. The checkpoint keeps the
    finished ones whole and the prompts of the others; a run resumed from it, in the same async mode or the other,
    trains the finished groups as they are (their uids and responses are the first run's), generates the others
    again, and trains exactly the prompts the uninterrupted run trained in steps 3 and 4, each once, none of those
    of steps 1 and 2. (How many had finished at the save depends on the machine's speed; `colocate_async` cuts what
    runs ahead once a batch is sampled, so mostly none.)"""
    mode, first, metrics = eta1_saved_at_step_2
    assert [m["async/in_flight_groups"] for m in metrics][:2] == [4, 4]  # step 2 saved with groups in flight
    kept = _kept_finished(first / "global_step_2")
    assert kept or mode == "colocate_async"  # the pool generates step 3's groups during all of step 2's update
    resumed = tmp_path / "resumed"
    metrics = resumed_from_step_2(first, resumed, [*FOUR_STEPS, *MODES[resumed_mode], *ETA1])
    assert [m["step"] for m in metrics] == [3, 4]
    before = _trained_prompts(first / "dumps", (1, 2, 3, 4))
    after = _trained_prompts(resumed / "dumps", (3, 4))
    assert after[3] | after[4] == before[3] | before[4] and len(after[3] | after[4]) == 8
    assert not after[3] & after[4]  # each once
    assert not (after[3] | after[4]) & (before[1] | before[2])
    assert sum(m["async/restored_groups"] for m in metrics) == len(kept)
    uids_before, uids_after = _uids(first / "dumps", (3, 4)), _uids(resumed / "dumps", (3, 4))
    for index in after[3] | after[4]:  # a kept group is the first run's; any other was generated again
        assert (uids_after[index] == uids_before[index]) == (index in kept), index


def test_an_asynchronous_checkpoint_resumed_synchronously_trains_the_prompts_it_had_in_flight(
    eta1_saved_at_step_2, tmp_path
):
    """Before, the sync loop ignored the checkpoint's in-flight prompts: 4 prompts were never trained, without a
    word. Now its steps 3 and 4 train exactly the prompts the asynchronous run (either mode) trained there."""
    mode, first, _ = eta1_saved_at_step_2
    resumed = tmp_path / "resumed"
    metrics = resumed_from_step_2(first, resumed, FOUR_STEPS)
    assert [m["step"] for m in metrics] == [3, 4]
    before = _trained_prompts(first / "dumps", (1, 2, 3, 4))
    after = _trained_prompts(resumed / "dumps", (3, 4))
    assert after[3] | after[4] == before[3] | before[4] and len(after[3] | after[4]) == 8
    assert not after[3] & after[4]  # each once
    # the groups the checkpoint kept finished are generated again (on-policy), first
    uids_before, uids_after = _uids(first / "dumps", (3, 4)), _uids(resumed / "dumps", (3, 4))
    kept = _kept_finished(first / "global_step_2")
    assert kept or mode == "colocate_async"
    assert set(kept) <= after[3] and all(not uids_after[i] & uids_before[i] for i in kept)


@pytest.fixture(scope="module")
def sync_saved_at_step_2(ray_cluster, tmp_path_factory) -> Path:
    """The sync run of FOUR_STEPS with a checkpoint at step 2: its folder `run` and its rollout dumps `sync_dumps`."""
    root = tmp_path_factory.mktemp("sync_saved")
    train_in_process(
        [
            *FOUR_STEPS,
            f"trainer.default_local_dir={root / 'run'}",
            "trainer.save_freq=2",
            f"trainer.rollout_data_dir={root / 'sync_dumps'}",
        ]
    )
    return root


@pytest.mark.parametrize("mode", list(MODES))
def test_a_synchronous_checkpoint_resumes_asynchronously_in_its_own_folder_and_each_step_is_logged_once(
    sync_saved_at_step_2, tmp_path, mode
):
    """Before, `separate_async` crashed on a sync checkpoint (KeyError: 'async_prompts'). Resumed in the same folder
    under either async mode, the run trains the prompts the sync run trained in steps 3 and 4, and metrics.jsonl
    holds each step once: the sync run's lines past the checkpoint are replaced by the resumed run's."""
    folder = tmp_path / "run"  # a copy of the sync run's folder: the resumed run rewrites its metrics.jsonl
    shutil.copytree(sync_saved_at_step_2 / "run", folder)
    metrics, _ = train_in_process(
        [
            *FOUR_STEPS,
            f"trainer.default_local_dir={folder}",
            *MODES[mode],
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={folder / 'global_step_2'}",
            f"trainer.rollout_data_dir={tmp_path / 'async_dumps'}",
        ]
    )
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert ["async/in_flight_groups" in m for m in metrics] == [False, False, True, True]
    before = _trained_prompts(sync_saved_at_step_2 / "sync_dumps", (3, 4))
    after = _trained_prompts(tmp_path / "async_dumps", (3, 4))
    assert after[3] | after[4] == before[3] | before[4] and len(after[3] | after[4]) == 8
