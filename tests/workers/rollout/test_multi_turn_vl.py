"""The tool agent with images (the tiny Qwen2-VL of builtin://tiny-vl, with a byte-level tokenizer): the first
turn's images go with every turn of the trajectory, the rendered prompt holds each image's tokens expanded for its
grid (as the dataset's prompts do), and the trajectory's positions are the 3-D ones over the whole row, tool turns
included; sync multi-turn and the agent loop alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.multi_turn import ScriptedEngine, call, rollout_cfg
from omegaconf import OmegaConf

from rlframe.models.vision import MULTIMODAL_KEYS, mrope_position_ids
from rlframe.protocol import DataProto
from rlframe.workers.rollout.multi_turn import build_multi_turn
from rlframe.workers.rollout.tools import CalculatorTool

COUNT = "How many squares? Answer with the number."
PROMPT, RESPONSE = 80, 96


class ImageCheckingEngine(ScriptedEngine):
    """The scripted replies, and for every row of every call: its images' token count, against its own tokens."""

    def _generate(self, prompts, params, eos_ids, pad_id, seeds):
        inputs = prompts.non_tensor_batch["multi_modal_inputs"]
        for ids, row_inputs in zip(prompts.batch["input_ids"], inputs):
            grid = row_inputs["image_grid_thw"]
            assert int((ids == self.vision.image_token_id).sum()) == sum(map(self.vision.tokens_per_image, grid))
            assert len(prompts.non_tensor_batch["multi_modal_data"][0]["image"]) == len(grid)
        return super()._generate(prompts, params, eos_ids, pad_id, seeds)


def _rows(tokenizer, model_path: str, folder: str) -> DataProto:
    from rlframe.data.builtin_tasks import resolve_data_files
    from rlframe.data.config import DataConfig
    from rlframe.data.dataset import RLHFDataset, collate_fn
    from rlframe.models.vision import load_vision_processor

    config = OmegaConf.structured(DataConfig)
    config.max_prompt_length = PROMPT
    files = resolve_data_files("builtin://count_vl", folder, 1, "val")
    dataset = RLHFDataset(files, tokenizer, config, load_vision_processor(model_path, tokenizer))
    rows = collate_fn([dataset[i] for i in range(2)])
    rows["agent_name"] = np.array(["tool_agent", "single_turn_agent"], dtype=object)
    return DataProto.from_single_dict(rows, meta_info={"do_sample": False})


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    """The tiny Qwen2-VL with a byte-level tokenizer: builtin://tiny-vl's alphabet has no characters of a tool call."""
    from rlframe.models.tiny import build_tokenizer
    from rlframe.models.tiny_vl import make_tiny_vl_model, with_vision_tokens

    return make_tiny_vl_model(str(tmp_path_factory.mktemp("vl_bytes")), tokenizer=with_vision_tokens(build_tokenizer()))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_image_rows_take_tool_turns_with_their_images_and_3d_positions(vl_path, tmp_path, mode):
    from transformers import AutoTokenizer

    from rlframe.workers.rollout.agent_loop import AgentLoopRollout

    tokenizer = AutoTokenizer.from_pretrained(vl_path)
    cfg = rollout_cfg(
        f"data.max_prompt_length={PROMPT}",
        f"data.max_response_length={RESPONSE}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
        f"actor_rollout_ref.rollout.mode={mode}",
    )
    engine = ImageCheckingEngine(cfg, tokenizer, vl_path, {COUNT: [call("12*7"), "4"]})
    multi_turn = build_multi_turn(engine, tokenizer)
    multi_turn.runner.tools["calculator"] = CalculatorTool({}, None)
    rollout = AgentLoopRollout(engine, 2, multi_turn) if mode == "async" else multi_turn
    prompts = _rows(tokenizer, vl_path, str(tmp_path))
    out = rollout.generate_sequences(prompts)
    assert sum(engine.calls) == 3  # rows generated: the tool row's two turns, the single-turn row's one
    b = out.batch
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 2]
    # whole = turn by turn, expanded
    assert out.meta_info["metrics"]["multi_turn/tokenization_mismatch_ratio"] == [0.0, 0.0]
    assert not set(MULTIMODAL_KEYS) & set(out.non_tensor_batch)  # the driver's batch keeps the images
    image_id = engine.vision.image_token_id
    for row in range(2):
        ids, mask = b["input_ids"][row], b["attention_mask"][row]
        grid = prompts.non_tensor_batch["multi_modal_inputs"][row]["image_grid_thw"]
        assert torch.equal(b["prompts"][row], prompts.batch["input_ids"][row])  # the dataset's prompt, expanded
        assert int((ids == image_id).sum()) == 9  # one 84 x 84 picture: 3 x 3 merged patches
        assert torch.equal(b["position_ids"][row], mrope_position_ids(ids, mask, grid, engine.vision))
    tool_row = tokenizer.decode(b["responses"][0][b["attention_mask"][0, PROMPT:].bool()])
    assert "84" in tool_row and tool_row.endswith("4<|im_end|>")
