"""rlframe's SFT loss equals verl 0.9.1's own `sft_loss` (verl/workers/utils/losses.py) on random log-probs: verl's
no-padding layout (nested rows; position t holds the log-prob of token t + 1, the loss mask rolled onto it) against
rlframe's actor layout (`sft_batch`: the response tokens' log-probs and `response_mask`)."""

import importlib
import sys

import pytest
import torch
from helpers import verl_reference
from helpers.sft_harness import make_rows
from tensordict import TensorDict

from rlframe.algorithms.sft import sft_loss
from rlframe.workers.sft import sft_batch


def verl_losses():
    """verl.workers.utils.losses, with the imports its chain needs but never calls here stood in."""
    for name in verl_reference._SFT_UNUSED_IMPORTS:
        if name not in sys.modules and (name.startswith("verl.") or importlib.util.find_spec(name) is None):
            sys.modules[name] = verl_reference._stand_in(name)
    return verl_reference.verl_module("verl.workers.utils.losses")


@pytest.mark.parametrize("dp_size", [1, 2])
def test_sft_loss_equals_verls_on_random_log_probs(dp_size):
    losses = verl_losses()
    tensordict_utils = verl_reference.verl_module("verl.utils.tensordict_utils")
    rows = make_rows(vocab_size=50, num_rows=6, seed=3)
    gen = torch.Generator().manual_seed(0)
    token_log_probs = [-5 * torch.rand(len(row["input_ids"]), generator=gen, dtype=torch.float64) for row in rows]
    # as if the other DP ranks held as many trained tokens: verl's batch_num_tokens is the global count
    global_tokens = torch.tensor(float(sum(int(row["loss_mask"].sum()) for row in rows) * dp_size))

    shifted = [torch.cat([lp[1:], torch.zeros(1, dtype=lp.dtype)]) for lp in token_log_probs]  # the last: masked
    data = TensorDict(
        {"loss_mask": torch.nested.nested_tensor([row["loss_mask"] for row in rows], layout=torch.jagged)},
        batch_size=[len(rows)],
    )
    tensordict_utils.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=global_tokens)
    model_output = {"log_probs": torch.nested.nested_tensor(shifted, layout=torch.jagged)}
    expected, _ = losses.sft_loss(config=None, model_output=model_output, data=data)

    batch = sft_batch(rows, pad_token_id=0)
    width = batch["responses"].shape[1]
    response_log_probs = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, log_probs in enumerate(token_log_probs):
        response_len = int(batch["attention_mask"][i, -width:].sum())
        response_log_probs[i, :response_len] = log_probs[len(log_probs) - response_len :]
    ours = sft_loss(response_log_probs, batch["response_mask"], global_tokens) * dp_size  # the updater's factor
    torch.testing.assert_close(ours, expected.to(ours.dtype), rtol=1e-12, atol=0)
