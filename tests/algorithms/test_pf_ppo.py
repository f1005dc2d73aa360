"""PF-PPO (algorithm.use_pf_ppo): the resampling weights by hand, the rows drawn against verl 0.9.1's own
`compute_pf_ppo_reweight_data`, the trainer's resampled batch, and when the keys are in effect."""

import types

import numpy as np
import pytest
import torch
from helpers.verl_reference import verl_core_algos
from tensordict import TensorDict

from rlframe.algorithms.pf_ppo import pf_ppo_resample_index, pf_ppo_weights
from rlframe.config.key_status import ignored_key_warnings
from rlframe.protocol import DataProto
from rlframe.trainer.config import compose, typed

EPS = 1e-8


def test_weights_of_each_method_by_hand():
    scores = torch.tensor([-2.0, 0.0, 1.0, 3.0])
    torch.testing.assert_close(pf_ppo_weights(scores, "pow", 2.0), torch.tensor([4.0, 0.0, 1.0, 9.0]) + EPS)
    torch.testing.assert_close(pf_ppo_weights(scores, "pow", 0.0), torch.ones(4) + EPS)  # uniform
    torch.testing.assert_close(pf_ppo_weights(scores, "max_min", 2.0), torch.tensor([1.0, 0.0, 0.0, 1.0]) + EPS)
    torch.testing.assert_close(pf_ppo_weights(scores, "max_random", 2.0), torch.tensor([0.1, 0.1, 0.1, 0.4]) + EPS)
    # all-zero scores: every row keeps a weight of 1e-8, so the draw is uniform rather than an error
    torch.testing.assert_close(pf_ppo_weights(torch.zeros(3), "pow", 2.0), torch.full((3,), EPS))
    with pytest.raises(ValueError, match="reweight_method='median'"):
        pf_ppo_weights(scores, "median", 2.0)


def test_max_min_draws_only_the_extreme_rows():
    scores = torch.zeros(6, 4)
    scores[1, 2], scores[4, 3] = 1.0, -1.0  # sequence scores [0, 1, 0, 0, -1, 0]
    index = pf_ppo_resample_index(scores, "max_min", 2.0, torch.Generator().manual_seed(0))
    assert index.shape == (6,) and set(index.tolist()) <= {1, 4}


@pytest.mark.parametrize("method,weight_pow", [("pow", 2.0), ("pow", 1.0), ("max_min", 2.0), ("max_random", 2.0)])
def test_rows_drawn_equal_verl_091_with_the_same_seed(method, weight_pow):
    core = verl_core_algos()
    scores = torch.zeros(16, 5)
    scores[torch.arange(16), torch.randint(0, 5, (16,), generator=torch.Generator().manual_seed(1))] = torch.tensor(
        [1.0, 0.0, 0.5, 1.0, -1.0, 0.0, 1.0, 0.25, 0.0, 1.0, 0.0, -0.5, 1.0, 0.0, 0.75, 0.0]
    )
    row = torch.arange(16).unsqueeze(-1)
    batch = TensorDict({"token_level_scores": scores, "row": row}, batch_size=[16])
    data = types.SimpleNamespace(batch=batch, non_tensor_batch={"uid": np.arange(16)}, meta_info={})
    torch.manual_seed(7)  # verl draws from torch's global generator
    theirs = core.compute_pf_ppo_reweight_data(data, method, weight_pow).batch["row"].squeeze(-1)
    ours = pf_ppo_resample_index(scores, method, weight_pow, torch.Generator().manual_seed(7))
    assert ours.tolist() == theirs.tolist()


def test_trainer_resamples_every_field_of_the_batch_together():
    from rlframe.trainer.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = compose(["algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min"])
    trainer.global_step = 3
    scores = torch.zeros(8, 4)
    scores[2, 1], scores[5, 3] = 2.0, -1.0
    batch = DataProto.from_dict(
        {"token_level_scores": scores, "advantages": torch.arange(8.0).unsqueeze(-1).expand(8, 4).clone()},
        {"uid": np.array([f"u{i}" for i in range(8)], dtype=object)},
    )
    out = trainer._pf_ppo_resample(batch)
    rows = out.batch["advantages"][:, 0].long().tolist()
    assert len(out) == 8 and set(rows) <= {2, 5}
    assert out.non_tensor_batch["uid"].tolist() == [f"u{r}" for r in rows]
    torch.testing.assert_close(out.batch["token_level_scores"], scores[rows])
    assert trainer._pf_ppo_resample(batch).batch["advantages"][:, 0].long().tolist() == rows  # seeded per step


def test_use_pf_ppo_is_in_effect_with_gae_only():
    gae = ["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min"]
    typed(compose(gae))
    assert [w for w in ignored_key_warnings(compose(gae), gae) if "pf_ppo" in w] == []
    grpo = ["algorithm.adv_estimator=grpo", "algorithm.use_pf_ppo=true"]
    assert [w for w in ignored_key_warnings(compose(grpo), grpo) if "pf_ppo" in w] == [
        "rlframe: warning: algorithm.use_pf_ppo=true has no effect: algorithm.adv_estimator=grpo: PF-PPO "
        "resamples after GAE only (as in verl 0.9.1)"
    ]
    with pytest.raises(ValueError, match="reweight_method"):
        typed(compose(["algorithm.pf_ppo.reweight_method=median"]))
