"""An SFT run's batch sizes, computed and checked from the config alone, before any model or data is loaded.

`python -m rlframe.trainer.sft_trainer --explain KEY=VALUE ...` prints the plan and the keys without effect and
starts nothing; a run computes the same plan first, so a config that does not divide fails before work starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlframe.config.schema import inactive_keys
from rlframe.trainer.sft_trainer.config import SFTTrainerConfig


@dataclass(frozen=True)
class SFTPlan:
    """How one step's rows are cut: over DP ranks, then into micro-batches."""

    world_size: int  # trainer.nnodes × trainer.n_gpus_per_node
    sp_size: int  # engine.ulysses_sequence_parallel_size: ranks that run the same rows
    dp_size: int  # world_size // sp_size
    rows_per_step: int  # data.train_batch_size
    rows_per_dp: int  # rows_per_step // dp_size: one optimizer step's rows on each DP rank
    use_dynamic_bsz: bool
    micro_batch_size: int | None  # static: rows per forward/backward
    fsdp_size: int  # engine.fsdp_size, checked: -1 or a divisor of the world
    num_micro_batches: int | None  # static: ceil(rows_per_dp / micro_batch_size)
    max_token_len: int | None  # dynamic: tokens per micro-batch, data.max_token_len_per_gpu × sp_size

    @classmethod
    def of(cls, config: SFTTrainerConfig) -> SFTPlan:
        """The plan of `config`; a ValueError naming the keys when they do not divide."""
        trainer, data = config.trainer, config.data
        world = trainer.nnodes * trainer.n_gpus_per_node
        sp = config.engine.ulysses_sequence_parallel_size
        if world % sp:
            raise ValueError(
                f"engine.ulysses_sequence_parallel_size={sp} must divide the world size {world} "
                f"(trainer.nnodes={trainer.nnodes} × trainer.n_gpus_per_node={trainer.n_gpus_per_node})"
            )
        fsdp_size = config.engine.fsdp_size
        if fsdp_size != -1 and (fsdp_size < 1 or world % fsdp_size):
            raise ValueError(
                f"engine.fsdp_size={fsdp_size} must be -1 (shard over all {world} ranks) or a divisor of the world "
                f"size {world} (HSDP: shard within groups of that many ranks)"
            )
        if config.model.lora_rank > 0 and config.engine.strategy == "fsdp" and world == 1:
            # FSDP1 on one rank runs NO_SHARD, whose state-dict hook fails on PEFT's names when a checkpoint is saved
            raise ValueError(
                f"model.lora_rank={config.model.lora_rank} with engine.strategy=fsdp on one process cannot save its "
                "checkpoint (FSDP1's NO_SHARD state dict); set engine.strategy=fsdp2, or launch two or more ranks"
            )
        dp = world // sp
        if data.train_batch_size % dp:
            raise ValueError(
                f"data.train_batch_size={data.train_batch_size} must be a multiple of the DP size {dp} "
                f"(world {world} / engine.ulysses_sequence_parallel_size {sp})"
            )
        rows_per_dp = data.train_batch_size // dp
        static = not data.use_dynamic_bsz
        micro = data.micro_batch_size_per_gpu if static else None
        return cls(
            world_size=world,
            sp_size=sp,
            fsdp_size=fsdp_size,
            dp_size=dp,
            rows_per_step=data.train_batch_size,
            rows_per_dp=rows_per_dp,
            use_dynamic_bsz=data.use_dynamic_bsz,
            micro_batch_size=micro,
            num_micro_batches=-(-rows_per_dp // micro) if static else None,
            max_token_len=None if static else data.max_token_len_per_gpu * sp,
        )

    def lines(self) -> list[str]:
        """The plan as a reader checks it: one line per cut."""
        out = [
            f"world {self.world_size} = dp {self.dp_size} × ulysses sp {self.sp_size}",
            f"rows per step {self.rows_per_step} (data.train_batch_size) → {self.rows_per_dp} per DP rank, "
            "balanced by tokens",
        ]
        if self.use_dynamic_bsz:
            out.append(f"micro-batches of at most {self.max_token_len} tokens (data.max_token_len_per_gpu × sp)")
        else:
            out.append(
                f"{self.num_micro_batches} micro-batch(es) of {self.micro_batch_size} rows "
                "(data.micro_batch_size_per_gpu) per optimizer step"
            )
        return out


def explain(config: SFTTrainerConfig) -> str:
    """The plan and the keys that have no effect in `config`, as `--explain` prints them."""
    lines = ["SFT batch plan:", *(f"  {line}" for line in SFTPlan.of(config).lines())]
    inactive = inactive_keys(config)
    if inactive:
        lines.append("keys without effect:")
        lines += [f"  {name}: {reason}" for name, reason in inactive.items()]
    return "\n".join(lines)
