"""The rollout stage's synchronous source without workers: a stand-in worker group "generates" a response per row, a
stand-in reward scores it, and `ColocatedSource` composes the stages (uids, n samples, generation, reward, DAPO's
dynamic sampling, the pending prompts of a resumed checkpoint). End to end: tests/e2e/test_golden_run.py (bitwise),
tests/e2e/test_dapo_e2e.py, tests/e2e/test_trainer_e2e.py (ReMax) and tests/e2e/test_async_e2e.py (the pooled source).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlframe.data.dataloader import make_dataloader
from rlframe.protocol import DataProto
from rlframe.trainer.config import compose
from rlframe.trainer.pending_prompts import PendingPrompts, plain_rows
from rlframe.trainer.rollout_stage import ColocatedSource, Scorer, SourceInputs

PROMPT_LEN, N = 3, 2


class EchoWorkers:
    """Generates, for each row, a one-token response: its prompt's index plus the sample's parity (so the two
    samples of a group score differently exactly when `vary` says so)."""

    def __init__(self, vary):
        self.vary, self.calls = vary, []

    def generate_sequences(self, gen_batch: DataProto) -> DataProto:
        self.calls.append(dict(gen_batch.meta_info))
        first = gen_batch.batch["input_ids"][:, 0]
        parity = torch.arange(len(gen_batch)) % 2
        tokens = first + parity * torch.tensor([int(self.vary(int(i))) for i in first])
        out = DataProto.from_dict({"responses": tokens[:, None], "response_mask": torch.ones(len(gen_batch), 1)})
        out.meta_info = {"metrics": {"gen/rows": [len(gen_batch)]}}
        return out


def score_by_response(batch: DataProto, return_dict: bool) -> dict:
    scores = batch.batch["responses"].float()
    return {"reward_tensor": scores, "dropped": torch.zeros(len(batch), dtype=torch.bool), "reward_extra_info": {}}


def loader(count: int):
    rows = [
        {
            "input_ids": torch.full((PROMPT_LEN,), i),
            "attention_mask": torch.ones(PROMPT_LEN, dtype=torch.long),
            "position_ids": torch.arange(PROMPT_LEN),
        }
        for i in range(count)
    ]
    return make_dataloader(rows, 2, shuffle=False, seed=0)


def source(vary=lambda i: True, *overrides, pending=None, count=8, epochs=1):
    config = compose(["actor_rollout_ref.rollout.n=2", f"trainer.total_epochs={epochs}", *overrides])
    filter_groups = config.algorithm.filter_groups.enable
    plan = SimpleNamespace(n=N, train_batch_size=2, filter_groups=filter_groups, max_num_gen_batches=0)
    workers = EchoWorkers(vary)
    scorer = Scorer(config, score_by_response, None)
    inputs = SourceInputs(config, plan, loader(count), pending or PendingPrompts(), scorer)
    return ColocatedSource(inputs, workers), workers


def test_each_loader_batch_becomes_a_scored_batch_of_n_samples_per_prompt_in_group_order():
    src, workers = source(vary=lambda i: False)
    ready = src.next_batch(1)
    assert len(ready.batch) == 2 * N
    uids = ready.batch.non_tensor_batch["uid"]
    assert uids[0] == uids[1] != uids[2] == uids[3]  # n samples side by side share their prompt's uid
    assert ready.batch.batch["token_level_scores"][:, 0].tolist() == [0, 0, 1, 1]
    assert {"gen", "reward"} <= ready.timings.keys() and "gen/rows" in ready.metrics
    assert workers.calls == [{"validate": False, "policy_version": 0}]  # nothing else travels with the prompts


def test_dynamic_sampling_collects_informative_groups_over_rounds_and_the_data_ends_the_run():
    # prompts 0..7 in loader batches of 2; only odd prompts' samples differ, so each round keeps one group
    src, workers = source(lambda i: i % 2 == 1, "algorithm.filter_groups.enable=true")
    ready = src.next_batch(1)
    assert len(workers.calls) == 2 and ready.metrics["train/num_gen_batches"] == 2
    assert ready.batch.batch["token_level_scores"][:, 0].tolist() == [1, 2, 3, 4]  # prompts 1 and 3, both samples
    assert src.next_batch(2) is not None  # rounds 3 and 4: prompts 5 and 7
    assert src.next_batch(3) is None  # one epoch: the data has run out


def test_a_checkpoints_untrained_prompts_are_generated_first_and_reported_until_handed_out():
    pending = PendingPrompts()
    restored = DataProto.from_single_dict(
        {
            "input_ids": torch.full((1, PROMPT_LEN), 40),
            "attention_mask": torch.ones(1, PROMPT_LEN, dtype=torch.long),
            "position_ids": torch.arange(PROMPT_LEN)[None],
        }
    )
    pending.restore({"pending_prompts": plain_rows([restored])})
    src, _ = source(vary=lambda i: False, pending=pending)
    assert len(src.untrained_prompts()) == 1
    ready = src.next_batch(1)
    assert ready.batch.batch["token_level_scores"][:, 0].tolist() == [40, 40, 0, 0]
    assert len(src.untrained_prompts()) == 1  # the loader's prompt 1 waits for the next batch


def test_a_checkpoints_finished_groups_are_generated_again_first_by_the_sync_loop():
    """The sync loop trains on-policy: a finished group an asynchronous checkpoint carried is generated again, its
    prompt before the checkpoint's other pending prompts (it is older), each once."""
    from rlframe.trainer.finished_groups import FinishedGroup

    def row(token):
        return DataProto.from_single_dict(
            {
                "input_ids": torch.full((1, PROMPT_LEN), token),
                "attention_mask": torch.ones(1, PROMPT_LEN, dtype=torch.long),
                "position_ids": torch.arange(PROMPT_LEN)[None],
            }
        )

    pending = PendingPrompts()
    pending.restore({"pending_prompts": plain_rows([row(41)])})
    src, workers = source(vary=lambda i: False, pending=pending)
    src.restore_finished([FinishedGroup(1, row(40), row(40).repeat(N))])
    ready = src.next_batch(1)
    assert len(workers.calls) == 1  # generated again
    assert ready.batch.batch["token_level_scores"][:, 0].tolist() == [40, 40, 41, 41]
    assert len(src.untrained_prompts()) == 2  # the loader's batch regrouped behind them


def test_remax_scores_one_greedy_response_per_prompt_before_the_samples():
    src, workers = source(lambda i: False, "algorithm.adv_estimator=remax")
    ready = src.next_batch(1)
    assert workers.calls == [{"validate": False, "do_sample": False}, {"validate": False, "policy_version": 0}]
    assert ready.batch.batch["reward_baselines"].tolist() == [0, 0, 1, 1]  # each prompt's greedy score, n times
    assert "gen_max" in ready.timings
