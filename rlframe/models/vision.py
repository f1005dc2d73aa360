"""Vision-language models of the Qwen2-VL family: their images, image tokens and 3-D rotary positions.

A prompt with images reaches the model as (verl's layout, which rlframe's batches keep):

    input_ids        each image's <|image_pad|> written t * (h / m) * (w / m) times, for its patch grid (t, h, w)
                     and the tower's spatial merge m (the processor's expansion of the chat template's one pad)
    position_ids     [4, seqlen]: row 0 the text positions (0, 1, 2, ... over the valid tokens), rows 1-3 the
                     multimodal rotary positions (mrope): text tokens count up on all three; an image's tokens
                     take (start, start + row, start + column); the text after it restarts at
                     start + max(h, w) / m. transformers' Qwen2-VL takes this [4, batch, seqlen] form as is.
    multi_modal_inputs  {"pixel_values": [patches, 3 * t_patch * p * p], "image_grid_thw": [images, 3]} per row
    multi_modal_data    {"image": [PIL images]} per row: what a rollout engine takes

`VisionProcessor` makes them from chat messages and images with the checkpoint's own image processor and
tokenizer (transformers' `Qwen2VLProcessor` does the same, but cannot be built without torchvision, which CPU
installs of torch here cannot import); `mrope_position_ids` equals transformers' `get_rope_index`
(tests/models/test_vision.py).
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass

import torch

MULTIMODAL_KEYS = ("multi_modal_data", "multi_modal_inputs")  # a batch row's images (non-tensor fields)
IMAGE_PLACEHOLDER = "<image>"  # verl's marker of an image's place in a prompt's text
# model types whose images rlframe lays out (Qwen2-VL's 3-D rotary positions and image tokens)
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def is_vision_model(config) -> bool:
    """Whether a transformers config (or its dict) is a vision-language model's: it has a vision tower."""
    get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
    return get("vision_config") is not None


def causal_lm_class(config):
    """The transformers auto class that loads a generating model of `config`: image-text-to-text for a vision
    tower (Qwen2-VL's `...ForConditionalGeneration`), causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(config) else AutoModelForCausalLM


def vision_spec(model_path: str, trust_remote_code: bool = False) -> VisionSpec | None:
    """The token layout of the model at `model_path`, None for a text model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return VisionSpec.from_config(config) if is_vision_model(config) else None


def check_vision_model(model_type: str, where: str) -> None:
    if model_type not in VISION_MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type {model_type!r} has a vision tower, and rlframe lays out the images of "
            f"{', '.join(VISION_MODEL_TYPES)} (Qwen2-VL's image tokens and 3-D rotary positions) only"
        )


# ------------------------------------------------------------------------------------------- images
def load_image(image, where: str):
    """An RGB PIL image from what verl's parquet files hold: {"bytes": ..., "path": ...}, bytes, a path, or PIL."""
    from PIL import Image

    try:
        if isinstance(image, Image.Image):
            return image.convert("RGB")
        if isinstance(image, dict):
            if image.get("bytes") is not None:
                image = image["bytes"]
            elif image.get("image") is not None:
                return load_image(image["image"], where)
            elif image.get("path"):
                image = image["path"]
            else:
                raise ValueError(f"a dict with neither 'bytes' nor 'path' ({sorted(image)})")
        if isinstance(image, (bytes, bytearray)):
            return Image.open(io.BytesIO(image)).convert("RGB")
        if isinstance(image, str):
            return Image.open(os.path.expanduser(image)).convert("RGB")
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: cannot read the image ({error})") from error
    raise ValueError(f"{where}: an image is {type(image).__name__}; expected a dict with 'bytes' or 'path', or PIL")


def png_bytes(image) -> bytes:
    """A PIL image as PNG bytes (lossless: `load_image` gives the same pixels back)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def messages_with_images(messages: list[dict], num_images: int, where: str) -> list[dict]:
    """verl's rule: each `<image>` in a message's text becomes an image part, in order; the count must match."""
    placed, out = 0, []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
            out.append(message)
            continue
        parts = []
        for piece in re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", content):
            if piece == IMAGE_PLACEHOLDER:
                parts.append({"type": "image"})
                placed += 1
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts})
    if placed != num_images:
        raise ValueError(
            f"{where}: the prompt has {placed} {IMAGE_PLACEHOLDER} placeholder(s) and the row {num_images} image(s); "
            f"each image needs one {IMAGE_PLACEHOLDER} where it goes in the text (verl's layout)"
        )
    return out


# ------------------------------------------------------------------------------------------- positions
@dataclass(frozen=True)
class VisionSpec:
    """What the token layout needs from a Qwen2-VL-family config."""

    image_token_id: int
    video_token_id: int
    merge_size: int

    @classmethod
    def from_config(cls, config) -> VisionSpec:
        get = config.get if isinstance(config, dict) else lambda name: getattr(config, name)
        vision = get("vision_config")
        merge = vision["spatial_merge_size"] if isinstance(vision, dict) else vision.spatial_merge_size
        return cls(int(get("image_token_id")), int(get("video_token_id")), int(merge))

    def tokens_per_image(self, grid_thw: torch.Tensor) -> int:
        return int(grid_thw.prod()) // (self.merge_size**2)

    def expand(self, ids: list[int], image_grid_thw: torch.Tensor | None) -> list[int]:
        """Rendered tokens with each image's one pad token repeated for its grid (what Qwen2-VL's processor does)."""
        grids = iter([] if image_grid_thw is None else image_grid_thw)
        out = []
        for token in ids:
            if token == self.image_token_id:
                grid = next(grids, None)
                if grid is None:
                    raise ValueError("the prompt has more image tokens than images")
                out.extend([token] * self.tokens_per_image(grid))
            else:
                out.append(token)
        if next(grids, None) is not None:
            raise ValueError("the prompt has fewer image tokens than images (does the chat template render images?)")
        return out


def mrope_position_ids(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None, spec: VisionSpec
) -> torch.Tensor:
    """[4, seqlen] positions of one row (verl's layout: text positions, then the 3 mrope rows).

    Padding gets text position 1 and mrope position 1, as verl writes them; no attention reads it.
    """
    valid = attention_mask.bool()
    ids = input_ids[valid].tolist()
    grids = iter([] if image_grid_thw is None else image_grid_thw.tolist())
    rows: list[list[int]] = [[], [], []]
    start, i = 0, 0
    while i < len(ids):
        if ids[i] != spec.image_token_id:
            for row in rows:
                row.append(start)
            start, i = start + 1, i + 1
            continue
        t, h, w = next(grids)
        h, w = h // spec.merge_size, w // spec.merge_size
        for frame in range(t):
            for y in range(h):
                for x in range(w):
                    rows[0].append(start + frame)
                    rows[1].append(start + y)
                    rows[2].append(start + x)
        i += t * h * w
        start += max(h, w)
    if next(grids, None) is not None:
        raise ValueError("more image grids than images in the row's tokens")
    out = torch.ones(4, input_ids.shape[-1], dtype=torch.long)
    out[0, valid] = torch.arange(int(valid.sum()))
    out[1:, valid] = torch.tensor(rows, dtype=torch.long).view(3, -1)
    return out


def concat_image_inputs(rows_inputs, device: torch.device) -> dict[str, torch.Tensor]:
    """Rows' `multi_modal_inputs` as one forward's image arguments: `pixel_values` and `image_grid_thw` concatenated
    in row order (transformers' Qwen2-VL scatters the features into the batch's image tokens in that order; rows
    without images add nothing); {} when no row has an image."""
    present = [inputs for inputs in rows_inputs if inputs and len(inputs.get("image_grid_thw", ())) > 0]
    if not present:
        return {}
    return {
        name: torch.cat([inputs[name] for inputs in present]).to(device) for name in ("pixel_values", "image_grid_thw")
    }


def generation_image_inputs(rows_inputs, input_ids: torch.Tensor, spec: VisionSpec) -> dict[str, torch.Tensor]:
    """`concat_image_inputs` plus the image-token types transformers asks for when it computes the 3-D positions
    itself (generation); {} when no row has an image."""
    images = concat_image_inputs(rows_inputs, input_ids.device)
    if images:
        images["mm_token_type_ids"] = (input_ids == spec.image_token_id).int()
    return images


def images_of(rows: list[dict]) -> dict:
    """Non-tensor batch fields of rows' image fields (each a `row_images` dict); {} when no row has an image."""
    if not any(row.get("multi_modal_inputs") for row in rows):
        return {}
    return {key: [row.get(key) or {} for row in rows] for key in MULTIMODAL_KEYS}


def row_images(batch, row: int) -> dict:
    """A batch row's image fields (`MULTIMODAL_KEYS`) as keyword arguments; {} for a text batch."""
    return {key: batch.non_tensor_batch[key][row] for key in MULTIMODAL_KEYS if key in batch.non_tensor_batch}


def extend_positions(prompt_positions: torch.Tensor, response_length: int) -> torch.Tensor:
    """[..., 4, prompt_len] -> [..., 4, prompt_len + response_length]: every row counts on from its last position
    (a response is text: one step per token on all of text, time, height and width)."""
    offsets = torch.arange(1, response_length + 1, device=prompt_positions.device, dtype=prompt_positions.dtype)
    last = prompt_positions[..., -1:]
    if prompt_positions.shape[-2] == 4:  # the mrope rows count on from the prompt's largest position, not its last
        last = torch.cat([last[..., :1, :], prompt_positions[..., 1:, :].amax(dim=-1, keepdim=True)], dim=-2)
    return torch.cat([prompt_positions, last + offsets], dim=-1)


# ------------------------------------------------------------------------------------------- the processor
class VisionProcessor:
    """A checkpoint's image processor and tokenizer, used as transformers' Qwen2-VL processor uses them."""

    def __init__(self, model_path: str, tokenizer, config):
        from transformers import AutoImageProcessor

        check_vision_model(config.model_type, model_path)
        if not os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
            raise ValueError(f"{model_path} is a vision-language model without preprocessor_config.json")
        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.tokenizer = tokenizer
        self.spec = VisionSpec.from_config(config)
        if not getattr(tokenizer, "chat_template", None):  # some checkpoints keep it beside the processor only
            path = os.path.join(model_path, "chat_template.json")
            if os.path.isfile(path):
                with open(path) as f:
                    tokenizer.chat_template = json.load(f)["chat_template"]

    def images(self, images: list) -> dict[str, torch.Tensor]:
        """{"pixel_values", "image_grid_thw"} of a row's images (empty for none)."""
        if not images:
            return {}
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def load_vision_processor(model_path: str, tokenizer, trust_remote_code: bool = False) -> VisionProcessor | None:
    """The model's `VisionProcessor`, or None for a text-only model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return VisionProcessor(model_path, tokenizer, config) if is_vision_model(config) else None
