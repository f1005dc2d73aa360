"""Generation with SGLang's offline engine (`sglang.Engine`), one engine per TP group, inside the training processes.

SGLang has no in-process SPMD mode like vLLM's external launcher: an `Engine` lives in one process and
spawns one scheduler process per TP rank. So rank 0 of each TP group builds the engine and its
schedulers run on the group's GPUs (`CUDA_VISIBLE_DEVICES` is set to the group's devices while the engine
is built; Ray gives each worker one), as verl 0.9.1 starts its SGLang server on its workers' devices.
The other TP ranks hold no engine: they take part in the weight sync, wait for the outcome of each of
rank 0's engine calls (`_on_rank0`) and receive the generated tokens from it.

Engine arguments come from `actor_rollout_ref.rollout` with verl 0.9.1's names and meanings
(`sglang_engine_kwargs`, a pure function); `engine_kwargs.sglang` is passed through last, as verl does.

Weight sync (`update_weights`): every TP rank holds the actor's full tensors, casts a bucket to the
rollout dtype on its own GPU and serializes CUDA IPC handles to it; rank 0 gathers the handles and
calls `Engine.update_weights_from_tensor` with one handle per TP rank (SGLang's `LocalSerializedTensor`),
so each scheduler reads the copy on its own GPU and no weight crosses a GPU boundary.

Memory around training (`free_cache_engine`), verl 0.9.1's order for every engine: `release()` frees
the KV cache and the weights (`release_memory_occupation`); `resume()` brings back the weights only,
the sync fills them, and the KV cache comes back at the next generation, so the weight copy and the KV
cache never peak together. verl 0.9.1 declares `multi_stage_wake_up` but reads it nowhere: this
staging is what it always does, and so does rlframe (the key is reported without effect).

`rollout_log_probs` are what SGLang returns with `return_logprob`: log_softmax(logits / temperature),
before top-k/top-p truncation (sglang 0.5.23 `layers/sampler.py`), which equals the actor's
log-probs when top-k/top-p are off. Greedy requests return log_softmax(logits) (temperature 1).

Sampling randomness: SGLang samples from its scheduler's own RNG, seeded once with `random_seed`
(`rollout.seed` + the group's DP index, as verl seeds vLLM replicas), so a resumed run does not repeat
the sampled tokens of an unbroken one, and the tokens depend on how requests are batched. Each request
also carries the sample's seed, keyed as the vLLM engine keys its own; SGLang reads it only in its
deterministic mode (`sampling_params_for`).

Nothing here imports sglang at module import time: it is an optional extra (`pip install 'rlframe[sglang]'`).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlframe.config.keys import ROLLOUT
from rlframe.protocol import DataProto
from rlframe.workers.rollout.base import BaseRollout, Generated, ServedModel, Stop, position_seed
from rlframe.workers.rollout.engine_args import engine_passthrough, model_max_position_embeddings, resolve_max_model_len
from rlframe.workers.rollout.sampling import SamplingParams
from rlframe.workers.rollout.spec import Capabilities, EngineSpec, check_owned_args
from rlframe.workers.rollout.tp import group_rank_and_size
from rlframe.workers.rollout.vllm_rollout import preserved_rng_state

if TYPE_CHECKING:
    from rlframe.workers.rollout.config import RolloutConfig

INSTALL_HINT = (
    "install it on a CUDA machine with `pip install 'rlframe[sglang]'` (its torch pin differs from the "
    "'gpu' extra's: use a separate environment, docs/gpu.md), or use actor_rollout_ref.rollout.name=vllm or hf"
)
WEIGHT_BUCKET_BYTES = 512 << 20  # bound on the extra GPU memory of one weight-sync step
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# SGLang samples greedily below this temperature (sglang 0.5.23 sampling_params.py, _SAMPLING_EPS);
# the actor would score such tokens at the configured temperature.
SGLANG_MIN_TEMPERATURE = 1e-6
# What release() frees: verl 0.9.1 releases these two (CUDA graphs stay) and resumes them one at a time.
RELEASED_MEMORY = ("kv_cache", "weights")
# SGLang engine arguments (ServerArgs) that rlframe sets itself, likewise: argument -> what to use instead.
RLFRAME_OWNED_SGLANG_ARGS = {
    "model_path": "actor_rollout_ref.model.path (the actor's model; the engine must be the same one)",
    "tokenizer_path": "data.tokenizer (prompts reach the engine as token ids)",
    "skip_tokenizer_init": "nothing: prompts and responses are token ids",
    "tp_size": f"{ROLLOUT}.tensor_model_parallel_size (rlframe builds the TP groups)",
    "pp_size": "nothing: the engine shards only by tensor parallelism, on the TP group's GPUs",
    "dp_size": "nothing: each DP group of training ranks runs its own engine",
    "nnodes": "nothing: a TP group's engine runs on one node",
    "node_rank": "nothing: a TP group's engine runs on one node",
    "base_gpu_id": "nothing: the engine runs on the GPUs of its TP group's ranks",
    "gpu_id_step": "nothing: the engine runs on the GPUs of its TP group's ranks",
    "dtype": f"{ROLLOUT}.dtype (the weight sync casts the actor's weights to it)",
    "random_seed": f"{ROLLOUT}.seed",
    "enable_memory_saver": f"{ROLLOUT}.free_cache_engine",
    "enable_weights_cpu_backup": f"{ROLLOUT}.free_cache_engine",
    "trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
    "json_model_override_args": "actor_rollout_ref.model.override_config (actor and engine must be the same model)",
    "context_length": f"{ROLLOUT}.max_model_len (checked against the model's max_position_embeddings)",
}


def check_sglang_engine_kwargs(engine_kwargs: dict) -> None:
    """The check of `engine_kwargs.sglang`: refuse arguments rlframe sets itself, naming what to use instead."""
    check_owned_args("sglang", RLFRAME_OWNED_SGLANG_ARGS, engine_kwargs)


def check_sglang_installed() -> None:
    """At launch: sglang importable, or a message naming the key and how to install it."""
    if importlib.util.find_spec("sglang") is None:
        raise ValueError(f"{ROLLOUT}.name=sglang needs the sglang package, which is not installed; {INSTALL_HINT}")


def check_sglang_usable(device_type: str) -> None:
    """In the worker: sglang importable and a CUDA device in use."""
    check_sglang_installed()
    if device_type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            f"{ROLLOUT}.name=sglang needs a CUDA device (trainer.device={device_type!r}, CUDA available: "
            f"{torch.cuda.is_available()}); use {ROLLOUT}.name=hf on a CPU"
        )


def check_sglang_temperature(value: float, key: str) -> None:
    """SGLang turns temperatures in (0, 1e-6) into greedy decoding; refuse them, naming the key."""
    if value == 0 or value >= SGLANG_MIN_TEMPERATURE:
        return
    raise ValueError(
        f"{key}={value}: with {ROLLOUT}.name=sglang the temperature must be 0 (greedy) or at least "
        f"{SGLANG_MIN_TEMPERATURE} (SGLang decodes greedily below it while the actor would score at {value})"
    )


def sglang_engine_kwargs(
    rollout_cfg,
    *,
    model: ServedModel,
    tp_size: int,
    dtype: torch.dtype,
    dp_rank: int,
    max_position_embeddings: int,
) -> dict:
    """`sglang.Engine(...)`'s keyword arguments from `actor_rollout_ref.rollout`.

    verl 0.9.1's mapping (`async_sglang_server.py`): gpu_memory_utilization -> mem_fraction_static,
    enforce_eager -> disable_cuda_graph, max_num_seqs -> max_running_requests, load_format, dtype, the
    memory saver with a CPU copy of the weights (so a missed weight is stale, never garbage), flashinfer
    attention unless engine_kwargs.sglang names another backend, and engine_kwargs.sglang last.
    rlframe also maps the keys verl leaves to SGLang's defaults where SGLang has the same setting:
    max_model_len -> context_length (only when set; null is the model's limit either way),
    enable_chunked_prefill/max_num_batched_tokens -> chunked_prefill_size (-1 = off) and
    max_prefill_tokens, enable_prefix_caching -> disable_radix_cache, seed (+ DP index) -> random_seed.
    """
    passthrough = engine_passthrough(rollout_cfg, "sglang", check_sglang_engine_kwargs)
    budget = int(rollout_cfg.max_num_batched_tokens)
    free_cache = bool(rollout_cfg.free_cache_engine)
    kwargs = dict(
        model_path=model.path,
        skip_tokenizer_init=True,  # token ids in, token ids out
        trust_remote_code=model.trust_remote_code,
        tp_size=tp_size,
        base_gpu_id=0,  # rank 0's schedulers see only the TP group's GPUs (module docstring)
        gpu_id_step=1,
        dtype=_DTYPE_NAMES[dtype],
        random_seed=int(rollout_cfg.seed) + dp_rank,
        load_format=str(rollout_cfg.load_format),
        mem_fraction_static=float(rollout_cfg.gpu_memory_utilization),
        max_running_requests=int(rollout_cfg.max_num_seqs),
        chunked_prefill_size=budget if rollout_cfg.enable_chunked_prefill else -1,
        max_prefill_tokens=budget,
        disable_radix_cache=not bool(rollout_cfg.enable_prefix_caching),
        disable_cuda_graph=bool(rollout_cfg.enforce_eager),
        enable_memory_saver=free_cache,
        enable_weights_cpu_backup=free_cache,
        attention_backend="flashinfer",  # verl 0.9.1's default for sglang >= 0.5.12
        json_model_override_args=json.dumps(dict(model.override_config or {})),
        log_level="error",
    )
    if rollout_cfg.max_model_len is not None:
        kwargs["context_length"] = resolve_max_model_len(rollout_cfg.max_model_len, max_position_embeddings)
    kwargs.update(passthrough)  # as in verl, engine_kwargs.sglang wins over the keys above
    return kwargs


def check_engine_argument_names(kwargs: dict, declared: Iterable[str]) -> None:
    """Every argument is one of SGLang's `ServerArgs` fields; an unknown one is named with its key."""
    unknown = sorted(set(kwargs) - set(declared))
    if unknown:
        raise ValueError(
            f"{ROLLOUT}.engine_kwargs.sglang: {', '.join(unknown)} is not an argument of this SGLang's "
            "ServerArgs; check the name against SGLang's server arguments"
        )


def server_arg_names() -> frozenset[str]:
    """The engine arguments this SGLang declares (the fields of its `ServerArgs` record)."""
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    return frozenset(field.name for field in record_fields(ServerArgs))


def max_new_tokens_for(prompt_len: int, response_length: int, max_model_len: int) -> int:
    """A request's max_new_tokens: response_length, cut to max_model_len - prompt - 1 (verl 0.9.1's SGLang rule)."""
    room = max_model_len - prompt_len - 1
    if room < 1:
        raise ValueError(
            f"a prompt of {prompt_len} tokens leaves no room to generate within {ROLLOUT}.max_model_len="
            f"{max_model_len} (SGLang keeps one position free); raise max_model_len (or null: the model's "
            "limit) or shorten prompts (data.max_prompt_length)"
        )
    return min(response_length, room)


def sampling_params_for(params: SamplingParams, eos_ids: list[int], max_new_tokens: int, seed: int) -> dict:
    """One request's SGLang sampling parameters (a plain dict of SGLang's `SamplingParams` fields).

    `seed` is the request's `sampling_seed`, which SGLang reads only in its deterministic mode
    (engine_kwargs.sglang.enable_deterministic_inference): there it would otherwise give every request
    the same seed, and the n samples of a prompt would be identical.
    """
    out = {"n": 1, "max_new_tokens": max_new_tokens, "stop_token_ids": list(eos_ids)}
    if params.greedy:
        out.update(temperature=0.0, top_p=1.0, top_k=-1)  # SGLang: temperature 0 = greedy
    else:
        check_sglang_temperature(params.temperature, f"{ROLLOUT}.temperature")
        top_k = params.top_k if params.top_k > 0 else -1
        out.update(temperature=params.temperature, top_p=params.top_p, top_k=top_k, sampling_seed=seed)
    return out


def response_from_output(output: dict, eos_ids: list[int], width: int, with_log_probs: bool):
    """(token ids, log-probs or None) of one SGLang result, at most `width` tokens, the EOS kept.

    SGLang's result is `{"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop", "matched": id}
    | {"type": "length", ...}, "output_token_logprobs": [(logprob, token_id, text), ...]}}`.
    """
    generated = [int(t) for t in output["output_ids"]]
    meta = output.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    matched = finish.get("matched")
    if finish.get("type") == "stop" and isinstance(matched, int) and matched in eos_ids:
        if not generated or generated[-1] != matched:
            generated.append(matched)  # the contract keeps the EOS token (masked in); never drop it
    generated = generated[:width]
    if not with_log_probs:
        return generated, None
    entries = meta.get("output_token_logprobs") or []
    if len(entries) < len(generated) or [int(e[1]) for e in entries[: len(generated)]] != generated:
        raise RuntimeError(
            f"SGLang returned {len(entries)} output log-probs whose token ids do not match the "
            f"{len(generated)} generated tokens; rollout_log_probs would be misaligned"
        )
    return generated, [float(e[0]) for e in entries[: len(generated)]]


def group_payloads(gathered: list[list[tuple[str, bytes]]]) -> list[tuple[str, list[bytes]]]:
    """Per-rank serialized buckets [rank][i] = (name, handle) -> [(name, [handle of each rank])]."""
    names = [name for name, _ in gathered[0]]
    for rank, bucket in enumerate(gathered[1:], start=1):
        if [name for name, _ in bucket] != names:
            raise RuntimeError(f"weight sync: TP rank {rank} sent other tensors than TP rank 0 (ranks out of step)")
    return [(name, [bucket[i][1] for bucket in gathered]) for i, name in enumerate(names)]


def visible_devices_for_group(devices: list[tuple[str, str]]) -> str:
    """The `CUDA_VISIBLE_DEVICES` of rank 0's engine: each TP rank's (host, device), in TP-rank order."""
    hosts = sorted({host for host, _ in devices})
    if len(hosts) > 1:
        raise ValueError(
            f"{ROLLOUT}.name=sglang: a TP group spans hosts {hosts}; SGLang's engine runs its TP ranks on one "
            "node, so tensor_model_parallel_size must divide trainer.n_gpus_per_node"
        )
    return ",".join(device for _, device in devices)


@contextmanager
def scoped_visible_devices(value: str | None) -> Iterator[None]:
    """Set CUDA_VISIBLE_DEVICES while SGLang spawns its schedulers; this process's CUDA is already set up."""
    if value is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _this_device_id() -> str:
    """This process's GPU as the node numbers it (Ray narrows CUDA_VISIBLE_DEVICES to it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = torch.cuda.current_device()
    return visible.split(",")[index] if visible else str(index)


class SGLangRollout(BaseRollout):
    """An SGLang engine per TP group (held by its rank 0); weights synced from the FSDP actor after each update."""

    def __init__(self, config: RolloutConfig, served: ServedModel, tokenizer, device_type: str, tp_group=None):
        check_sglang_usable(device_type)
        super().__init__(config, served, tokenizer, device_type, tp_group)
        self.tp_rank, _ = group_rank_and_size(tp_group)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp_rank, self.seed = rank // self.tp_size, int(config.seed)
        max_positions = model_max_position_embeddings(served.path, served.trust_remote_code, served.override_config)
        self.max_model_len = resolve_max_model_len(config.max_model_len, max_positions)
        kwargs = sglang_engine_kwargs(
            config,
            model=served,
            tp_size=self.tp_size,
            dtype=self.dtype,
            dp_rank=self.dp_rank,
            max_position_embeddings=max_positions,
        )
        check_engine_argument_names(kwargs, server_arg_names())
        devices = self._gather((socket.gethostname(), _this_device_id()))
        self.engine = None
        self._released = False
        self._kv_cache_asleep = False

        def build() -> None:
            import sglang

            visible = visible_devices_for_group(devices) if self.tp_size > 1 else None
            with scoped_visible_devices(visible), preserved_rng_state([self.device.index]):
                self.engine = sglang.Engine(**kwargs)

        self._on_rank0(build)

    # ------------------------------------------------------------------ TP group helpers
    def _gather(self, obj) -> list:
        """`obj` of every TP rank, in TP-rank order (on every rank)."""
        if self.tp_size == 1:
            return [obj]
        out = [None] * self.tp_size
        dist.all_gather_object(out, obj, group=self.tp_group)
        return out

    def _on_rank0(self, call):
        """Run `call` on TP rank 0, which holds the engine; every TP rank returns its result or raises.

        The peers wait for rank 0's outcome, so they neither run ahead (into training, while the engine
        still holds memory on their GPU) nor wait forever when the engine fails.
        """
        result, error = None, None
        if self.tp_rank == 0:
            try:
                result = call()
            except Exception as err:  # re-raised below, after the peers have heard of it
                error = err
        if self.tp_size > 1:
            shared = [(result, None if error is None else f"{type(error).__name__}: {error}")]
            dist.broadcast_object_list(shared, group_src=0, group=self.tp_group)
            result, message = shared[0]
            if error is None and message is not None:
                raise RuntimeError(f"the SGLang engine on TP rank 0 of this rollout group failed: {message}")
        if error is not None:
            raise error
        return result

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream full actor tensors into the engine in buckets of ~WEIGHT_BUCKET_BYTES, then drop its prefix cache."""
        bucket, bucket_bytes = [], 0
        for name, tensor in named_tensors:
            tensor = tensor.to(self.device, self.dtype if tensor.is_floating_point() else tensor.dtype)
            bucket.append((name, tensor.contiguous()))
            bucket_bytes += tensor.numel() * tensor.element_size()
            if bucket_bytes >= WEIGHT_BUCKET_BYTES:
                self._load_bucket(bucket)
                bucket, bucket_bytes = [], 0
        if bucket:
            self._load_bucket(bucket)
        del bucket
        self._on_rank0(lambda: self.engine.flush_cache())  # cached KV blocks were computed with the old weights

    def _load_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket from every TP rank's GPU into the engine; each rank keeps its tensors until it is loaded."""
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # IPC handles name the GPU by UUID: each scheduler maps it to its own index
        torch.cuda.synchronize()  # the copies must be complete before another process reads them
        handles = [(name, MultiprocessingSerializer.serialize(tensor.detach())) for name, tensor in bucket]
        gathered = self._gather(handles)

        def load() -> None:
            named = [(name, LocalSerializedTensor(values=values)) for name, values in group_payloads(gathered)]
            success, message = self.engine.update_weights_from_tensor(named, flush_cache=False)
            if not success:
                raise RuntimeError(f"SGLang refused the weight update: {message}")

        self._on_rank0(load)

    def release(self) -> None:
        """Free the KV cache and the weights (only with free_cache_engine), on every TP rank's GPU."""
        if not self.config.free_cache_engine or self._released:
            return
        self._on_rank0(lambda: self.engine.release_memory_occupation(tags=list(RELEASED_MEMORY)))
        self._released = True

    def resume(self) -> None:
        """Bring back the weights now and the KV cache at the next generation (a lower peak during the sync)."""
        if not self._released:
            return
        torch.cuda.empty_cache()  # the trainer's freed blocks stay in torch's cache otherwise
        self._on_rank0(lambda: self.engine.resume_memory_occupation(tags=["weights"]))
        self._released = False
        self._kv_cache_asleep = True

    def shutdown(self) -> None:
        """Stop the engine and its scheduler processes (rank 0); the trainer's process group stays."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        gc.collect()
        torch.cuda.empty_cache()

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts: DataProto, params: SamplingParams, eos_ids: list[int], pad_id: int, seeds):
        if self._released:
            raise RuntimeError("sglang rollout is released: call resume() (and update_weights) before generating")
        width = params.response_length
        with_log_probs = self.config.calculate_log_probs

        def generate() -> list:
            if self._kv_cache_asleep:
                self.engine.resume_memory_occupation(tags=["kv_cache"])
                self._kv_cache_asleep = False
            return self._run_engine(prompts, params, eos_ids, seeds, with_log_probs)

        # every TP rank gets the group's tokens (generate_in_tp_group keeps each rank's share)
        responses = self._on_rank0(generate)
        self._kv_cache_asleep = False
        tokens = torch.full((len(responses), width), pad_id, dtype=torch.long)
        log_probs = torch.zeros(len(responses), width) if with_log_probs else None
        lengths = torch.zeros(len(responses), dtype=torch.long)
        prompt_lengths = prompts.batch["attention_mask"].sum(-1).tolist()
        stops = torch.zeros(len(responses), dtype=torch.int8)
        for i, (generated, row_log_probs) in enumerate(responses):
            tokens[i, : len(generated)] = torch.tensor(generated, dtype=torch.long)
            lengths[i] = len(generated)
            if log_probs is not None:
                log_probs[i, : len(generated)] = torch.tensor(row_log_probs)
            # no interrupt here: an EOS, else the budget, which max_new_tokens_for may have shortened
            limited = max_new_tokens_for(int(prompt_lengths[i]), width, self.max_model_len) < width
            ended = bool(generated) and generated[-1] in eos_ids
            stops[i] = int(Stop.EOS if ended else Stop.CONTEXT_LIMIT if limited else Stop.LENGTH)
        return Generated(tokens, lengths, log_probs, stops)

    def _run_engine(self, prompts: DataProto, params: SamplingParams, eos_ids, seeds, with_log_probs: bool):
        """Rank 0: one batched `Engine.generate` over the group's prompts; per row (token ids, log-probs)."""
        ids, mask = prompts.batch["input_ids"].cpu(), prompts.batch["attention_mask"].cpu().bool()
        input_ids = [row[keep].tolist() for row, keep in zip(ids, mask)]
        if not input_ids:
            return []
        sampling = [self.request_params(params, eos_ids, seed, len(p)) for p, seed in zip(input_ids, seeds)]
        outputs = self.engine.generate(input_ids=input_ids, sampling_params=sampling, return_logprob=with_log_probs)
        width = params.response_length
        return [response_from_output(output, eos_ids, width, with_log_probs) for output in outputs]

    def request_params(self, params: SamplingParams, eos_ids: list[int], sample_seed: int, prompt_len: int) -> dict:
        """One request's sampling parameters; its seed keyed by the sample's seed and context length, as vLLM's."""
        max_new_tokens = max_new_tokens_for(prompt_len, params.response_length, self.max_model_len)
        return sampling_params_for(params, eos_ids, max_new_tokens, position_seed(sample_seed, prompt_len) & 0x7FFFFFFF)


def _check_section(rollout, path: str, root) -> None:
    """sglang installed, its sampling limits, and TP groups that fit on one node (one engine each)."""
    check_sglang_installed()
    if rollout.do_sample:
        check_sglang_temperature(rollout.temperature, f"{path}.temperature")
    if rollout.val_kwargs.do_sample:
        check_sglang_temperature(rollout.val_kwargs.temperature, f"{path}.val_kwargs.temperature")
    gpus_per_node = int(root.trainer.n_gpus_per_node)
    if gpus_per_node % rollout.tensor_model_parallel_size:
        raise ValueError(
            f"{path}.tensor_model_parallel_size={rollout.tensor_model_parallel_size} with {path}.name=sglang must "
            f"divide trainer.n_gpus_per_node={gpus_per_node}: a TP group's SGLang engine runs on one node"
        )


def _inactive(rollout, path: str, root) -> dict[str, str]:
    return {f"{path}.disable_log_stats": f"{path}.name=sglang: a vLLM setting"}


SPEC = EngineSpec(
    name="sglang",
    build=SGLangRollout,
    capabilities=Capabilities(),
    setting="an SGLang setting",
    owned_args=RLFRAME_OWNED_SGLANG_ARGS,
    check=_check_section,
    inactive=_inactive,
)
