"""A batch for the reward functions."""

import torch

from rlframe.protocol import DataProto


def make_batch(tokenizer, responses, sources, truths, response_len=8, prompt_len=4, use_response_mask=True):
    """A rollout-shaped DataProto: left-padded prompts, right-padded responses ending in EOS."""
    rows, masks = [], []
    for text in responses:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = ids[:response_len]
        rows.append(ids + [tokenizer.pad_token_id] * (response_len - len(ids)))
        masks.append([1] * len(ids) + [0] * (response_len - len(ids)))
    bs = len(responses)
    response_ids, response_mask = torch.tensor(rows), torch.tensor(masks)
    prompts = torch.full((bs, prompt_len), tokenizer.pad_token_id)
    prompts[:, -2:] = 7
    prompt_mask = torch.zeros(bs, prompt_len, dtype=torch.long)
    prompt_mask[:, -2:] = 1
    tensors = {
        "prompts": prompts,
        "responses": response_ids,
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
    }
    if use_response_mask:
        tensors["response_mask"] = response_mask
    return DataProto.from_dict(
        tensors,
        {
            "data_source": sources,
            "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
            "extra_info": [{"index": i} for i in range(bs)],
        },
    )
