"""End to end: `python -m rlframe.trainer.main_ppo` on the tiny model with CPU Ray workers. The runs whose checks
read the process's output go as subprocesses; the others in this process, on one Ray the module starts."""

import json
import os
import shutil

import pandas as pd
import pytest
import torch
from helpers.runs import COMMON, read_metrics, run_in_process, run_main

from rlframe.data.builtin_tasks import countdown_add_rows
from rlframe.workers.checkpoint import read_full_tensors

pytestmark = pytest.mark.slow


def test_grpo_dp2_sp2_rollout_tp2_remove_padding_dynamic_bsz(module_ray, tmp_path):
    run_in_process(
        COMMON
        + [
            f"trainer.default_local_dir={tmp_path}",
            "trainer.total_training_steps=2",
            "trainer.n_gpus_per_node=4",
            "data.train_batch_size=8",
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",  # the hf engine, sharded over 2 TP groups
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.save_freq=2",
            "trainer.test_freq=2",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        ]
    )
    # the Hugging Face export of the FSDP-sharded actor loads as a plain model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = tmp_path / "global_step_2" / "actor" / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(export)
    assert AutoTokenizer.from_pretrained(export).pad_token_id is not None
    # ... and holds exactly the tensors of the sharded checkpoint the 4 ranks wrote
    saved = read_full_tensors(str(tmp_path / "global_step_2" / "actor" / "model"))
    exported = model.state_dict()
    assert saved.keys() == exported.keys()
    assert all(torch.equal(saved[name], exported[name]) for name in saved)
    metrics = read_metrics(tmp_path)
    steps = [m for m in metrics if m["step"] > 0 and "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        for key in (
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/grad_norm",
            "critic/score/mean",
            "timing_s/gen",
            "global_seqlen/balanced_max",
            "response_length/mean",
            "perf/throughput",
            "actor/micro_batch/utilization",
            "actor/micro_batch/imbalance_ratio",
        ):
            assert key in m, key
    assert "val-core/countdown_add/reward/mean@1" in steps[-1]
    assert os.path.isfile(os.path.join(tmp_path, "config.yaml"))


def failing_scorer_file(tmp_path):
    path = tmp_path / "scorer.py"
    path.write_text(
        "calls = [0]\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    calls[0] += 1  # every other sample fails, whatever the sampling order\n"
        "    if calls[0] % 2:\n"
        "        raise RuntimeError('scorer bug on every other sample')\n"
        "    return 1.0 if solution_str.strip().startswith(str(ground_truth)) else 0.0\n"
    )
    return path


def test_ppo_with_critic_kl_in_reward_and_a_failing_reward_function(tmp_path, cache_dir):
    scorer = failing_scorer_file(tmp_path)
    run_dir = tmp_path / "run"
    # external_lib: a module every worker imports before loading its model
    (tmp_path / "rlframe_marker_lib.py").write_text(
        "import os, pathlib\npathlib.Path(os.environ['MARKER_DIR'], f'imported-{os.getpid()}').touch()\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "MARKER_DIR": str(tmp_path)}
    out = run_main(
        COMMON
        + [
            "actor_rollout_ref.model.external_lib=rlframe_marker_lib",
            f"trainer.default_local_dir={run_dir}",
            "trainer.total_training_steps=2",
            "algorithm.adv_estimator=gae",
            "critic.optim.lr=1e-3",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "trainer.log_val_generations=1",
            "trainer.test_freq=2",
            f"custom_reward_function.path={scorer}",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        ],
        cache_dir,
        extra_env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    with open(tmp_path / "rollouts" / "2.jsonl") as f:
        dumped = [json.loads(line) for line in f]
    assert len(dumped) == 8 and {"prompt", "response", "score", "uid", "index"} <= set(dumped[0])
    assert all(len({d["index"] for d in dumped if d["uid"] == uid}) == 1 for uid in {d["uid"] for d in dumped})
    steps = [m for m in read_metrics(run_dir) if "critic/vf_loss" in m]
    assert len(steps) == 2
    assert all(m["reward/num_scorer_errors"] > 0 for m in steps)  # counted, and the run went on
    assert all("actor/reward_kl_penalty" in m for m in steps)  # reference model + KL in reward
    assert "scorer bug on every other sample" in out.stdout + out.stderr  # first traceback logged
    assert "[countdown_add] response=" in out.stderr  # trainer.log_val_generations shows validation samples
    assert len(list(tmp_path.glob("imported-*"))) == 2  # both worker processes imported external_lib


def test_bad_config_fails_before_ray_with_the_equation(tmp_path, cache_dir):
    out = run_main(
        [
            "--verbose",  # lets Ray's "Started a local Ray instance" through, were Ray started
            f"trainer.default_local_dir={tmp_path}",
            "data.train_batch_size=6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ],
        cache_dir,
        timeout=300,
    )
    assert out.returncode == 2
    assert "actor_rollout_ref.actor.ppo_mini_batch_size" in out.stderr and "data.train_batch_size" in out.stderr
    assert "but 6 % 4 = 2" in out.stderr  # the broken equation, in values
    assert "Started a local Ray instance" not in out.stdout + out.stderr


def _small_dataset(tmp_path, num_prompts: int) -> str:
    path = tmp_path / "train.parquet"
    pd.DataFrame(countdown_add_rows("train", num_prompts, seed=3)).to_parquet(path)
    return str(path)


def _actor_tensors(step_dir):
    """The actor's full parameters and optimizer tensors in a checkpoint."""
    actor = os.path.join(step_dir, "actor")
    return {part: read_full_tensors(os.path.join(actor, part)) for part in ("model", "optimizer")}


def test_resume_from_step_k_equals_uninterrupted_run(tmp_path, cache_dir):
    # 8 prompts / batch 4 = 2 steps per epoch: resuming at step 2 crosses an epoch boundary,
    # and step 3 is resumed mid-epoch when run B stops there. Mini-batch shuffling is on, so the
    # shuffle generator's state must travel with the checkpoint too.
    train = _small_dataset(tmp_path, 8)
    base = COMMON + [
        f"data.train_files={train}",
        "trainer.total_epochs=3",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.actor.shuffle=true",
    ]
    run_a = tmp_path / "a"
    out = run_main(base + [f"trainer.default_local_dir={run_a}"], cache_dir)
    assert out.returncode == 0, out.stderr[-4000:]
    for k in (2, 3):  # crash after step k: drop later checkpoints, point "latest" at k, resume
        run_b = tmp_path / f"b{k}"
        shutil.copytree(run_a, run_b)
        for step in range(k + 1, 7):
            shutil.rmtree(run_b / f"global_step_{step}")
        (run_b / "latest_checkpointed_iteration.txt").write_text(str(k))
        out = run_main(base + [f"trainer.default_local_dir={run_b}", "trainer.resume_mode=auto"], cache_dir)
        assert out.returncode == 0, out.stderr[-4000:]
        assert f"resuming from {run_b / f'global_step_{k}'}" in out.stdout
        final_a, final_b = _actor_tensors(run_a / "global_step_6"), _actor_tensors(run_b / "global_step_6")
        for part in final_a:
            assert final_a[part].keys() == final_b[part].keys()
            for name, tensor in final_a[part].items():
                assert torch.equal(tensor, final_b[part][name]), f"{part}:{name} differs after resuming from step {k}"


def test_grpo_with_a_reward_model_worker(module_ray, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlframe.models.tiny import make_tiny_model

    policy = make_tiny_model(str(tmp_path / "policy"))
    rm_dir = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(policy).save_pretrained(rm_dir)
    run_dir = tmp_path / "run"
    run_in_process(
        COMMON
        + [
            f"trainer.default_local_dir={run_dir}",
            "trainer.total_training_steps=1",
            f"actor_rollout_ref.model.path={policy}",
            "reward_model.enable=true",
            f"reward_model.model.path={rm_dir}",
        ]
    )
    (step,) = [m for m in read_metrics(run_dir) if "critic/score/mean" in m]
    assert "reward/rule_score/mean" in step
    # a random reward model gives non-zero, non-rule scores
    assert step["critic/score/max"] != step["critic/score/min"]


def test_val_only_validates_the_resumed_checkpoint_and_trains_nothing(tmp_path, cache_dir):
    # trainer.val_only (verl's key): after resuming a checkpoint, one validation of that policy, then stop
    run_dir = tmp_path / "run"
    base = COMMON + [f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=3", "trainer.save_freq=1"]
    out = run_main(base + ["trainer.total_training_steps=1"], cache_dir)
    assert out.returncode == 0, out.stderr[-4000:]
    out = run_main(
        base + ["trainer.resume_mode=auto", "trainer.val_before_train=true", "trainer.val_only=true"], cache_dir
    )
    assert out.returncode == 0, out.stderr[-4000:]
    steps = read_metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 1]  # the training step, then the validation at the resumed step
    assert any(key.startswith("val-core/") for key in steps[1]) and "actor/pg_loss" not in steps[1]
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_1"]  # nothing trained or saved
    assert "resuming from" in out.stdout


def test_pooled_cpu_generation_trains_on_the_same_samples(module_ray, tmp_path):
    """rollout.pool_cpu_generation=true (rank 0 generates both workers' rows) and false give the same run."""
    train = _small_dataset(tmp_path, 8)
    base = COMMON + [
        f"data.train_files={train}",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cpu",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
    ]
    runs = {}
    for pool in ("true", "false"):
        run_dir = tmp_path / pool
        run_in_process(
            base + [f"trainer.default_local_dir={run_dir}", f"actor_rollout_ref.rollout.pool_cpu_generation={pool}"]
        )
        runs[pool] = run_dir
    pooled, alone = read_metrics(runs["true"]), read_metrics(runs["false"])
    # the rollout server's batches: rank 0 serves both workers' 4 rows when pooled, each worker its own 4 alone
    assert [r["rollout/server_batch_size_mean"] for r in pooled] == [8, 8]
    assert [r["rollout/server_batch_size_mean"] for r in alone] == [4, 4]
    for a, b in zip(pooled, alone):
        for key in ("critic/score/mean", "response_length/mean", "response_length/clip_ratio", "actor/pg_loss"):
            assert a[key] == b[key], key
    final_pooled, final_alone = (
        _actor_tensors(runs["true"] / "global_step_2"),
        _actor_tensors(runs["false"] / "global_step_2"),
    )
    for part in final_pooled:
        for name, tensor in final_pooled[part].items():
            assert torch.equal(tensor, final_alone[part][name]), f"{part}:{name}"
