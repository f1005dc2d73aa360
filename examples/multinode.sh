#!/usr/bin/env bash
# Multi-node: start Ray on every node, then launch once from the head node.
#
#   head node:    ray start --head --port=6379
#   other nodes:  ray start --address=<head-ip>:6379
#   head node:    bash examples/multinode.sh [KEY=VALUE ...]
#
# Workers rendezvous through rank 0's node address, chosen by the worker group.
set -euo pipefail
NNODES="${NNODES:-2}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/grpo_gsm8k_qwen05b_gpu.sh" \
    trainer.ray_init.address=auto trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$GPUS_PER_NODE" "$@"
