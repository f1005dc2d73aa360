"""Groups a checkpoint carries finished but not trained, so that an asynchronous resume trains them as they are.

An asynchronous run (`trainer.v1.trainer_mode=separate_async` or `colocate_async`) has groups whose n responses
are all back, waiting in its ledger for a step. Its checkpoint keeps each of them whole in the driver state as
`finished_groups`: its prompt row, its n generated rows in sample order (responses, the engine's log-probs, each
token's policy version: what the step that takes it scores and trains on) and its admission version. The groups
still generating, and the prompts waiting for room, stay `pending_prompts` (`pending_prompts.py`), as verl's V1
keeps the finished ones and generates the rest again.

A run resumed under an asynchronous mode puts them back into its ledger with their admission versions
(`GroupLedger.restore`): they are the oldest groups, so the first steps take them without generating them again,
and one older than η allows is evicted as any stale group is. The synchronous loop trains on-policy: it takes their
prompts first, as pending prompts, and generates them again. Either way each prompt is trained once. Restoring them
needs the saving run's actor_rollout_ref.rollout.n: a resume under an asynchronous mode with another n is refused.
Checkpoints without the entry (older ones, and synchronous runs') restore none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rlframe.protocol import DataProto, plain_data
from rlframe.trainer.pending_prompts import plain_rows, rows_from_plain

logger = logging.getLogger(__name__)

STATE_KEY = "finished_groups"
N_KEY = "actor_rollout_ref.rollout.n"


@dataclass
class FinishedGroup:
    """One group generated and not trained: what its step scores and trains on, and its admission version."""

    version: int  # the published policy version when it was admitted (it bounds the group's staleness)
    prompt: DataProto  # its prompt row, as the loader gave it (the sync loop generates it again)
    rows: DataProto  # its n generated rows, in sample order, not scored yet


def plain_groups(groups: list[FinishedGroup], n: int) -> tuple[dict, list[DataProto]]:
    """(the driver-state entry of the groups, the prompts of those whose rows are not plain data). A group whose rows
    hold a value a checkpoint cannot (`plain_data`) is kept as its prompt, to be generated again."""
    kept, prompts = [], []
    for group in groups:
        try:
            plain_data(plain_rows([group.rows]), "finished group", "")
        except TypeError as error:
            logger.warning("a finished group is saved as its prompt, to be generated again: %s", error)
            prompts.append(group.prompt)
            continue
        kept.append(group)
    entry = {
        "rollout_n": n,
        "versions": [group.version for group in kept],
        "prompts": plain_rows([group.prompt for group in kept]),
        "rows": plain_rows([group.rows for group in kept]),
    }
    return entry, prompts


def saved_groups(driver_state: dict) -> list[FinishedGroup]:
    """The finished groups a checkpoint carried, oldest first (none from a checkpoint without the entry)."""
    entry = driver_state.get(STATE_KEY)
    if not entry or not entry["versions"]:
        return []
    n = int(entry["rollout_n"])
    prompts, rows = rows_from_plain(entry["prompts"]), rows_from_plain(entry["rows"])
    return [
        FinishedGroup(int(version), prompt, DataProto.concat(rows[i * n : (i + 1) * n]))
        for i, (version, prompt) in enumerate(zip(entry["versions"], prompts))
    ]


def check_rollout_n(driver_state: dict, n: int, mode: str) -> None:
    """An asynchronous resume restores the groups as saved: refuse one whose n differs from the saving run's."""
    entry = driver_state.get(STATE_KEY)
    if not entry or not entry["versions"] or int(entry["rollout_n"]) == n:
        return
    saved = int(entry["rollout_n"])
    raise ValueError(
        f"the checkpoint holds {len(entry['versions'])} finished groups of {N_KEY}={saved} samples each, to be "
        f"trained as they are under {mode}; this run has {N_KEY}={n}. Resume with {N_KEY}={saved}, or under "
        f"trainer.v1.trainer_mode=sync, which generates their prompts again with the run's n"
    )
