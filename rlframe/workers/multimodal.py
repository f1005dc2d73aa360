"""Images in the training forward: how a micro-batch finds its rows' images, and how they reach the model.

A vision-language batch (`rlframe.models.vision`) carries, per row, `position_ids` [4, seqlen] (text row, then
the three mrope rows) and `non_tensor_batch["multi_modal_inputs"]`, a numpy object array of dicts
`{"pixel_values": [patches, D], "image_grid_thw": [images, 3]}` (empty for a row without images).

Finding a micro-batch's images. The workers cut a batch as a TensorDict (mini-batches, shuffles, dynamic
micro-batches that reorder rows), which cannot hold the object array. So the role adds one tensor before any
cut, `IMAGE_ROW` [batch] = 0, 1, 2, ...: each row's index into the call's object array. Every cut carries it
with its row, and a micro-batch's images are `RowImages.of(micro[IMAGE_ROW])`: its rows' pixel values and grids
concatenated in the micro-batch's row order, as transformers' Qwen2-VL takes them (it scatters the features
into the image tokens of the flattened batch in order).

Reaching the model. `vision_hooks` installs, for one forward of a vision-language model:
- on the vision tower, a pre-hook that drops the packed text row's keyword arguments (`cu_seq_lens_q`,
  `max_length_q`, the Ulysses group): transformers hands the model's extra keyword arguments on to the tower,
  whose attention would otherwise read the text row's sequence bounds as the images';
- with images and Ulysses sequence parallelism, a pre-hook on the language model that takes this rank's slice
  of the embeddings and positions. Each rank runs the whole packed row through the embedding and the
  image-feature merge (every image's features land on its tokens), then the decoder runs on its 1/sp of the
  row. Slicing the token ids first, as for text, would leave a rank with image tokens whose features are on
  another rank;
- without images, a pre-hook on the language model that runs the tower on one blank image of the smallest
  grid and adds 0 x its features to the embeddings (verl does the same). Under FSDP every rank must gather
  the tower's blocks in every micro-batch's forward and reduce their gradients in its backward: a DP rank
  whose micro-batch has no image would otherwise skip the tower's collectives while another runs them, and
  the ranks' collectives would pair up wrongly (silently wrong numbers on gloo, tests/workers/
  test_vl_equivalence.py). Adding 0 changes no value and no gradient.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlframe.distributed.ulysses import slice_for_rank
from rlframe.models.vision import concat_image_inputs

IMAGE_ROW = "multi_modal_row"  # each row's index into the call's multi_modal_inputs
# the packed text row's keyword arguments (rlframe.workers.model_forward.PackedLayout) the vision tower must not see
TEXT_ROW_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "ulysses_group")


@dataclass(frozen=True)
class RowImages:
    """A call's per-row image inputs, looked up by the rows a micro-batch carries."""

    per_row: np.ndarray  # object array of dicts, one per row of the call's batch

    def of(self, rows: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        """`pixel_values` and `image_grid_thw` of `rows`, concatenated in their order ({} when none has an image)."""
        return concat_image_inputs([self.per_row[int(row)] for row in rows.tolist()], device)


def with_image_rows(batch: TensorDict, non_tensor_batch: dict) -> tuple[TensorDict, RowImages | None]:
    """`batch` with its `IMAGE_ROW` index and the call's `RowImages`; as is, and None, for a batch without images."""
    per_row = non_tensor_batch.get("multi_modal_inputs")
    if per_row is None:
        return batch, None
    if len(per_row) != len(batch):
        raise ValueError(f"multi_modal_inputs has {len(per_row)} rows, the batch {len(batch)}")
    batch = batch.clone(recurse=False)
    batch[IMAGE_ROW] = torch.arange(len(batch), device=batch.device)
    return batch, RowImages(per_row)


def named_submodule(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The submodule whose attribute name is `name` (through FSDP1's and PEFT's wrappers); None if there is none."""
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] == name:
            return module
    return None


_TOWERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [its tower or None], looked up once


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower of a Qwen2-VL-family model (`model.visual`, verl's name); None for a text model."""
    if model not in _TOWERS:
        _TOWERS[model] = [named_submodule(model, "visual")]
    return _TOWERS[model][0]


@contextlib.contextmanager
def vision_hooks(model: torch.nn.Module, with_images: bool, sp_group: dist.ProcessGroup | None = None):
    """The forward hooks of the module docstring for one forward of `model` (none for a text model).

    `with_images`: the micro-batch's images are among the model's inputs; `sp_group`: the Ulysses group the
    packed row is split over (None without sequence parallelism).
    """
    tower = vision_tower(model)
    if tower is None:
        if with_images:
            raise ValueError("the batch carries images (multi_modal_inputs) but the model has no vision tower (visual)")
        yield
        return
    language_model = named_submodule(model, "language_model")
    if language_model is None:
        raise ValueError(f"{type(model).__name__}: no language_model beside its vision tower (Qwen2-VL's layout)")
    handles = [tower.register_forward_pre_hook(_drop_text_row_kwargs, with_kwargs=True)]
    if not with_images:
        handles.append(language_model.register_forward_pre_hook(_blank_image(tower), with_kwargs=True))
    elif sp_group is not None:
        handles.append(language_model.register_forward_pre_hook(_rank_slice(sp_group), with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _drop_text_row_kwargs(module, args, kwargs):
    return args, {name: value for name, value in kwargs.items() if name not in TEXT_ROW_KWARGS}


def _blank_image(tower: torch.nn.Module):
    """The language model's pre-hook that runs `tower` on a blank image and adds 0 x its features (docstring)."""
    config = tower.config
    merge = config.spatial_merge_size
    patch = config.in_channels * config.temporal_patch_size * config.patch_size**2

    def hook(module, args, kwargs):
        embeds = kwargs["inputs_embeds"]
        grid = torch.tensor([[1, merge, merge]], device=embeds.device)
        pixels = torch.zeros(merge * merge, patch, device=embeds.device, dtype=embeds.dtype)
        features = tower(pixels, grid_thw=grid).pooler_output
        return args, {**kwargs, "inputs_embeds": embeds + 0.0 * features.sum().to(embeds.dtype)}

    return hook


def _rank_slice(group: dist.ProcessGroup):
    def hook(module, args, kwargs):
        kwargs = dict(kwargs)
        kwargs["inputs_embeds"] = slice_for_rank(kwargs["inputs_embeds"], group, dim=1)  # [1, T, hidden]
        kwargs["position_ids"] = slice_for_rank(kwargs["position_ids"], group, dim=-1)  # [4, 1, T]
        return args, kwargs

    return hook
