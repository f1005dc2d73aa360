"""fsdp_config.model_dtype and fsdp_config.mixed_precision (verl 0.9.1's keys) reach FSDP as configured.

model_dtype is the dtype the model is loaded in, so the dtype FSDP holds (and the optimizer steps) the
parameters in; mixed_precision.param_dtype is the dtype the forward computes in, reduce_dtype the one
gradients are reduced in, buffer_dtype the one FSDP1 casts buffers to. bf16 runs on CPU, so every case runs
here, under FSDP2 and FSDP1, from the config the worker reads (`fsdp_spec`). The default (fp32, and
param_dtype auto = fp32 on CPU) wraps without mixed precision: outputs bitwise those of the plain model.
"""

import pytest
import torch
from helpers.world import spawned_world

from rlframe.distributed.parallel_dims import build_fsdp_mesh
from rlframe.trainer.config import compose, typed
from rlframe.workers.dtypes import resolve_dtype
from rlframe.workers.fsdp_workers import fsdp_spec
from rlframe.workers.fsdp_wrap import decoder_layers, wrap_fsdp
from rlframe.workers.model_loading import ModelSpec, load_hf_model

FSDP = "actor_rollout_ref.actor.fsdp_config"
CASES = {
    "default": [],
    "bf16_model": [f"{FSDP}.model_dtype=bf16", f"+{FSDP}.mixed_precision.param_dtype=bf16"],
    "fp32_model_bf16_compute": [
        f"+{FSDP}.mixed_precision.param_dtype=bf16",
        f"+{FSDP}.mixed_precision.reduce_dtype=bf16",
        f"+{FSDP}.mixed_precision.buffer_dtype=bf16",
    ],
}


def _observed(case: str, strategy: str, model_path: str) -> dict:
    """Wrap the tiny model as the actor worker would; what FSDP holds, computes in and was told."""
    cfg = typed(compose(CASES[case]))
    fsdp_cfg = cfg.actor_rollout_ref.actor.fsdp_config
    spec = fsdp_spec(fsdp_cfg, strategy, "cpu")
    load = ModelSpec(model_path, "actor", resolve_dtype(fsdp_cfg.model_dtype, "cpu"), use_remove_padding=False)
    torch.manual_seed(0)
    plain = load_hf_model(load)
    model = load_hf_model(load)
    model = wrap_fsdp(model, spec, build_fsdp_mesh("cpu", 1, -1), "cpu")
    compute = []
    linear = decoder_layers(model)[0].mlp.down_proj
    linear.register_forward_hook(lambda m, args, out: compute.append((args[0].dtype, m.weight.dtype)))
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids, use_cache=False).logits
    if strategy == "fsdp2":
        policy = model._get_fsdp_state()._mp_policy
        told = (policy.param_dtype, policy.reduce_dtype, None)
    else:
        mixed = model.mixed_precision
        told = (None, None, None) if mixed is None else (mixed.param_dtype, mixed.reduce_dtype, mixed.buffer_dtype)
    inv_freq = next(b for name, b in model.named_buffers() if name.endswith("inv_freq"))
    return {
        "held": {p.dtype for p in model.parameters()},
        "compute": compute[0],
        "told": told,
        "inv_freq": inv_freq.dtype,
        "bitwise_plain": torch.equal(logits, plain(input_ids=ids, use_cache=False).logits),
    }


def _worker(rank: int, model_path: str) -> dict:

    return {(c, s): _observed(c, s, model_path) for c in CASES for s in ("fsdp2", "fsdp")}


@pytest.fixture(scope="module")
def observed(tiny_model_path):
    return spawned_world(1).run(_worker, tiny_model_path)[0]


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_the_default_wraps_without_mixed_precision_bitwise(observed, strategy):
    seen = observed[("default", strategy)]
    assert seen["told"] == (None, None, None)
    assert seen["held"] == {FP32} and seen["compute"] == (FP32, FP32)
    assert seen["bitwise_plain"]


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_a_bf16_model_is_held_and_computed_in_bf16(observed, strategy):
    seen = observed[("bf16_model", strategy)]
    assert seen["held"] == {BF16} and seen["compute"] == (BF16, BF16)
    assert seen["told"][:2] == (BF16, FP32)  # verl's reduce_dtype default: gradients reduced in fp32
    if strategy == "fsdp":
        assert seen["told"][2] == FP32 and seen["inv_freq"] == FP32  # buffer_dtype fp32 (verl's default)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_mixed_precision_computes_in_param_dtype_over_fp32_parameters(observed, strategy):
    seen = observed[("fp32_model_bf16_compute", strategy)]
    assert seen["held"] == {FP32} and seen["compute"] == (BF16, BF16)
    assert seen["told"][:2] == (BF16, BF16)
    if strategy == "fsdp":
        assert seen["told"][2] == BF16 and seen["inv_freq"] == BF16


def test_verl_spellings_reach_each_role():
    cfg = typed(
        compose(
            [
                "algorithm.adv_estimator=gae",
                "critic.fsdp.model_dtype=bf16",
                "critic.fsdp.mixed_precision.param_dtype=fp32",
                "actor_rollout_ref.ref.fsdp_config.model_dtype=bf16",
                "+actor_rollout_ref.ref.fsdp_config.mixed_precision.reduce_dtype=bf16",
            ]
        )
    )
    critic = cfg.critic.model.fsdp_config
    assert critic.model_dtype == "bf16" and critic.mixed_precision.param_dtype == "fp32"
    ref = cfg.actor_rollout_ref.ref.fsdp_config
    assert ref.model_dtype == "bf16" and ref.mixed_precision.reduce_dtype == "bf16"
    # verl's default mixed_precision (None) is bf16 / fp32 / fp32 for every role, independently of the actor's
    assert ref.mixed_precision.param_dtype == "auto" and ref.mixed_precision.buffer_dtype == "fp32"


@pytest.mark.parametrize(
    "override,message",
    [
        (f"{FSDP}.model_dtype=fp16", "fp16 training needs loss scaling"),
        (f"+{FSDP}.mixed_precision.param_dtype=float16", "fp16 training needs loss scaling"),
        (f"{FSDP}.model_dtype=auto", "is not one of"),
        ("actor_rollout_ref.model.torch_dtype=bfloat16", "verl 0.9.1 has no such key either"),
    ],
)
def test_bad_dtypes_are_refused_by_name(override, message):
    with pytest.raises(ValueError, match=message) as err:
        typed(compose([override]))
    assert override.lstrip("+").split("=")[0] in str(err.value)
