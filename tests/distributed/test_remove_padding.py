"""Remove-padding (packed rows + varlen attention) leaves log-probs, entropy, values and gradients unchanged."""

import pytest
import torch
from helpers.padding import RESPONSE_LEN, assert_rel_close, load, make_rl_batch, run
from transformers import AutoModelForCausalLM

from rlframe.distributed.attention import ATTN_IMPLEMENTATION
from rlframe.distributed.padding import (
    cu_seqlens_from_position_ids,
    pack_tensor,
    pad_output,
    position_ids_from_mask,
    unpad_input,
)
from rlframe.workers.model_forward import ScoringSpec, forward_micro_batch


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    vocab = AutoModelForCausalLM.from_pretrained(tiny_model_path).config.vocab_size
    return make_rl_batch(prompt_lens=[6, 3, 1, 4], response_lens=[5, 2, 4, 1], vocab_size=vocab)


def test_unpad_pad_round_trip_and_restarting_positions():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1]])
    ids = torch.arange(15).view(3, 5) * mask
    packed, indices, cu_seqlens, max_seqlen = unpad_input(ids, mask)
    assert packed.tolist() == [[1, 2, 3, 5, 6, 12, 13, 14]]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 5, 8]
    assert max_seqlen == 3
    positions = pack_tensor(position_ids_from_mask(mask), indices)
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert torch.equal(pad_output(packed[0], indices, 3, 5), ids)
    recovered, recovered_max = cu_seqlens_from_position_ids(positions.unsqueeze(0))
    assert recovered.tolist() == cu_seqlens.tolist() and recovered_max == 3


@pytest.mark.parametrize("reference_attn", ["sdpa", "eager"])
def test_packed_log_probs_entropy_and_grads_match_padded(tiny_model_path, batch, reference_attn):
    padded_out, padded_grads = run(
        load(tiny_model_path, reference_attn), batch, use_remove_padding=False, calculate_entropy=True
    )
    packed_out, packed_grads = run(
        load(tiny_model_path, ATTN_IMPLEMENTATION), batch, use_remove_padding=True, calculate_entropy=True
    )
    assert set(packed_out) == {"log_probs", "entropy"}
    for name in packed_out:
        assert packed_out[name].shape == (4, RESPONSE_LEN)
        assert_rel_close(packed_out[name], padded_out[name])
    assert packed_grads.keys() == padded_grads.keys() and len(packed_grads) > 0
    for name in packed_grads:
        assert_rel_close(packed_grads[name], padded_grads[name])


def test_packed_values_and_grads_match_padded(tiny_model_path, batch):
    padded_out, padded_grads = run(
        load(tiny_model_path, "sdpa", value_head=True), batch, use_remove_padding=False, value_head=True
    )
    packed_out, packed_grads = run(
        load(tiny_model_path, ATTN_IMPLEMENTATION, value_head=True), batch, use_remove_padding=True, value_head=True
    )
    assert set(packed_out) == {"values"}
    assert_rel_close(packed_out["values"], padded_out["values"])
    for name in padded_grads:
        assert_rel_close(packed_grads[name], padded_grads[name])


@pytest.mark.parametrize("use_remove_padding", [True, False])
def test_only_positions_scoring_the_response_reach_the_output_head(
    tiny_model_path, batch, monkeypatch, use_remove_padding
):
    """The head projects the response's scoring positions only; results equal projecting every position."""
    import rlframe.workers.model_forward as model_forward

    attn = ATTN_IMPLEMENTATION if use_remove_padding else "sdpa"
    model = load(tiny_model_path, attn)
    rows = []
    model.get_output_embeddings().register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[:-1].numel()))
    kwargs = dict(use_remove_padding=use_remove_padding, calculate_entropy=True, calculate_sum_pi_squared=True)
    kept_out, kept_grads = run(model, batch, **kwargs)
    monkeypatch.setattr(model_forward, "_keeps_logits", lambda model, value_head: False)
    all_out, all_grads = run(model, batch, **kwargs)

    mask = batch["attention_mask"]
    scoring_columns = mask[:, -RESPONSE_LEN - 1 : -1]  # the columns whose logits score a response token
    expected_rows = int(scoring_columns.sum()) if use_remove_padding else scoring_columns.numel()
    assert rows == [expected_rows, int(mask.sum()) if use_remove_padding else mask.numel()]
    for name in all_out:
        assert_rel_close(kept_out[name], all_out[name], rel=1e-6)
    assert kept_grads.keys() == all_grads.keys()
    for name in all_grads:
        assert_rel_close(kept_grads[name], all_grads[name], rel=1e-6)


def test_temperature_divides_logits_before_log_softmax(tiny_model_path, batch):
    model = load(tiny_model_path, ATTN_IMPLEMENTATION)
    with torch.no_grad():
        hot = forward_micro_batch(model, batch, RESPONSE_LEN, ScoringSpec(temperature=2.0))["log_probs"]
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits[:, -RESPONSE_LEN - 1 : -1]
    expected = torch.log_softmax(logits / 2.0, dim=-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    expected = expected * batch["attention_mask"][:, -RESPONSE_LEN:]
    assert_rel_close(hot, expected)


def test_outputs_are_zero_outside_response_mask(tiny_model_path, batch):
    with torch.no_grad():
        out = forward_micro_batch(
            load(tiny_model_path, ATTN_IMPLEMENTATION), batch, RESPONSE_LEN, ScoringSpec(calculate_entropy=True)
        )
    outside = batch["attention_mask"][:, -RESPONSE_LEN:] == 0
    for x in out.values():
        assert (x[outside] == 0).all() and (x[~outside] != 0).all()


def test_varlen_recovers_segments_from_position_ids_and_is_sdpa_on_padded_batches(tiny_model_path, batch):
    model = load(tiny_model_path, ATTN_IMPLEMENTATION)
    sdpa = load(tiny_model_path, "sdpa")
    ids, indices, cu_seqlens, max_seqlen = unpad_input(batch["input_ids"], batch["attention_mask"])
    pos = pack_tensor(batch["position_ids"], indices).unsqueeze(0)
    with torch.no_grad():
        explicit = model(
            input_ids=ids,
            position_ids=pos,
            use_cache=False,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
        ).logits
        recovered = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        padded_kwargs = dict(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        )
        padded_varlen, padded_sdpa = model(**padded_kwargs).logits, sdpa(**padded_kwargs).logits
    assert torch.equal(explicit, recovered)
    assert torch.equal(padded_varlen, padded_sdpa)
    assert_rel_close(explicit[0], pack_tensor(padded_sdpa, indices))


def test_entropy_chunking_is_exact():
    from rlframe.workers.model_forward import _entropy_from_logits_chunked, entropy_from_logits

    logits = torch.randn(3, 7, 11, requires_grad=True)
    chunked = _entropy_from_logits_chunked(logits, chunk_tokens=4)
    whole = entropy_from_logits(logits)
    assert torch.allclose(chunked, whole, rtol=1e-6, atol=0)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    (g_whole,) = torch.autograd.grad(whole.sum(), logits)
    assert torch.allclose(g_chunked, g_whole, rtol=1e-6, atol=1e-7)


def test_varlen_generation_is_bit_identical_to_sdpa(tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = tokenizer(["what is 1 + 2 =", "hi"], return_tensors="pt", padding=True)  # left-padded
    results = []
    for attn in ("sdpa", ATTN_IMPLEMENTATION):
        out = load(tiny_model_path, attn).generate(
            **prompts, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        results.append(out)
    assert torch.equal(results[0].sequences, results[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(results[0].scores, results[1].scores))
