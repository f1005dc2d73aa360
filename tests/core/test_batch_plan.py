"""The batch plan: hand-computed sizes over a grid of cluster shapes, every rejection names its keys,
and the keys in effect / ignored for a config."""

import json

import pytest
from helpers.small_config import SMALL
from omegaconf import OmegaConf

from rlframe.batch_plan import TINY_MODEL_SHAPE, BatchPlan, ModelShape, make_batch_plan, read_model_shape
from rlframe.config.key_status import ignored_key_warnings, ignored_keys, key_statuses, override_key
from rlframe.trainer.config import compose

A, R, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
SHORT = {  # short names used by the grid below
    "nodes": "trainer.nnodes",
    "gpus": "trainer.n_gpus_per_node",
    "sp": f"{A}.ulysses_sequence_parallel_size",
    "tp": f"{R}.tensor_model_parallel_size",
    "n": f"{R}.n",
    "batch": "data.train_batch_size",
    "mini": f"{A}.ppo_mini_batch_size",
    "micro": f"{A}.ppo_micro_batch_size_per_gpu",
    "epochs": f"{A}.ppo_epochs",
    "dynamic": f"{A}.use_dynamic_bsz",
    "max_tokens": f"{A}.ppo_max_token_len_per_gpu",
    "engine": f"{R}.name",
    "prompt": "data.max_prompt_length",
    "response": "data.max_response_length",
    "logprob_micro": f"{R}.log_prob_micro_batch_size_per_gpu",
}


@pytest.fixture(scope="module")
def base():
    return compose(SMALL)


def overrides_of(**kv) -> list[str]:
    return [f"{SHORT.get(k, k)}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in kv.items()]


def cfg_of(base, *extra, **kv):
    """The default config with overrides merged (interpolations kept, like Hydra's compose)."""
    return OmegaConf.merge(base, OmegaConf.from_dotlist(overrides_of(**kv) + list(extra)))


# Each case: cluster/config overrides, then the sizes worked out by hand.
GRID = [
    (
        dict(nodes=1, gpus=8, sp=1, tp=2, engine="vllm", n=4, batch=32, mini=8, micro=4),
        dict(
            world=8,
            seqs=128,
            dp=8,
            per_gpu=16,
            per_dp=16,
            mini_dp=4,
            num_mini=4,
            accum=1,
            rollout_dp=4,
            rollout_per_dp=32,
            opt_steps=4,
        ),
    ),
    (
        dict(nodes=2, gpus=8, sp=4, tp=4, engine="vllm", n=8, batch=64, mini=16, micro=2),
        dict(
            world=16,
            seqs=512,
            dp=4,
            per_gpu=32,
            per_dp=128,
            mini_dp=32,
            num_mini=4,
            accum=16,
            rollout_dp=4,
            rollout_per_dp=128,
            opt_steps=4,
        ),
    ),
    (
        dict(nodes=4, gpus=4, sp=2, tp=8, engine="vllm", n=5, batch=32, mini=8, micro=5, epochs=2),
        dict(
            world=16,
            seqs=160,
            dp=8,
            per_gpu=10,
            per_dp=20,
            mini_dp=5,
            num_mini=4,
            accum=1,
            rollout_dp=2,
            rollout_per_dp=80,
            opt_steps=8,
        ),
    ),
    (
        dict(nodes=1, gpus=2, sp=1, n=4, batch=8, mini=4, micro=2),  # the small CPU config (helpers/small_config.py)
        dict(
            world=2,
            seqs=32,
            dp=2,
            per_gpu=16,
            per_dp=16,
            mini_dp=8,
            num_mini=2,
            accum=4,
            rollout_dp=2,
            rollout_per_dp=16,
            opt_steps=2,
        ),
    ),
    (
        dict(nodes=1, gpus=4, sp=2, tp=2, n=1, batch=12, mini=4, micro=1),  # hf shards over TP groups too
        dict(
            world=4,
            seqs=12,
            dp=2,
            per_gpu=3,
            per_dp=6,
            mini_dp=2,
            num_mini=3,
            accum=2,
            rollout_dp=2,
            rollout_per_dp=6,
            opt_steps=3,
        ),
    ),
    (
        dict(nodes=3, gpus=2, sp=3, n=2, batch=6, mini=3, micro=3),
        dict(
            world=6,
            seqs=12,
            dp=2,
            per_gpu=2,
            per_dp=6,
            mini_dp=3,
            num_mini=2,
            accum=1,
            rollout_dp=6,
            rollout_per_dp=2,
            opt_steps=2,
        ),
    ),
]


@pytest.mark.parametrize("case,expected", GRID)
def test_plan_matches_hand_computed_sizes(base, case, expected):
    plan = make_batch_plan(cfg_of(base, **case))
    assert plan.world_size == expected["world"]
    assert plan.sequences_per_step == expected["seqs"]
    a = plan.actor
    assert (a.dp_size, a.sequences_per_gpu, a.sequences_per_dp) == (
        expected["dp"],
        expected["per_gpu"],
        expected["per_dp"],
    )
    assert (a.mini_batch_size_per_dp, a.num_mini_batches, a.grad_accum_steps) == (
        expected["mini_dp"],
        expected["num_mini"],
        expected["accum"],
    )
    assert a.optimizer_steps_per_step == expected["opt_steps"]
    assert a.max_token_len is None and a.micro_batch_size == case["micro"]
    assert (plan.rollout.dp_size, plan.rollout.sequences_per_dp) == (expected["rollout_dp"], expected["rollout_per_dp"])
    assert plan.balance_partitions == expected["dp"]
    # old log-probs: forward only, the whole per-rank share in micro-batches of log_prob_micro (4)
    assert a.forward.sequences_per_dp == expected["per_dp"]
    assert a.forward.num_micro_batches == -(-expected["per_dp"] // 4)


def test_dynamic_budget_is_per_gpu_tokens_times_sp(base):
    plan = make_batch_plan(
        cfg_of(base, gpus=2, sp=2, n=1, batch=6, mini=2, dynamic=True, max_tokens=3000, prompt=1024, response=2048)
    )
    a = plan.actor
    assert (a.dp_size, a.sequences_per_gpu, a.sequences_per_dp, a.mini_batch_size_per_dp) == (1, 3, 6, 2)
    assert (a.max_token_len_per_gpu, a.max_token_len) == (3000, 6000)
    assert a.micro_batch_size is None and a.grad_accum_steps is None and a.packing_algorithm == "kk"
    assert a.forward.max_token_len == 6000  # the log-prob budget interpolates the actor's
    assert plan.max_sequence_length == 3072


def test_critic_and_ref_plans_use_their_own_keys(base):
    cfg = cfg_of(
        base,
        "algorithm.adv_estimator=gae",
        "critic.ulysses_sequence_parallel_size=2",
        "critic.ppo_mini_batch_size=2",
        "critic.ppo_micro_batch_size_per_gpu=1",
        f"{A}.use_kl_loss=true",
        f"{REF}.log_prob_use_dynamic_bsz=true",
        f"{REF}.log_prob_max_token_len_per_gpu=512",
        gpus=4,
        n=2,
        batch=8,
        mini=4,
    )
    plan = make_batch_plan(cfg)
    assert (plan.actor.dp_size, plan.actor.mini_batch_size_per_dp, plan.actor.grad_accum_steps) == (4, 2, 1)
    c = plan.critic
    assert (c.sequence_parallel_size, c.dp_size, c.sequences_per_dp) == (2, 2, 8)
    assert (c.mini_batch_size_per_dp, c.num_mini_batches, c.grad_accum_steps) == (2, 4, 2)
    assert (c.forward.micro_batch_size, c.forward.num_micro_batches) == (1, 8)  # forward micro follows critic micro
    assert plan.ref.use_dynamic_bsz and plan.ref.max_token_len == 512 and plan.ref.dp_size == 4
    assert make_batch_plan(base).critic is None and make_batch_plan(base).ref is None


def test_plan_round_trips_through_json(base):
    cfg = cfg_of(base, "algorithm.adv_estimator=gae", f"{A}.use_kl_loss=true")
    plan = make_batch_plan(cfg)
    assert BatchPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


# Each rejected case: overrides, then fragments the message must contain (keys, values, equation).
REJECTED = [
    (dict(batch=8, mini=3), ["data.train_batch_size = 8", f"{A}.ppo_mini_batch_size = 3", "8 % 3 = 2"]),
    (
        dict(gpus=3),
        [
            "data.train_batch_size × actor_rollout_ref.rollout.n = 8 × 4 = 32",
            "trainer.nnodes × trainer.n_gpus_per_node = 1 × 3 = 3",
            "32 % 3 = 2",
        ],
    ),
    (
        dict(gpus=8, mini=1),
        [
            f"{A}.ppo_mini_batch_size × {R}.n = 1 × 4 = 4",
            f"dp = world_size / {A}.ulysses_sequence_parallel_size = 8 / 1 = 8",
            "trainer.n_gpus_per_node",
            "4 % 8 = 4",
        ],
    ),
    (
        dict(gpus=4, sp=3, batch=12, n=1, mini=12),
        [f"{A}.ulysses_sequence_parallel_size = 3", "trainer.nnodes × trainer.n_gpus_per_node", "4 % 3 = 1"],
    ),
    (
        dict(micro=3),
        [f"{A}.ppo_micro_batch_size_per_gpu = 3", f"{A}.ppo_mini_batch_size", f"{R}.n", "(4 × 4) / 2 = 8", "8 % 3 = 2"],
    ),
    (dict(gpus=4, tp=3, engine="vllm"), [f"{R}.tensor_model_parallel_size = 3", "4 % 3 = 1"]),
    (
        dict(sp=2, **{"actor_rollout_ref.model.use_remove_padding": False}),
        [f"{A}.ulysses_sequence_parallel_size = 2", "actor_rollout_ref.model.use_remove_padding"],
    ),
    (dict(dynamic=True, max_tokens=64), [f"{A}.ppo_max_token_len_per_gpu", "64 + 16 = 80", "at least 80"]),
    (dict(sp=2, dynamic=True, max_tokens=32), [f"{A}.ppo_max_token_len_per_gpu", "32 × 2 = 64", "at least 40"]),
    (dict(n=0), [f"{R}.n = 0", "positive"]),
    (dict(batch=0), ["data.train_batch_size = 0"]),
    (dict(mini=-4), [f"{A}.ppo_mini_batch_size = -4"]),
    (dict(gpus=0), ["trainer.n_gpus_per_node = 0"]),
    (dict(micro=0), [f"{A}.ppo_micro_batch_size_per_gpu = 0"]),
    (dict(logprob_micro=0), [f"{R}.log_prob_micro_batch_size_per_gpu = 0"]),
    (dict(dynamic=True, max_tokens=0), [f"{A}.ppo_max_token_len_per_gpu = 0"]),
    (dict(epochs=0), [f"{A}.ppo_epochs = 0"]),
    (dict(sp=0), [f"{A}.ulysses_sequence_parallel_size = 0"]),
    ({"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 3}, ["critic.ppo_mini_batch_size = 3", "8 % 3"]),
    (
        {"algorithm.adv_estimator": "gae", "critic.ppo_micro_batch_size_per_gpu": 3},
        ["critic.ppo_micro_batch_size_per_gpu = 3", "8 % 3 = 2"],
    ),
    (
        {
            "algorithm.adv_estimator": "gae",
            "critic.ulysses_sequence_parallel_size": 2,
            "critic.model.use_remove_padding": False,
        },
        ["critic.ulysses_sequence_parallel_size = 2", "critic.model.use_remove_padding"],
    ),
    (
        {"algorithm.adv_estimator": "gae", "critic.forward_micro_batch_size_per_gpu": 0},
        ["critic.forward_micro_batch_size_per_gpu = 0"],
    ),
    (
        {
            f"{A}.use_kl_loss": True,
            f"{REF}.log_prob_use_dynamic_bsz": True,
            f"{REF}.log_prob_max_token_len_per_gpu": 50,
        },
        [f"{REF}.log_prob_max_token_len_per_gpu", "at least 80"],
    ),
    (
        {f"{A}.use_kl_loss": True, f"{REF}.ulysses_sequence_parallel_size": 3},
        [f"{REF}.ulysses_sequence_parallel_size = 3"],
    ),
]


@pytest.mark.parametrize("case,fragments", REJECTED)
def test_plan_rejects_bad_combination_naming_keys_values_and_equation(base, case, fragments):
    with pytest.raises(ValueError) as err:
        make_batch_plan(cfg_of(base, **case))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_rejects_every_non_dividing_mini_batch_over_dp(base):
    """Sweep mini × n over dp: exactly the non-dividing combinations fail, and they name both keys."""
    for gpus in (1, 2, 4, 8):
        for n in (1, 2, 3, 4):
            for mini in (1, 2, 4, 8):
                cfg = cfg_of(base, gpus=gpus, n=n, batch=8 * gpus, mini=mini, micro=1)
                if (mini * n) % gpus:
                    with pytest.raises(ValueError, match=r"ppo_mini_batch_size × actor_rollout_ref\.rollout\.n"):
                        make_batch_plan(cfg)
                else:
                    assert make_batch_plan(cfg).actor.mini_batch_size_per_dp == mini * n // gpus


def test_heads_must_divide_over_ulysses_and_tensor_parallel_ranks(base):
    heads_error = r"{} = 8 must divide the model's num_attention_heads = 4.*divisor of both .*: 1, 2, 4"
    with pytest.raises(ValueError, match=heads_error.format("ulysses_sequence_parallel_size")):
        make_batch_plan(cfg_of(base, gpus=8, sp=8, batch=16, mini=16, micro=1), TINY_MODEL_SHAPE)
    with pytest.raises(ValueError, match=heads_error.format("tensor_model_parallel_size")):
        make_batch_plan(cfg_of(base, gpus=8, tp=8, engine="vllm", batch=16, mini=16, micro=1), TINY_MODEL_SHAPE)
    assert make_batch_plan(cfg_of(base, gpus=4, sp=4, batch=16, mini=16, micro=1), TINY_MODEL_SHAPE)


def test_read_model_shape_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2})
    )
    assert read_model_shape(str(tmp_path)) == ModelShape(896, 14, 2)
    assert read_model_shape("builtin://tiny") == TINY_MODEL_SHAPE
    assert read_model_shape(str(tmp_path / "missing")) is None


# ───────────────────────────── keys in effect / ignored ─────────────────────────────


def status_of(cfg) -> dict[str, bool]:
    return {row.key: row.in_effect for row in key_statuses(cfg)}


def test_static_vs_dynamic_decides_micro_size_or_token_budget(base):
    static = status_of(base)
    assert static[f"{A}.ppo_micro_batch_size_per_gpu"] and not static[f"{A}.ppo_max_token_len_per_gpu"]
    dynamic = status_of(cfg_of(base, dynamic=True))
    assert not dynamic[f"{A}.ppo_micro_batch_size_per_gpu"] and dynamic[f"{A}.ppo_max_token_len_per_gpu"]
    assert dynamic[f"{R}.log_prob_max_token_len_per_gpu"]  # follows the actor through ${...}


def test_critic_ref_vllm_and_hf_keys(base):
    grpo = status_of(base)
    assert not grpo["critic"] and not grpo[REF] and not grpo[f"{R}.gpu_memory_utilization"]
    assert grpo[f"{R}.micro_batch_size"] and grpo[f"{R}.tensor_model_parallel_size"]
    gae = status_of(cfg_of(base, "algorithm.adv_estimator=gae", f"{A}.use_kl_loss=true", engine="vllm"))
    assert "critic" not in gae and gae["critic.ppo_micro_batch_size_per_gpu"]
    assert REF not in gae and gae[f"{REF}.log_prob_micro_batch_size_per_gpu"]
    assert gae[f"{R}.tensor_model_parallel_size"] and not gae[f"{R}.micro_batch_size"]


def test_key_feeding_a_live_key_through_interpolation_is_in_effect(base):
    # Static actor, dynamic old-log-prob forward: the actor's budget is read via ${...}.
    cfg = cfg_of(base, f"{R}.log_prob_use_dynamic_bsz=true")
    row = next(r for r in key_statuses(cfg) if r.key == f"{A}.ppo_max_token_len_per_gpu")
    assert row.in_effect and f"{R}.log_prob_max_token_len_per_gpu" in row.reason
    assert ignored_keys(cfg, [f"{A}.ppo_max_token_len_per_gpu=4096"]) == []


def test_user_set_keys_without_effect_get_one_warning_line_each(base):
    overrides = [
        f"{A}.ppo_max_token_len_per_gpu=4096",
        "+critic.optim.lr=1e-5",
        "algorithm.lam=0.95",
        f"{R}.gpu_memory_utilization=0.8",
        f"{A}.ppo_micro_batch_size_per_gpu=2",
        "trainer.nnodes=1",
        "~trainer.logger",
    ]
    cfg = cfg_of(base, *[o.lstrip("+") for o in overrides if not o.startswith("~")])
    lines = ignored_key_warnings(cfg, overrides)
    assert [line.split(" has no effect")[0] for line in lines] == [
        f"rlframe: warning: {A}.ppo_max_token_len_per_gpu=4096",
        "rlframe: warning: critic.optim.lr=1e-5",
        "rlframe: warning: algorithm.lam=0.95",
        f"rlframe: warning: {R}.gpu_memory_utilization=0.8",
    ]
    assert "use_dynamic_bsz=false" in lines[0] and "adv_estimator=grpo" in lines[1]
    dynamic = cfg_of(base, dynamic=True)
    assert ignored_keys(dynamic, [f"{A}.ppo_micro_batch_size_per_gpu=2"])[0][0] == f"{A}.ppo_micro_batch_size_per_gpu"


def test_override_key_parses_hydra_syntax():
    assert override_key("a.b=1") == "a.b"
    assert override_key("+a.b=1") == "a.b"
    assert override_key("++a.b=x=y") == "a.b"
    assert override_key("~a.b") is None
    assert override_key("a@pkg=v") == "a"


def test_unknown_packing_algorithm_is_rejected_only_when_dynamic(base):
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.packing_algorithm = 'best' is not a packing"):
        make_batch_plan(cfg_of(base, f"{A}.packing_algorithm=best", dynamic=True))
    assert make_batch_plan(cfg_of(base, f"{A}.packing_algorithm=best")).actor.packing_algorithm is None


def test_wrong_type_is_refused_when_composing_naming_the_key():
    with pytest.raises(ValueError, match=rf"{A}.ppo_mini_batch_size=2.5 has the wrong type"):
        compose([f"{A}.ppo_mini_batch_size=2.5"])


def test_verl_global_micro_batch_keys_are_divided_by_dp_as_verl_does(base):
    # verl 0.9.1: ppo_micro_batch_size //= world_size // sp, then it is the per-GPU size
    cfg = cfg_of(
        base,
        f"{A}.ppo_micro_batch_size_per_gpu=null",
        f"{A}.ppo_micro_batch_size=9",
        f"{R}.log_prob_micro_batch_size_per_gpu=null",
        f"{R}.log_prob_micro_batch_size=8",
        gpus=4,
    )
    plan = make_batch_plan(cfg)
    assert plan.actor.micro_batch_size == 2 and plan.actor.forward.micro_batch_size == 2


def test_micro_batch_size_needs_exactly_one_of_the_per_gpu_and_global_keys(base):
    with pytest.raises(
        ValueError,
        match=rf"{A}.ppo_micro_batch_size_per_gpu = 2 and {A}.ppo_micro_batch_size = 8 "
        r"are both set",
    ):
        make_batch_plan(cfg_of(base, f"{A}.ppo_micro_batch_size=8"))
    with pytest.raises(ValueError, match=rf"{A}.ppo_micro_batch_size_per_gpu is not set.*use_dynamic_bsz=true"):
        make_batch_plan(cfg_of(base, f"{A}.ppo_micro_batch_size_per_gpu=null"))
    assert make_batch_plan(cfg_of(base, f"{A}.ppo_micro_batch_size_per_gpu=null", dynamic=True)).actor.use_dynamic_bsz


# ───────────────────────────── the parallel layout ─────────────────────────────


def test_parallel_plan_lays_out_each_worker_group(base):
    plan = make_batch_plan(cfg_of(base, gpus=4, sp=2, tp=2, **{f"{REF}.ulysses_sequence_parallel_size": 2}))
    actor = plan.actor_parallel
    assert (actor.world_size, actor.sp_size, actor.dp_size, actor.tp_size) == (4, 2, 2, 2)
    assert actor.fsdp_size == 4  # fsdp_size -1: shard over every rank
    assert plan.critic_parallel is None and plan.reward_model_parallel is None
    assert (actor.sp_size, actor.dp_size) == (plan.actor.sequence_parallel_size, plan.actor.dp_size)
    gae = cfg_of(
        base,
        "algorithm.adv_estimator=gae",
        "critic.ulysses_sequence_parallel_size=2",
        "critic.model.fsdp_config.fsdp_size=1",
        "reward_model.enable=true",
        "reward_model.model.fsdp_config.fsdp_size=2",
        f"{A}.fsdp_config.fsdp_size=2",
        gpus=4,
    )
    plan = make_batch_plan(gae)
    assert (plan.actor_parallel.fsdp_size, plan.actor_parallel.sp_size) == (2, 1)
    critic, scorer = plan.critic_parallel, plan.reward_model_parallel
    assert (critic.sp_size, critic.dp_size, critic.fsdp_size, critic.tp_size) == (2, 2, 1, 1)
    assert (scorer.sp_size, scorer.fsdp_size, scorer.tp_size) == (1, 2, 1)


def test_cpu_generation_pools_only_for_an_engine_that_pools_without_tp_over_several_ranks(base):
    def pools(rollout_pools, **case):
        return make_batch_plan(cfg_of(base, **case), rollout_pools=rollout_pools).actor_parallel.pools_generation

    assert pools(True, gpus=2)
    assert not pools(False, gpus=2)  # the engine does not pool
    assert not pools(True, gpus=2, tp=2)  # a TP group generates together
    assert not pools(True, gpus=1, batch=8, mini=8)  # one rank: nobody to pool with


@pytest.mark.parametrize(
    "case,key",
    [
        ({f"{A}.fsdp_config.fsdp_size": 3}, f"{A}.fsdp_config.fsdp_size"),
        ({"algorithm.adv_estimator": "gae", "critic.model.fsdp_config.fsdp_size": 0}, "critic.model.fsdp_config"),
        (
            {
                "reward_model.enable": True,
                "reward_model.model.path": "rm",
                "reward_model.model.fsdp_config.fsdp_size": 3,
            },
            "reward_model.model.fsdp_config.fsdp_size",
        ),
    ],
)
def test_fsdp_size_is_checked_once_by_the_plan(base, case, key):
    """The sections no longer check it (the typed tree accepts it); the plan refuses it, as before Ray."""
    from rlframe.trainer.config import typed

    cfg = cfg_of(base, gpus=4, **case)
    typed(cfg)
    with pytest.raises(ValueError, match=rf"{key}.*=\d must be -1 \(shard over all 4 ranks\) or a divisor of "
                       r"world_size = trainer.nnodes × trainer.n_gpus_per_node = 4"):  # fmt: skip
        make_batch_plan(cfg)


def test_reference_and_actor_share_one_ulysses_degree(base):
    with pytest.raises(ValueError, match=rf"{REF}.ulysses_sequence_parallel_size=2 must equal {A}.ulysses_seq"):
        make_batch_plan(cfg_of(base, **{f"{REF}.ulysses_sequence_parallel_size": 2}))
