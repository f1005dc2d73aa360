"""`rlframe merge CHECKPOINT_DIR OUT_DIR`: a trainer checkpoint as a Hugging Face folder, offline.

verl's model merger, for rlframe's checkpoints: the sharded parameters of one role (written by any
number of ranks, FSDP1, FSDP2 or HSDP) are read in this one process through PyTorch Distributed
Checkpoint, placed into the model built from its Hugging Face config, and written with
`save_pretrained` (safetensors), together with the tokenizer. Nothing is gathered on GPUs and no
process group is needed. The tensors are written bitwise as saved (the FSDP master weights' dtype,
fp32 unless the run said otherwise); `--dtype` converts them. A LoRA run's checkpoint holds the adapter
only: it is put on the base model and written as its HF export is (the merged model, and the adapter in
`lora_adapter/`).

CHECKPOINT_DIR is a step folder (`global_step_N`, whose manifest is verified first; `--role` picks
actor or critic) or a role folder (`global_step_N/actor`). The model's config and tokenizer come
from `--model PATH`, else from the run's `config.yaml` next to the step folders
(`actor_rollout_ref.model.path`, or `critic.model.path` for the critic).
"""

from __future__ import annotations

import argparse
import os
import sys

from rlframe.config.secrets import MASK
from rlframe.utils.manifest import MANIFEST, verify_manifest
from rlframe.utils.safe_files import replace_folder
from rlframe.workers.checkpoint import MODEL_DIR, read_full_tensors
from rlframe.workers.lora import is_adapter_tensor, merge_lora_checkpoint

ROLES = ("actor", "critic")
DTYPES = ("float32", "bfloat16", "float16")


def role_folder(checkpoint_dir: str, role: str) -> str:
    """The role folder to merge; a step folder (or a role folder inside one) is verified against its manifest."""
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    if os.path.isdir(os.path.join(checkpoint_dir, MODEL_DIR)):
        step_dir = os.path.dirname(checkpoint_dir)
        folder = checkpoint_dir
    elif os.path.isdir(os.path.join(checkpoint_dir, role)):
        step_dir, folder = checkpoint_dir, os.path.join(checkpoint_dir, role)
    else:
        raise ValueError(
            f"{checkpoint_dir} is neither a step folder with {role}/ nor a role folder with {MODEL_DIR}/ "
            "(expected <default_local_dir>/global_step_N or global_step_N/actor)"
        )
    if os.path.isfile(os.path.join(step_dir, MANIFEST)):
        verify_manifest(step_dir)
    return folder


def model_source(folder: str, role: str, model: str | None) -> str:
    """Where the config and tokenizer come from: `--model`, else the run's config.yaml."""
    if model is not None:
        return model
    run_config = os.path.join(os.path.dirname(os.path.dirname(folder)), "config.yaml")
    if not os.path.isfile(run_config):
        raise ValueError(
            f"no --model given and no run config at {run_config}; pass --model PATH "
            "(the Hugging Face folder the run started from)"
        )
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_config)
    key = "critic.model.path" if role == "critic" else "actor_rollout_ref.model.path"
    source = str(cfg.critic.model.path if role == "critic" else cfg.actor_rollout_ref.model.path)
    if MASK in source:  # the run's value held a secret (docs/reliability.md), so config.yaml does not have it
        raise ValueError(
            f"{key} is masked in {run_config}; pass --model PATH (the Hugging Face folder the run started from)"
        )
    return source


def merge(checkpoint_dir: str, out_dir: str, role: str = "actor", model: str | None = None, dtype=None) -> str:
    """Write the role's full model as a Hugging Face folder at `out_dir` (through a temporary name)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    folder = role_folder(checkpoint_dir, role)
    source = model_source(folder, role, model)
    tensors = read_full_tensors(os.path.join(folder, MODEL_DIR))
    if tensors and all(is_adapter_tensor(name) for name in tensors):  # a LoRA run: its adapter on the base model
        merge_lora_checkpoint(folder, tensors, source, out_dir, dtype)
        return out_dir
    config = AutoConfig.from_pretrained(source)
    if role == "critic":  # as the critic worker builds it: a scalar value head
        config.num_labels = 1
        config.classifier_dropout = 0.0
    model_cls = AutoModelForTokenClassification if role == "critic" else AutoModelForCausalLM
    with torch.device("meta"):  # no second copy of the weights: the loaded tensors are assigned
        hf_model = model_cls.from_config(config)
    if dtype is not None:
        tensors = {name: value.to(getattr(torch, dtype)) for name, value in tensors.items()}
    missing, unexpected = hf_model.load_state_dict(tensors, strict=False, assign=True)
    missing = [name for name in missing if name not in _tied(hf_model)]
    if missing or unexpected:
        raise ValueError(
            f"{folder}/{MODEL_DIR} does not fit the model of {source}: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (pass --model with the folder the run started from, and --role for the critic)"
        )
    hf_model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(source)

    def fill(tmp: str) -> None:
        hf_model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    replace_folder(out_dir.rstrip(os.sep), fill)
    return out_dir


def _tied(model) -> set[str]:
    """Parameter names that are tied to another (e.g. lm_head.weight to the embedding) and may be absent."""
    return set(getattr(model, "_tied_weights_keys", None) or ())  # a list (transformers 4) or a dict (5)


def main(argv: list[str]) -> int:
    """`rlframe merge CHECKPOINT_DIR OUT_DIR [--role actor|critic] [--model PATH] [--dtype D]`."""
    parser = argparse.ArgumentParser(prog="rlframe merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="global_step_N (or global_step_N/actor)")
    parser.add_argument("out_dir", help="the Hugging Face folder to write")
    parser.add_argument("--role", choices=ROLES, default="actor")
    parser.add_argument("--model", default=None, help="config + tokenizer source; default: the run's config.yaml")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="convert the weights; default: as saved")
    args = parser.parse_args(argv)
    try:
        out = merge(args.checkpoint_dir, args.out_dir, args.role, args.model, args.dtype)
    except ValueError as err:
        print(f"rlframe merge: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"[rlframe] wrote {out}", flush=True)
    return 0
