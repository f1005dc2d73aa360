"""FLOP counting for MFU: hand-checked on a small case, and the device peak lookup."""

import pytest
from transformers import AutoModelForCausalLM

from rlframe.utils.flops import PEAK_ENV, device_peak_tflops, model_flops_info, train_flops


def test_train_flops_dense_and_causal_attention_terms():
    # N=10 matmul params, 2 layers, width 4, sequences of 3 and 1 tokens:
    # 6·10·4 = 240 dense; 12·2·4·(9+1)/2 = 480 attention
    assert train_flops(10, 2, 4, [3, 1]) == 240 + 480


def test_model_flops_info_excludes_the_embedding_lookup(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    info = model_flops_info(model)
    total = sum(p.numel() for p in model.parameters())
    assert info["matmul_params"] == total - model.get_input_embeddings().weight.numel()  # untied head
    assert info["num_layers"] == model.config.num_hidden_layers
    assert info["attn_width"] == model.config.hidden_size


def test_device_peak_lookup(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert device_peak_tflops("NVIDIA H100 80GB HBM3")[0] == 989.0
    assert device_peak_tflops("NVIDIA H100 PCIe")[0] == 756.0
    assert device_peak_tflops("Some New GPU")[0] is None
    monkeypatch.setenv(PEAK_ENV, "123")
    assert device_peak_tflops("Some New GPU") == (pytest.approx(123.0), f"${PEAK_ENV}")
