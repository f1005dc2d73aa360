"""Partial rollout of vision-language rows (rollout/partial.py on builtin://tiny-vl): a row cut mid-generation and
continued on the same weights is the uncut row, its [4, seqlen] positions and its images included."""

from __future__ import annotations

import torch
from helpers.rollout import one_process_rollout_worker
from omegaconf import OmegaConf
from test_partial_rollout import CutAfter

from rlframe.protocol import DataProto
from rlframe.workers.rollout.partial import STOP_KEY, VERSIONS_KEY, interrupted

PROMPT = 64


def _prompts(model_path: str, folder: str) -> DataProto:
    from transformers import AutoTokenizer

    from rlframe.data.builtin_tasks import resolve_data_files
    from rlframe.data.config import DataConfig
    from rlframe.data.dataset import RLHFDataset, collate_fn
    from rlframe.models.vision import load_vision_processor

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = OmegaConf.structured(DataConfig)
    config.max_prompt_length = PROMPT
    files = resolve_data_files("builtin://count_vl", folder, 1, "val")
    dataset = RLHFDataset(files, tokenizer, config, load_vision_processor(model_path, tokenizer))
    rows = collate_fn([dataset[i] for i in range(3)])
    keys = ("input_ids", "attention_mask", "position_ids", "multi_modal_inputs", "multi_modal_data")
    return DataProto.from_single_dict({k: rows[k] for k in keys}, meta_info={"do_sample": True})


def test_a_cut_image_row_continued_is_the_uncut_row(tiny_vl_path, tmp_path):
    overrides = [f"data.max_prompt_length={PROMPT}", "actor_rollout_ref.rollout.calculate_log_probs=true"]
    with one_process_rollout_worker(tiny_vl_path, str(tmp_path / "store"), *overrides) as worker:
        prompts = _prompts(tiny_vl_path, str(tmp_path / "data"))
        state = torch.get_rng_state()
        whole = worker.generate_sequences(prompts)
        whole.pop(batch_keys=[STOP_KEY])
        torch.set_rng_state(state)
        worker.engine.interrupt = CutAfter(2)
        try:
            cut = worker.generate_sequences(prompts)
        finally:
            worker.engine.interrupt = None
        flags = interrupted(cut)
        cut.pop(batch_keys=[STOP_KEY])
        assert flags.any()
        rows = cut.select_idxs(flags)
        for key, value in prompts.select_idxs(flags).non_tensor_batch.items():  # the images go with the cut rows
            rows.non_tensor_batch[key] = value
        continued = worker.continue_sequences(rows)
        expected = whole.select_idxs(flags)
        assert continued.batch["position_ids"].shape[1:] == (4, PROMPT + expected.batch["responses"].shape[1])
        for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids", VERSIONS_KEY):
            assert torch.equal(continued.batch[key], expected.batch[key]), key
