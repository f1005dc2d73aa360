"""Exposure: a local Ray's dashboard off or on localhost only; a single-node group rendezvous over loopback.

Secrets in what a run prints or saves: tests/config/test_faults_secrets.py and tests/e2e/test_faults_secrets_run.py.
"""

from __future__ import annotations

import psutil
import pytest


@pytest.mark.slow
def test_a_local_cluster_starts_no_dashboard():
    import ray

    from rlframe.single_controller.ray import init_ray

    assert not ray.is_initialized()
    init_ray(num_cpus=1)
    try:
        listening = [
            (proc.name(), conn.laddr.port)
            for proc in psutil.Process().children(recursive=True)
            for conn in _listening(proc)
        ]
        assert listening, "no Ray process found listening at all: the check would be vacuous"
        assert not [entry for entry in listening if entry[1] == 8265], listening  # the dashboard's port
        assert not [name for name, _ in listening if name.startswith("ray::Dashboard") and "Agent" not in name]
    finally:
        ray.shutdown()


def _listening(proc):
    try:
        return [c for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return []


@pytest.mark.slow
def test_a_dashboard_asked_for_listens_on_localhost_and_ranks_rendezvous_over_loopback():
    import ray
    from helpers.ray_workers import EchoWorker

    from rlframe.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, init_ray

    assert not ray.is_initialized()
    init_ray(num_cpus=2, dashboard_host="127.0.0.1")  # trainer.ray_init.dashboard_host=127.0.0.1
    try:
        listening = [conn.laddr for proc in psutil.Process().children(recursive=True) for conn in _listening(proc)]
        http = [address for address in listening if address.port == 8265]  # the dashboard's port
        assert http, f"the dashboard is not listening on its port 8265: {listening}"
        assert all(address.ip == "127.0.0.1" for address in http), http
        pool = RayResourcePool([2], use_gpu=False)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker))
        try:
            masters = [rank["master"][0] for rank in group.whoami("rendezvous")]
            assert masters == ["127.0.0.1", "127.0.0.1"]  # one node: never a routable address
            # and no TCPStore (it would listen on every interface): the ranks meet through a file
            assert group.rendezvous_store() == ["FileStore", "FileStore"]
            port = group.whoami("port")[0]["master"][1]
            assert not [
                c for p in psutil.Process().children(recursive=True) for c in _listening(p) if c.laddr.port == port
            ]
        finally:
            group.shutdown()
            pool.remove()
    finally:
        ray.shutdown()
