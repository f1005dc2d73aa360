"""Secrets stay secret: a value from `${oc.env:…}` (whatever the variable's name) or under a credential-named key is
masked wherever a run shows it, and a run folder whose name would hold one is refused.

The launch path is real here (`main_ppo.prepare`, then `main_ppo.train` up to the worker groups); a whole run with
every tracker is `tests/e2e/test_faults_secrets_run.py`.
"""

from __future__ import annotations

import json

import pytest
from helpers.small_config import SMALL
from omegaconf import OmegaConf

from rlframe.config.schema import Section, walk
from rlframe.config.secrets import MASK, credential_key, credential_variable, find_secrets, place_variable
from rlframe.explain.report import explain
from rlframe.trainer import main_ppo
from rlframe.trainer.config import PPOTrainerConfig
from rlframe.trainer.merge import model_source
from rlframe.viz import report

WANDB = "wandbSECRET0123456789abcdef"
ENV = {
    "WANDB_API_KEY": WANDB,
    "OPENAI_KEY": "sk-openai-0123456789",  # the names below miss a `*_API_KEY`/`*_TOKEN` pattern
    "AWS_ACCESS_KEY_ID": "AKIAABCDEFGHIJKLMNOP",
    "DATABASE_URL": "postgres://trainer:pg-pass-4242@db.internal/runs",
    "RUN_PIN": "73915502",  # a secret of digits, for a key typed as a number
    "SHORT_SECRET": "q7z",  # too short to search for in free text: masked by its key
}
TYPED = "sk-typed-on-the-command-line"  # a literal under a credential-named key
EVERY_SECRET = [*ENV.values(), "pg-pass-4242", TYPED]


@pytest.fixture(autouse=True)
def _environment(cache_dir, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", str(cache_dir))
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)


def _overrides(tmp_path, *extra):
    return [*SMALL, f"data.builtin_dir={tmp_path / 'data'}", *extra]


def test_credential_names_are_told_from_verls_token_and_key_settings():
    for name in ("hf_token", "token", "api_key", "apiKey", "access_key_id", "client_secret", "password", "auth"):
        assert credential_key(name), name
    ordinary = ("tokenizer", "max_token_len", "ppo_max_token_len_per_gpu", "max_num_batched_tokens", "pad_token")
    for name in (*ordinary, "prompt_key", "image_key", "reward_fn_key", "gdpo_reward_keys", "key", "author"):
        assert not credential_key(name), name
    # no key rlframe declares is masked for its name (a verl user's data.prompt_key stays readable)
    declared = [path for path, value, _ in walk(PPOTrainerConfig()) if not isinstance(value, Section)]
    assert [path for path in declared if credential_key(path.rsplit(".", 1)[-1])] == []
    for name in ("WANDB_API_KEY", "HF_TOKEN", "OPENAI_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert credential_variable(name) and not place_variable(name), name
    assert not credential_variable("DATABASE_URL")  # a secret only through ${oc.env:…} or its URL password
    assert all(place_variable(name) for name in ("HOME", "USER", "DATA_DIR", "HF_HOME", "SLURM_JOB_ID"))


def test_a_plain_config_is_masked_by_key_name_by_value_and_by_url_password():
    env = {"WANDB_API_KEY": WANDB, "HF_TOKEN": "hf_abcdefghijkl", "WANDB_MODE": "offline-mode"}
    config = {
        "trainer": {"experiment_name": f"run-{WANDB}", "project_name": "p", "logger": ["wandb"], "seed": 73915502},
        "actor_rollout_ref": {
            "model": {"path": "/models/x", "override_config": {"api_key": 12345}},
            "rollout": {"engine_kwargs": {"vllm": {"hf_token": "anything", "max_num_batched_tokens": 8192}}},
        },
        "data": {"tokenizer": None, "prompt_key": "prompt", "urls": ["https://u:hf_abcdefghijkl@host/x"]},
        "critic": {"ppo_max_token_len_per_gpu": 100, "token": "", "store": "postgres://u:short@db/x"},
    }
    shown = find_secrets(None, {**env, "LICENSE_KEY": "73915502"}).mask(config)
    assert shown["trainer"] == {
        "experiment_name": f"run-{MASK}",
        "project_name": "p",
        "logger": ["wandb"],
        "seed": MASK,
    }
    assert shown["actor_rollout_ref"]["model"] == {"path": "/models/x", "override_config": {"api_key": MASK}}
    vllm = shown["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]
    assert vllm == {"hf_token": MASK, "max_num_batched_tokens": 8192}  # *_tokens is not a secret
    assert shown["data"] == {"tokenizer": None, "prompt_key": "prompt", "urls": [f"https://u:{MASK}@host/x"]}
    assert shown["critic"] == {"ppo_max_token_len_per_gpu": 100, "token": "", "store": f"postgres://u:{MASK}@db/x"}
    assert config["trainer"]["experiment_name"] == f"run-{WANDB}"  # a copy: the run's own config is untouched


def test_values_from_the_environment_are_masked_in_config_yaml_the_console_and_warnings(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    overrides = _overrides(
        tmp_path,
        f"trainer.default_local_dir={run_dir}",
        "trainer.experiment_name=run-${oc.env:WANDB_API_KEY}",
        "trainer.project_name=${oc.env:AWS_ACCESS_KEY_ID}",
        "data.seed=${oc.env:RUN_PIN}",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.endpoint=${oc.env:OPENAI_KEY}",
        "+critic.model.override_config.store=${oc.env:DATABASE_URL}",
        "+critic.model.override_config.label=${oc.env:SHORT_SECRET}",
        f"+actor_rollout_ref.rollout.engine_kwargs.sglang.api_key={TYPED}",
    )
    run = main_ppo.prepare(overrides)
    monkeypatch.setattr(main_ppo, "train_with_restarts", lambda run, verbose=False: {})  # up to the workers
    main_ppo.train(run, print_config=True)
    out = capsys.readouterr()
    saved = (run_dir / "config.yaml").read_text()
    for secret in EVERY_SECRET:
        assert secret not in out.out + out.err + saved, secret
    assert "engine_kwargs.sglang.api_key=*** has no effect" in out.err  # the launch warning, masked
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert (cfg.trainer.experiment_name, cfg.trainer.project_name, cfg.data.seed) == (f"run-{MASK}", MASK, MASK)
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.endpoint == MASK
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.sglang.api_key == MASK
    assert cfg.critic.model.override_config == {"store": MASK, "label": MASK}
    # ordinary keys keep their values
    assert (cfg.data.prompt_key, cfg.data.image_key, cfg.data.reward_fn_key) == ("prompt", "images", "data_source")
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 1024 and cfg.data.tokenizer is None
    assert cfg.trainer.default_local_dir == str(run_dir)


def test_a_secret_in_the_default_run_folder_is_refused_naming_the_key_not_the_value(tmp_path, monkeypatch):
    secret_name = "trainer.experiment_name=run-${oc.env:WANDB_API_KEY}"
    with pytest.raises(ValueError) as refused:
        main_ppo.prepare(_overrides(tmp_path, secret_name))
    assert str(refused.value).startswith(
        "trainer.default_local_dir follows trainer.experiment_name, which takes ${oc.env:WANDB_API_KEY}: "
        "rlframe does not put a secret into a folder's name"
    )
    assert WANDB not in str(refused.value)
    with pytest.raises(ValueError, match=r"trainer.rollout_data_dir takes \$\{oc.env:OPENAI_KEY\}") as refused:
        main_ppo.prepare(
            _overrides(
                tmp_path, f"trainer.default_local_dir={tmp_path}", "trainer.rollout_data_dir=${oc.env:OPENAI_KEY}"
            )
        )
    assert ENV["OPENAI_KEY"] not in str(refused.value)
    # a variable that names a place makes a folder; the secret run name then only reaches the (masked) trackers
    monkeypatch.setenv("RUNS_ROOT", str(tmp_path / "runs"))
    run = main_ppo.prepare(_overrides(tmp_path, secret_name, "trainer.default_local_dir=${oc.env:RUNS_ROOT}/a"))
    assert run.cfg.trainer.default_local_dir == str(tmp_path / "runs" / "a")
    assert run.secrets.shown("trainer.experiment_name", run.cfg.trainer.experiment_name) == f"run-{MASK}"


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.truncation=${oc.env:WANDB_API_KEY}", r"^data.truncation=\*\*\* is not one of error, left, right"),
        ("data.truncation=${oc.env:SHORT_SECRET}", r"^data.truncation=\*\*\* is not one of error, left, right"),
        (
            "trainer.total_epochs=${oc.env:WANDB_API_KEY}",
            r"could not be converted to Integer\s+full_key: trainer.total",
        ),
        (f"+actor_rollout_ref.rollout.hf_token={TYPED}", r"unknown config key 'actor_rollout_ref.rollout.hf_token'"),
    ],
)
def test_config_errors_name_the_key_never_a_secret_value(tmp_path, override, message):
    with pytest.raises(ValueError, match=message) as refused:
        main_ppo.prepare(_overrides(tmp_path, override))
    assert not [secret for secret in EVERY_SECRET if secret in str(refused.value)]


def test_the_command_line_error_hides_the_secret(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main_ppo.main(_overrides(tmp_path, "data.truncation=${oc.env:WANDB_API_KEY}"))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "rlframe: error: data.truncation=*** is not one of" in err
    assert WANDB not in err


def test_explain_never_shows_a_secret(tmp_path):
    overrides = _overrides(tmp_path, f"+critic.model.override_config.api_key={TYPED}")
    for fmt in ("text", "json"):
        shown = explain(overrides, fmt=fmt, plan_only=True)
        assert TYPED not in shown and "critic.model.override_config.api_key=***" in shown


def test_the_report_masks_a_config_saved_unmasked(tmp_path):
    run_dir = tmp_path / "old-run"  # a run folder copied from elsewhere: its config.yaml was saved as it was
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    config = {
        "trainer": {"experiment_name": f"run-{WANDB}", "project_name": "p"},
        "data": {"prompt_key": "prompt"},
        "actor_rollout_ref": {"model": {"override_config": {"hf_token": TYPED, "db": ENV["DATABASE_URL"]}}},
    }
    OmegaConf.save(OmegaConf.create(config), run_dir / "config.yaml")
    out = tmp_path / "report.html"
    assert report.main([str(run_dir), "-o", str(out)]) == 0
    page = out.read_text()
    assert not [secret for secret in (WANDB, TYPED, "pg-pass-4242") if secret in page]
    assert f"run-{MASK}" in page and "prompt_key" in page


def test_merge_asks_for_the_model_when_the_runs_model_path_was_masked(tmp_path):
    step = tmp_path / "run" / "global_step_1" / "actor"
    step.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"actor_rollout_ref": {"model": {"path": MASK}}}), tmp_path / "run" / "config.yaml")
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path is masked in .*config.yaml; pass --model PATH"):
        model_source(str(step), "actor", None)
    assert model_source(str(step), "actor", "/models/base") == "/models/base"
