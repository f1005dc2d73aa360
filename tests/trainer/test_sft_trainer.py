"""The SFT trainer end to end on CPU (`python -m rlframe.trainer.sft_trainer` on builtin://tiny), and its config:
verl 0.9.1's sft_trainer_engine.yaml keys with verl's defaults, each honoured or refused by name."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.runs import COMMON, read_metrics, run_main

from rlframe.trainer.sft_trainer.config import sft_config


def write_rows(path: str, num_rows: int, seed: int) -> str:
    """Single-digit additions as two-message conversations."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for a, b in torch.randint(0, 10, (num_rows, 2), generator=gen).tolist():
        rows.append(
            {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def run_sft(overrides: list[str], cache_dir, nproc: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLFRAME_CACHE": str(cache_dir)}
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    command = [sys.executable, *launcher, "-m", "rlframe.trainer.sft_trainer", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def metrics_of(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_data")
    return write_rows(str(folder / "train.parquet"), 48, 0), write_rows(str(folder / "val.parquet"), 16, 1)


def base_overrides(data, run_dir) -> list[str]:
    train, val = data
    return [
        "model.path=builtin://tiny",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=8",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
    ]


@pytest.mark.slow
def test_sft_learns_and_writes_a_checkpoint_ppo_starts_from(data, tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlframe.trainer.config import compose, typed

    run_dir = tmp_path / "run"
    overrides = base_overrides(data, run_dir) + [
        "trainer.total_training_steps=6",
        "trainer.test_freq=3",
        "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]
    result = run_sft(overrides, cache_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    losses = [row["train/loss"] for row in rows]
    assert losses[-1] < losses[0] - 0.5, losses
    validated = [row for row in rows if "val/loss" in row]
    assert [row["step"] for row in validated] == [3, 6]
    assert validated[1]["val/loss"] < validated[0]["val/loss"]
    assert open(run_dir / "latest_checkpointed_iteration.txt").read() == "6"
    hf_folder = str(run_dir / "global_step_6" / "actor" / "huggingface")
    AutoModelForCausalLM.from_pretrained(hf_folder)
    AutoTokenizer.from_pretrained(hf_folder)
    ppo = typed(compose([f"actor_rollout_ref.model.path={hf_folder}"]))  # the PPO trainer's key takes it as it is
    assert ppo.actor_rollout_ref.model.path == hf_folder
    grpo_dir = tmp_path / "grpo"  # and a GRPO run starts from it unchanged
    grpo = run_main(
        [
            *COMMON,
            f"actor_rollout_ref.model.path={hf_folder}",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={grpo_dir}",
        ],
        cache_dir,
    )
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    assert [m["step"] for m in read_metrics(grpo_dir) if "actor/pg_loss" in m] == [1]


@pytest.mark.slow
def test_sft_resumed_from_its_latest_checkpoint_trains_as_a_straight_run(data, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    first = run_sft(base_overrides(data, run_dir) + ["trainer.total_training_steps=2"], cache_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    with open(run_dir / "metrics.jsonl", "a") as f:  # a step an interrupted run logged after its last checkpoint
        f.write(json.dumps({"step": 3, "train/loss": 0.0}) + "\n")
    keep_one = ["trainer.total_training_steps=4", "trainer.max_ckpt_to_keep=1"]
    second = run_sft(base_overrides(data, run_dir) + keep_one, cache_dir)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = metrics_of(run_dir)
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    assert sorted(os.listdir(run_dir)) == [
        "global_step_4",
        "latest_checkpointed_iteration.txt",
        "metrics.jsonl",
    ]
    straight = run_sft(base_overrides(data, tmp_path / "straight") + ["trainer.total_training_steps=4"], cache_dir)
    assert straight.returncode == 0, straight.stderr[-3000:]
    for after_resume, without in zip(resumed[2:], metrics_of(tmp_path / "straight")[2:], strict=True):
        for name in ("train/loss", "train/grad_norm", "train/lr", "val/loss"):
            if name in without:
                assert after_resume[name] == without[name], name  # bit for bit: optimizer, schedule, data order


@pytest.mark.slow
def test_torchrun_on_two_ranks_gives_the_single_process_losses(data, tmp_path, cache_dir):
    steps = ["trainer.total_training_steps=3", "data.use_dynamic_bsz=false", "data.micro_batch_size_per_gpu=3"]
    single = run_sft(base_overrides(data, tmp_path / "one") + steps, cache_dir)
    assert single.returncode == 0, single.stderr[-3000:]
    two = run_sft(base_overrides(data, tmp_path / "two") + steps + ["trainer.n_gpus_per_node=2"], cache_dir, nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    for one_rank, two_ranks in zip(metrics_of(tmp_path / "one"), metrics_of(tmp_path / "two"), strict=True):
        for name in ("train/loss", "train/grad_norm", "val/loss"):
            if name in one_rank:
                assert two_ranks[name] == pytest.approx(one_rank[name], rel=1e-5), name


@pytest.mark.slow
def test_sft_with_lora_exports_the_merged_model(data, tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    overrides = base_overrides(data, run_dir) + [
        "trainer.total_training_steps=2",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "engine.strategy=fsdp2",
        "checkpoint.save_contents=[model,extra,hf_model]",
    ]
    result = run_sft(overrides, cache_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    hf_folder = run_dir / "global_step_2" / "actor" / "huggingface"
    assert (hf_folder / "lora_adapter").is_dir()
    AutoModelForCausalLM.from_pretrained(str(hf_folder))


def test_sft_config_takes_verls_defaults():
    config = sft_config([])
    assert (config.data.train_batch_size, config.data.use_dynamic_bsz, config.data.pad_mode) == (
        256,
        True,
        "no_padding",
    )
    assert (config.optim.lr, config.optim.clip_grad, config.engine.strategy) == (1e-3, 1.0, "fsdp")
    assert config.checkpoint.load_contents == ["model", "optimizer", "extra"]  # follows save_contents
    assert config.trainer.default_local_dir == "checkpoints/gsm8k-sft/test"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "data.trian_batch_size=8",
            "unknown SFT config key 'data.trian_batch_size'.*Did you mean data.train_batch_size",
        ),
        ("model.use_liger=true", "model.use_liger=True: not implemented in rlframe's SFT trainer: Liger kernels"),
        ("model.mtp.enable=true", r"multi-token prediction; set \{'enable': True\}"),
        ("engine.full_determinism=true", "engine.full_determinism=True: not implemented"),
        ("data.pad_mode=left_right", "data.pad_mode='left_right' is not one of no_padding, right"),
        ("data.max_length=many", "data.max_length has the wrong type"),
        ("optim.optimizer=SGD", "optim.optimizer='SGD' is not one of AdamW"),
        ("checkpoint.save_contents=[model,weights]", r"unknown entries \['weights'\]"),
        ("data.train_batch_size=0", "data.train_batch_size=0 must be at least 1"),
    ],
)
def test_bad_sft_keys_are_refused_by_name(override, message):
    with pytest.raises(ValueError, match=message):
        sft_config([override])


def test_every_sft_key_is_in_docs_sft_md():
    from pathlib import Path

    from rlframe.config.schema import Section, walk
    from rlframe.trainer.sft_trainer.config import SFTTrainerConfig

    doc = (Path(__file__).parents[2] / "docs" / "sft.md").read_text()
    keys = [path for path, value, _ in walk(SFTTrainerConfig()) if not isinstance(value, Section)]
    assert [key for key in keys if f"| `{key}` |" not in doc] == []


def test_ulysses_needs_remove_padding():
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=2 needs model.use_remove_padding=true"):
        sft_config(["engine.ulysses_sequence_parallel_size=2", "model.use_remove_padding=false"])


@pytest.mark.slow
def test_a_batch_larger_than_the_data_is_refused_before_training(data, tmp_path, cache_dir):
    result = run_sft(base_overrides(data, tmp_path / "run") + ["data.train_batch_size=64"], cache_dir)
    assert result.returncode != 0
    assert "data.train_batch_size=64 is more than the 48 training rows" in result.stderr


def test_explain_prints_the_plan_and_starts_nothing(capsys):
    from rlframe.cli import main

    assert main(["sft", "--explain", "trainer.n_gpus_per_node=8", "engine.ulysses_sequence_parallel_size=2"]) == 0
    out = capsys.readouterr().out
    assert "world 8 = dp 4 × ulysses sp 2" in out
    assert "rows per step 256 (data.train_batch_size) → 64 per DP rank" in out
    assert "micro-batches of at most 16384 tokens" in out
    assert "data.micro_batch_size_per_gpu: data.use_dynamic_bsz=true cuts by max_token_len_per_gpu" in out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.n_gpus_per_node=8", "data.train_batch_size=6"], "data.train_batch_size=6 must be a multiple of"),
        (["trainer.n_gpus_per_node=6", "engine.ulysses_sequence_parallel_size=4"], "must divide the world size 6"),
        (["model.lora_rank=4", "engine.strategy=fsdp"], "set engine.strategy=fsdp2, or launch two or more ranks"),
    ],
)
def test_a_plan_that_does_not_divide_is_refused_before_work(overrides, message):
    from rlframe.trainer.sft_trainer.plan import SFTPlan

    with pytest.raises(ValueError, match=message):
        SFTPlan.of(sft_config(overrides))


def _verl_sft_defaults() -> dict:
    """{dotted key: default} of verl 0.9.1's sft_trainer_engine.yaml with its model, engine and optim groups."""
    import yaml
    from helpers.verl_reference import verl_source

    source = verl_source()
    if not source:
        pytest.skip("verl 0.9.1's source is not available (set RLFRAME_VERL_SRC)")
    root = os.path.join(source, "verl", "trainer", "config")

    def flat(node: dict, prefix: str) -> dict:
        out = {}
        for name, value in node.items():
            if name in ("_target_", "defaults"):
                continue
            path = f"{prefix}.{name}" if prefix else name
            out.update(flat(value, path) if isinstance(value, dict) and value else {path: value})
        return out

    with open(os.path.join(root, "sft_trainer_engine.yaml")) as f:
        keys = flat(yaml.safe_load(f), "")
    for group in ("model/hf_model", "engine/fsdp", "optim/fsdp", "profiler/profiler"):
        with open(os.path.join(root, f"{group}.yaml")) as f:
            keys.update(flat(yaml.safe_load(f) or {}, group.split("/")[0]))
    return keys


def test_every_verl_sft_key_is_declared_with_verls_default():
    from omegaconf import OmegaConf

    from rlframe.config.schema import Section, walk
    from rlframe.trainer.sft_trainer.config import SFTTrainerConfig

    verl = _verl_sft_defaults()
    ours = {path: value for path, value, _ in walk(SFTTrainerConfig()) if not isinstance(value, Section)}
    whole_dicts = [path for path, value in ours.items() if isinstance(value, dict)]  # declared as one key
    assert [k for k in verl if k not in ours and not any(k.startswith(d + ".") for d in whole_dicts)] == []
    assert [k for k in ours if k not in verl and not any(v.startswith(k + ".") for v in verl)] == []
    resolved = OmegaConf.to_container(OmegaConf.structured(SFTTrainerConfig), resolve=True)
    documented = {"data.enable_thinking_default"}  # verl's YAML says `none`, a string (docs/sft.md)
    for path, default in verl.items():
        if path in ours and path not in documented and not isinstance(ours[path], dict):
            value = OmegaConf.select(OmegaConf.create(resolved), path)
            expected = float(default) if isinstance(value, float) else default  # PyYAML reads 1e-3 as a string
            assert value == expected or "${" in str(default), path
