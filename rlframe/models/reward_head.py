"""Reward models: a sequence-classification checkpoint, its trained head applied at every token.

A reward model is saved as `AutoModelForSequenceClassification`: a backbone plus a linear head (`score` for
Llama, Qwen2, GPT-2, GPT-NeoX, Phi-3, …; `classifier` for CTRL) that transformers applies to every token's last
hidden state before reading the last non-pad token. Loading it as `AutoModelForTokenClassification` instead
keeps the head only where both classes name it alike: GPT-2's and GPT-NeoX's token classifiers call it
`classifier`, so transformers silently drew a random head there. So rlframe loads the sequence classifier
itself and runs its backbone and head per token (`TokenScoreModel`): the worker reads the score at each row's
last valid token, whatever the padding side or packing.

`check_reward_checkpoint` compares the checkpoint's head weights (read from the safetensors headers) with
the ones the model class expects (built on the `meta` device) before Ray starts; the worker checks
transformers' own loading report again.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from rlframe.models.weight_check import check_pretrained_weights

SEQUENCE_CLASSIFIER = "AutoModelForSequenceClassification"


class TokenScoreModel(nn.Module):
    """A sequence classifier's backbone and linear head run at every token: `logits` [batch, seqlen, 1].

    The same operations as the sequence classifier's forward before it picks one token (so a row's score at
    its last token equals transformers' score of the unpadded row); any padding and packing the backbone
    takes (attention mask, position ids, `cu_seq_lens_*`) passes through.
    """

    def __init__(self, sequence_classifier: nn.Module):
        super().__init__()
        self.head_name = score_head_name(sequence_classifier)
        self.backbone = sequence_classifier.base_model
        self.head = getattr(sequence_classifier, self.head_name)
        self.config = sequence_classifier.config
        self._no_split_modules = sequence_classifier._no_split_modules  # FSDP's decoder layers

    def forward(self, input_ids: torch.Tensor, **kwargs):
        from transformers.modeling_outputs import TokenClassifierOutput

        hidden = self.backbone(input_ids=input_ids, **kwargs).last_hidden_state
        return TokenClassifierOutput(logits=self.head(hidden))


def score_head_name(sequence_classifier: nn.Module) -> str:
    """The name of the one linear layer the sequence classifier applies to each token's last hidden state.

    Encoder classifiers pool first (BERT's `pooler`) or stack layers (RoBERTa's head): rlframe scores a row
    at its last token, which is their score only after a head that is a single per-token linear layer.
    """
    cls_name = type(sequence_classifier).__name__
    prefix = sequence_classifier.base_model_prefix
    heads = [
        (name, child)
        for name, child in sequence_classifier.named_children()
        if name != prefix and any(True for _ in child.parameters())
    ]
    pooler = getattr(sequence_classifier.base_model, "pooler", None)
    if len(heads) != 1 or not isinstance(heads[0][1], nn.Linear) or pooler is not None:
        found = ", ".join(f"{name} ({type(child).__name__})" for name, child in heads) or "none"
        raise ValueError(
            f"{cls_name} is not scored at its last token by one linear head (modules beside the backbone "
            f"{prefix!r}: {found}{'; its backbone pools' if pooler is not None else ''}): rlframe's reward model is a "
            "decoder sequence classifier (Llama, Qwen2, GPT-2, GPT-NeoX, Phi-3, Mistral, Gemma, …)"
        )
    return heads[0][0]


def reward_model_config(path: str):
    """The checkpoint's config with one label (a scalar reward), as the worker loads it."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, num_labels=1)


def checkpoint_shapes(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every weight of the checkpoint folder: name -> (shape, file it is in); reads headers, not tensors."""
    from safetensors import safe_open

    names = sorted(os.listdir(path))
    files = [n for n in names if n.endswith(".safetensors")] or [n for n in names if n.endswith(".bin")]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):  # a sharded checkpoint: only the shards its index names
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    shapes = {}
    for name in files:
        file = os.path.join(path, name)
        if name.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                shapes.update({key: (tuple(f.get_slice(key).get_shape()), name) for key in f.keys()})
        else:  # a pickled state dict: memory-mapped, tensors are not read
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            shapes.update({key: (tuple(value.shape), name) for key, value in state.items()})
    return shapes


def check_reward_checkpoint(path: str, key: str = "reward_model.model.path") -> None:
    """Fail, naming the weights and the file, unless the checkpoint holds exactly the head the model expects.

    The expected head is `AutoModelForSequenceClassification`'s for the checkpoint's config with one label,
    built on the `meta` device (no memory, no weights read); the backbone's weights are transformers' to match.
    """
    from transformers import AutoModelForSequenceClassification

    config = reward_model_config(path)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    head_name = score_head_name(model)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    prefix = model.base_model_prefix + "."
    backbone = {name.removeprefix(prefix) for name in expected if name.startswith(prefix)}
    found = checkpoint_shapes(path)
    found_head = {name: shape for name, shape in found.items() if not name.startswith(prefix) and name not in backbone}
    expected_head = {name: shape for name, shape in expected.items() if not name.startswith(prefix)}
    problems = []
    files = ", ".join(sorted({file for _, file in found.values()}))
    for name in sorted(expected_head.keys() - found_head.keys()):
        problems.append(f"{name} {list(expected_head[name])} is missing from {files}")
    for name in sorted(found_head.keys() - expected_head.keys()):
        problems.append(f"{name} in {found_head[name][1]} is not a weight of {type(model).__name__}")
    for name in sorted(found_head.keys() & expected_head.keys()):
        if found_head[name][0] != expected_head[name]:
            shape, file = found_head[name]
            problems.append(
                f"{name} in {file} has shape {list(shape)}, a one-label head needs {list(expected_head[name])}"
            )
    if problems:
        raise ValueError(
            f"{key}={path!r} is not a one-label sequence-classification checkpoint of {type(model).__name__} "
            f"(its head is {head_name!r}): " + "; ".join(problems) + ". A reward model is saved with "
            f"{SEQUENCE_CLASSIFIER}.from_pretrained(..., num_labels=1).save_pretrained(...) after training; "
            "rlframe never scores with a head it drew at random"
        )


def load_token_score_model(path: str, dtype: torch.dtype, attn_implementation: str) -> TokenScoreModel:
    """The checkpoint's sequence classifier, scoring every token; fails on any weight transformers did not match."""
    from transformers import AutoModelForSequenceClassification

    model, info = AutoModelForSequenceClassification.from_pretrained(
        path,
        config=reward_model_config(path),
        dtype=dtype,
        attn_implementation=attn_implementation,
        output_loading_info=True,
    )
    unmatched = {kind: sorted(info.get(kind) or []) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(unmatched.values()):
        details = "; ".join(f"{kind}: {', '.join(map(str, names))}" for kind, names in unmatched.items() if names)
        raise ValueError(f"reward model {path!r} did not load exactly as {type(model).__name__}: {details}")
    check_pretrained_weights(model, path)
    return TokenScoreModel(model)
