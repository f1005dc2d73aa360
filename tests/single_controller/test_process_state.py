"""Run state has an owner with a lifetime, not a module global; the config-read trace patches only while entered.

The roles a ColocatedWorker hosts share its kill points, shared-memory groups and any `process_state`, also
inside their own `__init__`; a `ReadTrace` records the keys read inside its block and puts omegaconf back on
exit; `KillPoints` objects count on their own.
"""

from __future__ import annotations

import pytest
from omegaconf import DictConfig, OmegaConf

from rlframe.config.trace import ReadTrace
from rlframe.single_controller.ray.colocate import ColocatedWorker
from rlframe.single_controller.worker import Worker
from rlframe.utils.faults import ENV, KillPoints


class _Role(Worker):
    def __init__(self, x):
        self.x = x
        self.session = self.process_state("session", object)  # in __init__: already the host's


class _OtherRole(_Role):
    pass


def test_the_roles_of_a_colocated_worker_share_what_the_process_owns():
    host = ColocatedWorker({"a": (_Role, (1,), {}), "b": (_OtherRole, (), {"x": 2})})
    a, b = host.roles["a"], host.roles["b"]
    assert (a.x, b.x) == (1, 2)
    assert a.session is b.session is host.process_state("session", object)
    assert a.kill_points is b.kill_points is host.kill_points
    assert a.shared_memory is b.shared_memory is host.shared_memory
    other = ColocatedWorker({"a": (_Role, (3,), {})})
    assert other.kill_points is not host.kill_points and other.roles["a"].session is not a.session


def test_read_trace_records_inside_its_block_only_and_restores_omegaconf(tmp_path):
    originals = (DictConfig.__getattr__, DictConfig.__getitem__, OmegaConf.__dict__["select"])
    cfg = OmegaConf.create({"a": {"b": 1, "c": 2}, "d": 3})
    path = tmp_path / "reads.keys"
    with ReadTrace(str(path)) as trace:
        assert cfg.a.b == 1 and cfg["d"] == 3 and OmegaConf.select(cfg.a, "c") == 2
        with ReadTrace(str(tmp_path / "inner.keys")):  # nested: both record
            assert cfg.a.b == 1
    assert (DictConfig.__getattr__, DictConfig.__getitem__, OmegaConf.__dict__["select"]) == originals
    assert cfg.d == 3  # after the block: not recorded
    assert path.read_text().split() == ["a", "a.b", "d", "a.c"] and trace.seen == {"a", "a.b", "d", "a.c"}
    assert (tmp_path / "inner.keys").read_text().split() == ["a", "a.b"]


def test_kill_points_count_per_object(monkeypatch):
    monkeypatch.setenv(ENV, "p:3")
    first, second = KillPoints(), KillPoints()
    for _ in range(2):
        first.hit("p")
    second.hit("p")
    first.hit("q")  # not named: not counted
    assert first.hits == {"p": 2} and second.hits == {"p": 1}


def test_delay_points_sleep_a_seeded_random_time_on_the_ranks_named(monkeypatch):
    from rlframe.utils import faults

    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv(faults.DELAY_ENV, "rollout.generate:7:1-2:1,other:7:5-5")
    monkeypatch.setenv("RANK", "0")
    faults.DelayPoints().hit("rollout.generate")
    assert slept == []  # rank 1 only
    monkeypatch.setenv("RANK", "1")
    first, again = faults.DelayPoints(), faults.DelayPoints()
    for points in (first, again):
        points.hit("rollout.generate")
        points.hit("rollout.generate")
    assert slept[:2] == slept[2:] and all(1 <= s <= 2 for s in slept) and slept[0] != slept[1]
    faults.DelayPoints().hit("other")
    assert slept[-1] == 5
    monkeypatch.setenv(faults.DELAY_ENV, "rollout.generate:7:fast")
    with pytest.raises(ValueError, match=r"RLFRAME_DELAY_AT='rollout.generate:7:fast': expected NAME:SEED:MIN-MAX"):
        faults.DelayPoints().hit("rollout.generate")
