"""CPU generation pooled on one rank: the ranks of one machine generate their rows together, on the first.

On a CPU a decoding step reads every weight of the model once for the whole batch, so two processes that
each decode half of the rows read the weights twice per step, each with one core's share of the memory
bandwidth, while one process decoding all the rows with both cores' threads reads them once: measured on
SmolLM2-135M, 32 new tokens after 128, 8 rows on 1 thread took 7.2 s, 16 rows on 2 threads 5.7 s
(docs/benchmarks.md §5). So with the HF engine on CPU (no TP) and every rank on one machine, each rank
sends its prompts to rank 0 of the group, which generates them all with the threads of every rank while
the others wait in the collective (a gloo wait sleeps), and sends each rank its rows back. Their weight
sync only sends their shards on (the rank that generates holds the only replica in use). When the model
fits in a core's cache, decoding costs Python's per-step overhead, not memory traffic, and pooling would
only add its collectives: `pools_generation` decides (`actor_rollout_ref.rollout.pool_cpu_generation`).

The samples are the ones each rank would have drawn alone: a rank draws its rows' sample seeds exactly as
`generate_in_tp_group` does (one draw of its own torch RNG, seeded per call with its rank), they travel
with the rows (`sample_seed`), and a row's tokens depend only on its prompt, its seed and the weights
(`position_seed`), not on the batch it is generated in. Only the floating-point rounding of the logits
follows the batch (its padding): `rollout_log_probs` agree to a few ulps, and a token could differ only
if its uniform draw fell within that rounding of a boundary between two tokens' probabilities.

Generation can take longer than the process group's timeout (`nccl_timeout`, 600 s by default), which bounds
every collective: so the other ranks do not wait in one. They poll the group's store instead (`_Heartbeat`),
where rank 0 adds a beat every `HEARTBEAT_S` while it generates and marks its results ready; they enter the
scatter only then, and it returns at once. A rank 0 that dies or hangs stops beating: after
`MISSED_HEARTBEATS` beats missed in a row (or at once, when the store itself went with it) the waiting
ranks raise an error that names rank 0 and what it was doing, instead of hanging or timing out.
"""

from __future__ import annotations

import contextlib
import glob
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from rlframe.distributed.shm_gather import SharedMemoryGroups
from rlframe.protocol import DataProto, all_gather_data_proto
from rlframe.workers.rollout.base import SEED_KEY, Rollout, call_seed, response_metrics, seeded

HEARTBEAT_S = 5.0  # rank 0 beats this often while it generates
MISSED_HEARTBEATS = 6  # beats missed in a row (30 s) before the waiting ranks give rank 0 up
# the waiting ranks ask the store whether rank 0 is ready at most this far apart: a check is one small store request
# (tens of microseconds), and every millisecond of delay is added to every pooled generation (a longer pause, 0.5 s,
# made the quickstart's generation phase 0.45 -> 0.67 s)
POLL_MAX_S = 0.01


def pools_generation(
    setting: bool | None, weight_bytes: int, group, shared_memory: SharedMemoryGroups | None = None
) -> bool:
    """Whether the ranks of `group` pool their generation (`rollout.pool_cpu_generation`, on CPU without TP).

    Only when every rank runs on this machine. `None` (the default) pools when the weights do not fit in a
    core's L2 cache: then every decoding step streams them from memory, and one stream for all the rows
    beats one per rank; a model that fits (the tiny built-ins) decodes at the speed of Python's per-step
    overhead, and pooling would only add its collectives. A collective: every rank calls it alike.
    `shared_memory` is the worker's (what its groups agreed on); without it the group is asked afresh.
    """
    if setting is False or not ranks_share_a_machine(group, shared_memory):
        return False
    return setting is True or weight_bytes > l2_cache_bytes()


def ranks_share_a_machine(group, shared_memory: SharedMemoryGroups | None = None) -> bool:
    """Every rank of `group` runs on this machine (`SharedMemoryGroups.ranks_share_a_machine`)."""
    return (shared_memory if shared_memory is not None else SharedMemoryGroups()).ranks_share_a_machine(group)


def l2_cache_bytes() -> int:
    """The L2 cache of CPU 0 (Linux sysfs); 1 MiB when the system does not say."""
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(f"{index}/level") as level, open(f"{index}/size") as size:
                if level.read().strip() == "2":
                    text = size.read().strip().upper()
                    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
                    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except (OSError, ValueError):
            break
    return 1 << 20


def generate_pooled(rollout: Rollout, prompts: DataProto, group) -> DataProto:
    """This rank's rows, generated by rank 0 of `group` together with every other rank's (see the module)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    with seeded(call_seed(dist.get_rank())):  # generate_in_tp_group's draws, TP=1
        seeds = rollout.sample_seeds(len(prompts))
    prompts.non_tensor_batch[SEED_KEY] = np.array(seeds, dtype=object)
    counts = [None] * size
    dist.all_gather_object(counts, len(prompts), group=group)
    every = all_gather_data_proto(prompts, group)
    prompts.non_tensor_batch.pop(SEED_KEY)
    shares = [None]
    heartbeat = _Heartbeat(group)
    if rank == 0:
        try:
            with heartbeat.beating(), _threads(size * torch.get_num_threads()):
                output = rollout.generate_sequences(every)
        except BaseException as error:  # the others wait for their rows: tell them, so that no rank hangs
            dist.scatter_object_list(shares, [f"{type(error).__name__}: {error}"] * size, group_src=0, group=group)
            raise
        output.non_tensor_batch.pop(SEED_KEY, None)
        bounds = np.cumsum([0, *counts]).tolist()
        parts = [output.select_idxs(slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
        for part in parts:
            part.meta_info = output.meta_info
        dist.scatter_object_list(shares, parts, group_src=0, group=group)
    else:
        heartbeat.wait_for_rank_0(f"generating the {sum(counts)} rows of the {size} ranks of this machine")
        dist.scatter_object_list(shares, None, group_src=0, group=group)
    share = shares[0]
    if isinstance(share, str):
        raise RuntimeError(
            f"pooled generation failed on rank 0 of the machine (it generates every rank's rows): {share}"
        )
    # length statistics describe this rank's rows; timing and throughput the pooled generation
    metrics = dict(share.meta_info["metrics"])
    eos_ids, _ = rollout.special_tokens_for(prompts.meta_info)
    metrics.update(response_metrics(share.batch["response_mask"], share.batch["responses"], eos_ids))
    share.meta_info = {"metrics": metrics}
    return share


class _Heartbeat:
    """Rank 0's beats and "ready" mark for one pooled generation, in the group's store (see the module).

    Keys are per call (`add` reads the beat counter without blocking, `check` whether "ready" is set); a call
    removes the previous call's keys, which every rank has passed since (they all took part in this call's
    gathers). The waiters poll at growing intervals, 1 ms to POLL_MAX_S: a generation is never held up by more than
    that, and a long one costs a hundred small store requests a second.
    """

    calls: dict[str, int] = {}  # pooled generations so far, per group name

    def __init__(self, group):
        name = group.group_name
        call = self.calls[name] = self.calls.get(name, 0) + 1
        self.store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank reaches
        self.beat_key, self.ready_key = f"rlframe/pool/{name}/{call}/beat", f"rlframe/pool/{name}/{call}/ready"
        if dist.get_rank(group) == 0 and call > 1:
            for key in (f"rlframe/pool/{name}/{call - 1}/beat", f"rlframe/pool/{name}/{call - 1}/ready"):
                self.store.delete_key(key)

    @contextlib.contextmanager
    def beating(self):
        """Rank 0: beat every HEARTBEAT_S inside the block (a thread), then mark the results ready."""
        stop = threading.Event()

        def beat():
            while not stop.wait(HEARTBEAT_S):
                self.store.add(self.beat_key, 1)

        thread = threading.Thread(target=beat, name="rlframe-pool-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:  # ready with rows or with an error: either way the others enter the scatter
            stop.set()
            thread.join()
            self.store.set(self.ready_key, b"1")

    def wait_for_rank_0(self, doing: str) -> None:
        """The other ranks: poll until rank 0 is ready, however long; raise once it stopped beating."""
        beats, last_beat, pause = 0, time.monotonic(), 0.001
        while True:
            try:
                if self.store.check([self.ready_key]):
                    return
                now_beats = self.store.add(self.beat_key, 0)
            except RuntimeError as error:  # the store went with rank 0's process (DistError is one)
                raise RuntimeError(
                    f"pooled generation: rank 0 of the machine died while {doing} (its store is gone: {error})"
                ) from error
            if now_beats != beats:
                beats, last_beat = now_beats, time.monotonic()
            elif time.monotonic() - last_beat > MISSED_HEARTBEATS * HEARTBEAT_S:
                raise RuntimeError(
                    f"pooled generation: rank 0 of the machine stopped beating while {doing}: "
                    f"{MISSED_HEARTBEATS} heartbeats of {HEARTBEAT_S:g} s missed, so it died or hangs "
                    "(see its log for why)"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)


@contextlib.contextmanager
def _threads(count: int):
    """torch's intra-op threads set to `count` inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
