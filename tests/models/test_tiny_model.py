"""The tiny offline model: Qwen2-style GQA config, tokenizer with pad/eos/chat template, reloadable."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def test_tiny_model_is_qwen2_with_gqa(tiny_model_path):
    config = AutoConfig.from_pretrained(tiny_model_path)
    assert config.model_type == "qwen2"
    assert 64 <= config.hidden_size <= 128
    assert config.num_key_value_heads < config.num_attention_heads


def test_tiny_tokenizer_has_pad_eos_and_chat_template(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "what is 3 + 4?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nwhat is 3 + 4?<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    # digits are single tokens, so answers are spelled digit by digit
    assert len(tok.encode("1234", add_special_tokens=False)) == 4


def test_tiny_model_reloads_and_runs_forward(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = torch.tensor([tok.encode("what is 1 + 2", add_special_tokens=False)])
    logits = model(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_make_tiny_model_is_deterministic(tmp_path):
    from rlframe.models.tiny import make_tiny_model

    a = AutoModelForCausalLM.from_pretrained(make_tiny_model(str(tmp_path / "a")))
    b = AutoModelForCausalLM.from_pretrained(make_tiny_model(str(tmp_path / "b")))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
