"""Whether a run's vLLM engines fit their machine's memory, checked on the driver before Ray starts.

An engine too large for its machine used to be found by Ray's memory monitor, which killed a worker mid-launch
with no word about the setting behind it. The checks here refuse such a config first, naming the keys and a size
that fits; they read the model's config.json, the environment and this machine, and start nothing.

- **CPU** (vLLM's CPU build): each engine allocates its KV cache whole and keeps it for the run (no sleep mode), in
  the memory the training uses too. The cache is the user's (`engine_kwargs.vllm.kv_cache_memory_bytes`, then
  VLLM_CPU_KVCACHE_SPACE) or rlframe's: `max_num_seqs` sequences of `max_model_len` tokens, which must fit the
  worker's part of `gpu_memory_utilization` of the machine's memory (`vllm_cpu.cpu_kv_cache_bytes`, the rule the
  worker applies again when it builds its engine). Then the caches of the engines on one machine must fit in the
  memory available now (MemAvailable), and a cache must hold one sequence of `max_model_len` tokens (vLLM's own
  rule). The driver's machine stands for every node of the run.
- **GPU**: vLLM pages its KV cache, so `max_num_seqs` sequences need not fit at once; it needs room for the weights
  (per TP rank, in `rollout.dtype`, counted from the checkpoint's headers) and one sequence of `max_model_len`
  tokens within `gpu_memory_utilization` of the device. The budget taken is min(`gpu_memory_utilization` × the
  device's memory, the most any visible device has free now, before any model is loaded; on one node only: other
  nodes' GPUs are not seen from here), an upper bound of what an engine gets, so a refusal is certain. vLLM's
  activation memory is not counted. A driver without a GPU checks nothing here; the worker's engine then fails
  with vLLM's own error.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from rlframe.config.checks import planned_device
from rlframe.config.keys import ROLLOUT
from rlframe.workers.dtypes import resolve_dtype
from rlframe.workers.rollout.engine_args import model_max_position_embeddings, plain_dict, resolve_max_model_len
from rlframe.workers.rollout.vllm_cpu import (
    KV_BLOCK_TOKENS,
    cpu_kv_cache_bytes,
    gib,
    kv_bytes_per_token,
    machine_memory_bytes,
    sequence_kv_bytes,
    user_kv_cache_bytes,
)

GPU_KV_BLOCK_TOKENS = 16  # vLLM's KV block size on a GPU


def check_engine_memory(cfg, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse a `rollout.name=vllm` config whose engines cannot fit the machine, naming the keys and a fitting size
    (the vLLM engine's `check_machine`)."""
    from transformers import AutoConfig

    rollout = cfg.actor_rollout_ref.rollout
    model = cfg.actor_rollout_ref.model
    hf_config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    override = plain_dict(model.override_config) if model.override_config else None
    max_positions = model_max_position_embeddings(model.path, model.trust_remote_code, override)
    max_model_len = resolve_max_model_len(rollout.max_model_len, max_positions)
    device = planned_device(cfg.trainer.device)
    tp = int(rollout.tensor_model_parallel_size)
    bytes_per_token = kv_bytes_per_token(hf_config, resolve_dtype(rollout.dtype, device), tp)
    if device == "cpu":
        _check_cpu_config(cfg, max_model_len, bytes_per_token, environ)
    elif device == "cuda":
        from rlframe.models.reward_head import checkpoint_shapes

        num_params = sum(math.prod(shape) for shape, _ in checkpoint_shapes(model.path).values())
        memory = gpu_memory()
        if memory is None:
            return
        free, total = memory
        if int(cfg.trainer.nnodes) > 1:  # the run's GPUs are on other nodes too: their free memory is not seen
            free = total
        check_gpu_engine(
            weight_bytes=num_params * resolve_dtype(rollout.dtype, device).itemsize // tp,
            max_model_len=max_model_len,
            bytes_per_token=bytes_per_token,
            memory_fraction=float(rollout.gpu_memory_utilization),
            free_memory=free,
            total_memory=total,
        )


def gpu_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the GPU with the most free memory, read by nvidia-smi: the driver process must not
    create a CUDA context (it would hold memory on every GPU for the whole run); None where nvidia-smi cannot say."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
        readings = [tuple(int(field) * 2**20 for field in line.split(",")) for line in lines if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return max(readings) if readings else None


def _check_cpu_config(cfg, max_model_len: int, bytes_per_token: int, environ: Mapping[str, str]) -> None:
    """The CPU checks for each pool of engines: the training processes', and separate_async's rollout pool's."""
    rollout = cfg.actor_rollout_ref.rollout
    pools = [int(cfg.trainer.n_gpus_per_node)]
    if cfg.trainer.v1.trainer_mode == "separate_async" and int(rollout.nnodes) > 0:
        pools.append(int(rollout.n_gpus_per_node))
    user = user_kv_cache_bytes(plain_dict(rollout.engine_kwargs.vllm), environ)
    sizes = dict(max_num_seqs=int(rollout.max_num_seqs), max_model_len=max_model_len, bytes_per_token=bytes_per_token)
    for workers_on_machine in pools:
        if user is None:  # rlframe's size, refused over the worker's share: the rule the worker applies again
            cache = cpu_kv_cache_bytes(
                **sizes,
                memory_fraction=float(rollout.gpu_memory_utilization),
                total_memory=machine_memory_bytes(),
                workers_on_machine=workers_on_machine,
                job_model_len=int(rollout.prompt_length) + int(rollout.response_length),
            )
        else:
            cache = user[0]
        check_cpu_engines(
            cache=cache,
            source=user[1] if user else None,
            available_memory=available_memory_bytes(),
            workers_on_machine=workers_on_machine,
            **sizes,
        )


def available_memory_bytes() -> int | None:
    """This machine's MemAvailable (Linux): what can be allocated now without swapping; None when unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_cpu_engines(
    *,
    cache: int,
    source: str | None,
    max_num_seqs: int,
    max_model_len: int,
    bytes_per_token: int,
    available_memory: int | None,
    workers_on_machine: int,
) -> None:
    """Refuse CPU engines whose KV cache (the user's, set by `source`, or rlframe's when None) cannot fit: one below
    a sequence of `max_model_len`, or the node's caches over the memory available; naming the keys and a fit."""
    sequence = sequence_kv_bytes(max_model_len, bytes_per_token)
    if source is not None and cache < sequence:
        shorter = cache // sequence_kv_bytes(1, bytes_per_token) * KV_BLOCK_TOKENS
        raise ValueError(
            f"{source} gives each vLLM engine {gib(cache)} of KV cache, less than one sequence of "
            f"{ROLLOUT}.max_model_len={max_model_len} tokens needs ({gib(sequence)}). A size that fits: a larger "
            f"{source}" + (f" or {ROLLOUT}.max_model_len={shorter}" if shorter else "")
        )
    if available_memory is None or workers_on_machine * cache <= available_memory:
        return
    each = available_memory // workers_on_machine
    if source is None:
        source = f"{ROLLOUT}.max_num_seqs={max_num_seqs} × max_model_len={max_model_len}"
        fit = f"{ROLLOUT}.max_num_seqs={each // sequence}" if each >= sequence else "a smaller max_model_len"
    else:
        fit = f"{source} of at most {gib(each)}"
    raise ValueError(
        f"{workers_on_machine} vLLM engine(s) on this machine with {gib(cache)} of KV cache each ({source}) need "
        f"{gib(workers_on_machine * cache)}, but the machine has {gib(available_memory)} available now; the training "
        f"needs its own share besides. A size that fits: {fit}"
    )


def check_gpu_engine(
    *,
    weight_bytes: int,
    max_model_len: int,
    bytes_per_token: int,
    memory_fraction: float,
    free_memory: int,
    total_memory: int,
) -> int:
    """The most KV cache a GPU engine can get (an upper bound), refused when one max_model_len sequence cannot fit."""
    budget = min(int(memory_fraction * total_memory), free_memory)
    cache = budget - weight_bytes
    block = sequence_kv_bytes(1, bytes_per_token, GPU_KV_BLOCK_TOKENS)
    sequence = sequence_kv_bytes(max_model_len, bytes_per_token, GPU_KV_BLOCK_TOKENS)
    if cache >= sequence:
        return cache
    fits = []
    if cache >= block:
        fits.append(f"{ROLLOUT}.max_model_len={cache // block * GPU_KV_BLOCK_TOKENS}")
    fraction = math.ceil(100 * (weight_bytes + sequence) / total_memory) / 100
    if fraction * total_memory <= free_memory and fraction <= 1:
        fits.append(f"{ROLLOUT}.gpu_memory_utilization={fraction:.2f}")
    fits.append(f"a larger {ROLLOUT}.tensor_model_parallel_size")
    raise ValueError(
        f"a vLLM engine gets at most min({ROLLOUT}.gpu_memory_utilization={memory_fraction} × {gib(total_memory)}, "
        f"{gib(free_memory)} free now) = {gib(budget)} of the GPU; its weights take {gib(weight_bytes)}, leaving "
        f"{gib(max(cache, 0))} for the KV cache, less than one sequence of {ROLLOUT}.max_model_len={max_model_len} "
        f"tokens needs ({gib(sequence)}). A size that fits: {' or '.join(fits)}"
    )
