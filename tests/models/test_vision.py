"""Vision-language inputs (rlframe.models.vision, the dataset's images): verl's layout, transformers' positions."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from rlframe.data.builtin_tasks import resolve_data_files
from rlframe.data.config import DataConfig
from rlframe.data.dataset import RLHFDataset, collate_fn
from rlframe.models.vision import (
    VisionProcessor,
    extend_positions,
    load_image,
    load_vision_processor,
    messages_with_images,
    mrope_position_ids,
)


@pytest.fixture(scope="module")
def vl(tiny_vl_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_path)
    return model, tokenizer, VisionProcessor(tiny_vl_path, tokenizer, model.config)


def _row(processor, tokenizer, text: str, images: list, pad: int):
    messages = messages_with_images([{"role": "user", "content": text}], len(images), "test")
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
    inputs = processor.images(images)
    ids = processor.spec.expand(list(ids), inputs.get("image_grid_thw"))
    return torch.tensor([0] * pad + ids), torch.tensor([0] * pad + [1] * len(ids)), inputs


def test_positions_equal_transformers_rope_index_and_the_model_gives_the_same_logits(vl):
    model, tokenizer, processor = vl
    images = [Image.new("RGB", (56, 84), (200, 0, 0)), Image.new("RGB", (112, 56), (0, 200, 0))]
    ids, mask, inputs = _row(processor, tokenizer, "<image>How many<image> squares?", images, pad=5)
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 4], [1, 4, 8]]
    assert int((ids == processor.spec.image_token_id).sum()) == 6 + 8  # t * h * w / merge² each
    positions = mrope_position_ids(ids, mask, inputs["image_grid_thw"], processor.spec)
    types = (ids == processor.spec.image_token_id).int()[None]
    reference, _ = model.model.get_rope_index(ids[None], types, inputs["image_grid_thw"], None, mask[None])
    valid = mask.bool()
    assert torch.equal(positions[1:, valid], reference[:, 0, valid])
    assert torch.equal(positions[0, valid], torch.arange(int(valid.sum())))
    with torch.no_grad():
        ours = model(input_ids=ids[None], attention_mask=mask[None], position_ids=positions[:, None], **inputs).logits
        theirs = model(input_ids=ids[None], attention_mask=mask[None], mm_token_type_ids=types, **inputs).logits
    assert torch.equal(ours[0, valid], theirs[0, valid])


def test_a_response_counts_on_from_the_prompts_largest_position():
    prompt = torch.tensor([[1, 0, 1, 2, 3], [1, 0, 1, 1, 5], [1, 0, 2, 2, 5], [1, 0, 1, 2, 5]])
    out = extend_positions(prompt[None], 3)[0]
    assert out[:, 5:].tolist() == [[4, 5, 6], [6, 7, 8], [6, 7, 8], [6, 7, 8]]
    text = torch.tensor([[0, 0, 1, 2]])
    assert extend_positions(text, 2).tolist() == [[0, 0, 1, 2, 3, 4]]


def test_placeholders_and_images_must_match_and_bad_images_are_named():
    with pytest.raises(ValueError, match=r"row 7.*1 <image> placeholder\(s\) and the row 2 image"):
        messages_with_images([{"role": "user", "content": "<image>hi"}], 2, "row 7")
    with pytest.raises(ValueError, match="row 3, image 0: cannot read the image"):
        load_image({"bytes": b"not a png", "path": None}, "row 3, image 0")
    with pytest.raises(ValueError, match="neither 'bytes' nor 'path'"):
        load_image({"other": 1}, "row 3")


def test_a_text_model_has_no_vision_processor(tiny_model_path, tiny_vl_path):
    from transformers import AutoTokenizer

    assert load_vision_processor(tiny_model_path, AutoTokenizer.from_pretrained(tiny_model_path)) is None
    assert load_vision_processor(tiny_vl_path, AutoTokenizer.from_pretrained(tiny_vl_path)) is not None


@pytest.mark.parametrize("task,tokens", [("colour_vl", 4), ("count_vl", 9)])
def test_the_dataset_lays_out_verl_image_rows(vl, tmp_path, task, tokens):
    _, tokenizer, processor = vl
    config = OmegaConf.structured(DataConfig)
    config.max_prompt_length = 96
    files = resolve_data_files(f"builtin://{task}", str(tmp_path), 1, "val")
    dataset = RLHFDataset(files, tokenizer, config, processor)
    batch = collate_fn([dataset[i] for i in range(3)])
    assert batch["position_ids"].shape == (3, 4, 96)
    assert "images" not in batch  # the column became the two fields below
    for i in range(3):
        ids, mask = batch["input_ids"][i], batch["attention_mask"][i]
        inputs = batch["multi_modal_inputs"][i]
        assert int((ids == processor.spec.image_token_id).sum()) == tokens
        assert inputs["pixel_values"].shape[0] == 4 * tokens  # 2 x 2 patches merged per token
        assert len(batch["multi_modal_data"][i]["image"]) == 1
        assert torch.equal(
            batch["position_ids"][i], mrope_position_ids(ids, mask, inputs["image_grid_thw"], processor.spec)
        )
    assert batch["raw_prompt"][0][0]["content"][0] == {"type": "image"}


def test_an_overlong_prompt_is_not_cut_through_its_image(vl, tmp_path):
    _, tokenizer, processor = vl
    config = OmegaConf.structured(DataConfig)
    config.max_prompt_length, config.truncation = 30, "left"  # count_vl's prompts are 45 tokens, 9 of them image
    files = resolve_data_files("builtin://count_vl", str(tmp_path), 1, "val")
    with pytest.raises(ValueError, match="would cut into the prompt's image tokens"):
        RLHFDataset(files, tokenizer, config, processor)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_hf_rollout_generates_from_images_as_the_model_does_and_scores_as_the_forward(vl, tiny_vl_path, tmp_path, mode):
    """Greedy rows equal `model.generate` with the images; the rollout's log-probs equal a teacher-forced forward
    at the batch's [4, seqlen] positions (what the actor computes): generation and training see the same
    positions, left padding included. Both the engine called directly (`mode=sync`) and the agent loop's server."""
    from helpers.rollout import rollout_config

    from rlframe.protocol import DataProto
    from rlframe.workers.rollout import build_rollout

    model, tokenizer, processor = vl
    config = OmegaConf.structured(DataConfig)
    config.max_prompt_length = 96
    files = resolve_data_files("builtin://count_vl", str(tmp_path), 1, "val")
    rows = collate_fn([RLHFDataset(files, tokenizer, config, processor)[i] for i in range(4)])
    # row 1 without its image (a text-only row in an image batch) and a shorter prompt: more left padding
    rows["multi_modal_inputs"][1] = {}
    keep = rows["input_ids"][1] != processor.spec.image_token_id
    rows["input_ids"][1] = torch.cat([torch.zeros(int((~keep).sum()), dtype=torch.long), rows["input_ids"][1][keep]])
    rows["attention_mask"][1] = (rows["input_ids"][1] != 0).long()
    rows["position_ids"][1] = mrope_position_ids(rows["input_ids"][1], rows["attention_mask"][1], None, processor.spec)
    prompts = DataProto.from_single_dict(
        {k: rows[k] for k in ("input_ids", "attention_mask", "position_ids", "multi_modal_inputs")},
        meta_info={"do_sample": False},
    )
    cfg = rollout_config(
        "data.max_prompt_length=96",
        "data.max_response_length=4",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.rollout.mode={mode}",
    )
    rollout = build_rollout("hf", cfg, tiny_vl_path, tokenizer, "cpu")
    out = rollout.generate_sequences(prompts)
    assert "multi_modal_inputs" not in out.non_tensor_batch  # the driver's batch keeps the images
    b = out.batch
    assert b["position_ids"].shape == (4, 4, 100)
    for i in range(4):  # one row at a time: generate's reference without padding effects
        image_inputs = rows["multi_modal_inputs"][i]
        types = (rows["input_ids"][i : i + 1] == processor.spec.image_token_id).int()
        with torch.no_grad():
            expected = model.generate(
                input_ids=rows["input_ids"][i : i + 1],
                attention_mask=rows["attention_mask"][i : i + 1],
                max_new_tokens=4,
                do_sample=False,
                **({**image_inputs, "mm_token_type_ids": types} if image_inputs else {}),
            )[0, 96:]
        length = int(b["response_mask"][i].sum())
        assert torch.equal(b["responses"][i, :length], expected[:length])
    with torch.no_grad():
        image_inputs = {
            "pixel_values": torch.cat([r["pixel_values"] for r in rows["multi_modal_inputs"] if r]),
            "image_grid_thw": torch.cat([r["image_grid_thw"] for r in rows["multi_modal_inputs"] if r]),
        }
        logits = model(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=b["position_ids"].transpose(0, 1),
            **image_inputs,
        ).logits[:, 95:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None]).squeeze(-1) * b["response_mask"]
    torch.testing.assert_close(b["rollout_log_probs"], expected, atol=1e-4, rtol=1e-4)


def test_the_rollout_never_samples_an_image_pad_and_its_log_probs_stay_the_actors(vl, tiny_vl_path, tmp_path):
    """A policy whose most likely first token is <|image_pad|> (its head row set along the hidden state that
    predicts it): the rollout never generates it,
    greedy or sampled, since the training forward cannot run an image token without an image; the log-probs it
    reports are still the actor's whole distribution's."""
    from helpers.rollout import rollout_config

    from rlframe.protocol import DataProto
    from rlframe.workers.rollout import build_rollout

    model, tokenizer, processor = vl
    config = OmegaConf.structured(DataConfig)
    config.max_prompt_length = 96
    files = resolve_data_files("builtin://colour_vl", str(tmp_path), 1, "val")
    rows = collate_fn([RLHFDataset(files, tokenizer, config, processor)[i] for i in range(2)])
    keys = ("input_ids", "attention_mask", "position_ids", "multi_modal_inputs")
    cfg = rollout_config(
        "data.max_prompt_length=96", "data.max_response_length=4", "actor_rollout_ref.rollout.calculate_log_probs=true"
    )
    rollout = build_rollout("hf", cfg, tiny_vl_path, tokenizer, "cpu")
    image_id = processor.spec.image_token_id
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():  # the pad's head row along the first prompt's last hidden state: its next token is the pad
        last = model.model(
            input_ids=rows["input_ids"][:1],
            attention_mask=rows["attention_mask"][:1],
            position_ids=rows["position_ids"][:1].transpose(0, 1),
            **rows["multi_modal_inputs"][0],
        ).last_hidden_state[0, -1]
    state["lm_head.weight"][image_id] = 100 * last / last.norm()
    rollout.update_weights(iter(state.items()))
    actor = copy.deepcopy(model)
    actor.load_state_dict(state)
    for do_sample in (False, True):
        prompts = DataProto.from_single_dict({k: rows[k] for k in keys}, meta_info={"do_sample": do_sample})
        out = rollout.generate_sequences(prompts)
        b = out.batch
        assert not (b["responses"] == image_id).any()
        with torch.no_grad():
            logits = actor(
                input_ids=b["input_ids"],
                attention_mask=b["attention_mask"],
                position_ids=b["position_ids"].transpose(0, 1),
                pixel_values=torch.cat([r["pixel_values"] for r in rows["multi_modal_inputs"]]),
                image_grid_thw=torch.cat([r["image_grid_thw"] for r in rows["multi_modal_inputs"]]),
            ).logits[:, 95:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None]).squeeze(-1) * b["response_mask"]
        torch.testing.assert_close(b["rollout_log_probs"], expected, atol=1e-4, rtol=1e-4)
        assert float(b["rollout_log_probs"][0, 0]) < -20  # the pad held nearly all the mass there: suppressed


def test_an_async_checkpoint_keeps_image_prompts_as_plain_data(vl, tmp_path):
    """The rollout pool's checkpoint (data.pt, read with weights_only) holds prompts not yet trained; image rows
    go in as tensors and PNG bytes and come back with the same pixels and inputs."""
    import numpy as np

    from rlframe.protocol import DataProto
    from rlframe.trainer.checkpointing import load_data
    from rlframe.trainer.pending_prompts import plain_rows, rows_from_plain

    _, tokenizer, processor = vl
    config = OmegaConf.structured(DataConfig)
    config.max_prompt_length = 96
    files = resolve_data_files("builtin://colour_vl", str(tmp_path), 1, "val")
    rows = DataProto.from_single_dict(
        collate_fn([RLHFDataset(files, tokenizer, config, processor)[i] for i in range(3)])
    )
    torch.save({"pending_prompts": plain_rows(rows.split(1))}, tmp_path / "data.pt")
    back = DataProto.concat(rows_from_plain(load_data(str(tmp_path / "data.pt"))["pending_prompts"]))
    for key in rows.batch_keys:
        assert torch.equal(back.batch[key], rows.batch[key]), key
    for before, after in zip(rows.non_tensor_batch["multi_modal_data"], back.non_tensor_batch["multi_modal_data"]):
        assert [np.asarray(i).tolist() for i in before["image"]] == [np.asarray(i).tolist() for i in after["image"]]
    for before, after in zip(rows.non_tensor_batch["multi_modal_inputs"], back.non_tensor_batch["multi_modal_inputs"]):
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_image_rows_for_a_text_model_are_refused_naming_the_row_and_key(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    config = OmegaConf.structured(DataConfig)
    config.max_prompt_length = 96
    files = resolve_data_files("builtin://colour_vl", str(tmp_path), 1, "val")
    with pytest.raises(
        ValueError, match=r"row 0, column 'images' \(data.image_key\): the row has images, but the model"
    ):
        RLHFDataset(files, AutoTokenizer.from_pretrained(tiny_model_path), config, None)


def test_explain_says_where_a_vision_language_models_images_come_from(tiny_vl_path, tmp_path, capsys, monkeypatch):
    from rlframe.explain.cli import main

    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path))
    status = main(
        [
            "algorithm.adv_estimator=grpo",
            f"actor_rollout_ref.model.path={tiny_vl_path}",
            "data.train_files=builtin://colour_vl",
            "data.val_files=builtin://colour_vl",
            "data.train_batch_size=16",
            "data.max_prompt_length=80",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "trainer.device=cpu",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "images    qwen2_vl vision tower: each prompt's images from column data.image_key='images'" in out
