"""separate_async's weight push: naive (Ray's object store) vs the collective push, against a memcpy floor.

    python bench/weight_push.py [--receivers 1] [--dtype float32] [--bucket-mb 2048] [--repeats 3] [--scale 1.0]
    python bench/weight_push.py --quick     # a 5% state, one repeat

A state shaped like SmolLM2-135M (random values; `--scale` shrinks the vocabulary and the layers for a quick run)
is pushed from one Ray actor (the training pool's rank 0, holding its copy of the full tensors, as `export_weights`
and `push_weights` do once they have gathered them) to `--receivers` Ray actors (rollout processes), each loading it
the way a rollout engine's `update_weights` does (a copy into its own tensors):

- naive (`checkpoint_engine.backend=naive`): rank 0 returns the state to the driver, which puts it once in Ray's
  object store for every receiver (`PoolReplicas.publish`), then each receiver loads it (`load_rollout_weights`);
- collective (`backend=nccl`; gloo on CPU): rank 0's `WeightSender` broadcasts it in buckets of `--bucket-mb` over
  the push group, each receiver loads the buckets as they arrive (`weight_push.receive_into`).

The floor is one copy of the state's bytes at this machine's memory bandwidth, measured in the same run
(`dst.copy_(src)` of a buffer of that size, best of `--repeats`): no push moves the bytes with fewer than one copy
per receiver. The table gives seconds (best of `--repeats`), the bytes, GB/s (bytes per receiver / seconds), and
each push's ratio to the floor.
"""

from __future__ import annotations

import argparse

import ray
import torch
from _common import best_of

SMOLLM2_135M = {"vocab": 49152, "hidden": 576, "intermediate": 1536, "layers": 30, "heads": 9, "kv_heads": 3}


def smollm2_state(dtype: torch.dtype, scale: float) -> dict[str, torch.Tensor]:
    """SmolLM2-135M's tensors by HF name (tied embedding once), random, `scale` times its vocabulary and layers."""
    s = SMOLLM2_135M
    vocab, layers = max(1, int(s["vocab"] * scale)), max(1, int(s["layers"] * scale))
    hidden, inter, kv = s["hidden"], s["intermediate"], s["hidden"] // s["heads"] * s["kv_heads"]
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.self_attn.q_proj.weight": (hidden, hidden),
                f"{p}.self_attn.k_proj.weight": (kv, hidden),
                f"{p}.self_attn.v_proj.weight": (kv, hidden),
                f"{p}.self_attn.o_proj.weight": (hidden, hidden),
                f"{p}.mlp.gate_proj.weight": (inter, hidden),
                f"{p}.mlp.up_proj.weight": (inter, hidden),
                f"{p}.mlp.down_proj.weight": (hidden, inter),
                f"{p}.input_layernorm.weight": (hidden,),
                f"{p}.post_attention_layernorm.weight": (hidden,),
            }
        )
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in shapes.items()}


class Engine:
    """A rollout engine's weights: `update_weights` copies what arrives into them."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.params = {name: torch.empty_like(t) for name, t in state.items()}

    def update_weights(self, named_tensors) -> None:
        for name, tensor in named_tensors:
            self.params[name].copy_(tensor)


@ray.remote(num_cpus=0)
class Trainer:
    """The training pool's rank 0, holding its copy of the full tensors."""

    def __init__(self, dtype: torch.dtype, scale: float):
        torch.set_num_threads(1)
        self.state = smollm2_state(dtype, scale)
        self.sender = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def export(self) -> dict[str, torch.Tensor]:
        return self.state

    def open(self, world_size: int, bucket_bytes: int) -> tuple[str, int]:
        from rlframe.workers.weight_push import WeightSender

        self.sender = WeightSender(world_size, torch.device("cpu"), bucket_bytes, timeout_s=600)
        return self.sender.address

    def push(self) -> int:
        self.sender.send(self.state)
        return self.sender.wait()[0]


@ray.remote(num_cpus=0)
class Rollout:
    def __init__(self, dtype: torch.dtype, scale: float):
        torch.set_num_threads(1)
        self.engine = Engine(smollm2_state(dtype, scale))
        self.group = None

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        from rlframe.workers.weight_sync import load_rollout_weights

        load_rollout_weights(self.engine, weights)

    def join(self, host: str, port: int, rank: int, world_size: int) -> None:
        from rlframe.distributed.push_group import PushGroup

        self.group = PushGroup(host, port, rank, world_size, torch.device("cpu"), timeout_s=600)

    def receive(self) -> None:
        from rlframe.workers.weight_push import receive_into

        receive_into(self.group, self.engine)

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.engine.params.values()))


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """One copy of `nbytes` in this process (one thread, as the push's copies run): the floor."""
    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # pages touched before timing
    return best_of(lambda: dst.copy_(src), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receivers", type=int, default=1, help="rollout processes")
    parser.add_argument("--dtype", default="float32", help="the actor's model_dtype (float32 on CPU, bfloat16)")
    parser.add_argument("--bucket-mb", type=int, default=2048, help="update_weights_bucket_megabytes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of SmolLM2-135M's vocabulary and layers")
    parser.add_argument("--quick", action="store_true", help="--scale 0.05 --repeats 1")
    args = parser.parse_args()
    if args.quick:
        args.scale, args.repeats = 0.05, 1
    dtype = getattr(torch, args.dtype)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer = Trainer.remote(dtype, args.scale)
        rollouts = [Rollout.remote(dtype, args.scale) for _ in range(args.receivers)]
        nbytes = ray.get(trainer.nbytes.remote())
        floor = memcpy_seconds(nbytes, args.repeats)

        def naive():
            weights = ray.get(trainer.export.remote())
            ref = ray.put(weights)
            ray.get([r.load.remote(ref) for r in rollouts])

        world = 1 + args.receivers
        host, port = ray.get(trainer.open.remote(world, args.bucket_mb * 2**20))
        ray.get([r.join.remote(host, port, 1 + i, world) for i, r in enumerate(rollouts)])

        def collective():
            ray.get([trainer.push.remote(), *[r.receive.remote() for r in rollouts]])

        rows = [("memcpy floor (one copy)", floor)]
        rows.append(("naive (Ray object store)", best_of(naive, args.repeats)))
        naive_sum = ray.get(rollouts[0].checksum.remote())
        rows.append((f"collective (gloo, {args.bucket_mb} MB buckets)", best_of(collective, args.repeats)))
        assert ray.get(rollouts[0].checksum.remote()) == naive_sum, "the two pushes loaded different weights"
    finally:
        ray.shutdown()
    print(
        f"state: SmolLM2-135M-shaped × {args.scale}, {args.dtype}, {nbytes / 1e6:.1f} MB; {args.receivers} receiver(s)"
    )
    print(f"{'path':<34} {'seconds':>8} {'MB':>8} {'GB/s':>7} {'× floor':>8}")
    for name, seconds in rows:
        print(f"{name:<34} {seconds:8.3f} {nbytes / 1e6:8.1f} {nbytes / seconds / 1e9:7.2f} {seconds / floor:8.1f}")


if __name__ == "__main__":
    main()
