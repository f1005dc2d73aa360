"""Vision-language models under every layout: the same numbers as the padded single-process reference.

On `builtin://tiny-vl` (a Qwen2-VL) and a batch whose rows hold none, one or two images of different sizes
(tests/helpers/vl_batch.py), left-padded prompts and right-padded responses: log-probs, entropy, losses and the
full gradient of one step, vision tower included, agree to 1e-5 relative (as the text models' equivalence tests,
tests/workers/test_fsdp_equivalence.py) under remove-padding, static and dynamic micro-batches (rows reordered),
DP with FSDP2 and FSDP1, and Ulysses sp = 2 (docs/multimodal.md).
"""

import numpy as np
import pytest
import torch
from helpers.equivalence import NUM_SEQS, assert_matches
from helpers.fsdp_harness import RESPONSE_LEN, Scenario, make_role, run_distributed, run_scenario
from helpers.vl_batch import ROW_IMAGES, make_vl_batch

from rlframe.workers.model_forward import PaddedLayout, forward_micro_batch
from rlframe.workers.model_loading import ModelSpec, load_hf_model
from rlframe.workers.multimodal import IMAGE_ROW, RowImages, vision_tower
from rlframe.workers.optimizer import build_optimizer
from rlframe.workers.reward_model import load_reward_model

assert len(ROW_IMAGES) == NUM_SEQS  # the harness's plans cut NUM_SEQS rows


@pytest.fixture(scope="module")
def vl_batch(tiny_vl_path):
    return make_vl_batch(tiny_vl_path)


@pytest.fixture(scope="module")
def vl_reference(tiny_vl_path, vl_batch):
    return run_scenario(
        Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS), tiny_vl_path, vl_batch
    )


def _load(path: str, use_remove_padding: bool = False, **kwargs):
    return load_hf_model(ModelSpec(path, "actor", torch.float32, use_remove_padding, **kwargs))


def _images_of(batch) -> RowImages:
    return RowImages(batch.non_tensor_batch["multi_modal_inputs"])


# ---------------------------------------------------------------- the batch format itself
def test_batch_format_gives_transformers_own_numbers(tiny_vl_path, vl_batch):
    """The padded forward of the batch ([4, batch, seqlen] positions, the rows' images concatenated) equals
    transformers' Qwen2-VL run on each row alone, computing its own positions from the image tokens."""
    model = _load(tiny_vl_path).eval()
    data = vl_batch.batch
    micro = {**dict(data.items()), IMAGE_ROW: torch.arange(NUM_SEQS)}
    response_length = data["responses"].shape[1]
    with torch.no_grad():
        batched = forward_micro_batch(model, micro, response_length, layout=PaddedLayout(), images=_images_of(vl_batch))
    image_token = model.config.image_token_id
    for row, inputs in enumerate(vl_batch.non_tensor_batch["multi_modal_inputs"]):
        valid = data["attention_mask"][row].bool()
        ids = data["input_ids"][row][valid][None]
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=(ids == image_token).int(), **inputs).logits[0]
        n = int(data["attention_mask"][row, -response_length:].sum())
        prompt = int(valid.sum()) - n
        alone = torch.log_softmax(logits[prompt - 1 : prompt - 1 + n], -1).gather(-1, ids[0, prompt:, None])[:, 0]
        torch.testing.assert_close(batched["log_probs"][row, :n], alone, rtol=1e-5, atol=1e-6)


def test_images_change_the_numbers(tiny_vl_path, vl_batch):
    """Blank pixels change every image row's log-probs and no other row's: the comparisons below see images."""
    model = _load(tiny_vl_path).eval()
    micro = {**dict(vl_batch.batch.items()), IMAGE_ROW: torch.arange(NUM_SEQS)}
    per_row = vl_batch.non_tensor_batch["multi_modal_inputs"]
    blank = np.empty(NUM_SEQS, dtype=object)
    blank[:] = [
        {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])} if inputs else {} for inputs in per_row
    ]
    with torch.no_grad():
        seen, blanked = (
            forward_micro_batch(model, micro, RESPONSE_LEN, layout=PaddedLayout(), images=RowImages(images))[
                "log_probs"
            ]
            for images in (per_row, blank)
        )
    for row, sizes in enumerate(ROW_IMAGES):
        assert torch.equal(seen[row], blanked[row]) != bool(sizes), row


# ---------------------------------------------------------------- single process: layouts and micro-batches
@pytest.mark.parametrize(
    "scenario",
    [
        Scenario(strategy="none", use_remove_padding=False, micro_batch_size=3),
        Scenario(strategy="none", use_remove_padding=True, micro_batch_size=3),
        Scenario(strategy="none", use_remove_padding=True, micro_batch_size=1),
        Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=40),  # rows reordered into 4+ micro-batches
        Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=1000),
    ],
    ids=["padded_micro3", "rmpad_micro3", "rmpad_micro1", "dynamic_40", "dynamic_1000"],
)
def test_vl_layouts_match_padded_reference(tiny_vl_path, vl_batch, vl_reference, scenario):
    assert_matches(run_scenario(scenario, tiny_vl_path, vl_batch), vl_reference)


def test_reference_trains_the_vision_tower(vl_reference):
    """The gradients compared include the tower's, and they are not zero (the images reach the loss)."""
    tower = {name: grad for name, grad in vl_reference["grads"].items() if ".visual." in name}
    assert tower and all(grad.norm() > 0 for grad in tower.values())


def test_frozen_tower_matches_its_reference(tiny_vl_path, vl_batch):
    """freeze_vision_tower: no gradient for the tower; the rest as the frozen reference, under dynamic batching."""
    ref = run_scenario(
        Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS, freeze_vision_tower=True),
        tiny_vl_path,
        vl_batch,
    )
    assert ref["grads"] and not any(".visual." in name for name in ref["grads"])
    sc = Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=40, freeze_vision_tower=True)
    assert_matches(run_scenario(sc, tiny_vl_path, vl_batch), ref)


# ---------------------------------------------------------------- the update itself
@pytest.mark.parametrize("freeze", [False, True])
def test_update_policy_changes_parameters_and_freeze_keeps_the_tower(tiny_vl_path, vl_batch, freeze):
    from rlframe.workers.config.model import OptimConfig

    sc = Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=40, freeze_vision_tower=freeze)
    model = _load(tiny_vl_path, use_remove_padding=True, freeze_vision_tower=freeze)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    actor = make_role(sc, NUM_SEQS, model, build_optimizer(model, OptimConfig(lr=1e-3)))
    metrics, _ = actor.update_policy(vl_batch)
    assert len(metrics["actor/pg_loss"]) == 1
    changed = {name: not torch.equal(p, before[name]) for name, p in model.named_parameters()}
    tower = [name for name in changed if ".visual." in name]
    assert tower and all(changed[name] != freeze for name in tower)
    assert all(changed[name] for name in changed if ".visual." not in name)


# ---------------------------------------------------------------- loading
def test_vl_model_loads_as_image_text_to_text_with_its_tower(tiny_vl_path):
    from transformers import Qwen2VLForConditionalGeneration

    model = _load(tiny_vl_path, freeze_vision_tower=True)
    assert isinstance(model, Qwen2VLForConditionalGeneration)
    assert not any(p.requires_grad for p in vision_tower(model).parameters())
    assert all(p.requires_grad for name, p in model.named_parameters() if ".visual." not in name)


def test_vl_critic_reward_model_and_text_freeze_are_refused_by_key(tiny_vl_path, tiny_model_path):
    with pytest.raises(ValueError, match=r"critic\.model\.path=.*vision-language"):
        load_hf_model(ModelSpec(tiny_vl_path, "critic", torch.float32, False))
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.freeze_vision_tower=true.*no vision tower"):
        _load(tiny_model_path, freeze_vision_tower=True)
    with pytest.raises(ValueError, match=r"reward_model\.model\.path=.*vision-language"):
        load_reward_model(tiny_vl_path, use_remove_padding=False)


# ---------------------------------------------------------------- multi-process (gloo + FSDP)
DISTRIBUTED = {
    "sp2_static": Scenario(world=2, sp=2, micro_batch_size=3),
    "sp2_dynamic": Scenario(world=2, sp=2, use_dynamic_bsz=True, max_token_len=24),
    # micro-batches of one row: a rank's micro-batch without images meets one with images on the other rank
    "dp2_fsdp2_rows_without_images": Scenario(world=2, micro_batch_size=1),
    "dp2_fsdp1": Scenario(world=2, strategy="fsdp", micro_batch_size=2),
    "dp2_padded": Scenario(world=2, use_remove_padding=False, micro_batch_size=4),
    "dp2_offload_grad_ckpt_prefetch": Scenario(
        world=2, micro_batch_size=1, param_offload=True, gradient_checkpointing=True, forward_prefetch=True
    ),
    "sp2_dp2_dynamic": Scenario(world=4, sp=2, use_dynamic_bsz=True, max_token_len=24),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_distributed_vl_actor_matches_single_process(tiny_vl_path, vl_batch, vl_reference, tmp_path, name):
    assert_matches(run_distributed(DISTRIBUTED[name], tiny_vl_path, vl_batch, str(tmp_path)), vl_reference)


@pytest.mark.slow
def test_distributed_frozen_tower_matches_single_process(tiny_vl_path, vl_batch, tmp_path):
    frozen = {"freeze_vision_tower": True}
    ref = run_scenario(
        Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS, **frozen), tiny_vl_path, vl_batch
    )
    sc = Scenario(world=2, sp=2, use_dynamic_bsz=True, max_token_len=24, **frozen)
    assert_matches(run_distributed(sc, tiny_vl_path, vl_batch, str(tmp_path)), ref)


# ---------------------------------------------------------------- Qwen2.5-VL: the family's other member
@pytest.fixture(scope="module")
def qwen25_vl_path(tiny_vl_path, tmp_path_factory):
    from helpers.vl_batch import make_tiny_qwen25_vl

    return make_tiny_qwen25_vl(str(tmp_path_factory.mktemp("qwen25_vl")), tiny_vl_path)


def test_qwen25_vl_batch_format_and_layouts_match(qwen25_vl_path):
    """A tiny Qwen2.5-VL (window attention in its tower): the batch format gives transformers' own numbers (its
    rope index computed from the image tokens), and remove-padding and dynamic micro-batches give the padded
    reference's log-probs and gradients."""
    batch = make_vl_batch(qwen25_vl_path)
    model = _load(qwen25_vl_path).eval()
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    data = batch.batch
    micro = {**dict(data.items()), IMAGE_ROW: torch.arange(NUM_SEQS)}
    with torch.no_grad():
        batched = forward_micro_batch(model, micro, RESPONSE_LEN, layout=PaddedLayout(), images=_images_of(batch))
    for row, inputs in enumerate(batch.non_tensor_batch["multi_modal_inputs"]):
        valid = data["attention_mask"][row].bool()
        ids = data["input_ids"][row][valid][None]
        with torch.no_grad():
            types = (ids == model.config.image_token_id).int()
            logits = model(input_ids=ids, mm_token_type_ids=types, **inputs).logits[0]
        n = int(data["attention_mask"][row, -RESPONSE_LEN:].sum())
        prompt = int(valid.sum()) - n
        alone = torch.log_softmax(logits[prompt - 1 : prompt - 1 + n], -1).gather(-1, ids[0, prompt:, None])[:, 0]
        torch.testing.assert_close(batched["log_probs"][row, :n], alone, rtol=1e-5, atol=1e-6)
    reference = run_scenario(
        Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS), qwen25_vl_path, batch
    )
    for scenario in (
        Scenario(strategy="none", use_remove_padding=True, micro_batch_size=3),
        Scenario(strategy="none", use_dynamic_bsz=True, max_token_len=40),
    ):
        assert_matches(run_scenario(scenario, qwen25_vl_path, batch), reference)


@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_fused_head_scores_a_vl_batch_as_the_logits_do(tiny_vl_path, vl_batch, use_remove_padding):
    """model.use_fused_kernels on a vision-language model: log-probs and entropy from the hidden states a chunk at a
    time equal those from the logits, padded and packed."""
    from rlframe.workers.model_forward import PackedLayout, ScoringSpec

    model = _load(tiny_vl_path, use_remove_padding=use_remove_padding).eval()
    micro = {**dict(vl_batch.batch.items()), IMAGE_ROW: torch.arange(NUM_SEQS)}
    layout = PackedLayout() if use_remove_padding else PaddedLayout()
    with torch.no_grad():
        plain, fused = (
            forward_micro_batch(
                model,
                micro,
                RESPONSE_LEN,
                ScoringSpec(calculate_entropy=True, use_fused_kernels=fuse),
                layout,
                images=_images_of(vl_batch),
            )
            for fuse in (False, True)
        )
    for name in ("log_probs", "entropy"):
        torch.testing.assert_close(fused[name], plain[name], rtol=1e-5, atol=1e-6)
