"""Shared pieces of the training benchmarks: the bimodal length mix, RL batches, timing and tables.

The length mix imitates RL rollouts where some responses run to the cap and most stop early:
30% long, 70% short. The reference mix at GPU scale is long 800–2048 tokens; on a 2-core CPU the
lengths are scaled down by 4 (long 200–512, short 12–50), which keeps the padded/real token
ratio, the quantity remove-padding and dynamic batching act on, in the same range.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass

import torch

from rlframe.protocol import DataProto


@dataclass(frozen=True)
class LengthMix:
    """Response lengths: `long_fraction` uniform in `long_range`, the rest in `short_range`; prompts uniform."""

    long_fraction: float = 0.3
    long_range: tuple[int, int] = (200, 512)
    short_range: tuple[int, int] = (12, 50)
    prompt_range: tuple[int, int] = (16, 48)

    @property
    def prompt_width(self) -> int:
        return self.prompt_range[1]

    @property
    def response_width(self) -> int:
        return self.long_range[1]

    def describe(self) -> str:
        return (
            f"{self.long_fraction:.0%} long responses {self.long_range[0]}–{self.long_range[1]}, "
            f"rest {self.short_range[0]}–{self.short_range[1]}; "
            f"prompts {self.prompt_range[0]}–{self.prompt_range[1]}"
        )


CPU_MIX = LengthMix()  # GPU-scale long 800–2048 divided by 4
GPU_MIX = LengthMix(long_range=(800, 2048), short_range=(50, 200), prompt_range=(64, 256))


def sample_lengths(mix: LengthMix, num_seqs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_lens, response_lens) [num_seqs]; exactly round(long_fraction · num_seqs) are long."""
    gen = torch.Generator().manual_seed(seed)
    num_long = round(mix.long_fraction * num_seqs)
    long = torch.randint(mix.long_range[0], mix.long_range[1] + 1, (num_long,), generator=gen)
    short = torch.randint(mix.short_range[0], mix.short_range[1] + 1, (num_seqs - num_long,), generator=gen)
    responses = torch.cat([long, short])[torch.randperm(num_seqs, generator=gen)]
    prompts = torch.randint(mix.prompt_range[0], mix.prompt_range[1] + 1, (num_seqs,), generator=gen)
    return prompts, responses


def make_rl_batch(
    prompt_lens: torch.Tensor,
    response_lens: torch.Tensor,
    prompt_width: int,
    response_width: int,
    vocab_size: int,
    seed: int = 0,
) -> DataProto:
    """An actor-update batch laid out as the trainer has it: left-padded prompts, right-padded responses."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(prompt_lens)
    ids = torch.randint(3, vocab_size, (num_seqs, prompt_width + response_width), generator=gen)
    columns = torch.arange(prompt_width + response_width)
    start = prompt_width - prompt_lens[:, None]
    end = prompt_width + response_lens[:, None]
    mask = ((columns >= start) & (columns < end)).long()
    ids = ids * mask  # pad id 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    shape = (num_seqs, response_width)
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "responses": ids[:, prompt_width:],
        "old_log_probs": -6.0 + 0.3 * torch.randn(shape, generator=gen),
        "ref_log_prob": -6.0 + 0.3 * torch.randn(shape, generator=gen),
        "advantages": torch.randn(shape, generator=gen),
    }
    return DataProto.from_dict(tensors, meta_info={"temperature": 1.0})


def padding_stats(batch: DataProto) -> tuple[int, int]:
    """(real tokens, padded tokens) of a batch: valid positions vs the full [batch, width] grid."""
    mask = batch.batch["attention_mask"]
    return int(mask.sum()), mask.numel()


def add_thread_flag(parser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared machine a descheduled OpenMP thread "
        "stalls its peers at every barrier, making multi-thread timings swing 10x)",
    )


def timed(fn) -> float:
    """Wall seconds of one call of `fn`."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_of(fn, repeats: int) -> float:
    """The fewest wall seconds of `repeats` calls of `fn` (the least disturbed by the machine's other work)."""
    return min(timed(fn) for _ in range(repeats))


def median(values) -> float:
    return statistics.median(values)


def print_table(headers: list[str], rows: list[list]) -> None:
    """A plain right-aligned text table (floats printed as given: format them before)."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for k, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def tiny_causal_lm(
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    use_remove_padding: bool,
    seed: int = 0,
    intermediate_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """Random-init Qwen2 causal LM (no files), with the attention the actor would load it with."""
    from transformers import AutoModelForCausalLM

    from rlframe.distributed.attention import register_varlen_attention
    from rlframe.models.tiny import build_model_config

    config = build_model_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=8192,
    )
    attn = register_varlen_attention() if use_remove_padding else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.config.use_cache = False
    return model


def free_port() -> int:
    """A free localhost TCP port for a gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
