"""The `data` section: which prompts, how they are templated and cut, how many per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from rlframe.config.schema import Section, key

TRUNCATION_MODES = ("error", "left", "right", "middle")
# apply_chat_template arguments rlframe sets itself: the prompt is rendered as text with the generation
# prompt, then tokenized; the tools come from the rollout's tool config
RESERVED_TEMPLATE_KWARGS = (
    "conversation",
    "tokenize",
    "add_generation_prompt",
    "tools",
    "return_dict",
    "return_tensors",
)


def _check_template_kwargs(kwargs: dict) -> None:
    reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"{reserved} are set by rlframe itself; pass only template variables (e.g. enable_thinking)")


@dataclass
class DataConfig(Section):
    tokenizer: Optional[str] = key(None, "tokenizer path; null = actor_rollout_ref.model.path")
    train_files: Any = key(
        "builtin://countdown_add", "parquet file(s) (str or list) in verl's schema; builtin://NAME = built-in task"
    )
    val_files: Any = key("builtin://countdown_add", "validation parquet file(s); same schema")
    prompt_key: str = key("prompt", "column with chat messages (list of {role, content})")
    reward_fn_key: str = key("data_source", "column that picks the rule-based scorer")
    max_prompt_length: int = key(512, "prompt tokens after chat template (left-padded to this)")
    max_response_length: int = key(512, "generated tokens per response")
    train_batch_size: int = key(1024, "prompts per training step")
    gen_batch_size: Optional[int] = key(
        None, "prompts per generation round with algorithm.filter_groups (DAPO); null = train_batch_size"
    )
    val_batch_size: Optional[int] = key(None, "prompts per validation batch; null = whole val set at once")
    return_raw_chat: bool = key(True, "keep raw chat messages in non_tensor_batch")
    image_key: str = key(
        "images", "column of each row's images (verl's geo3k layout), read when the model has a vision tower"
    )
    shuffle: bool = key(True, "shuffle the training set each epoch")
    seed: int = key(1, "seed for shuffling and the built-in task generator")
    filter_overlong_prompts: bool = key(False, "drop prompts longer than max_prompt_length (count reported)")
    truncation: str = key(
        "error",
        "prompts over max_prompt_length (when not filtered): error|left|right|middle",
        choices=TRUNCATION_MODES,
    )
    trust_remote_code: bool = key(False, "passed to the tokenizer's from_pretrained")
    apply_chat_template_kwargs: Dict[str, Any] = key(
        {},
        "extra arguments of apply_chat_template for prompts and multi-turn turns (enable_thinking, reasoning_effort)",
        check=_check_template_kwargs,
    )
    dataloader_num_workers: int = key(8, "verl's loader processes; no effect: prompts are tokenized up front")
    filter_overlong_prompts_workers: int = key(1, "verl's filter processes; no effect: prompts are tokenized once")
    builtin_dir: Optional[str] = key(
        None, "where builtin:// tasks write their parquet; null = $RLFRAME_CACHE/data (~/.cache/rlframe)"
    )

    def inactive(self, path: str, root: Any) -> dict[str, str]:
        # every prompt is templated and tokenized once, up front, in the driver; batches are then only padded
        reason = "rlframe tokenizes every prompt once, up front, and pads batches in the driver"
        return {f"{path}.dataloader_num_workers": reason, f"{path}.filter_overlong_prompts_workers": reason}
