"""No key is accepted and ignored: in a real run, every config key is read by some process, or the
launch checks report it as having no effect in that config.

Each run traces the config keys the driver and the workers read (`rlframe.config.trace`); the test
walks every leaf of the run's config and looks for it among the reads and the keys reported ignored.
"""

import json
import os

import pytest
from helpers.runs import run_main
from helpers.small_config import SMALL
from omegaconf import OmegaConf

from rlframe.config.key_status import key_statuses
from rlframe.config.loader import leaves
from rlframe.config.trace import ENV
from rlframe.trainer.config import compose

pytestmark = pytest.mark.slow

# Keys honoured by a launch check alone: they admit one value, which is what rlframe does.
CHECKED_ONLY = {
    "actor_rollout_ref.hybrid_engine": "must be true: actor, rollout and reference always share processes",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend": "must be torch: triton and liger are refused",
    "trainer.v1.separate_async.parameter_sync_step": "must make train_batch_size = parameter_sync_step × "
    "ppo_mini_batch_size: the weights are pushed once per step",
    "distillation.nnodes": "must be 0: a teacher pool of its own is refused; the teacher shares the training processes",
}

RUNS = {
    "grpo_kl_loss_dynamic": [
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "trainer.save_freq=2",
        "trainer.test_freq=1",
    ],
    "grpo_lora_kl_loss": [  # the reference policy is the actor with its adapter disabled
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
    ],
    "grpo_fused_head_bf16_kl_loss": [  # the fused head in the update, old-log-prob and ref passes; bf16 on CPU
        "actor_rollout_ref.model.use_fused_kernels=true",
        "actor_rollout_ref.model.enable_activation_offload=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.skip_on_policy_old_log_prob=false",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
    ],
    "grpo_separate_async": [  # a rollout pool of its own, one step off
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.sampler.max_off_policy_threshold=2",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "trainer.val_before_train=false",
    ],
    "grpo_distillation_policy_gradient": [  # the teacher is the policy's own initial checkpoint
        "distillation.enabled=true",
        "distillation.teacher_models.teacher_model.model_path=builtin://tiny",
        "distillation.distillation_loss.loss_mode=k1",
        "distillation.distillation_loss.use_policy_gradient=true",
        "trainer.val_before_train=false",
    ],
    "ppo_critic_kl_in_reward": [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
    ],
}
COMMON = [
    *SMALL,
    "trainer.total_training_steps=2",
    "trainer.logger=[jsonl]",
    "trainer.resume_mode=disable",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "data.max_response_length=8",
]


def unread_and_active(overrides: list[str], trace_dir: str) -> list[str]:
    """Leaves of the run's config that no process read and that the launch checks did not report ignored."""
    cfg = compose(overrides)
    read = set()
    for name in os.listdir(trace_dir):
        with open(os.path.join(trace_dir, name)) as f:
            read.update(line.strip() for line in f)
    ignored = [row.key for row in key_statuses(cfg) if not row.in_effect]
    missing = []
    for leaf in leaves(OmegaConf.to_container(cfg, resolve=False)):
        covered = any(leaf == key or leaf.startswith(key + ".") for key in ignored)
        if leaf not in read and not covered and leaf not in CHECKED_ONLY:
            missing.append(leaf)
    return missing


@pytest.mark.parametrize("name", list(RUNS))
def test_every_key_is_read_or_reported_ignored(name, tmp_path, cache_dir):
    overrides = COMMON + RUNS[name] + [f"trainer.default_local_dir={tmp_path / 'run'}"]
    trace_dir = tmp_path / "reads"
    out = run_main(overrides, cache_dir, extra_env={ENV: str(trace_dir)})
    assert out.returncode == 0, out.stderr[-4000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        validated = any(key.startswith("val-core/") for line in f for key in json.loads(line))
    # as verl: without test_freq > 0 (and val_before_train=false) a run does not validate
    assert validated == (name == "grpo_kl_loss_dynamic")
    missing = unread_and_active(overrides, str(trace_dir))
    assert not missing, "accepted but neither read nor reported ignored:\n" + "\n".join(missing)
