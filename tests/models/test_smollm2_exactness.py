"""Exactness on a real pretrained architecture: SmolLM2-135M-Instruct (30 layers, 9 heads, 3 KV heads, tied embeddings).

rlframe's actor (compute_log_prob, then one PPO step: clipped policy loss, entropy bonus, low-var KL
loss) under each parallel knob, against a plain Hugging Face forward/backward of the same loss in one
process (padded batch, sdpa attention, log_softmax). In fp64, log-probs, entropy, losses and every
parameter's gradient agree to 1e-5 relative (‖a − b‖ / ‖b‖ per tensor); in fp32 the log-probs,
entropy and losses do (why not the fp32 gradients: assert_exact, docs/models.md). One converted model
serves every test (the `smollm2_path` fixture); sequences are short (≤ 16 tokens) to keep CPU cost low.
"""

from dataclasses import replace

import pytest
import torch
from helpers.fsdp_harness import (
    RESPONSE_LEN,
    Scenario,
    make_batch,
    relative_error,
    role_for,
    run_distributed,
    run_scenario,
)
from helpers.small_config import SMALL
from transformers import AutoModelForCausalLM

from rlframe.algorithms.kl import kl_penalty
from rlframe.algorithms.loss import Aggregation, PolicyLossArgs, get_policy_loss_fn
from rlframe.trainer.main_ppo import prepare

# the fp64 worlds hold ~13 GB: beside another test file, Ray's memory monitor kills workers (tests/README.md)
pytestmark = pytest.mark.serial

RTOL = 1e-5
NUM_SEQS = 6  # splits evenly over dp 2 and dp 3
VOCAB = 49152
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@pytest.fixture(scope="module")
def batches():
    return {name: make_batch(VOCAB, NUM_SEQS, seed=3, dtype=dtype) for name, dtype in DTYPES.items()}


@pytest.fixture(scope="module")
def references(smollm2_path, batches):
    return {name: hf_reference(smollm2_path, batches[name], dtype) for name, dtype in DTYPES.items()}


def hf_reference(model_path: str, batch, dtype: torch.dtype) -> dict:
    """Plain transformers forward/backward on the padded batch: outputs, losses and gradients."""
    s, _, _ = role_for(Scenario(), len(batch))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
    b = batch.batch
    mask = b["attention_mask"]
    logits = model(input_ids=b["input_ids"], attention_mask=mask, position_ids=b["position_ids"]).logits
    log_softmax = torch.log_softmax(logits[:, -RESPONSE_LEN - 1 : -1], dim=-1)
    response_mask = mask[:, -RESPONSE_LEN:].bool()
    log_probs = log_softmax.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    agg = Aggregation(s.loss_agg_mode)
    args = PolicyLossArgs(s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c, agg)
    pg_loss, _ = get_policy_loss_fn("vanilla")(b["old_log_probs"], log_probs, b["advantages"], response_mask, args)
    entropy_loss = agg(entropy, response_mask)
    kl_loss = agg(kl_penalty(log_probs, b["ref_log_prob"], s.kl_loss_type), response_mask)
    (pg_loss - s.entropy_coeff * entropy_loss + s.kl_loss_coef * kl_loss).backward()
    outputs = {"log_probs": log_probs, "entropy": entropy}
    return {
        "outputs": {k: torch.where(response_mask, v, 0.0).detach() for k, v in outputs.items()},
        "losses": {"pg_loss": pg_loss.item(), "entropy_loss": entropy_loss.item(), "kl_loss": kl_loss.item()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


def errors(result: dict, reference: dict) -> dict[str, dict[str, float]]:
    """Relative errors of every output, loss and parameter gradient, and of the gradient as one vector."""
    assert result["grads"].keys() == reference["grads"].keys()
    grads = {k: relative_error(result["grads"][k], ref) for k, ref in reference["grads"].items()}
    names = list(reference["grads"])
    whole = relative_error(*(torch.cat([g[k].flatten() for k in names]) for g in (result["grads"], reference["grads"])))
    return {
        "outputs": {k: relative_error(result["outputs"][k], ref) for k, ref in reference["outputs"].items()},
        "losses": {
            k: relative_error(torch.tensor(result["metrics"][f"actor/{k}"]), torch.tensor([ref]))
            for k, ref in reference["losses"].items()
        },
        "grads": grads,
        "whole_grad": {"all parameters": whole},
    }


def assert_exact(result: dict, references: dict, dtype_name: str) -> None:
    """Every output, loss and parameter gradient within RTOL in fp64; in fp32 the outputs and losses.

    fp32 gradients are printed, not held to RTOL: on this model the plain fp32 gradient is itself up to
    5e-5 per tensor (1.1e-5 as a whole) away from the fp64 one, so no fp32 implementation can meet it
    (docs/models.md). The fp32-only code paths are held to RTOL per tensor on the tiny model
    (tests/workers/test_fsdp_equivalence.py); the architecture is held to it here in fp64.
    """
    found = {
        group: max(e.items(), key=lambda item: item[1]) for group, e in errors(result, references[dtype_name]).items()
    }
    print(f"{dtype_name} max relative errors:", {group: f"{name} {err:.1e}" for group, (name, err) in found.items()})
    checked = found if dtype_name == "fp64" else {k: found[k] for k in ("outputs", "losses")}
    for group, (name, err) in checked.items():
        assert err <= RTOL, f"{dtype_name} {group}: {name} differs by {err:.2e} relative"


def test_the_reference_is_the_real_architecture(references):
    model_grads = references["fp64"]["grads"]
    assert len([n for n in model_grads if n.endswith("self_attn.q_proj.weight")]) == 30
    assert model_grads["model.layers.0.self_attn.k_proj.weight"].shape == (3 * 64, 576)  # 3 KV heads of 64
    assert "lm_head.weight" not in model_grads  # tied: the embedding's gradient holds both uses
    assert all(g.abs().sum() > 0 for g in model_grads.values())


# ---------------------------------------------------------------- one process, no FSDP
SINGLE = {
    "rmpad_static_micro2": Scenario(strategy="none", micro_batch_size=2),
    "padded_static_micro4": Scenario(strategy="none", use_remove_padding=False, micro_batch_size=4),
}  # dynamic micro-batches: dp2_fsdp2_rmpad_dynamic below


# every scenario in fp64, one in fp32 as well (log-probs and losses, see assert_exact)
SINGLE_RUNS = [(name, "fp64") for name in SINGLE] + [("rmpad_static_micro2", "fp32")]


@pytest.mark.slow  # a multi-process world or a subprocess: over 6 s on 2 cores (tests/README.md)
@pytest.mark.parametrize("name,dtype_name", SINGLE_RUNS)
def test_single_process_actor_matches_plain_hf(smollm2_path, batches, references, name, dtype_name):
    sc = replace(SINGLE[name], dtype=DTYPES[dtype_name])
    assert_exact(run_scenario(sc, smollm2_path, batches[dtype_name]), references, dtype_name)


# ---------------------------------------------------------------- gloo processes + FSDP
DISTRIBUTED = {
    "dp2_fsdp2_rmpad_dynamic": Scenario(world=2, use_dynamic_bsz=True, max_token_len=32),
    "dp2_fsdp1_padded_static": Scenario(world=2, strategy="fsdp", use_remove_padding=False, micro_batch_size=2),
    "dp3_fsdp2_rmpad_static": Scenario(world=3, micro_batch_size=1),
    "sp3_fsdp2_rmpad_static": Scenario(world=3, sp=3, micro_batch_size=4),
}


# fp64, and the Ulysses one in fp32 as well (log-probs and losses, see assert_exact). FSDP1 runs in fp32 only:
# its clip_grad_norm_ computes norms in fp32 and refuses fp64 gradients.
DISTRIBUTED_RUNS = [(name, "fp64") for name in DISTRIBUTED if DISTRIBUTED[name].strategy == "fsdp2"] + [
    ("dp2_fsdp1_padded_static", "fp32"),
    ("sp3_fsdp2_rmpad_static", "fp32"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype_name", DISTRIBUTED_RUNS)
def test_distributed_actor_matches_plain_hf(smollm2_path, batches, references, tmp_path, name, dtype_name):
    sc = replace(DISTRIBUTED[name], dtype=DTYPES[dtype_name])
    result = run_distributed(sc, smollm2_path, batches[dtype_name], str(tmp_path))
    assert_exact(result, references, dtype_name)


# ---------------------------------------------------------------- a knob that cannot apply
def test_sp2_with_9_heads_is_refused_before_ray_naming_the_key_and_valid_values(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))
    sp = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    overrides = [
        *SMALL,
        f"actor_rollout_ref.model.path={smollm2_path}",
        "trainer.n_gpus_per_node=6",
        "data.train_batch_size=12",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        f"{sp}=2",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(ValueError) as err:
        prepare(overrides)
    message = str(err.value)
    assert f"{sp} = 2 must divide the model's num_attention_heads = 9" in message, message
    assert "divisor of both num_attention_heads 9 and world_size 6: 1, 3" in message, message
