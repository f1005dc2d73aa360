"""Every key is declared once, in a typed section; the YAML, the checks and the key statuses derive from it."""

import dataclasses
import json
from pathlib import Path

import pytest
from helpers.small_config import SMALL

from rlframe.config.loader import config_dir
from rlframe.config.schema import Section, read_only, sections_of, walk
from rlframe.explain.cli import main as explain_main
from rlframe.trainer.config import PPOTrainerConfig, compose, default_yaml, typed
from rlframe.trainer.main_ppo import prepare


def test_the_yaml_is_generated_from_the_typed_sections():
    on_disk = (Path(config_dir()) / "ppo_trainer.yaml").read_text()
    assert on_disk == default_yaml(), "run: python -m rlframe.trainer.config > configs/ppo_trainer.yaml"


def test_every_key_has_a_help_line():
    missing = [
        path
        for path, value, field in walk(PPOTrainerConfig())
        if not isinstance(value, Section) and not field.metadata.get("help")
    ]
    assert not missing


def test_every_section_is_a_typed_dataclass():
    sections = [value for _, value, _ in walk(PPOTrainerConfig()) if dataclasses.is_dataclass(value)]
    assert sections and all(isinstance(s, Section) for s in sections)


def test_an_added_key_that_nothing_reads_is_refused_by_name():
    with pytest.raises(
        ValueError,
        match=r"unknown config key 'actor_rollout_ref.actor.overlong_buffer' \(from the override "
        r"'\+actor_rollout_ref.actor.overlong_buffer=4'\): no rlframe component reads it",
    ):
        compose(["+actor_rollout_ref.actor.overlong_buffer=4"])


def test_a_misspelled_key_after_a_hydra_override_is_named():
    with pytest.raises(ValueError, match=r"unknown config key 'data.train_batch_sizee'.*data.train_batch_size"):
        compose(["hydra.run.dir=/tmp/somewhere", "data.train_batch_sizee=3"])


def test_a_wrong_type_is_refused_by_name():
    with pytest.raises(ValueError, match=r"data.train_batch_size='eight' has the wrong type"):
        compose(["data.train_batch_size=eight"])


BAD_CONFIGS = [
    ["algorithm.adv_estimator=gpg"],
    ["+trainer.not_a_key=1"],
    ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
    ["actor_rollout_ref.rollout.name=sglang"],
    ["trainer.device=tpu"],
    ["actor_rollout_ref.model.path=/nonexistent/model"],
    ["reward_model.enable=true"],
    ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"],
    ["actor_rollout_ref.actor.loss_agg_mode=mean"],
]


@pytest.mark.parametrize("overrides", BAD_CONFIGS, ids=lambda o: " ".join(o))
def test_explain_and_train_give_the_same_verdict(overrides, capsys):
    with pytest.raises(ValueError) as err:
        prepare(overrides)
    assert explain_main(overrides) == 2
    assert str(err.value) in capsys.readouterr().err


def test_clip_ratio_alone_is_reported_as_without_effect_like_in_verl():
    # verl 0.9.1's yaml sets clip_ratio_low/high to 0.2; clip_ratio only fills in where they are null
    from rlframe.config.key_status import ignored_key_warnings
    from rlframe.workers.config.actor import clip_ratio_bounds

    overrides = ["actor_rollout_ref.actor.clip_ratio=0.3"]
    (line,) = ignored_key_warnings(compose(overrides), overrides)
    assert "actor_rollout_ref.actor.clip_ratio=0.3 has no effect" in line
    nulls = overrides + ["actor_rollout_ref.actor.clip_ratio_low=null", "actor_rollout_ref.actor.clip_ratio_high=null"]
    assert ignored_key_warnings(compose(nulls), nulls) == []
    actor = compose(nulls).actor_rollout_ref.actor
    assert clip_ratio_bounds(actor) == (0.3, 0.3)


def test_restart_node_wait_without_restarts_is_reported_without_effect():
    from rlframe.config.key_status import ignored_key_warnings

    overrides = ["trainer.restart_node_wait_s=60"]
    (line,) = ignored_key_warnings(compose(overrides), overrides)
    assert "trainer.restart_node_wait_s=60 has no effect: trainer.max_restarts=0: the run never restarts" in line
    restarts = [*overrides, "trainer.max_restarts=1"]
    assert ignored_key_warnings(compose(restarts), restarts) == []
    with pytest.raises(ValueError, match=r"restart_node_wait_s.*must be >= 0"):
        typed(compose(["trainer.restart_node_wait_s=-1"]))


def test_a_verl_key_rlframe_does_not_implement_is_taken_at_verls_default_only():
    compose(
        [
            "critic.model.lora_rank=0",
            "algorithm.filter_groups.enable=False",
            "actor_rollout_ref.rollout.mode=async",
        ]
    )  # the same run as without them
    with pytest.raises(
        ValueError,
        match=r"critic.model.lora_rank=32: LoRA for the critic is not implemented.*"
        r"verl 0.9.1's default \(0\)",
    ):
        compose(["critic.model.lora_rank=32"])
    with pytest.raises(
        ValueError, match=r"actor_rollout_ref.actor.use_prefix_grouper=True: rlframe does not implement"
    ):
        compose(["actor_rollout_ref.actor.use_prefix_grouper=True"])


def test_every_verl_key_is_declared_by_rlframe_or_has_a_verl_default():
    # the catalog covers every key of verl's generated config, so no verl key falls through as "unknown"
    from rlframe.config.verl_keys import check_verl_override, verl_defaults

    defaults = verl_defaults()
    assert len(defaults) > 800
    for key, default in defaults.items():
        if not (isinstance(default, str) and "${" in default) and not isinstance(default, (dict, list)):
            assert check_verl_override(key, json.dumps(default) if not isinstance(default, str) else default) is None, (
                key
            )


def test_a_list_key_takes_a_single_value_as_verl_does():
    assert list(compose(["trainer.logger=console"]).trainer.logger) == ["console"]
    assert list(compose(["trainer.logger=[console,jsonl]"]).trainer.logger) == ["console", "jsonl"]


def test_verls_newer_critic_fsdp_path_reaches_rlframes_key():
    assert compose(["critic.fsdp.param_offload=true"]).critic.model.fsdp_config.param_offload is True


def test_verls_newer_spellings_reach_rlframes_keys_and_are_warned_about_like_them():
    from rlframe.config.key_status import ignored_key_warnings

    cfg = compose(["reward.reward_manager.name=batch", "ray_kwargs.ray_init.num_cpus=3"])
    assert cfg.reward_model.reward_manager == "batch" and cfg.trainer.ray_init.num_cpus == 3
    overrides = ["algorithm.adv_estimator=grpo", "critic.fsdp.param_offload=true"]  # no critic: no effect, said so
    (line,) = ignored_key_warnings(compose(overrides), overrides)
    assert "critic.model.fsdp_config.param_offload" in line and "only gae trains a critic" in line


# The algorithm.* keys each estimator leaves without effect (gamma: only gae and reinforce_plus_plus discount;
# lam: only gae; norm_adv_by_std_in_grpo: only grpo and grpo_passk, as verl 0.9.1 never passes it to grpo_vectorized).
ESTIMATOR_UNREAD = {
    "gae": {"norm_adv_by_std_in_grpo"},
    "grpo": {"gamma", "lam"},
    "rloo": {"gamma", "lam", "norm_adv_by_std_in_grpo"},
    "reinforce_plus_plus": {"lam", "norm_adv_by_std_in_grpo"},
    "reinforce_plus_plus_baseline": {"gamma", "lam", "norm_adv_by_std_in_grpo"},
    "remax": {"gamma", "lam", "norm_adv_by_std_in_grpo"},
    "grpo_vectorized": {"gamma", "lam", "norm_adv_by_std_in_grpo"},
    "rloo_vectorized": {"gamma", "lam", "norm_adv_by_std_in_grpo"},
    "opo": {"gamma", "lam", "norm_adv_by_std_in_grpo"},
    "gpg": {"gamma", "lam", "norm_adv_by_std_in_grpo"},
    "grpo_passk": {"gamma", "lam"},
    "optimal_token_baseline": {"gamma", "lam", "norm_adv_by_std_in_grpo"},
    "tir_optimal_token_baseline": {"gamma", "lam", "norm_adv_by_std_in_grpo"},
    "gdpo": {"gamma", "lam", "norm_adv_by_std_in_grpo"},  # verl 0.9.1 never passes gdpo norm_adv_by_std_in_grpo
}


def test_each_estimators_unread_algorithm_keys_are_reported_inactive():
    from rlframe.algorithms.advantage import ADV_ESTIMATORS
    from rlframe.config.schema import inactive_keys

    assert set(ESTIMATOR_UNREAD) == set(ADV_ESTIMATORS), "pin the algorithm keys a new estimator reads"
    estimator_keys = {"algorithm.gamma", "algorithm.lam", "algorithm.norm_adv_by_std_in_grpo"}
    for name, unread in ESTIMATOR_UNREAD.items():
        overrides = [f"algorithm.adv_estimator={name}"]
        if name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
            overrides.append("actor_rollout_ref.actor.calculate_sum_pi_squared=true")
        if name == "gdpo":
            overrides.append("algorithm.gdpo_reward_keys=[format_reward,accuracy_reward]")
        inactive = inactive_keys(typed(compose(overrides)))
        assert {k.removeprefix("algorithm.") for k in estimator_keys & set(inactive)} == unread, name


def test_a_verl_key_that_follows_another_is_taken_at_that_keys_value():
    compose(["actor_rollout_ref.ref.strategy=fsdp2"])  # verl: ${actor.strategy}, fsdp2 here
    with pytest.raises(ValueError, match=r"actor_rollout_ref.ref.strategy=fsdp: .*here 'fsdp2'"):
        compose(["actor_rollout_ref.ref.strategy=fsdp"])


# Keys whose default differs from verl 0.9.1's on purpose; each is listed, with why, in docs/verl_compatibility.md.
DELIBERATE_DEFAULTS = {
    "actor_rollout_ref.actor.strategy",
    "critic.strategy",
    "actor_rollout_ref.model.path",
    "critic.model.path",
    "critic.model.tokenizer_path",
    "actor_rollout_ref.rollout.dtype",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "custom_reward_function.name",
    "data.seed",
    "data.train_files",
    "data.val_files",
    "reward_model.enable",
    "reward_model.reward_manager",
    "trainer.device",
    "trainer.experiment_name",
    "trainer.logger",
    "trainer.n_gpus_per_node",
    "trainer.project_name",
}


def test_every_shared_key_has_verls_default_unless_the_docs_say_why():
    from omegaconf import OmegaConf

    from rlframe.config.loader import leaves
    from rlframe.config.verl_keys import same_value, verl_defaults

    ours = leaves(OmegaConf.to_container(compose([]), resolve=True))
    differ = {
        key
        for key, default in verl_defaults().items()
        if key in ours and not (isinstance(default, str) and "${" in default) and not same_value(ours[key], default)
    }
    assert differ == DELIBERATE_DEFAULTS
    docs = (Path(__file__).resolve().parents[2] / "docs" / "verl_compatibility.md").read_text()
    assert all(f"`{key}`" in docs for key in DELIBERATE_DEFAULTS)


def test_gradients_are_clipped_by_optim_clip_grad_as_in_verl():
    # verl 0.9.1 clips by optim.clip_grad and never reads actor.grad_clip / critic.grad_clip
    from rlframe.trainer.config import typed

    cfg = compose(
        [
            *SMALL,
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.optim.clip_grad=0.5",
            "critic.optim.clip_grad=0.25",
            "actor_rollout_ref.actor.grad_clip=9",
        ]
    )
    root = typed(cfg)
    assert root.actor_rollout_ref.actor.optim.clip_grad == 0.5  # what PPOUpdater clips by
    assert root.critic.optim.clip_grad == 0.25


def test_gdpo_needs_its_reward_keys_and_one_weight_each():
    gdpo = ["algorithm.adv_estimator=gdpo"]
    with pytest.raises(ValueError, match=r"adv_estimator=gdpo needs algorithm.gdpo_reward_keys=None"):
        typed(compose(gdpo))
    gdpo.append("algorithm.gdpo_reward_keys=[a,b]")
    with pytest.raises(ValueError, match=r"gdpo_reward_weights=\[1.0\]: give one weight per gdpo_reward_keys"):
        typed(compose([*gdpo, "algorithm.gdpo_reward_weights=[1.0]"]))
    typed(compose([*gdpo, "algorithm.gdpo_reward_weights=[1.0,2]"]))


def test_a_worker_gets_its_sections_typed_read_only_and_named_by_full_key():
    from omegaconf.errors import ReadonlyConfigError

    from rlframe.workers.fsdp_workers import CriticWorker

    tree = typed(compose(SMALL))
    sections = sections_of(tree, CriticWorker.SECTIONS)
    assert sections["critic"] is tree.critic and "algorithm" not in sections and "reward_model" not in sections
    config = read_only(sections)
    assert config.critic.model._get_full_key("path") == "critic.model.path"  # what the read trace records
    assert config.critic.ppo_epochs == tree.critic.ppo_epochs and isinstance(config.critic.ppo_epochs, int)
    with pytest.raises(ReadonlyConfigError):
        config.critic.ppo_epochs = 3
