"""The batch plan: every batch size of one training step, computed and checked once.

User-facing sizes are global and counted in prompts (`data.train_batch_size`,
`*.ppo_mini_batch_size`) or per device (`*_per_gpu`). What one GPU actually holds depends on the
cluster shape and on two all-gathers: DP_COMPUTE_PROTO hands every worker `1 / world_size` of the
sequences, then the workers of one rollout TP group or one Ulysses SP group all-gather their shares
so that the group works on `tp×` / `sp×` as many sequences. `make_batch_plan` does this arithmetic
for every role, checks every division and bound, and raises a `ValueError` that names the keys,
their values and the equation that broke. The driver builds the plan before Ray starts; workers
read their sizes from it (`BatchPlan.from_dict(plan.to_dict())`) instead of re-deriving them.

`key_statuses` says which config keys take effect for this config and why the others do not;
`ignored_keys` picks the ones the user set on the command line, for the launch warnings.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from omegaconf import DictConfig, OmegaConf

from rlframe.utils.config import leaves
from rlframe.utils.tiny_model import BUILTIN_MODEL, TINY_SHAPE

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
REF = "actor_rollout_ref.ref"
MODEL = "actor_rollout_ref.model"
VLLM_ONLY_KEYS = ("gpu_memory_utilization", "max_num_batched_tokens", "enforce_eager", "free_cache_engine")

# ───────────────────────────── key sets per role ─────────────────────────────


@dataclass(frozen=True)
class ForwardKeys:
    """Config keys of one forward-only pass (old log-probs, ref log-probs, critic values)."""

    sp: str
    remove_padding: str
    dynamic: str
    micro: str
    max_token_len: str
    packing: str


@dataclass(frozen=True)
class UpdateKeys:
    """Config keys of one model's PPO update (actor or critic) and of its forward pass."""

    sp: str
    remove_padding: str
    mini: str
    epochs: str
    dynamic: str
    micro: str
    max_token_len: str
    packing: str
    forward: ForwardKeys


ACTOR_KEYS = UpdateKeys(
    sp=f"{ACTOR}.ulysses_sequence_parallel_size", remove_padding=f"{MODEL}.use_remove_padding",
    mini=f"{ACTOR}.ppo_mini_batch_size", epochs=f"{ACTOR}.ppo_epochs", dynamic=f"{ACTOR}.use_dynamic_bsz",
    micro=f"{ACTOR}.ppo_micro_batch_size_per_gpu", max_token_len=f"{ACTOR}.ppo_max_token_len_per_gpu",
    packing=f"{ACTOR}.packing_algorithm",
    forward=ForwardKeys(  # old log-probs: the actor model, with the rollout's log_prob_* keys
        sp=f"{ACTOR}.ulysses_sequence_parallel_size", remove_padding=f"{MODEL}.use_remove_padding",
        dynamic=f"{ROLLOUT}.log_prob_use_dynamic_bsz", micro=f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
        max_token_len=f"{ROLLOUT}.log_prob_max_token_len_per_gpu", packing=f"{ACTOR}.packing_algorithm"),
)
REF_KEYS = ForwardKeys(
    sp=f"{REF}.ulysses_sequence_parallel_size", remove_padding=f"{MODEL}.use_remove_padding",
    dynamic=f"{REF}.log_prob_use_dynamic_bsz", micro=f"{REF}.log_prob_micro_batch_size_per_gpu",
    max_token_len=f"{REF}.log_prob_max_token_len_per_gpu", packing=f"{ACTOR}.packing_algorithm",
)
CRITIC_KEYS = UpdateKeys(
    sp="critic.ulysses_sequence_parallel_size", remove_padding="critic.model.use_remove_padding",
    mini="critic.ppo_mini_batch_size", epochs="critic.ppo_epochs", dynamic="critic.use_dynamic_bsz",
    micro="critic.ppo_micro_batch_size_per_gpu", max_token_len="critic.ppo_max_token_len_per_gpu",
    packing="critic.packing_algorithm",
    forward=ForwardKeys(
        sp="critic.ulysses_sequence_parallel_size", remove_padding="critic.model.use_remove_padding",
        dynamic="critic.use_dynamic_bsz", micro="critic.forward_micro_batch_size_per_gpu",
        max_token_len="critic.forward_max_token_len_per_gpu", packing="critic.packing_algorithm"),
)

# ───────────────────────────── the plan ─────────────────────────────


@dataclass(frozen=True)
class ForwardPlan:
    """A forward-only pass (no gradients) on one DP rank: old log-probs, ref log-probs or values."""

    sequence_parallel_size: int
    dp_size: int
    sequences_per_gpu: int            # dispatched to each worker, before the SP all-gather
    sequences_per_dp: int             # held by each SP group after the all-gather
    use_dynamic_bsz: bool
    micro_batch_size: int | None      # static: sequences per forward
    num_micro_batches: int | None     # static: ceil(sequences_per_dp / micro_batch_size)
    max_token_len_per_gpu: int | None  # dynamic: the key's value
    max_token_len: int | None         # dynamic: token budget per micro-batch = per_gpu × sp
    packing_algorithm: str | None     # dynamic: kk | ffd


@dataclass(frozen=True)
class UpdatePlan:
    """One model's PPO update on one DP rank (actor or critic), and its forward pass."""

    sequence_parallel_size: int
    dp_size: int
    sequences_per_gpu: int            # dispatched to each worker, before the SP all-gather
    sequences_per_dp: int             # held by each SP group after the all-gather
    mini_batch_size: int              # prompts per optimizer step (the key)
    mini_batch_size_per_dp: int       # sequences per DP rank per optimizer step: mini × n // dp
    num_mini_batches: int             # optimizer steps per epoch: train_batch_size // mini
    ppo_epochs: int
    optimizer_steps_per_step: int     # num_mini_batches × ppo_epochs
    use_dynamic_bsz: bool
    micro_batch_size: int | None      # static: sequences per forward/backward
    grad_accum_steps: int | None      # static: mini_batch_size_per_dp // micro_batch_size
    max_token_len_per_gpu: int | None  # dynamic: the key's value
    max_token_len: int | None         # dynamic: token budget per micro-batch = per_gpu × sp
    packing_algorithm: str | None     # dynamic: kk | ffd
    forward: ForwardPlan


@dataclass(frozen=True)
class RolloutPlan:
    """Generation: each TP group gathers its workers' shares and generates them together."""

    name: str                         # hf | vllm
    tensor_parallel_size: int         # 1 for hf, which generates with the FSDP model on every worker
    dp_size: int                      # generation groups: world_size // tensor_parallel_size
    sequences_per_gpu: int            # dispatched to each worker, before the TP all-gather
    sequences_per_dp: int             # generated by one TP group after the all-gather
    micro_batch_size: int | None      # hf: sequences per generate call
    num_generate_calls: int | None    # hf: ceil(sequences_per_dp / micro_batch_size)


@dataclass(frozen=True)
class BatchPlan:
    """Every batch size of one training step, per role; build it with `make_batch_plan`."""

    nnodes: int
    n_gpus_per_node: int
    world_size: int
    train_batch_size: int             # prompts per step
    n: int                            # samples per prompt
    sequences_per_step: int           # train_batch_size × n
    max_prompt_length: int
    max_response_length: int
    max_sequence_length: int          # prompt + response: the longest sequence a micro-batch must hold
    balance_batch: bool
    balance_partitions: int           # _balance_batch splits the step into this many (actor dp) parts
    rollout: RolloutPlan
    actor: UpdatePlan
    ref: ForwardPlan | None           # None: no reference model (no KL loss, no KL in reward)
    critic: UpdatePlan | None         # None: the estimator needs no critic (only gae does)

    def to_dict(self) -> dict:
        """Plain nested dict (JSON-ready); `from_dict` rebuilds the plan on a worker."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "BatchPlan":
        """Inverse of `to_dict`."""
        def update(d):
            return None if d is None else UpdatePlan(**{**d, "forward": ForwardPlan(**d["forward"])})

        return cls(**{**data, "rollout": RolloutPlan(**data["rollout"]), "actor": update(data["actor"]),
                      "ref": None if data["ref"] is None else ForwardPlan(**data["ref"]),
                      "critic": update(data["critic"])})


@dataclass(frozen=True)
class ModelShape:
    """The few model dimensions the plan checks against (Ulysses and TP split attention heads)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int


TINY_MODEL_SHAPE = ModelShape(hidden_size=TINY_SHAPE["hidden_size"], num_attention_heads=TINY_SHAPE["num_heads"],
                              num_key_value_heads=TINY_SHAPE["num_kv_heads"])


def read_model_shape(path: str | None) -> ModelShape | None:
    """Hidden size and heads from `<path>/config.json` (or the tiny model); None when not readable."""
    if path == BUILTIN_MODEL:
        return TINY_MODEL_SHAPE
    config_file = os.path.join(path or "", "config.json")
    if not path or not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        hf = json.load(f)
    hf = hf.get("text_config") or hf  # multimodal configs nest the language model's dimensions
    heads = hf["num_attention_heads"]
    return ModelShape(hf["hidden_size"], heads, hf.get("num_key_value_heads") or heads)

# ───────────────────────────── checked arithmetic ─────────────────────────────


@dataclass(frozen=True)
class _Quantity:
    """An integer with the equation it came from, so an error can show keys, values and arithmetic."""

    value: int
    formula: str      # in key names
    numbers: str      # the same formula in values
    name: str = ""    # short name shown first ("dp", "world_size")
    where: str = ""   # equations of the named operands ("world_size = trainer.nnodes × ...")

    def equation(self) -> str:
        parts = [self.name] if self.name else []
        parts.append(self.formula)
        if self.numbers != str(self.value):
            parts.append(self.numbers)
        if self.formula != str(self.value):
            parts.append(str(self.value))
        return " = ".join(parts)

    __str__ = equation


def _paren(text: str) -> str:
    return f"({text})" if " " in text else text


def _combine(a: _Quantity, op: str, b: _Quantity, value: int, name: str = "") -> _Quantity:
    """a op b; a named operand (dp, world_size) appears by name, its own equation shown where it is checked."""
    def term(q: _Quantity) -> tuple[str, str]:
        return (q.name, str(q.value)) if q.name else (_paren(q.formula), _paren(q.numbers))

    (fa, na), (fb, nb) = term(a), term(b)
    where = ", ".join(q.equation() for q in (a, b) if q.name)
    return _Quantity(value, f"{fa} {op} {fb}", f"{na} {op} {nb}", name, where)


def _mul(a: _Quantity, b: _Quantity, name: str = "") -> _Quantity:
    return _combine(a, "×", b, a.value * b.value, name)


def _div(a: _Quantity, b: _Quantity, name: str = "") -> _Quantity:
    return _combine(a, "/", b, a.value // b.value, name)


def _get(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key, default="<missing>")
    if value == "<missing>":
        raise ValueError(f"{key} is missing from the config")
    return value


def _int(cfg: DictConfig, key: str) -> _Quantity:
    """A config key that must be a positive integer."""
    value = _get(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} = {value!r} must be a positive integer")
    return _Quantity(value, key, str(value))


def _bool(cfg: DictConfig, key: str) -> bool:
    value = _get(cfg, key)
    if not isinstance(value, bool):
        raise ValueError(f"{key} = {value!r} must be true or false")
    return value


def _divisors(n: int, limit: int = 12) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    shown = ", ".join(map(str, found[:limit]))
    return shown + (", …" if len(found) > limit else "")


def _require_multiple(total: _Quantity, parts: _Quantity, statement: str, fix: str, why: str = "") -> None:
    """Raise unless `parts` divides `total`; `statement` says what must hold, with both equations."""
    remainder = total.value % parts.value
    if remainder:
        why = f" ({why})" if why else ""
        where = "".join(f"; {q.where}" for q in (total, parts) if q.where)
        raise ValueError(f"{statement}, but {total.value} % {parts.value} = {remainder}{why}{where}. Fix: {fix}.")


def _divisor_fix(key: str, total: int) -> str:
    return f"set {key} to a divisor of {total}: {_divisors(total)}"


def _common_divisor_fix(key: str, heads: int, world: _Quantity) -> str:
    return (f"set {key} to a divisor of both num_attention_heads {heads} and world_size {world.value}: "
            f"{_divisors(math.gcd(heads, world.value))}")


def _multiple_fix(key: str, times: _Quantity, over: _Quantity) -> str:
    """How to pick `key` so that key × times is a multiple of over."""
    step = over.value // math.gcd(times.value, over.value)
    return f"make {key} a multiple of {step}"


def _sp_and_dp(cfg: DictConfig, sp_key: str, remove_padding_key: str, world: _Quantity,
               model: ModelShape | None) -> tuple[_Quantity, _Quantity]:
    """Ulysses degree and the DP size it leaves, with the SP rules checked."""
    sp = _int(cfg, sp_key)
    _require_multiple(world, sp, f"{sp} must divide {world} workers into whole Ulysses groups",
                      _divisor_fix(sp_key, world.value))
    if sp.value > 1 and not _bool(cfg, remove_padding_key):
        raise ValueError(f"{sp_key} = {sp.value} needs {remove_padding_key} = true: Ulysses slices the "
                         f"packed (unpadded) row along the sequence. Set {remove_padding_key}=true or {sp_key}=1.")
    if model is not None and model.num_attention_heads % sp.value:
        raise ValueError(f"{sp_key} = {sp.value} must divide the model's num_attention_heads = "
                         f"{model.num_attention_heads} (each Ulysses rank attends with heads / sp of them). "
                         f"Fix: {_common_divisor_fix(sp_key, model.num_attention_heads, world)}.")
    return sp, _div(world, sp, name="dp")


def _token_budget(cfg: DictConfig, key: str, sp: _Quantity, max_seq: _Quantity) -> _Quantity:
    """Dynamic micro-batching's budget: per-GPU tokens × sp (the SP group holds sp× the sequences)."""
    budget = _mul(_int(cfg, key), sp)
    if budget.value < max_seq.value:
        need = -(-max_seq.value // sp.value)
        raise ValueError(f"{budget} tokens per micro-batch cannot hold one sequence of {max_seq} tokens. "
                         f"Fix: raise {key} to at least {need}.")
    return budget


def _packing(cfg: DictConfig, key: str) -> str:
    from rlframe.seqpack import ALLOCATE_FNS

    name = _get(cfg, key)
    if name not in ALLOCATE_FNS:
        raise ValueError(f"{key} = {name!r} is not a packing algorithm; use one of {', '.join(ALLOCATE_FNS)}")
    return name


def _forward_plan(cfg: DictConfig, keys: ForwardKeys, world: _Quantity, sequences: _Quantity,
                  max_seq: _Quantity, model: ModelShape | None) -> ForwardPlan:
    sp, dp = _sp_and_dp(cfg, keys.sp, keys.remove_padding, world, model)
    per_dp = sequences.value // dp.value
    dynamic = _bool(cfg, keys.dynamic)
    micro = budget = None
    if dynamic:
        budget = _token_budget(cfg, keys.max_token_len, sp, max_seq)
    else:
        micro = _int(cfg, keys.micro).value  # forward-only: a smaller last micro-batch is fine
    return ForwardPlan(
        sequence_parallel_size=sp.value, dp_size=dp.value, sequences_per_gpu=sequences.value // world.value,
        sequences_per_dp=per_dp, use_dynamic_bsz=dynamic, micro_batch_size=micro,
        num_micro_batches=None if micro is None else -(-per_dp // micro),
        max_token_len_per_gpu=None if budget is None else budget.value // sp.value,
        max_token_len=None if budget is None else budget.value,
        packing_algorithm=_packing(cfg, keys.packing) if dynamic else None,
    )


def _update_plan(cfg: DictConfig, keys: UpdateKeys, world: _Quantity, train_batch: _Quantity, n: _Quantity,
                 max_seq: _Quantity, model: ModelShape | None) -> UpdatePlan:
    sequences = _mul(train_batch, n)
    sp, dp = _sp_and_dp(cfg, keys.sp, keys.remove_padding, world, model)
    mini = _int(cfg, keys.mini)
    _require_multiple(train_batch, mini, f"{train_batch} prompts per step must be a whole number of "
                      f"mini-batches of {mini} prompts", _divisor_fix(keys.mini, train_batch.value))
    mini_sequences = _mul(mini, n)
    _require_multiple(mini_sequences, dp, f"{mini_sequences} sequences per mini-batch must split evenly over "
                      f"{dp} ranks", _multiple_fix(keys.mini, n, dp),
                      why="every DP rank takes an equal share of each mini-batch")
    mini_per_dp = _div(mini_sequences, dp, name="mini_batch_size_per_dp")
    epochs = _int(cfg, keys.epochs)
    dynamic = _bool(cfg, keys.dynamic)
    micro = budget = None
    if dynamic:
        budget = _token_budget(cfg, keys.max_token_len, sp, max_seq)
    else:
        micro = _int(cfg, keys.micro)
        _require_multiple(mini_per_dp, micro, f"{mini_per_dp} sequences per DP rank per optimizer step must be a "
                          f"whole number of micro-batches of {micro} sequences",
                          f"{_divisor_fix(keys.micro, mini_per_dp.value)}, or set {keys.dynamic}=true",
                          why="gradient accumulation must cover the mini-batch exactly")
    num_mini = train_batch.value // mini.value
    return UpdatePlan(
        sequence_parallel_size=sp.value, dp_size=dp.value, sequences_per_gpu=sequences.value // world.value,
        sequences_per_dp=sequences.value // dp.value, mini_batch_size=mini.value,
        mini_batch_size_per_dp=mini_per_dp.value, num_mini_batches=num_mini, ppo_epochs=epochs.value,
        optimizer_steps_per_step=num_mini * epochs.value, use_dynamic_bsz=dynamic,
        micro_batch_size=None if micro is None else micro.value,
        grad_accum_steps=None if micro is None else mini_per_dp.value // micro.value,
        max_token_len_per_gpu=None if budget is None else budget.value // sp.value,
        max_token_len=None if budget is None else budget.value,
        packing_algorithm=_packing(cfg, keys.packing) if dynamic else None,
        forward=_forward_plan(cfg, keys.forward, world, sequences, max_seq, model),
    )


def _rollout_plan(cfg: DictConfig, world: _Quantity, sequences: _Quantity, model: ModelShape | None) -> RolloutPlan:
    name = str(_get(cfg, f"{ROLLOUT}.name"))
    if name not in ("hf", "vllm"):
        raise ValueError(f"{ROLLOUT}.name = {name!r} is not a rollout engine; use hf or vllm")
    tp_key = f"{ROLLOUT}.tensor_model_parallel_size"
    micro = None
    if name == "hf":
        tp = _Quantity(1, "1", "1")  # hf generates with each worker's FSDP model; the TP key has no effect
        micro = _int(cfg, f"{ROLLOUT}.micro_batch_size").value
    else:
        tp = _int(cfg, tp_key)
        _require_multiple(world, tp, f"{tp} must divide {world} workers into whole TP groups",
                          _divisor_fix(tp_key, world.value))
        if model is not None and model.num_attention_heads % tp.value:
            raise ValueError(f"{tp_key} = {tp.value} must divide the model's num_attention_heads = "
                             f"{model.num_attention_heads}. Fix: "
                             f"{_common_divisor_fix(tp_key, model.num_attention_heads, world)}.")
    dp = world.value // tp.value
    per_dp = sequences.value // dp
    return RolloutPlan(name=name, tensor_parallel_size=tp.value, dp_size=dp,
                       sequences_per_gpu=sequences.value // world.value, sequences_per_dp=per_dp,
                       micro_batch_size=micro, num_generate_calls=None if micro is None else -(-per_dp // micro))


def ref_enabled(cfg: DictConfig) -> bool:
    """A reference model is loaded for a KL loss or a KL penalty in the reward."""
    return _bool(cfg, f"{ACTOR}.use_kl_loss") or _bool(cfg, "algorithm.use_kl_in_reward")


def critic_enabled(cfg: DictConfig) -> bool:
    """Only GAE learns a value function."""
    return _get(cfg, "algorithm.adv_estimator") == "gae"


def make_batch_plan(cfg: DictConfig, model: ModelShape | None = None) -> BatchPlan:
    """Compute and check every batch size of one step; a broken rule raises ValueError naming its keys.

    `model` (see `read_model_shape`) adds the checks that depend on attention heads.
    """
    world = _mul(_int(cfg, "trainer.nnodes"), _int(cfg, "trainer.n_gpus_per_node"), name="world_size")
    train_batch = _int(cfg, "data.train_batch_size")
    n = _int(cfg, f"{ROLLOUT}.n")
    _int(cfg, f"{ROLLOUT}.val_kwargs.n")
    prompt_len, response_len = _int(cfg, "data.max_prompt_length"), _int(cfg, "data.max_response_length")
    max_seq = _combine(prompt_len, "+", response_len, prompt_len.value + response_len.value)
    sequences = _mul(train_batch, n)
    _require_multiple(
        sequences, world, f"{sequences} sequences per step must split evenly over {world} workers",
        _multiple_fix("data.train_batch_size", n, world),
        why="DP_COMPUTE_PROTO gives every worker an equal share; a remainder would be padded with "
            "copies that the update trains on")
    rollout = _rollout_plan(cfg, world, sequences, model)
    actor = _update_plan(cfg, ACTOR_KEYS, world, train_batch, n, max_seq, model)
    ref = _forward_plan(cfg, REF_KEYS, world, sequences, max_seq, model) if ref_enabled(cfg) else None
    critic = _update_plan(cfg, CRITIC_KEYS, world, train_batch, n, max_seq, model) if critic_enabled(cfg) else None
    return BatchPlan(
        nnodes=_get(cfg, "trainer.nnodes"), n_gpus_per_node=_get(cfg, "trainer.n_gpus_per_node"),
        world_size=world.value, train_batch_size=train_batch.value, n=n.value, sequences_per_step=sequences.value,
        max_prompt_length=prompt_len.value, max_response_length=response_len.value,
        max_sequence_length=max_seq.value, balance_batch=_bool(cfg, "trainer.balance_batch"),
        balance_partitions=actor.dp_size, rollout=rollout, actor=actor, ref=ref, critic=critic,
    )

# ───────────────────────────── keys in effect and ignored ─────────────────────────────


@dataclass(frozen=True)
class KeyStatus:
    """Whether a config key (or a whole section, e.g. `critic`) takes effect in this config, and why."""

    key: str
    in_effect: bool
    reason: str


def _micro_rows(cfg: DictConfig, keys: ForwardKeys | UpdateKeys, what: str) -> list[KeyStatus]:
    """Static micro size vs token budget: exactly one of the two applies."""
    if _bool(cfg, keys.dynamic):
        because = f"{keys.dynamic}=true: {what} micro-batches are cut by {keys.max_token_len}"
        return [KeyStatus(keys.micro, False, because),
                KeyStatus(keys.max_token_len, True, f"token budget per {what} micro-batch (× sp)"),
                KeyStatus(keys.packing, True, f"packs {what} micro-batches")]
    because = f"{keys.dynamic}=false: {what} micro-batches are cut by {keys.micro}"
    return [KeyStatus(keys.micro, True, f"sequences per {what} micro-batch"),
            KeyStatus(keys.max_token_len, False, because), KeyStatus(keys.packing, False, because)]


def _optim_rows(cfg: DictConfig, prefix: str) -> list[KeyStatus]:
    rows = [KeyStatus(f"{prefix}.total_training_steps", False,
                      "filled in by the trainer from the data; set trainer.total_training_steps instead")]
    steps = _get(cfg, f"{prefix}.lr_warmup_steps")
    if steps >= 0:
        rows.append(KeyStatus(f"{prefix}.lr_warmup_steps_ratio", False,
                              f"{prefix}.lr_warmup_steps={steps} (>= 0) takes precedence"))
    style = _get(cfg, f"{prefix}.warmup_style")
    if style != "cosine":
        rows.append(KeyStatus(f"{prefix}.min_lr_ratio", False, f"{prefix}.warmup_style={style}: only cosine decays"))
    return rows


def _rules(cfg: DictConfig) -> list[KeyStatus]:
    """Every rule of the form 'key K applies / has no effect because ...', in display order."""
    rows = [KeyStatus("trainer.nnodes", True, "world_size = nnodes × n_gpus_per_node"),
            KeyStatus("trainer.n_gpus_per_node", True, "world_size = nnodes × n_gpus_per_node"),
            KeyStatus("data.train_batch_size", True, "prompts per step"),
            KeyStatus(f"{ROLLOUT}.n", True, "samples per prompt"),
            KeyStatus("data.max_prompt_length", True, "longest prompt"),
            KeyStatus("data.max_response_length", True, "longest response"),
            KeyStatus(ACTOR_KEYS.mini, True, "prompts per actor optimizer step"),
            KeyStatus(ACTOR_KEYS.epochs, True, "passes over each batch"),
            KeyStatus(ACTOR_KEYS.dynamic, True, "static (sequence count) or dynamic (token budget) micro-batches"),
            *_micro_rows(cfg, ACTOR_KEYS, "actor update"),
            KeyStatus(ACTOR_KEYS.sp, True, "Ulysses degree of actor (and old log-prob) forward/backward"),
            KeyStatus(ACTOR_KEYS.remove_padding, True, "packed sequences (required by Ulysses)"),
            KeyStatus(ACTOR_KEYS.forward.dynamic, True, "old log-prob micro-batching mode"),
            *_micro_rows(cfg, ACTOR_KEYS.forward, "old log-prob")]

    name = _get(cfg, f"{ROLLOUT}.name")
    if name == "hf":
        rows.append(KeyStatus(f"{ROLLOUT}.micro_batch_size", True, "sequences per hf generate call"))
        rows.append(KeyStatus(f"{ROLLOUT}.tensor_model_parallel_size", False,
                              f"{ROLLOUT}.name=hf generates with every worker's FSDP model (tp = 1)"))
        rows += [KeyStatus(f"{ROLLOUT}.{key}", False, f"{ROLLOUT}.name=hf: a vLLM setting") for key in VLLM_ONLY_KEYS]
    else:
        rows.append(KeyStatus(f"{ROLLOUT}.tensor_model_parallel_size", True, "vLLM tensor-parallel degree"))
        rows.append(KeyStatus(f"{ROLLOUT}.micro_batch_size", False,
                              f"{ROLLOUT}.name={name}: the engine batches by max_num_batched_tokens"))

    if ref_enabled(cfg):
        rows += [KeyStatus(REF_KEYS.sp, True, "Ulysses degree of the ref forward"),
                 KeyStatus(REF_KEYS.dynamic, True, "ref log-prob micro-batching mode"),
                 *_micro_rows(cfg, REF_KEYS, "ref log-prob")]
    else:
        rows.append(KeyStatus(REF, False, f"no reference model: {ACTOR}.use_kl_loss=false and "
                                          "algorithm.use_kl_in_reward=false"))
    if not _bool(cfg, f"{ACTOR}.use_kl_loss"):
        rows += [KeyStatus(f"{ACTOR}.{key}", False, f"{ACTOR}.use_kl_loss=false")
                 for key in ("kl_loss_coef", "kl_loss_type")]
    if not _bool(cfg, "algorithm.use_kl_in_reward"):
        rows += [KeyStatus(f"algorithm.{key}", False, "algorithm.use_kl_in_reward=false")
                 for key in ("kl_penalty", "kl_ctrl")]
    elif _get(cfg, "algorithm.kl_ctrl.type") != "adaptive":
        rows += [KeyStatus(f"algorithm.kl_ctrl.{key}", False, "algorithm.kl_ctrl.type=fixed")
                 for key in ("horizon", "target_kl")]

    estimator = _get(cfg, "algorithm.adv_estimator")
    if critic_enabled(cfg):
        rows += [KeyStatus(CRITIC_KEYS.mini, True, "prompts per critic optimizer step"),
                 KeyStatus(CRITIC_KEYS.dynamic, True, "critic micro-batching mode"),
                 *_micro_rows(cfg, CRITIC_KEYS, "critic update"),
                 *[row for row in _micro_rows(cfg, CRITIC_KEYS.forward, "value") if row.key != CRITIC_KEYS.packing],
                 KeyStatus(CRITIC_KEYS.sp, True, "Ulysses degree of the critic"),
                 *_optim_rows(cfg, "critic.optim")]
    else:
        rows.append(KeyStatus("critic", False, f"algorithm.adv_estimator={estimator}: only gae trains a critic"))
        rows.append(KeyStatus("algorithm.lam", False, f"algorithm.adv_estimator={estimator}: only gae uses lambda"))
    if estimator != "grpo":
        rows.append(KeyStatus("algorithm.norm_adv_by_std_in_grpo", False, f"algorithm.adv_estimator={estimator}"))
    if not _bool(cfg, "reward_model.enable"):
        rows += [KeyStatus(f"reward_model.{key}", False, "reward_model.enable=false")
                 for key in ("model", "micro_batch_size_per_gpu")]
    rows += _optim_rows(cfg, f"{ACTOR}.optim")
    if _get(cfg, "trainer.resume_mode") != "resume_path":
        rows.append(KeyStatus("trainer.resume_from_path", False,
                              f"trainer.resume_mode={_get(cfg, 'trainer.resume_mode')} (only resume_path reads it)"))
    rows.append(KeyStatus("trainer.balance_batch", True, "Karmarkar–Karp balance across actor DP ranks"))
    # A key shared by two passes (packing_algorithm, the actor's token budget) is in effect if either uses it.
    live = {row.key for row in rows if row.in_effect}
    seen: set[str] = set()
    out = []
    for row in rows:
        if row.key not in seen and (row.in_effect or row.key not in live):
            seen.add(row.key)
            out.append(row)
    return out


_INTERPOLATION = re.compile(r"\$\{([\w.]+)\}")


def _under(key: str, section: str) -> bool:
    return key == section or key.startswith(section + ".")


def _dead_leaves(cfg: DictConfig, rows: list[KeyStatus]) -> tuple[dict[str, str], dict[str, str]]:
    """Leaves with no effect (→ reason), and ignored leaves that still feed a live one (→ consumer).

    A key that is ignored by its own rule can still matter through `${...}`: the critic's token
    budget interpolates the actor's, so with a static actor and a dynamic critic the actor key is live.
    """
    raw = leaves(OmegaConf.to_container(cfg, resolve=False))
    ignored = [row for row in rows if not row.in_effect]

    def covering(leaf: str) -> KeyStatus | None:
        return next((row for row in ignored if _under(leaf, row.key)), None)

    live = [leaf for leaf in raw if covering(leaf) is None]
    feeds: dict[str, str] = {}
    seen = set(live)
    while live:
        consumer = live.pop()
        for target in _INTERPOLATION.findall(str(raw[consumer])):
            for leaf in raw:
                if _under(leaf, target) and leaf not in seen:
                    seen.add(leaf)
                    live.append(leaf)
                    feeds[leaf] = consumer
    dead = {leaf: covering(leaf).reason for leaf in raw if leaf not in seen}
    return dead, feeds


def key_statuses(cfg: DictConfig) -> list[KeyStatus]:
    """The batch-relevant keys in effect and every key or section with no effect, with reasons.

    Pass the composed config (interpolations intact) so that a key feeding another through
    `${...}` counts as in effect.
    """
    rows = _rules(cfg)
    _, feeds = _dead_leaves(cfg, rows)
    out = []
    for row in rows:
        feeding = sorted(leaf for leaf in feeds if _under(leaf, row.key))
        if not row.in_effect and feeding:
            row = KeyStatus(row.key, True, f"feeds {feeds[feeding[0]]} through ${{{feeding[0]}}}")
        out.append(row)
    return out


def override_key(override: str) -> str | None:
    """The key a Hydra override sets (`a.b=1`, `+a.b=1`, `++a.b=1`); None for deletions (`~a.b`)."""
    text = override.strip()
    if not text or text.startswith("~") or "=" not in text:
        return None
    return text.split("=", 1)[0].lstrip("+").split("@", 1)[0]


def ignored_keys(cfg: DictConfig, overrides: list[str]) -> list[tuple[str, str]]:
    """(key, reason) for each key set in `overrides` that has no effect in this config."""
    dead, _ = _dead_leaves(cfg, _rules(cfg))
    all_leaves = leaves(OmegaConf.to_container(cfg, resolve=False))
    out = []
    for override in overrides:
        key = override_key(override)
        if key is None:
            continue
        under = [leaf for leaf in all_leaves if _under(leaf, key)] or [key]
        reasons = [dead.get(leaf) for leaf in under]
        if all(reasons):
            out.append((key, reasons[0]))
    return out


def ignored_key_warnings(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """One line per user-set key that has no effect, as printed at launch."""
    values = {override_key(o): o.split("=", 1)[1] for o in overrides if override_key(o)}
    return [f"rlframe: warning: {key}={values[key]} has no effect: {reason}"
            for key, reason in ignored_keys(cfg, overrides)]


def warn_ignored_keys(cfg: DictConfig, overrides: list[str], stream: TextIO | None = None) -> list[str]:
    """Print `ignored_key_warnings` (to stderr by default) and return them."""
    lines = ignored_key_warnings(cfg, overrides)
    for line in lines:
        print(line, file=stream or sys.stderr)
    return lines


__all__ = [
    "ACTOR_KEYS", "BatchPlan", "CRITIC_KEYS", "ForwardPlan", "KeyStatus", "ModelShape", "REF_KEYS",
    "RolloutPlan", "TINY_MODEL_SHAPE", "UpdatePlan", "critic_enabled", "ignored_key_warnings", "ignored_keys",
    "key_statuses", "make_batch_plan", "override_key", "read_model_shape", "ref_enabled", "warn_ignored_keys",
]
