"""actor_rollout_ref.model.use_fused_kernels: the fused head gives the plain path's log-probs, entropy and gradients.

The plain path projects every token to the vocabulary, then scores the logits; the fused head scores each
chunk of hidden states as it projects it (rlframe.workers.fused_head). Both agree to fp32 rounding (1e-5
relative, as every parallel knob, docs/architecture.md), with or without remove-padding, at any temperature,
through the actor's micro-batching (static and dynamic), FSDP1/FSDP2 and Ulysses.
"""

import pytest
import torch
from helpers.equivalence import NUM_SEQS, assert_matches
from helpers.fsdp_harness import Scenario, make_batch, relative_error, run_distributed, run_scenario
from helpers.padding import RESPONSE_LEN, load, make_rl_batch, run
from transformers import AutoConfig

from rlframe.distributed.attention import ATTN_IMPLEMENTATION
from rlframe.trainer.config import compose, typed
from rlframe.workers import fused_head
from rlframe.workers.model_forward import ScoringSpec, forward_micro_batch

RTOL = 1e-5


@pytest.fixture(scope="module")
def rl_batch(tiny_model_path):
    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    return make_rl_batch(prompt_lens=[6, 3, 1, 4], response_lens=[5, 2, 4, 1], vocab_size=vocab)


@pytest.fixture
def small_chunks(monkeypatch):
    """7-token chunks: every micro-batch spans several chunks, the last one ragged."""
    monkeypatch.setattr(fused_head, "CHUNK_TOKENS", 7)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_remove_padding", [True, False])
def test_fused_head_matches_the_plain_path(tiny_model_path, rl_batch, small_chunks, use_remove_padding, temperature):
    model = load(tiny_model_path, ATTN_IMPLEMENTATION if use_remove_padding else "sdpa")
    kwargs = dict(use_remove_padding=use_remove_padding, calculate_entropy=True, temperature=temperature)
    plain_out, plain_grads = run(model, rl_batch, **kwargs)
    fused_out, fused_grads = run(model, rl_batch, **kwargs, use_fused_kernels=True)
    assert fused_out.keys() == plain_out.keys() == {"log_probs", "entropy"}
    for name, expected in plain_out.items():
        assert fused_out[name].shape == (4, RESPONSE_LEN)
        assert relative_error(fused_out[name], expected) <= RTOL, name
    assert fused_grads.keys() == plain_grads.keys() and "lm_head.weight" in fused_grads
    for name, expected in plain_grads.items():
        assert relative_error(fused_grads[name], expected) <= RTOL, name


def test_the_head_never_projects_more_than_one_chunk(tiny_model_path, rl_batch, small_chunks, monkeypatch):
    model = load(tiny_model_path, ATTN_IMPLEMENTATION)
    projected, head_outputs = [], []
    original = fused_head._project_and_score

    def recording(hidden, *args):
        projected.append(hidden.shape[0])
        return original(hidden, *args)

    monkeypatch.setattr(fused_head, "_project_and_score", recording)
    model.lm_head.register_forward_hook(lambda module, args, out: head_outputs.append(out.shape))
    forward_micro_batch(model, rl_batch, RESPONSE_LEN, ScoringSpec(calculate_entropy=True, use_fused_kernels=True))
    tokens = int(rl_batch["attention_mask"].sum())
    assert max(projected) == 7 and sum(projected) == tokens  # every token once, 7 at a time
    assert head_outputs == [torch.Size([1, tokens, 2])]  # per token: log-prob and entropy, no vocab dimension
    assert "forward" not in vars(model.lm_head)  # the plain nn.Linear again after the call
    logits = model(input_ids=rl_batch["input_ids"][:1], use_cache=False).logits
    assert logits.shape[-1] == model.config.vocab_size


def test_the_fused_head_refuses_what_it_cannot_compute_exactly(tiny_model_path, rl_batch):
    model = load(tiny_model_path, ATTN_IMPLEMENTATION)
    with pytest.raises(ValueError, match="Σπ²"):
        ScoringSpec(calculate_sum_pi_squared=True, use_fused_kernels=True)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        forward_micro_batch(model, rl_batch, RESPONSE_LEN, ScoringSpec(use_fused_kernels=True))
    model.config.final_logit_softcapping = None

    class ScaledHead(torch.nn.Linear):
        pass

    head = ScaledHead(model.config.hidden_size, model.config.vocab_size, bias=False)
    model.set_output_embeddings(head)
    with pytest.raises(ValueError, match="plain nn.Linear output head; this model's is ScaledHead"):
        forward_micro_batch(model, rl_batch, RESPONSE_LEN, ScoringSpec(use_fused_kernels=True))


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    return make_batch(AutoConfig.from_pretrained(tiny_model_path).vocab_size, NUM_SEQS)


@pytest.fixture(scope="module")
def reference(tiny_model_path, batch):
    """The plain path: one process, padded, the whole batch in one micro-batch."""
    sc = Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS)
    return run_scenario(sc, tiny_model_path, batch)


FUSED = {"use_fused_kernels": True}
SINGLE_PROCESS = {
    "static_padded": Scenario(strategy="none", use_remove_padding=False, micro_batch_size=3, extra=FUSED),
    "static_packed": Scenario(strategy="none", micro_batch_size=2, extra=FUSED),
    "dynamic_packed": Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=24, extra=FUSED),
}


@pytest.mark.parametrize("name", list(SINGLE_PROCESS))
def test_actor_update_with_fused_head_matches_the_plain_path(tiny_model_path, batch, reference, small_chunks, name):
    """Log-probs, entropy, losses and the full gradient of one PPO step (entropy bonus and KL loss on)."""
    assert_matches(run_scenario(SINGLE_PROCESS[name], tiny_model_path, batch), reference)


DISTRIBUTED = {
    "dp2_fsdp2_dynamic": Scenario(world=2, use_dynamic_bsz=True, max_token_len=24, extra=FUSED),
    "dp2_fsdp1_static": Scenario(world=2, strategy="fsdp", micro_batch_size=3, extra=FUSED),
    "sp2_ulysses": Scenario(world=2, sp=2, micro_batch_size=3, extra=FUSED),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_distributed_fused_head_matches_the_plain_path(tiny_model_path, batch, reference, tmp_path, name):
    assert_matches(run_distributed(DISTRIBUTED[name], tiny_model_path, batch, str(tmp_path)), reference)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"], "triton kernel .* is not implemented"),
        (["actor_rollout_ref.model.fused_kernel_options.impl_backend=cuda"], "backends are torch, triton and liger"),
        (
            [
                "actor_rollout_ref.model.use_fused_kernels=true",
                "algorithm.adv_estimator=optimal_token_baseline",
                "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
            ],
            "Σπ² needs the full logits",
        ),
        (["critic.model.use_fused_kernels=true"], "a value model has no vocabulary head to fuse"),
    ],
)
def test_what_the_fused_head_cannot_do_is_refused_at_launch(overrides, message):
    with pytest.raises(ValueError, match=message):
        typed(compose(overrides))


def test_the_backend_option_is_in_effect_only_with_the_switch():
    from rlframe.config.schema import inactive_keys

    root = typed(compose(["actor_rollout_ref.model.use_fused_kernels=true"]))
    assert root.actor_rollout_ref.model.use_fused_kernels
    assert "actor_rollout_ref.model.fused_kernel_options" not in inactive_keys(root)
    off = typed(compose([]))
    assert inactive_keys(off)["actor_rollout_ref.model.fused_kernel_options"].endswith("use_fused_kernels=false")
