"""trainer.v1.* and the rollout pool's keys: verl's names and defaults, and every refusal naming its key."""

import os

import pytest

from rlframe.config.schema import inactive_keys
from rlframe.trainer.config import compose, typed

SEPARATE = [
    "trainer.v1.trainer_mode=separate_async",
    "actor_rollout_ref.rollout.nnodes=1",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",  # parameter_sync_step 4 (verl's default) × 2 = 8
]
COLOCATE = ["trainer.v1.trainer_mode=colocate_async", "trainer.v1.sampler.max_off_policy_threshold=3"]

OPENAI_AGENT = [
    "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
    f"actor_rollout_ref.rollout.agent.openai_agent.path={os.path.dirname(__file__)}/../assets/agents/two_turns.py",
    "actor_rollout_ref.rollout.agent.openai_agent.name=agent",
]


def test_the_v1_keys_have_verls_names_and_defaults():
    from rlframe.config.verl_keys import verl_defaults

    cfg = typed(compose([]))
    v1, defaults = cfg.trainer.v1, verl_defaults()
    assert v1.trainer_mode == defaults["trainer.v1.trainer_mode"] == "sync"
    assert v1.sampler.max_off_policy_threshold == defaults["trainer.v1.sampler.max_off_policy_threshold"] == 8
    assert v1.sampler.max_off_policy_strategy == defaults["trainer.v1.sampler.max_off_policy_strategy"] == "drop"
    assert v1.separate_async.num_warmup_batches == defaults["trainer.v1.separate_async.num_warmup_batches"] == 1
    assert v1.separate_async.parameter_sync_step == defaults["trainer.v1.separate_async.parameter_sync_step"] == 4
    assert v1.colocate_async.num_warmup_batches == defaults["trainer.v1.colocate_async.num_warmup_batches"] == 1
    assert cfg.actor_rollout_ref.rollout.nnodes == defaults["actor_rollout_ref.rollout.nnodes"] == 0
    # verl: ${oc.select:trainer.n_gpus_per_node,8}; rlframe's trainer.n_gpus_per_node always exists
    assert typed(compose(["trainer.n_gpus_per_node=3"])).actor_rollout_ref.rollout.n_gpus_per_node == 3


def test_separate_async_with_a_rollout_pool_is_accepted_and_its_keys_take_effect():
    typed(compose([*SEPARATE, *OPENAI_AGENT, "actor_rollout_ref.rollout.partial_rollout=false"]))  # episodes uncut
    typed(compose([*SEPARATE, *OPENAI_AGENT]))  # a push cuts a request and the replica continues it
    tp2 = ["actor_rollout_ref.rollout.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    typed(compose([*SEPARATE, *OPENAI_AGENT, *tp2]))  # ... on a TP replica, whose ranks load the same weights
    cfg = typed(compose(SEPARATE))
    assert cfg.trainer.v1.trainer_mode == "separate_async"
    inactive = inactive_keys(cfg)
    in_effect = ("trainer.v1.sampler", "trainer.v1.separate_async", "actor_rollout_ref.rollout.n")
    assert not any(key.startswith(in_effect) for key in inactive)


def test_under_sync_the_async_keys_are_reported_without_effect():
    inactive = inactive_keys(typed(compose([])))
    for key in (
        "trainer.v1.sampler",
        "trainer.v1.separate_async",
        "trainer.v1.colocate_async",
        "actor_rollout_ref.rollout.nnodes",
    ):
        assert "trainer.v1.trainer_mode=sync" in inactive[key]


def test_colocate_async_is_accepted_on_the_training_processes_and_reads_its_own_lookahead():
    from rlframe.trainer.config import lookahead

    cfg = typed(compose([*COLOCATE, "trainer.v1.colocate_async.num_warmup_batches=2"]))
    assert cfg.trainer.v1.trainer_mode == "colocate_async"
    assert lookahead(cfg.trainer.v1) == 2  # min(num_warmup_batches 2, η = 3 - 1)
    inactive = inactive_keys(cfg)
    assert not any(key.startswith(("trainer.v1.sampler", "trainer.v1.colocate_async")) for key in inactive)
    for key in (
        "trainer.v1.separate_async",
        "actor_rollout_ref.rollout.nnodes",
        "actor_rollout_ref.rollout.partial_rollout",
    ):
        assert "only separate_async reads it" in inactive[key]
    assert "colocate_async" in inactive_keys(typed(compose(SEPARATE)))["trainer.v1.colocate_async"]
    # ReMax, LoRA and the profiler run on the training processes' engines too (tests/e2e/test_async_e2e.py)
    typed(compose([*COLOCATE, "algorithm.adv_estimator=remax", "actor_rollout_ref.model.lora_rank=8"]))
    typed(compose([*COLOCATE, "global_profiler.tool=torch", "global_profiler.steps=[1]"]))


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["trainer.v1.colocate_async.num_warmup_batches=-1"], r"colocate_async.num_warmup_batches=-1: must be >= 0"),
        (["actor_rollout_ref.rollout.pool_cpu_generation=true"], r"pool_cpu_generation=true with .*colocate_async"),
        ([*OPENAI_AGENT, "actor_rollout_ref.rollout.partial_rollout=false"], r"openai_agent with .*colocate_async"),
    ],
)
def test_what_colocate_async_does_not_support_is_refused_by_name(overrides, expected):
    with pytest.raises(ValueError, match=expected):
        typed(compose([*COLOCATE, *overrides]))


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["trainer.v1.trainer_mode=fully_async"], r"trainer.v1.trainer_mode='fully_async' is not one of sync"),
        ([*SEPARATE, "actor_rollout_ref.rollout.nnodes=0"], r"rollout.nnodes=0 with .*separate_async"),
        ([*SEPARATE, "trainer.v1.sampler.max_off_policy_threshold=0"], r"max_off_policy_threshold=0: must be >= 1"),
        ([*SEPARATE, "trainer.v1.sampler.max_off_policy_strategy=skip"], r"max_off_policy_strategy='skip' is not one"),
        ([*SEPARATE, "trainer.v1.separate_async.num_warmup_batches=-1"], r"num_warmup_batches=-1: must be >= 0"),
        (
            [*SEPARATE, "trainer.v1.separate_async.parameter_sync_step=2"],
            r"parameter_sync_step=2 with data.train_batch_size=8 .* set .*parameter_sync_step=4",
        ),
        (
            [
                *SEPARATE,
                "actor_rollout_ref.rollout.n_gpus_per_node=3",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            ],
            r"tensor_model_parallel_size=2 with .*n_gpus_per_node = 3 processes; pick a TP size that divides 3",
        ),
        (
            [*SEPARATE, *OPENAI_AGENT, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
            r"openai_agent with .*partial_rollout=true and .*checkpoint_engine.backend=nccl with .*separate_async: "
            r".*set checkpoint_engine.backend=naive or partial_rollout=false",
        ),
        ([*SEPARATE, "actor_rollout_ref.hybrid_engine=false"], r"hybrid_engine=false"),
    ],
)
def test_what_separate_async_does_not_support_is_refused_by_name(overrides, expected):
    with pytest.raises(ValueError, match=expected):
        typed(compose(overrides))


@pytest.mark.parametrize(
    "override,expected",
    [
        ("trainer.v1.separate_async.hybrid_rollout.enable_switch=true", r"lending idle training replicas"),
        ("trainer.v1.sampler.sync_refill_failed_groups=true", r"refilling failed groups is not implemented"),
        ("trainer.use_v1=false", r"trainer.use_v1=false: verl's legacy"),
    ],
)
def test_verls_other_v1_keys_are_taken_at_their_defaults_only(override, expected):
    key = override.split("=")[0]
    from rlframe.config.verl_keys import verl_defaults

    compose([f"{key}={str(verl_defaults()[key]).lower()}"])  # verl's default: the same run
    with pytest.raises(ValueError, match=expected):
        compose([override])


@pytest.mark.parametrize("trainer_mode", ["separate", "colocate"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_tool_agent_runs_in_either_async_mode_and_either_rollout_mode(mode, trainer_mode):
    typed(
        compose(
            [
                *{"separate": SEPARATE, "colocate": COLOCATE}[trainer_mode],
                "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                f"actor_rollout_ref.rollout.mode={mode}",
                "data.return_raw_chat=true",
            ]
        )
    )


def test_the_rollout_pool_cuts_hf_and_vllm_and_runs_sglang_without_partial_rollout():
    # sglang is refused earlier when it is not installed (here): the pool's own rule, read directly
    from rlframe.trainer.config import _separate_async_refusals

    cfg = typed(compose(SEPARATE))
    for name, refused in (("hf", False), ("vllm", False), ("sglang", True)):
        cfg.actor_rollout_ref.rollout.name = name
        engine = _separate_async_refusals(cfg)[0]
        assert engine[0] is refused, name
        assert engine[1] == f"actor_rollout_ref.rollout.name={name} with actor_rollout_ref.rollout.partial_rollout=true"
        assert "set actor_rollout_ref.rollout.partial_rollout=false" in engine[2]
    # without partial rollout nothing is cut: SGLang generates on the pool, at any TP size (verl's one-step-off)
    cfg.actor_rollout_ref.rollout.partial_rollout = False
    cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = 2
    assert not [setting for is_set, setting, _ in _separate_async_refusals(cfg) if is_set]
    cfg.trainer.v1.trainer_mode = "colocate_async"  # always cuts what generates ahead
    refused = [setting for is_set, setting, _ in _separate_async_refusals(cfg) if is_set]
    assert refused[0] == "actor_rollout_ref.rollout.name=sglang" and len(refused) == 2  # and its TP group's cut


def test_tp_replicas_run_on_the_rollout_pool_with_hf_and_vllm_and_an_engine_that_cannot_cut_them_is_refused():
    from dataclasses import replace

    from rlframe.trainer.config import _separate_async_refusals
    from rlframe.workers.rollout.registry import find_engine, register, unregister

    cfg = typed(
        compose([*SEPARATE, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    )  # 2 processes: 1 replica
    for name in ("hf", "vllm"):  # read directly: vllm is refused earlier when it is not installed
        cfg.actor_rollout_ref.rollout.name = name
        assert not [setting for is_set, setting, _ in _separate_async_refusals(cfg) if is_set], name
    # an engine whose TP ranks would not stop at the same step (Capabilities.tp_cut=False)
    hf = find_engine("hf")
    register(replace(hf, name="no_tp_cut", capabilities=replace(hf.capabilities, tp_cut=False)))
    try:
        cfg.actor_rollout_ref.rollout.name = "no_tp_cut"
        refused = [(setting, why) for is_set, setting, why in _separate_async_refusals(cfg) if is_set]
    finally:
        unregister("no_tp_cut")
    setting = "actor_rollout_ref.rollout.tensor_model_parallel_size=2 with actor_rollout_ref.rollout.name=no_tp_cut"
    assert [s for s, _ in refused] == [setting]
    assert "would not stop at the same step" in refused[0][1]


def test_the_profiler_runs_on_the_rollout_pool_with_the_actors_settings_by_default_as_in_verl():
    actor = ["actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.ranks=[1]"]
    cfg = typed(compose([*SEPARATE, "global_profiler.tool=torch", "global_profiler.steps=[1]", *actor]))
    profiler = cfg.actor_rollout_ref.rollout.profiler
    assert (profiler.enable, profiler.all_ranks, profiler.ranks) == (True, False, [1])
    assert not any(key.startswith("actor_rollout_ref.rollout.profiler") for key in inactive_keys(cfg))
    own = typed(
        compose([*SEPARATE, "global_profiler.tool=torch", *actor, "actor_rollout_ref.rollout.profiler.ranks=[0]"])
    )
    assert own.actor_rollout_ref.rollout.profiler.ranks == [0]


def test_the_checkpoint_engine_keys_have_verls_names_and_defaults_and_nccl_runs_on_the_rollout_pool():
    from rlframe.config.verl_keys import verl_defaults

    engine, defaults = typed(compose([])).actor_rollout_ref.rollout.checkpoint_engine, verl_defaults()
    prefix = "actor_rollout_ref.rollout.checkpoint_engine"
    for name in ("backend", "update_weights_bucket_megabytes", "engine_kwargs", "custom_backend_module"):
        assert getattr(engine, name) == defaults[f"{prefix}.{name}"], name
    cfg = typed(compose([*SEPARATE, f"{prefix}.backend=nccl", f"{prefix}.update_weights_bucket_megabytes=64"]))
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes == 64
    inactive = inactive_keys(cfg)
    assert f"{prefix}.backend" not in inactive and f"{prefix}.update_weights_bucket_megabytes" not in inactive
    assert (
        "only {}" in inactive[f"{prefix}.engine_kwargs"] and "only null" in inactive[f"{prefix}.custom_backend_module"]
    )
    naive = inactive_keys(typed(compose(SEPARATE)))  # the naive push sends whole tensors: no buckets
    assert "backend=naive" in naive[f"{prefix}.update_weights_bucket_megabytes"]
    assert "trainer.v1.trainer_mode=sync" in inactive_keys(typed(compose([])))[prefix]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
            r"checkpoint_engine.backend=nccl with trainer.v1.trainer_mode=sync: .*nothing to push",
        ),
        (
            [*COLOCATE, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
            r"checkpoint_engine.backend=nccl with trainer.v1.trainer_mode=colocate_async: .*set "
            r"trainer.v1.trainer_mode=separate_async",
        ),
        (
            [*SEPARATE, "actor_rollout_ref.rollout.checkpoint_engine.backend=nixl"],
            r"checkpoint_engine.backend='nixl' is not one of .*naive.*nccl",
        ),
        (
            [*SEPARATE, "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=0"],
            r"update_weights_bucket_megabytes=0: must be >= 1",
        ),
        (
            [*SEPARATE, "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.nccl.rebuild_group=true"],
            r"checkpoint_engine.engine_kwargs=.*take no engine arguments.*leave it \{\}",
        ),
        (
            [*SEPARATE, "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=my.backend"],
            r"checkpoint_engine.custom_backend_module='my.backend': custom checkpoint-engine backends are not "
            r"supported; leave it null",
        ),
    ],
)
def test_what_the_checkpoint_engine_does_not_support_is_refused_by_name(overrides, expected):
    with pytest.raises(ValueError, match=expected):
        typed(compose(overrides))
