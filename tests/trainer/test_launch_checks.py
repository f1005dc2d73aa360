"""Bad input fails in `main_ppo.prepare`, before Ray starts, with the key, the value and what is accepted."""

import json

import pytest
from helpers.small_config import SMALL

from rlframe.trainer.main_ppo import prepare
from rlframe.trainer.tracking import Tracking


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", str(tmp_path / "cache"))


def _prepare(tmp_path, *overrides):
    return prepare(
        [*SMALL, f"trainer.default_local_dir={tmp_path / 'run'}", f"data.builtin_dir={tmp_path / 'data'}", *overrides]
    )


def test_the_small_config_prepares_a_plan_and_data(tmp_path):
    run = _prepare(tmp_path)
    assert run.plan.world_size == 2 and run.total_steps == len(run.train_loader)
    assert run.cfg.actor_rollout_ref.model.path.endswith("tiny-qwen2-v1")


@pytest.mark.parametrize(
    "override,expected",
    [
        ("algorithm.adv_estimator=ppo2", r"adv.*'ppo2'.*grpo"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=clipx", r"'clipx'.*vanilla"),
        ("actor_rollout_ref.actor.loss_agg_mode=mean", r"loss_agg_mode='mean'.*token-mean"),
        ("actor_rollout_ref.rollout.name=trtllm", r"rollout.name='trtllm'.*hf, vllm, sglang"),
        ("reward_model.reward_manager=prime", r"reward_manager='prime'.*naive"),
        ("actor_rollout_ref.actor.strategy=deepspeed", r"strategy='deepspeed'.*fsdp2, fsdp"),
        ("algorithm.kl_ctrl.type=pid", r"kl_ctrl.type='pid'.*fixed, adaptive"),
        ("actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", r"ref.ulysses_sequence_parallel_size=2 must equal"),
        ("actor_rollout_ref.actor.fsdp_config.fsdp_size=3", r"fsdp_size=3 must be -1 .* divisor of world_size"),
        ("actor_rollout_ref.hybrid_engine=false", r"hybrid_engine=false"),
        ("trainer.device=tpu", r"trainer.device='tpu' is not one of auto, cpu, cuda"),
    ],
)
def test_unknown_names_are_rejected_with_the_valid_ones(tmp_path, override, expected):
    with pytest.raises(ValueError, match=expected):
        _prepare(tmp_path, override)


def test_a_misspelled_key_is_named_with_the_closest_real_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key 'trainer.n_gpu_per_node'.*trainer.n_gpus_per_node"):
        _prepare(tmp_path, "trainer.n_gpu_per_node=8")


def test_custom_reward_file_is_executed_once_for_training_and_validation(tmp_path):
    scorer = tmp_path / "scorer.py"
    scorer.write_text(
        f"open({str(tmp_path / 'loads')!r}, 'a').write('x')\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 0.0\n"
    )
    run = _prepare(tmp_path, f"custom_reward_function.path={scorer}")
    assert (tmp_path / "loads").read_text() == "x"
    assert run.val_reward_fn.compute_score is run.reward_fn.compute_score


def test_model_folder_without_weights_names_the_key(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path=.*no weights"):
        _prepare(tmp_path, f"actor_rollout_ref.model.path={folder}")
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path=.*not a directory"):
        _prepare(tmp_path, f"actor_rollout_ref.model.path={tmp_path / 'missing'}")


def test_ulysses_degree_must_divide_heads(tmp_path):
    # the tiny model has 4 heads: sp=8 cannot split them (world 8)
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size"):
        _prepare(
            tmp_path,
            "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        )


def test_token_budget_smaller_than_one_sequence_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_gpu"):
        _prepare(
            tmp_path,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
        )


def test_reward_model_without_path_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"reward_model.model.path"):
        _prepare(tmp_path, "reward_model.enable=true")


def test_tracking_writes_jsonl_always_and_rejects_unknown_backends(tmp_path, capsys):
    tracker = Tracking("p", "e", ["console"], str(tmp_path))
    tracker.log({"critic/score/mean": 0.5, "n": 3}, step=1)
    tracker.finish()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[0]["step"] == 1 and rows[0]["critic/score/mean"] == 0.5
    assert "step:1" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"trainer.logger.*neptune.*console, jsonl"):
        Tracking("p", "e", ["neptune"], str(tmp_path))


def test_tensorboard_backend_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    tracker = Tracking("p", "e", ["tensorboard"], str(tmp_path))
    tracker.log({"critic/score/mean": 0.25}, step=3)
    tracker.finish()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_wandb_backend_runs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracking("rlframe-test", "offline-run", ["wandb"], str(tmp_path), config={"a": 1})
    tracker.log({"critic/score/mean": 0.25}, step=1)
    tracker.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_the_run_stops_at_total_epochs_even_with_more_total_training_steps(tmp_path):
    # verl 0.9.1: the lr schedule spans total_training_steps; the loop also ends after total_epochs
    run = _prepare(tmp_path, "trainer.total_epochs=1", "trainer.total_training_steps=100000")
    assert run.total_steps == len(run.train_loader) and run.schedule_steps == 100000
    run = _prepare(tmp_path, "trainer.total_epochs=1", "trainer.total_training_steps=3")
    assert run.total_steps == run.schedule_steps == 3
