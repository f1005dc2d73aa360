"""Process worlds of the tests: a free port to rendezvous on, and the two-GPU tensor-parallel world."""

from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    """A TCP port nobody listens on now, for a torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_tp2_gpu_world(rank: int, port: int):
    """This process as rank `rank` of a two-process NCCL world, shown one GPU as Ray shows it (LOCAL_RANK its index on
    the node); returns the world's tensor-parallel group."""
    os.environ.update(
        CUDA_VISIBLE_DEVICES=str(rank), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    return dist.new_group([0, 1])
