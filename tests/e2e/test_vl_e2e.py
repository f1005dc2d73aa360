"""Vision-language GRPO end to end: builtin://tiny-vl on the built-in image task, through the driver, the rollout
with images, the training forward and the weight sync, on 2 CPU workers (docs/multimodal.md). The runs go in this
process, on one Ray the module starts.

Each run checks what only the whole path shows: the rollout's log-probs are the actor's (the images and the 3-D
positions reached both, and the synced weights are the trained ones), and the run trains; the LoRA run with the
tower frozen (verl's run_qwen2_5_vl-7b_lora.sh keys) saves an adapter with no vision-tower module.
"""

from __future__ import annotations

import os

import pytest
from helpers.runs import COMMON, read_metrics, run_in_process
from safetensors.torch import load_file

ADAPTER_FILE = "adapter_model.safetensors"

pytestmark = pytest.mark.slow

VL = [
    *COMMON,
    "actor_rollout_ref.model.path=builtin://tiny-vl",
    "data.train_files=builtin://count_vl",
    "data.val_files=builtin://count_vl",
    "data.image_key=images",
    "data.max_prompt_length=64",
    "data.max_response_length=4",
    "trainer.n_gpus_per_node=2",
    "trainer.total_training_steps=3",
    "actor_rollout_ref.rollout.calculate_log_probs=true",
]


def _data(metrics: list[dict]) -> list[dict]:
    return [m.get("data", m) for m in metrics]


@pytest.mark.parametrize(
    "name,extra",
    [
        (
            "rmpad_dynamic",
            ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true"],
        ),
        (
            "padded_sync_rollout",
            ["actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.rollout.mode=sync"],
        ),
        (  # a rollout pool of its own (docs/async.md) at η = 0: its samples are the current weights'
            "separate_async",
            [
                "trainer.n_gpus_per_node=1",
                "trainer.v1.trainer_mode=separate_async",
                "actor_rollout_ref.rollout.nnodes=1",
                "actor_rollout_ref.rollout.n_gpus_per_node=1",
                "trainer.v1.sampler.max_off_policy_threshold=1",
                "trainer.v1.separate_async.num_warmup_batches=0",
                "trainer.v1.separate_async.parameter_sync_step=2",
            ],
        ),
    ],
)
def test_tiny_vl_grpo_trains_with_images_and_the_rollout_scores_as_the_actor(module_ray, tmp_path, name, extra):
    run_dir = tmp_path / name
    run_in_process([*VL, *extra, f"trainer.default_local_dir={run_dir}"])
    steps = [m for m in _data(read_metrics(run_dir)) if "training/global_step" in m]
    assert [m["training/global_step"] for m in steps] == [1, 2, 3]
    for m in steps:  # after each update the rollout ran on the synced weights, images and positions as the actor's
        assert m["training/rollout_probs_diff_max"] < 1e-4, m
        assert m["response_length/mean"] > 0


def test_lora_on_the_language_model_with_the_tower_frozen(module_ray, tmp_path):
    run_dir = tmp_path / "lora"
    overrides = [
        *VL,
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.exclude_modules=.*visual.*",
        "actor_rollout_ref.actor.freeze_vision_tower=true",
        "actor_rollout_ref.model.use_remove_padding=true",
        "trainer.save_freq=3",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",  # the PEFT adapter too
        f"trainer.default_local_dir={run_dir}",
    ]
    run_in_process(overrides)
    steps = [m for m in _data(read_metrics(run_dir)) if "training/global_step" in m]
    assert len(steps) == 3 and all(m["training/rollout_probs_diff_max"] < 1e-4 for m in steps)
    adapters = [os.path.join(root, f) for root, _, files in os.walk(run_dir) for f in files if f == ADAPTER_FILE]
    assert adapters, f"no adapter saved under {run_dir}"
    names = list(load_file(adapters[0]))
    assert any("language_model" in n for n in names), names[:5]  # the language model's linears got adapters
    assert not any("visual" in n for n in names), [n for n in names if "visual" in n][:5]
