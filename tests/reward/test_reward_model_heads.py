"""Reward models load their trained head for every decoder architecture, or the run fails before Ray starts."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlframe.workers.reward_model import last_token_scores, load_reward_model

TEXTS = ["what is 3 + 4 = 7", "the answer", "please solve 12 + 30 = 42. think step by step"]
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def tiny_config(arch: str, vocab_size: int):
    """A two-layer config of `arch` with one label; GPT-2 keeps its default of no pad token."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128, num_labels=1)
    configs = {"gpt_neox": GPTNeoXConfig, "llama": LlamaConfig, "qwen2": Qwen2Config}
    extra = {"num_key_value_heads": 2} if arch != "gpt_neox" else {}
    return configs[arch](vocab_size=vocab_size, max_position_embeddings=128, num_labels=1, **TINY, **extra)


def save_reward_model(arch: str, tokenizer_path, out_dir):
    """A random-init sequence classifier of `arch` saved with the tiny tokenizer, as a trained reward model is."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if arch == "gpt2":  # GPT-2's tokenizer has no pad token either
        tokenizer.pad_token = None
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config(arch, len(tokenizer)))
    torch.nn.init.normal_(model.score.weight, std=1.0)  # a head far from any other random draw
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model.eval()


def padded_batch(tokenizer, texts):
    """Right-padded ids and mask, padded with EOS where the tokenizer has no pad token (as the worker does): the
    score is read under the attention mask, so the pad id never matters (transformers needs one for batches)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return encoded["input_ids"], encoded["attention_mask"]


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "qwen2"])
def test_scores_equal_sequence_classification_for_every_architecture(arch, tiny_model_path, tmp_path):
    """GPT-2's and GPT-NeoX's token classifiers call the head `classifier`: loaded that way, `score` was dropped."""
    seq_cls = save_reward_model(arch, tiny_model_path, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids, mask = padded_batch(tokenizer, TEXTS)
    with torch.no_grad():
        expected = torch.stack([seq_cls(**tokenizer(text, return_tensors="pt")).logits[0, 0] for text in TEXTS])
        padded = last_token_scores(load_reward_model(str(tmp_path), False), ids, mask)
        packed = last_token_scores(load_reward_model(str(tmp_path), True), ids, mask, use_remove_padding=True)
    torch.testing.assert_close(padded, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_and_qwen2_scores_are_bitwise_the_token_classification_ones(arch, tiny_model_path, tmp_path):
    """Where the old load kept the head (both classes call it `score`), the scores are unchanged to the bit."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    save_reward_model(arch, tiny_model_path, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids, mask = padded_batch(tokenizer, TEXTS)
    config = AutoConfig.from_pretrained(tmp_path, num_labels=1)
    old = AutoModelForTokenClassification.from_pretrained(
        tmp_path, config=config, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        assert torch.equal(
            last_token_scores(load_reward_model(str(tmp_path), False), ids, mask), last_token_scores(old, ids, mask)
        )


def _rewrite_weights(folder, change):
    """Rewrite the folder's model.safetensors with `change(state) -> state`."""
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    save_file(change(load_file(file)), file, metadata={"format": "pt"})


def _launch_checks(tiny_model_path, rm_dir):
    from helpers.small_config import SMALL

    from rlframe.trainer.main_ppo import check_config

    overrides = [
        *SMALL,
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        f"actor_rollout_ref.model.path={tiny_model_path}",
        "reward_model.enable=true",
        f"reward_model.model.path={rm_dir}",
    ]
    return check_config(overrides)


def test_missing_head_weight_fails_before_ray_naming_weight_and_file(tiny_model_path, tmp_path):
    import ray

    save_reward_model("gpt2", tiny_model_path, tmp_path)
    _rewrite_weights(tmp_path, lambda state: {k: v for k, v in state.items() if k != "score.weight"})
    with pytest.raises(ValueError, match=r"score\.weight \[1, 32\] is missing from model\.safetensors") as error:
        _launch_checks(tiny_model_path, tmp_path)
    assert f"reward_model.model.path='{tmp_path}'" in str(error.value)
    assert not ray.is_initialized()


def test_causal_lm_checkpoint_as_reward_model_fails_naming_both_heads(tiny_model_path, tmp_path):
    """A policy checkpoint is no reward model: its `lm_head` is unexpected and `score` missing."""
    with pytest.raises(ValueError, match=r"score\.weight .* is missing.*lm_head\.weight in model\.safetensors"):
        _launch_checks(tiny_model_path, tiny_model_path)


def test_token_classification_head_name_fails(tiny_model_path, tmp_path):
    """A GPT-2 saved as token classification (head `classifier`, with a bias) is refused, not re-drawn."""
    save_reward_model("gpt2", tiny_model_path, tmp_path)

    def rename(state):
        weight = state.pop("score.weight")
        return {**state, "classifier.weight": weight, "classifier.bias": torch.zeros(1)}

    _rewrite_weights(tmp_path, rename)
    with pytest.raises(ValueError, match=r"classifier\.bias in model\.safetensors is not a weight of GPT2For"):
        _launch_checks(tiny_model_path, tmp_path)


def test_two_label_head_fails_with_its_shape(tiny_model_path, tmp_path):
    save_reward_model("qwen2", tiny_model_path, tmp_path)
    _rewrite_weights(tmp_path, lambda state: {**state, "score.weight": torch.zeros(2, 32)})
    with pytest.raises(ValueError, match=r"score\.weight in model\.safetensors has shape \[2, 32\], a one-label"):
        _launch_checks(tiny_model_path, tmp_path)


def test_worker_load_fails_on_a_missing_backbone_weight(tiny_model_path, tmp_path):
    """The launch check reads the head; transformers' own report catches the rest when the worker loads."""
    save_reward_model("llama", tiny_model_path, tmp_path)
    _rewrite_weights(tmp_path, lambda state: {k: v for k, v in state.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match=r"did not load exactly as LlamaForSequenceClassification: missing_keys: "):
        load_reward_model(str(tmp_path), False)


def test_encoder_classifier_that_pools_is_refused(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from rlframe.models.reward_head import check_reward_checkpoint

    config = BertConfig(vocab_size=64, num_labels=1, **TINY)
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"BertForSequenceClassification is not scored at its last token.*pools"):
        check_reward_checkpoint(str(tmp_path))


def test_sharded_and_pickled_checkpoints_are_read_for_the_head(tiny_model_path, tmp_path):
    """A sharded safetensors checkpoint (read through its index) and a `pytorch_model.bin` are checked alike."""
    import json

    from safetensors.torch import load_file, save_file

    from rlframe.models.reward_head import check_reward_checkpoint

    sharded, pickled = tmp_path / "sharded", tmp_path / "pickled"
    model = save_reward_model("gpt2", tiny_model_path, tmp_path / "whole")
    model.save_pretrained(sharded, max_shard_size="30KB")
    check_reward_checkpoint(str(sharded))  # the head is in one of the shards: taken
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sharded / index["weight_map"].pop("score.weight")
    save_file({k: v for k, v in load_file(shard).items() if k != "score.weight"}, shard, metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"score\.weight \[1, 32\] is missing from model-00001-of-"):
        check_reward_checkpoint(str(sharded))

    model.config.save_pretrained(pickled)
    state = {("classifier.weight" if k == "score.weight" else k): v for k, v in model.state_dict().items()}
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"classifier\.weight in pytorch_model\.bin is not a weight of GPT2For"):
        check_reward_checkpoint(str(pickled))
