"""Reward model scoring: a sequence-classification checkpoint read at each row's last valid token."""

import numpy as np
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
    from helpers.small_config import SMALL
    from helpers.world import free_port
    from torch.distributed.fsdp import CPUOffloadPolicy

    from rlframe.batch_plan import make_batch_plan
    from rlframe.config.loader import resolved
    from rlframe.config.schema import sections_of
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
    plan = make_batch_plan(cfg)  # and the plan's: the reward model's workers are laid out there
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    worker = RewardModelWorker(sections_of(cfg, RewardModelWorker.SECTIONS), plan)
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


def _bos_template_tokenizer(tiny_model_path):
    """The tiny tokenizer with a BOS token its chat template writes first (as Llama-style templates do)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.bos_token = "<|endoftext|>"
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    return tokenizer


def _chat_rows(tokenizer, answers, response_width=12):
    """Prompts (raw chat, left-padded ids) and right-padded responses ending in EOS, but for the last one."""
    from rlframe.protocol import DataProto

    chats = [[{"role": "user", "content": f"{i}+{i}="}] for i in range(len(answers))]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    width = max(map(len, prompts))
    eos = tokenizer.eos_token_id
    responses = [
        tokenizer.encode(a, add_special_tokens=False) + ([eos] if i < len(answers) - 1 else [])
        for i, a in enumerate(answers)
    ]
    ids = torch.full((len(answers), width + response_width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        ids[i, width - len(prompt) : width], mask[i, width - len(prompt) : width] = torch.tensor(prompt), 1
        ids[i, width : width + len(response)], mask[i, width : width + len(response)] = torch.tensor(response), 1
    raw = np.empty(len(chats), dtype=object)
    raw[:] = chats
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, width:],
            "response_mask": mask[:, width:],
        },
        {"raw_prompt": raw},
    )


@pytest.mark.parametrize("bos_in_template", [False, True])
def test_reward_loop_texts_equal_verl_091(tiny_model_path, bos_in_template):
    import asyncio
    import types

    from helpers.verl_reference import verl_core_algos
    from transformers import AutoTokenizer

    from rlframe.workers.reward_model import reward_loop_texts

    verl_core_algos()  # puts verl 0.9.1's package on the path, or skips
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.protocol import DataProto as VerlDataProto

    policy = AutoTokenizer.from_pretrained(tiny_model_path)
    rm = _bos_template_tokenizer(tiny_model_path) if bos_in_template else policy
    data = _chat_rows(policy, ["12", "3 apples", "7"])
    ours = reward_loop_texts(data, policy, rm)
    worker = types.SimpleNamespace(input_tokenizer=policy, reward_model_tokenizer=rm)
    theirs = []
    for i in range(len(data)):
        row = VerlDataProto.from_dict(
            {k: v[i : i + 1] for k, v in data.batch.items()},
            {"raw_prompt": data.non_tensor_batch["raw_prompt"][i : i + 1]},
        )
        theirs.append(asyncio.run(RewardLoopWorker._preprocess_reward_inputs(worker, row)))
    assert ours == theirs
    assert not any(text.startswith("<|endoftext|>") for text in ours)
    assert ours[0].endswith("<|im_start|>assistant\n12<|im_end|>\n")  # the EOS comes from the template, once


def test_reward_loop_worker_scores_the_rendered_chat(tiny_model_path, tmp_path, monkeypatch):
    """reward_model.use_reward_loop=true (the default): the score is the model's logit on the text verl's reward
    loop would send its server, not on the policy's own ids (which the legacy worker scores)."""
    from helpers.small_config import SMALL
    from helpers.world import free_port
    from transformers import AutoTokenizer

    from rlframe.batch_plan import make_batch_plan
    from rlframe.config.loader import resolved
    from rlframe.config.schema import sections_of
    from rlframe.trainer.config import compose, typed
    from rlframe.workers.reward_model import RewardModelWorker, reward_loop_texts

    rm_dir = tmp_path / "rm"
    seq_cls = make_reward_model(tiny_model_path, rm_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    data = _chat_rows(tokenizer, ["12", "3 apples", "7"])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    scores = {}
    for use_reward_loop in (True, False):
        overrides = [
            *SMALL,
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=1",
            f"actor_rollout_ref.model.path={tiny_model_path}",
            "reward_model.enable=true",
            f"reward_model.model.path={rm_dir}",
            f"reward_model.use_reward_loop={str(use_reward_loop).lower()}",
        ]
        composed = compose(overrides)
        typed(composed)
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        cfg = resolved(composed)
        worker = RewardModelWorker(sections_of(cfg, RewardModelWorker.SECTIONS), make_batch_plan(cfg))
        try:
            worker.init_model(total_training_steps=1)
            scores[use_reward_loop] = worker.compute_rm_score(data).batch["rm_scores"].sum(-1)
        finally:
            torch.distributed.destroy_process_group()
    with torch.no_grad():
        rendered = [tokenizer(text)["input_ids"] for text in reward_loop_texts(data, tokenizer, tokenizer)]
        expected = torch.stack(
            [seq_cls(input_ids=torch.tensor([ids]), use_cache=False).logits[0, 0] for ids in rendered]
        )
        own_ids = [row[m.bool()] for row, m in zip(data.batch["input_ids"], data.batch["attention_mask"])]
        legacy = torch.stack([seq_cls(input_ids=ids[None], use_cache=False).logits[0, 0] for ids in own_ids])
    torch.testing.assert_close(scores[True], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores[False], legacy, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(scores[True], scores[False])  # the rendered text differs from the policy's ids


def test_reward_loop_command_lines_are_taken_with_the_server_settings_reported():
    from helpers.small_config import SMALL

    from rlframe.config.key_status import ignored_key_warnings
    from rlframe.config.loader import resolved
    from rlframe.trainer.config import compose, typed

    # verl 0.9.1's reward-model example (legacy spelling, as its scripts write it) and its reward.* spelling
    server = ["gpu_memory_utilization=0.8", "tensor_model_parallel_size=1", "prompt_length=2048"]
    legacy = [
        *SMALL,
        "reward_model.enable=true",
        "reward_model.model.path=/rm",
        "reward_model.use_reward_loop=true",
        "reward_model.rollout.name=vllm",
        *[f"reward_model.rollout.{s}" for s in server],
        "reward_model.num_workers=8",
    ]
    newer = [
        *SMALL,
        "reward.reward_model.enable=true",
        "reward.reward_model.model_path=/rm",
        "reward.reward_model.rollout.name=vllm",
        *[f"reward.reward_model.rollout.{s}" for s in server],
        "reward.num_workers=8",
    ]
    for overrides in (legacy, newer):
        composed = compose(overrides)
        typed(composed)
        cfg = resolved(composed).reward_model
        assert cfg.enable and cfg.model.path == "/rm" and cfg.use_reward_loop and cfg.rollout.name == "vllm"
        assert cfg.rollout.gpu_memory_utilization == 0.8 and cfg.num_workers == 8
        warned = [w for w in ignored_key_warnings(composed, overrides) if w.startswith("rlframe: warning: reward")]
        assert len(warned) == 5, warned
        assert all("has no effect" in w for w in warned)
        assert any(
            "rollout.name=vllm has no effect: rlframe scores the reward model with its FSDP" in w for w in warned
        )
    with pytest.raises(ValueError, match="reward_model.rollout.name='trtllm' is not one of"):
        typed(compose([*SMALL, "reward_model.rollout.name=trtllm"]))
    with pytest.raises(ValueError, match="custom_reward_function.path and reward_model.use_reward_loop=true"):
        typed(compose([*legacy, "custom_reward_function.path=/f.py"]))
