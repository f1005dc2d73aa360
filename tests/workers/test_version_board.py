"""The VersionBoard (`rlframe/workers/versioned_rollout.py`): a replica's held `newer_than` call is answered the moment
a newer version is announced, at once when one already is, and never by an older announcement."""

from __future__ import annotations

import asyncio

from rlframe.workers.versioned_rollout import VersionBoard


def test_a_held_call_is_answered_by_the_next_newer_announcement_and_older_ones_change_nothing():
    async def scenario():
        board = VersionBoard()
        waiting = asyncio.create_task(board.newer_than(0))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing announced yet: the call is held
        await board.announce(2, ["weights of 2"])
        assert await asyncio.wait_for(waiting, 1) == 2
        assert await asyncio.wait_for(board.newer_than(1), 1) == 2  # already newer: answered at once
        later = asyncio.create_task(board.newer_than(2))
        await board.announce(1, ["weights of 1"])  # older than what the board holds: ignored
        await asyncio.sleep(0.01)
        assert not later.done() and board.announced_weights() == (2, ["weights of 2"])
        await board.announce(3)  # a version without weights (colocate_async): none to catch up to
        assert await asyncio.wait_for(later, 1) == 3 and board.announced_weights() == (3, None)

    asyncio.run(scenario())


def test_a_tp_peer_finds_its_leaders_version_after_one_more_push_but_not_two():
    async def scenario():
        board = VersionBoard(keep_previous=True)
        await board.announce(1, ["weights of 1"])
        await board.announce(1, ["weights of 1"])  # announced again (a resumed run's first sync): still one version
        await board.announce(2, ["weights of 2"])
        assert board.weights_of(1) == ["weights of 1"] and board.weights_of(2) == ["weights of 2"]
        await board.announce(3, ["weights of 3"])
        assert board.weights_of(1) is None and board.weights_of(2) == ["weights of 2"]

    asyncio.run(scenario())


def test_without_keep_previous_only_the_newest_weights_are_held():
    async def scenario():
        board = VersionBoard()
        await board.announce(1, ["weights of 1"])
        await board.announce(2, ["weights of 2"])
        assert board.weights_of(1) is None and board.weights_of(2) == ["weights of 2"]

    asyncio.run(scenario())
