"""Which kernel packed attention runs (flash-attn, torch's varlen_attn, SDPA per sequence), and sliding windows.

The selection is checked with the kernels' availability faked; the windowed packed path is checked against the
padded reference on the tiny model, through the SDPA fallback and through a pure-torch stand-in of `varlen_attn`
(flash's window semantics), so the window arithmetic that only a GPU runs for real is pinned here too.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers.padding import assert_rel_close, load, make_rl_batch, run
from transformers import AutoConfig, AutoModelForCausalLM

from rlframe.distributed import attention
from rlframe.distributed.attention import (
    ATTN_IMPLEMENTATION,
    FLASH_ATTN_VARLEN,
    SDPA_PER_SEQUENCE,
    TORCH_VARLEN_ATTN,
    varlen_kernel,
)

WINDOW = 3  # tokens a query sees, itself included (the tiny batch's sequences run to 11 tokens)


def _available(monkeypatch, flash: bool, torch_varlen: bool, calls: list | None = None):
    """Fake which kernels import: a stand-in callable for each one that does."""
    flash_fn = (lambda *a, **k: calls.append(("flash", a, k))) if flash else None
    monkeypatch.setattr(attention, "_flash_attn_varlen_func", lambda: flash_fn)
    monkeypatch.setattr(attention, "_torch_varlen_attn", lambda: reference_varlen_attn if torch_varlen else None)


def reference_varlen_attn(
    q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """`torch.nn.attention.varlen.varlen_attn` (torch 2.13's form) in plain torch: query i sees keys i - left ..
    i + right of its segment (-1: unbounded), causal exactly when window_size == (-1, 0); GQA groups share kv heads."""
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    assert enable_gqa == (k.shape[1] != q.shape[1])
    left, right = window_size
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outs = []
    for s, e in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        assert e - s <= max_q
        offsets = torch.arange(e - s)[:, None] - torch.arange(e - s)[None, :]  # query minus key position
        allowed = ((offsets <= left) | (left < 0)) & ((-offsets <= right) | (right < 0))
        segment = (x[s:e].transpose(0, 1)[None] for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(*segment, attn_mask=allowed, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("flash", "torch_varlen", "device", "dtype", "dropout", "expected"),
    [
        (True, True, "cuda", torch.bfloat16, 0.0, FLASH_ATTN_VARLEN),
        (True, False, "cuda", torch.float16, 0.1, FLASH_ATTN_VARLEN),
        (False, True, "cuda", torch.bfloat16, 0.0, TORCH_VARLEN_ATTN),
        (False, True, "cuda", torch.float16, 0.0, TORCH_VARLEN_ATTN),
        (False, True, "cuda", torch.bfloat16, 0.1, SDPA_PER_SEQUENCE),  # varlen_attn's dropout is fixed at 0
        (False, False, "cuda", torch.bfloat16, 0.0, SDPA_PER_SEQUENCE),
        (True, True, "cuda", torch.float32, 0.0, SDPA_PER_SEQUENCE),
        (True, True, "cpu", torch.bfloat16, 0.0, SDPA_PER_SEQUENCE),
        (True, True, "cpu", torch.float32, 0.0, SDPA_PER_SEQUENCE),
    ],
)
def test_kernel_order_is_flash_attn_then_torch_varlen_attn_then_sdpa(
    monkeypatch, flash, torch_varlen, device, dtype, dropout, expected
):
    _available(monkeypatch, flash, torch_varlen)
    assert varlen_kernel(device, dtype, dropout) == expected


def test_this_cpu_build_runs_sdpa_per_sequence():
    """The real lookups here: a CPU tensor never reaches a flash kernel, whatever is installed."""
    assert varlen_kernel("cpu", torch.float32) == SDPA_PER_SEQUENCE
    if not torch.cuda.is_available():
        assert attention._torch_varlen_attn() is None  # no flash attention compiled into a CPU build


def _packed_inputs(lengths=(5, 1, 9, 3), heads=4, kv_heads=2, dim=8):
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=gen)
    k, v = (torch.randn(total, kv_heads, dim, generator=gen) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lengths)


@pytest.mark.parametrize("sliding_window", [None, WINDOW, 100])
def test_torch_varlen_attn_gets_causal_window_gqa_and_int32_offsets(monkeypatch, sliding_window):
    """With varlen_attn selected the row goes to it whole: (-1, 0) causal, (S - 1, 0) for a window of S tokens,
    kv heads unrepeated with enable_gqa; the result is the per-sequence SDPA fallback's."""
    q, k, v, cu, max_len = _packed_inputs()
    expected = attention.varlen_causal_attention(q, k, v, cu.long(), None, 0.3, sliding_window=sliding_window)
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["window_size"])
        return reference_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(attention, "varlen_kernel", lambda *a: TORCH_VARLEN_ATTN)
    monkeypatch.setattr(attention, "_torch_varlen_attn", lambda: spy)
    got = attention.varlen_causal_attention(q, k, v, cu.long(), None, 0.3, sliding_window=sliding_window)
    assert seen == [(-1, 0) if sliding_window is None else (sliding_window - 1, 0)]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_flash_attn_gets_a_window_only_when_the_model_has_one(monkeypatch):
    """flash-attn before 2.3 has no window_size: a model without sliding windows calls it as before."""
    q, k, v, cu, max_len = _packed_inputs()
    calls = []
    _available(monkeypatch, flash=True, torch_varlen=True, calls=calls)
    monkeypatch.setattr(attention, "varlen_kernel", lambda *a: FLASH_ATTN_VARLEN)
    attention.varlen_causal_attention(q, k, v, cu, max_len, 0.3)
    attention.varlen_causal_attention(q, k, v, cu, max_len, 0.3, sliding_window=WINDOW)
    (_, args, plain), (_, _, windowed) = calls
    assert args[3].dtype == torch.int32 and args[5] == args[6] == max_len
    assert plain == dict(dropout_p=0.0, softmax_scale=0.3, causal=True)
    assert windowed == dict(plain, window_size=(WINDOW - 1, 0))


def _windowed(path, attn):
    """The tiny Qwen2 with every layer a sliding-window layer of WINDOW tokens."""
    config = AutoConfig.from_pretrained(path, use_sliding_window=True, sliding_window=WINDOW)
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    return AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation=attn).float()


@pytest.mark.parametrize("kernel", [SDPA_PER_SEQUENCE, TORCH_VARLEN_ATTN])
def test_packed_sliding_window_log_probs_and_grads_match_padded(tiny_model_path, monkeypatch, kernel):
    """A packed row with sliding windows equals transformers' padded sdpa with its sliding-window mask."""
    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    batch = make_rl_batch(prompt_lens=[6, 3, 1, 4], response_lens=[5, 2, 4, 1], vocab_size=vocab)
    padded_out, padded_grads = run(_windowed(tiny_model_path, "sdpa"), batch, use_remove_padding=False)
    full_out, _ = run(load(tiny_model_path, "sdpa"), batch, use_remove_padding=False)
    assert not torch.allclose(full_out["log_probs"], padded_out["log_probs"])  # the window changes the numbers
    if kernel == TORCH_VARLEN_ATTN:
        monkeypatch.setattr(attention, "varlen_kernel", lambda *a: TORCH_VARLEN_ATTN)
        monkeypatch.setattr(attention, "_torch_varlen_attn", lambda: reference_varlen_attn)
    packed_out, packed_grads = run(_windowed(tiny_model_path, ATTN_IMPLEMENTATION), batch, use_remove_padding=True)
    assert_rel_close(packed_out["log_probs"], padded_out["log_probs"])
    assert packed_grads.keys() == padded_grads.keys() and len(packed_grads) > 0
    for name in packed_grads:
        assert_rel_close(packed_grads[name], padded_grads[name])


def _form_a(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """varlen_attn's first form: causal flag, no scale, no window."""


def _form_b(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    """A later form: scale and window, no enable_gqa (kv heads must equal query heads)."""
    assert key.shape[1] == query.shape[1]
    return reference_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size
    )


@pytest.mark.parametrize(("form", "capability", "expected"), [
    (_form_a, (9, 0), None),  # no scale or window: SDPA per sequence instead
    (reference_varlen_attn, (7, 5), None),  # flash needs sm80
    (reference_varlen_attn, (8, 0), "as is"),
    (_form_b, (9, 0), "kv repeated"),
])  # fmt: skip
def test_torch_varlen_attn_is_used_in_each_form_that_takes_scale_and_window(monkeypatch, form, capability, expected):
    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(torch_varlen, "varlen_attn", form)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    found = attention._torch_varlen_attn.__wrapped__()  # the uncached lookup
    if expected is None:
        assert found is None
        return
    assert (found is form) == (expected == "as is")
    q, k, v, cu, max_len = _packed_inputs()
    expected_out = attention.varlen_causal_attention(q, k, v, cu, max_len, 0.3, sliding_window=WINDOW)
    monkeypatch.setattr(attention, "varlen_kernel", lambda *a: TORCH_VARLEN_ATTN)
    monkeypatch.setattr(attention, "_torch_varlen_attn", lambda: found)
    got = attention.varlen_causal_attention(q, k, v, cu, max_len, 0.3, sliding_window=WINDOW)
    torch.testing.assert_close(got, expected_out, rtol=1e-6, atol=1e-6)


def test_an_unpacked_batch_without_a_mask_keeps_the_window(tiny_model_path):
    """No attention mask and no packing (a plain `model(input_ids)`): the window still applies, as in sdpa."""
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = _windowed(tiny_model_path, "sdpa")(input_ids=ids, use_cache=False).logits
        got = _windowed(tiny_model_path, ATTN_IMPLEMENTATION)(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, reference, rtol=0, atol=0)
