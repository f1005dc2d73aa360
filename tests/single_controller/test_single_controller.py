"""Single controller on a small local Ray cluster: dispatch modes, order, errors, colocation."""

import inspect
import os
import sys
import time

import pytest
import ray
import torch
from helpers.ray_workers import EchoWorker

from rlframe.protocol import DataProto
from rlframe.single_controller import (
    Dispatch,
    Execute,
    Worker,
    WorkerDiedError,
    WorkerError,
    WorkerGroupError,
    WorkerTimeoutError,
    register,
)
from rlframe.single_controller.decorator import RegisterSpec, plan_call

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Ray workers cannot import this test module (tests/ is not on their path): ship its classes by value.
ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORLD_SIZE = 4


def make_data(n: int) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3)},
        {"uid": [f"s{i}" for i in range(n)]},
        {"temperature": 0.7},
    )


class CrashWorker(Worker):
    def __init__(self):
        self.init_process_group(timeout_s=60)

    @register(Dispatch.ONE_TO_ALL)
    def crash_one_while_peers_wait(self, crash_rank):
        import torch.distributed as dist

        if self.rank == crash_rank:
            os._exit(1)
        dist.barrier()  # never completes: the peer is gone
        return "unreachable"


class ShmWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def make_folder_removed_at_exit(self, parent):
        from rlframe.utils.shm import remove_at_exit

        folder = os.path.join(parent, f"rank{self.rank}")
        os.makedirs(folder)
        remove_at_exit(folder)
        return folder


class ActorRole(Worker):
    def __init__(self, scale):
        self.scale = scale

    @register(Dispatch.ONE_TO_ALL)
    def name(self):
        return ("actor", self.scale, os.getpid())

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"log_prob": data.batch["x"][:, 0] * self.scale})


class CriticRole(Worker):
    def __init__(self, scale):
        self.scale = scale

    @register(Dispatch.ONE_TO_ALL)
    def name(self):
        return ("critic", self.scale, os.getpid())

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"values": data.batch["x"][:, 0] + self.scale})


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from rlframe.single_controller.ray import init_ray

    init_ray(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def small_pool(n: int):
    from rlframe.single_controller.ray import RayResourcePool

    return RayResourcePool([n], num_cpus_per_process=0.25)


@pytest.fixture(scope="module")
def group(ray_cluster):
    from rlframe.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    pool = small_pool(WORLD_SIZE)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker, offset=0.0), call_timeout_s=120)
    yield wg
    wg.shutdown()
    pool.remove()


# ---------------------------------------------------------------------------------- no Ray needed
@pytest.mark.parametrize("n", [1, 3, 5, 7, 8, 13])
def test_plan_pads_splits_and_restores_order(n):
    data = make_data(n)
    spec = RegisterSpec(Dispatch.DP_COMPUTE_PROTO, Execute.ALL)
    plan = plan_call(spec, "f", (data,), {}, WORLD_SIZE)
    shard_sizes = {len(args[0]) for args in plan.args}
    assert len(shard_sizes) == 1  # equal shards keep every rank in lock-step
    out = plan.collect([args[0] for args in plan.args])
    assert out.non_tensor_batch["uid"].tolist() == data.non_tensor_batch["uid"].tolist()
    assert torch.equal(out.batch["x"], data.batch["x"])


def test_register_rejects_rank_zero_execution_of_sharded_modes():
    with pytest.raises(ValueError, match="DP_COMPUTE_PROTO"):
        register(Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.RANK_ZERO)
    with pytest.raises(ValueError, match="Dispatch member"):
        register("dp_compute_proto")


# ---------------------------------------------------------------------------------- dispatch modes
def test_workers_know_rank_world_size_and_rendezvous(group):
    infos = group.whoami("hi")
    assert [i["rank"] for i in infos] == list(range(WORLD_SIZE))
    assert {i["world_size"] for i in infos} == {WORLD_SIZE}
    assert [i["local_rank"] for i in infos] == list(range(WORLD_SIZE))
    assert len({i["master"] for i in infos}) == 1
    assert {i["tag"] for i in infos} == {"hi"}


def test_one_gloo_group_spans_the_workers(group):
    assert group.all_reduce_rank() == [float(sum(range(WORLD_SIZE)))] * WORLD_SIZE


@pytest.mark.parametrize("n", [5, 7, 8, 9])
def test_dp_compute_proto_preserves_order_through_padding(group, n):
    data = make_data(n)
    out = group.add_offset(data)
    assert len(out) == n
    assert out.non_tensor_batch["uid"].tolist() == [f"s{i}" for i in range(n)]
    assert torch.equal(out.batch["x"], data.batch["x"] + 1.0)  # the driver's copy is untouched
    per_rank = -(-n // WORLD_SIZE)  # padded shard size
    assert out.batch["rank"].tolist() == [i // per_rank for i in range(n)]
    assert out.meta_info["temperature"] == 0.7


def test_rank_zero_modes(group):
    assert group.rank_zero_answer() == 0
    assert group.only_rank_zero_runs() == [0]


def test_ranks_that_do_not_answer_in_time_are_named(group, monkeypatch):
    monkeypatch.setattr(group, "call_timeout_s", 0.2)  # production sets it from trainer.worker_timeout_s
    with pytest.raises(WorkerTimeoutError, match=r"ranks \[0, 1, 2, 3\] did not answer within 0.2s"):
        group.sleepy(1.5)


def test_each_rank_gets_its_own_contiguous_chunk_padded_with_leading_samples(group):
    group.add_offset(make_data(5))  # 5 samples, padded to 8: two per rank
    assert group.get_last_seen() == [["s0", "s1"], ["s2", "s3"], ["s4", "s0"], ["s1", "s2"]]


def test_one_to_all_data_is_put_once_and_each_rank_writes_its_own_copy(group, monkeypatch):
    import ray

    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value, **kw))
    data = make_data(3)
    outs = group.add_one_in_place(data)
    monkeypatch.undo()
    assert len(puts) == 1  # one object, though four workers read it
    # Every rank wrote into its input in place; each must have had its own copy (x + 1, not + 4).
    assert all(torch.equal(out.batch["x"], make_data(3).batch["x"] + 1.0) for out in outs)
    assert torch.equal(data.batch["x"], make_data(3).batch["x"])  # the driver's copy is untouched


@pytest.mark.parametrize("n", [8, 40_000])  # a few bytes per rank (sent inline), ~80 kB (Ray stores it itself)
def test_dp_shards_travel_with_their_call_not_put_by_the_driver(group, monkeypatch, n):
    import ray

    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value, **kw))
    data = make_data(n)
    out = group.add_offset(data)
    monkeypatch.undo()
    assert puts == []  # each shard has one reader: it goes with that rank's call
    assert torch.equal(out.batch["x"], data.batch["x"] + 1.0)
    assert out.non_tensor_batch["uid"].tolist() == [f"s{i}" for i in range(n)]


def test_group_methods_carry_the_worker_signature_and_doc(group):
    method = group.add_offset
    assert method.__self__ is group
    assert method.__wrapped__ is EchoWorker.add_offset
    assert list(inspect.signature(method).parameters) == ["data"]
    assert "constructor offset" in method.__doc__
    assert "def add_offset" in inspect.getsource(method)


# ---------------------------------------------------------------------------------- errors
def test_exception_on_one_worker_reaches_driver_with_its_rank(group):
    with pytest.raises(WorkerError) as info:
        group.fail_on(2)
    assert info.value.rank == 2
    assert "EchoWorker.fail_on" in str(info.value)
    assert "ValueError: boom from 2" in info.value.traceback_text
    assert group.fail_on(-1) == ["ok"] * WORLD_SIZE  # the group survives a raised exception


def test_non_dataproto_argument_is_rejected_before_dispatch(group):
    with pytest.raises(TypeError, match=r"add_offset\(\).*positional argument 0 must be a DataProto.*got dict"):
        group.add_offset({"x": torch.zeros(3)})


def test_asking_for_more_processes_than_the_cluster_has_fails_before_scheduling(ray_cluster):
    from ray.util import placement_group_table

    from rlframe.single_controller.ray import RayResourcePool

    before = len(placement_group_table())
    pool = RayResourcePool([3, 3], num_cpus_per_process=1.0)
    with pytest.raises(ValueError, match=r"2 node\(s\) × \[3, 3\] processes.*1 alive node.*CPU=4"):
        pool.placement_groups()
    assert len(placement_group_table()) == before
    with pytest.raises(ValueError, match="GPU"):
        RayResourcePool([1], use_gpu=True).placement_groups()


def test_a_pool_told_to_wait_for_nodes_fails_after_that_wait_naming_the_nodes(ray_cluster, caplog):
    from ray.util import placement_group_table

    from rlframe.single_controller.ray import ClusterTooSmallError, RayResourcePool

    before = len(placement_group_table())
    pool = RayResourcePool([3, 3], num_cpus_per_process=1.0, node_wait_s=2)
    start = time.monotonic()
    with pytest.raises(ClusterTooSmallError, match=r"\[3, 3\] processes.*1 alive node.*CPU=4.*\(waited 2s for nodes"):
        pool.placement_groups()
    assert 2 <= time.monotonic() - start < 10
    assert "Waiting up to 2s for nodes to join." in caplog.text  # said once, when the wait began
    assert len(placement_group_table()) == before
    # a pool that fits does not wait
    start = time.monotonic()
    fits = RayResourcePool([1], num_cpus_per_process=1.0, node_wait_s=60)
    fits.placement_groups()
    fits.remove()
    assert time.monotonic() - start < 5


def test_dead_worker_is_reported_with_its_rank_not_waited_on(ray_cluster):
    from rlframe.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    pool = small_pool(2)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(CrashWorker), call_timeout_s=90)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            wg.crash_one_while_peers_wait(1)
        assert info.value.rank == 1
        assert time.monotonic() - start < 60
    finally:
        wg.shutdown()
        pool.remove()
    with pytest.raises(WorkerGroupError, match="shut down"):
        wg.crash_one_while_peers_wait(1)


def test_group_shutdown_removes_what_its_workers_registered_in_shared_memory(ray_cluster, tmp_path):
    from rlframe.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    pool = small_pool(2)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(ShmWorker), call_timeout_s=90)
    try:
        folders = wg.make_folder_removed_at_exit(str(tmp_path))
        assert all(os.path.isdir(folder) for folder in folders)
    finally:
        wg.shutdown()  # kills the workers: no exit handler of theirs runs, the group asks them first
        pool.remove()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------- colocation
def test_colocated_roles_call_their_own_methods_in_shared_processes(ray_cluster):
    from rlframe.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls

    pool = small_pool(2)
    colocated = create_colocated_worker_cls(
        {"actor": RayClassWithInitArgs(ActorRole, scale=2.0), "critic": RayClassWithInitArgs(CriticRole, scale=10.0)}
    )
    wg = RayWorkerGroup(pool, colocated)
    try:
        roles = wg.spawn({"actor", "critic"})
        actor, critic = roles["actor"], roles["critic"]
        actor_names, critic_names = actor.name(), critic.name()
        assert [n[:2] for n in actor_names] == [("actor", 2.0)] * 2
        assert [n[:2] for n in critic_names] == [("critic", 10.0)] * 2
        assert [n[2] for n in actor_names] == [n[2] for n in critic_names]  # same processes
        data = make_data(3)
        assert actor.compute_log_prob(data).batch["log_prob"].tolist() == [0.0, 2.0, 4.0]
        assert critic.compute_values(data).batch["values"].tolist() == [10.0, 11.0, 12.0]
        assert not hasattr(actor, "compute_values") and not hasattr(critic, "compute_log_prob")
        with pytest.raises(ValueError, match="unknown roles"):
            wg.spawn({"reward"})
    finally:
        wg.shutdown()
        pool.remove()


def test_spawned_views_of_a_declared_group_class_dispatch_as_any_group(ray_cluster):
    # a group class declaring its worker's methods (for an editor) changes nothing in what a call does
    from rlframe.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls

    class ActorGroup(RayWorkerGroup[ActorRole]):
        compute_log_prob = ActorRole.compute_log_prob

    pool = small_pool(2)
    wg = RayWorkerGroup(pool, create_colocated_worker_cls({"actor": RayClassWithInitArgs(ActorRole, scale=2.0)}))
    try:
        actor = wg.spawn({"actor"}, {"actor": ActorGroup})["actor"]
        assert isinstance(actor, ActorGroup)
        assert actor.compute_log_prob(make_data(3)).batch["log_prob"].tolist() == [0.0, 2.0, 4.0]  # both ranks ran
        assert [view.compute_log_prob(make_data(1)).batch["log_prob"].tolist() for view in actor.rank_views()] == [
            [0.0],
            [0.0],
        ]
        assert all(isinstance(view, ActorGroup) for view in actor.rank_views())
    finally:
        wg.shutdown()
        pool.remove()


# ---------------------------------------------------------------------------------- non-blocking calls
def test_calls_submitted_on_two_groups_run_at_the_same_time_and_one_groups_calls_in_order(ray_cluster):
    from rlframe.single_controller.ray import PendingCall, RayClassWithInitArgs, RayWorkerGroup

    pools = [small_pool(1), small_pool(1)]
    first, second = (RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker), call_timeout_s=120) for pool in pools)
    try:
        on_first = first.submit("stamped_sleep", 1.0)
        on_second = second.submit("stamped_sleep", 1.0)
        then_first = first.submit("stamped_sleep", 0.1)
        assert isinstance(on_first, PendingCall)
        [(start_a, end_a)], [(start_b, end_b)] = on_first.result(), on_second.result()
        [(start_c, end_c)] = then_first.result()
        assert start_b < end_a and start_a < end_b  # the two groups' sleeps overlap
        assert start_c >= end_a  # a group's own calls run in submission order
        assert on_first.done() and then_first.done()
        with pytest.raises(RuntimeError, match="already taken"):
            on_first.result()
        with pytest.raises(AttributeError, match="not a registered worker method"):
            first.submit("no_such_method")
        assert first.submit("whoami", "t").result()[0]["tag"] == "t"  # the same result as the blocking call
    finally:
        for wg, pool in zip((first, second), pools):
            wg.shutdown()
            pool.remove()


def test_rank_views_run_a_call_on_one_rank_each_and_wait_any_returns_the_first_done(group):
    from rlframe.single_controller.ray import wait_any

    views = group.rank_views()
    assert [view.world_size for view in views] == [1] * WORLD_SIZE
    assert [view.whoami("v")[0]["rank"] for view in views] == list(range(WORLD_SIZE))
    slow, fast = views[0].submit("stamped_sleep", 1.5), views[1].submit("stamped_sleep", 0.1)
    assert wait_any([slow, fast]) is fast
    [(_, fast_end)] = fast.result()
    assert wait_any([slow]) is slow
    [(_, slow_end)] = slow.result()
    assert fast_end < slow_end
    first, second = views[0].submit("stamped_sleep", 0.0), views[1].submit("stamped_sleep", 0.0)
    first.result(), second.result()  # both long done: list order decides, not the order Ray reports them
    assert wait_any([first, second]) is first and wait_any([second, first]) is second
    with pytest.raises(ValueError, match="at least one"):
        wait_any([])


def test_rank_views_of_two_ranks_split_the_group_into_consecutive_pairs(group):
    pairs = group.rank_views(2)  # the rollout pool's TP-2 replicas
    assert [[info["rank"] for info in view.whoami("p")] for view in pairs] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"rank_views\(3\): 4 ranks do not split"):
        group.rank_views(3)


def test_a_failure_in_a_submitted_call_surfaces_from_result_with_its_rank(group):
    pending = group.submit("fail_on", 2)
    with pytest.raises(WorkerError) as info:
        pending.result()
    assert info.value.rank == 2 and "boom from 2" in str(info.value)


# ---------------------------------------------------------------------------------- verl's ray.remote classes
@ray.remote
class Accumulator(Worker):
    """verl's docs' worker, as they write it: decorated with ray.remote, calling Worker.__init__."""

    def __init__(self) -> None:
        super().__init__()
        self.value = torch.zeros(size=(1,)) + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x):
        self.value += x
        return self.value.cpu()


class EnvReader(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def env(self, name):
        return os.environ.get(name), self.rank


def test_a_ray_remote_worker_class_runs_as_verls_docs_write_it(ray_cluster):
    from rlframe.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    resource_pool = RayResourcePool([2], num_cpus_per_process=0.25)
    class_with_args = RayClassWithInitArgs(cls=Accumulator)
    worker_group = RayWorkerGroup(resource_pool, class_with_args)
    try:
        assert [v.item() for v in worker_group.add(x=2)] == [2.0, 3.0]
        assert [v.item() for v in worker_group.add(x=1)] == [3.0, 4.0]  # the same actors, state kept
    finally:
        worker_group.shutdown()
        resource_pool.remove()


def test_ray_remote_options_other_than_placement_reach_every_worker(ray_cluster):
    """`ray.remote(cls, runtime_env=...)` as verl's main_ppo writes `ray.remote(ActorRolloutRefWorker)`."""
    from rlframe.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    remote_cls = ray.remote(runtime_env={"env_vars": {"RLFRAME_TEST_TAG": "kept"}}, max_concurrency=2)(EnvReader)
    pool = small_pool(1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=remote_cls))
    try:
        assert wg.env("RLFRAME_TEST_TAG") == [("kept", 0)]
        assert wg.env("WORLD_SIZE") == [("1", 0)]  # the group's own variables are still set
    finally:
        wg.shutdown()
        pool.remove()


def test_ray_remote_placement_options_other_than_the_pools_are_refused():
    from rlframe.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls

    pool = small_pool(2)  # 0.25 CPU per process
    RayClassWithInitArgs(ray.remote(num_cpus=0.25, num_gpus=0)(EnvReader)).check_placement(pool)  # the same: taken
    with pytest.raises(ValueError, match=r"ray.remote\(EnvReader\) was given \{'num_cpus': 2\}.*num_cpus_per_process"):
        RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(num_cpus=2)(EnvReader)))
    with pytest.raises(ValueError, match="colocated roles share one Ray actor"):
        create_colocated_worker_cls({"env": RayClassWithInitArgs(ray.remote(max_restarts=1)(EnvReader))})
    with pytest.raises(TypeError, match="subclass of rlframe.single_controller.Worker"):
        RayClassWithInitArgs(ray.remote(type("NotAWorker", (), {})))
