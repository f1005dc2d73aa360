"""The distillation teachers of one training process, and the routing of rows to them (docs/distillation.md).

One teacher scores every row. With several (verl's `distillation.teacher_models.NAME` entries), a row goes to the
teacher whose `key` equals the row's `distillation.teacher_key` field (`data_source` by default), and each teacher
scores only its rows. A teacher is an FSDP module, so its forward is a collective over the training processes:
every rank must run the same passes. Each rank therefore pads its rows for a teacher to the most any rank of its
DP group holds (repeating one of them; the copies' outputs are dropped), and a teacher no rank needs is skipped by
all. The micro-batches are then cut as for one teacher (`actor_rollout_ref.rollout.log_prob_*`), dynamic ones to
the same count on every rank as always.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from rlframe.distributed.parallel_dims import spans_ranks
from rlframe.protocol import DataProto
from rlframe.workers.actor import PPOActor


def route(values: Sequence, keys: Sequence[str], field: str) -> dict[str, list[int]]:
    """{teacher key: the rows it scores, in order} for the rows' `field` values (compared as text)."""
    rows: dict[str, list[int]] = {key: [] for key in keys}
    for row, value in enumerate(values):
        if str(value) not in rows:
            raise ValueError(
                f"row {row}: {field}={value!r} (distillation.teacher_key) routes to no teacher; the teachers' keys: "
                f"{', '.join(map(repr, keys))}"
            )
        rows[str(value)].append(row)
    return rows


def padded(rows: list[int], count: int) -> list[int]:
    """`rows` repeated at its first entry (row 0 when empty) up to `count` rows."""
    return rows + [rows[0] if rows else 0] * (count - len(rows))


class Teachers:
    """The frozen teacher models by routing key (one teacher: the key None takes every row)."""

    def __init__(self, models: dict[str | None, PPOActor], field: str, topk: int, dp_group):
        self.models = models
        self.field = field
        self.topk = topk  # forward_kl_topk reads the top-k tokens per position; the estimators the sampled ones
        self.dp_group = dp_group

    def score(self, data: DataProto) -> dict[str, torch.Tensor]:
        """Each row's teacher outputs: `teacher_log_probs` [bs, resp_len], or for top-k `teacher_topk_log_probs`
        and `teacher_topk_ids` [bs, resp_len, topk]."""
        if len(self.models) == 1:
            return self._outputs(next(iter(self.models.values())), data)
        routed = route(data.non_tensor_batch[self.field], list(self.models), self.field)
        counts = torch.tensor([len(rows) for rows in routed.values()], dtype=torch.int64)
        if spans_ranks(self.dp_group):
            counts = counts.to(data.batch.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.dp_group)
        out: dict[str, torch.Tensor] = {}
        for (key, rows), count in zip(routed.items(), counts.tolist()):
            if count == 0:  # no rank holds a row for this teacher
                continue
            part = self._outputs(self.models[key], data.select_idxs(np.asarray(padded(rows, count))))
            for name, values in part.items():
                if name not in out:
                    out[name] = values.new_zeros((len(data), *values.shape[1:]))
                out[name][rows] = values[: len(rows)]
        return out

    def _outputs(self, teacher: PPOActor, data: DataProto) -> dict[str, torch.Tensor]:
        if self.topk:
            stats = teacher.compute_token_stats(data, topk=self.topk)
            return {"teacher_topk_log_probs": stats["topk_log_probs"], "teacher_topk_ids": stats["topk_ids"]}
        return {"teacher_log_probs": teacher.compute_log_prob(data)[0]}
