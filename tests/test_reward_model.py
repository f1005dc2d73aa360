"""Reward model scoring: a sequence-classification checkpoint read at each row's last valid token."""

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

from rlframe.workers.reward_model import last_token_scores, place_on_last_response_token


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
