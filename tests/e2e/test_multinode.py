"""Two simulated Ray nodes on one machine: placement across nodes and one gloo group."""

import sys

import pytest
import torch

from rlframe.single_controller import Dispatch, Worker, register

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/


class NodeWorker(Worker):
    def __init__(self):
        self.init_process_group(backend="gloo", timeout_s=120)

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self):
        import torch.distributed as dist

        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        return value.item(), dist.get_world_size()


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from rlframe.single_controller.ray import init_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    init_ray(address=cluster.address)  # the driver joins an existing cluster
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_workers_span_both_nodes_and_form_one_gloo_group(two_nodes):
    import ray

    from rlframe.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    pool = RayResourcePool([2, 2], num_cpus_per_process=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(NodeWorker), call_timeout_s=120)
    try:
        info = wg.worker_info
        nodes = [i["node_id"] for i in info]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # ranks follow the pool's nodes
        assert [i["LOCAL_RANK"] for i in info] == ["0", "1", "0", "1"]
        assert len({(i["MASTER_ADDR"], i["MASTER_PORT"]) for i in info}) == 1
        node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        assert info[0]["MASTER_ADDR"] == node_ip[nodes[0]]  # rendezvous at rank 0's node
        assert wg.all_reduce_rank() == [(6.0, 4)] * 4
    finally:
        wg.shutdown()
        pool.remove()


def test_request_larger_than_any_node_names_every_node(two_nodes):
    from rlframe.single_controller.ray import RayResourcePool

    with pytest.raises(ValueError, match=r"1 node\(s\) × \[3\].*2 alive node\(s\).*room for 2.*room for 2"):
        RayResourcePool([3], num_cpus_per_process=0.5).placement_groups()
