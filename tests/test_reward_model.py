"""Reward model scoring: a sequence-classification checkpoint read at each row's last valid token."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

from rlframe.workers.reward_model import last_token_scores, load_reward_model, place_on_last_response_token


def make_reward_model(tiny_model_path, out_dir):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model.save_pretrained(out_dir)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(out_dir)
    return model


def test_scores_match_sequence_classification_on_unpadded_rows(tiny_model_path, tmp_path):
    seq_cls = make_reward_model(tiny_model_path, tmp_path).eval()
    config = AutoConfig.from_pretrained(tmp_path, num_labels=1)
    token_cls = AutoModelForTokenClassification.from_pretrained(tmp_path, config=config).eval()
    rows = [torch.randint(3, 300, (n,)) for n in (5, 9, 7)]
    width = 12
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):  # left padding 2, right padding the rest
        ids[i, 2 : 2 + len(row)] = row
        mask[i, 2 : 2 + len(row)] = 1
    with torch.no_grad():
        ours = last_token_scores(token_cls, ids, mask)
        expected = torch.stack([seq_cls(input_ids=row[None], use_cache=False).logits[0, 0] for row in rows])
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_scores_land_on_the_last_response_token():
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = place_on_last_response_token(torch.tensor([0.5, -1.0, 3.0]), response_mask)
    assert out.tolist() == [[0, 0.5, 0, 0], [0, 0, 0, -1.0], [0, 0, 0, 0]]


def _padded_rows(rows, width, left_pad=2):
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):  # left padding, then right padding up to `width`
        ids[i, left_pad : left_pad + len(row)] = row
        mask[i, left_pad : left_pad + len(row)] = 1
    return ids, mask


def test_packed_scores_equal_padded_scores(tiny_model_path, tmp_path):
    """reward_model.model.use_remove_padding: the packed row gives the padded forward's scores."""
    make_reward_model(tiny_model_path, tmp_path)
    padded, packed = load_reward_model(str(tmp_path), False), load_reward_model(str(tmp_path), True)
    rows = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 1, 8)]
    ids, mask = _padded_rows(rows, width=16)
    with torch.no_grad():
        expected = last_token_scores(padded, ids, mask)
        ours = last_token_scores(packed, ids, mask, use_remove_padding=True)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_worker_scores_packed_with_offloaded_parameters(tiny_model_path, tmp_path, monkeypatch):
    """The worker reads use_remove_padding and fsdp_config.param_offload: FSDP2 offloads, scores stay exact."""
    from fsdp_harness import free_port
    from omegaconf import OmegaConf
    from small_config import SMALL
    from torch.distributed.fsdp import CPUOffloadPolicy

    from rlframe.config.loader import resolved
    from rlframe.protocol import DataProto
    from rlframe.trainer.config import compose, typed
    from rlframe.workers.reward_model import RewardModelWorker

    rm_dir = tmp_path / "rm"
    seq_cls = make_reward_model(tiny_model_path, rm_dir).eval()
    overrides = [
        *SMALL,
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        f"actor_rollout_ref.model.path={tiny_model_path}",
        "reward_model.enable=true",
        f"reward_model.model.path={rm_dir}",
        "reward_model.use_reward_loop=false",
        "reward_model.model.use_remove_padding=true",
        "reward_model.model.fsdp_config.param_offload=true",
        "reward_model.micro_batch_size_per_gpu=3",
    ]
    composed = compose(overrides)
    typed(composed)  # the launch checks pass
    cfg = resolved(composed)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    worker = RewardModelWorker(OmegaConf.to_container(cfg), plan=None)
    try:
        worker.init_model(total_training_steps=1)
        assert worker.use_remove_padding
        assert isinstance(worker.module._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
        rows = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 12, 7, 10)]
        ids, mask = _padded_rows(rows, width=16)
        response_mask = mask[:, -8:]
        data = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": mask, "responses": ids[:, -8:], "response_mask": response_mask}
        )
        rm_scores = worker.compute_rm_score(data).batch["rm_scores"]
        with torch.no_grad():
            expected = torch.stack([seq_cls(input_ids=row[None], use_cache=False).logits[0, 0] for row in rows])
        torch.testing.assert_close(rm_scores.sum(-1), expected, rtol=1e-5, atol=1e-6)
        assert rm_scores.nonzero().shape[0] == len(rows)  # one score per row, on its last response token
    finally:
        torch.distributed.destroy_process_group()


def test_reward_loop_with_a_reward_model_is_refused_before_ray():
    from small_config import SMALL

    from rlframe.trainer.config import compose, typed

    overrides = [*SMALL, "reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.use_reward_loop=true"]
    with pytest.raises(ValueError, match="reward_model.use_reward_loop=true .*set reward_model.use_reward_loop=false"):
        typed(compose(overrides))
