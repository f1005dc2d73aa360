"""Supervised fine-tuning with verl 0.9.1's SFT keys: `python -m rlframe.trainer.sft_trainer KEY=VALUE ...`.

Launched as verl's SFT trainer is: one process per device under `torchrun` (or one process alone, which starts
a process group of one). Each rank reads and tokenizes the rows (`SFTDataset`), builds the model as the PPO
actor's worker does (load, LoRA, FSDP wrap, AdamW, verl's lr schedule) and trains it with `SFTLearner`: the
actor's update with an NLL loss (rlframe.workers.sft). A step takes `data.train_batch_size` rows of a shuffled
epoch, balanced over the DP ranks by tokens (Karmarkar–Karp); the ranks of one Ulysses group take the same rows.

A checkpoint is `global_step_N/actor/` in the PPO trainer's layout: `rlframe merge` reads it, and with `hf_model`
in checkpoint.save_contents its `huggingface/` folder is a model folder `actor_rollout_ref.model.path` takes.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import socket
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

from rlframe.batch_plan import UpdatePlan
from rlframe.data.sft_dataset import SFTDataset
from rlframe.distributed.parallel_dims import ParallelDims, ParallelPlan
from rlframe.models.builtin import resolve_model_path
from rlframe.seqpack import get_seqlen_balanced_partitions
from rlframe.trainer.checkpointing import LATEST
from rlframe.trainer.sft_trainer.config import SFTTrainerConfig, sft_config
from rlframe.trainer.sft_trainer.plan import SFTPlan, explain
from rlframe.trainer.tracking import Tracking
from rlframe.utils.safe_files import remove_under
from rlframe.workers import checkpoint as ckpt
from rlframe.workers import lora
from rlframe.workers.dtypes import resolve_dtype
from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
from rlframe.workers.lr_schedule import build_lr_scheduler
from rlframe.workers.model_loading import ModelSpec, load_hf_model
from rlframe.workers.optimizer import build_optimizer
from rlframe.workers.sft import SFTLearner, sft_batch, sft_update_plan
from rlframe.workers.updater import ModelOptions, RoleModel

_STEP_DIR = re.compile(r"global_step_(\d+)$")


@contextmanager
def process_group(device_type: str):
    """torchrun's process group, or one of a single process; left as found when one is already up (tests)."""
    if dist.is_initialized():
        yield
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class SFTTrainer:
    """One rank of an SFT run: its data, its learner, and the loop of steps, validations and checkpoints."""

    def __init__(self, config: SFTTrainerConfig):
        from transformers import AutoTokenizer

        self.config = config
        data, model, trainer = config.data, config.model, config.trainer
        self.device_type = trainer.device
        self.plan = SFTPlan.of(config)
        world = dist.get_world_size()
        if self.plan.world_size != world:
            raise ValueError(
                f"trainer.nnodes={trainer.nnodes} × trainer.n_gpus_per_node={trainer.n_gpus_per_node} must equal "
                f"the launched world size {world} (torchrun --nnodes/--nproc-per-node)"
            )
        parallel = ParallelPlan(world, self.plan.sp_size, self.plan.fsdp_size)
        self.dims = ParallelDims.build(parallel, self.device_type)
        self.model_path = resolve_model_path(os.path.expanduser(model.path))
        self.tokenizer = AutoTokenizer.from_pretrained(
            model.tokenizer_path or self.model_path, trust_remote_code=model.trust_remote_code
        )
        if model.custom_chat_template is not None:
            self.tokenizer.chat_template = model.custom_chat_template
        rows = dataclasses.asdict(data)
        self.train_rows = SFTDataset(_files(data.train_files), self.tokenizer, rows, data.train_max_samples)
        self.val_rows = None
        if data.val_files:
            self.val_rows = SFTDataset(_files(data.val_files), self.tokenizer, rows, data.val_max_samples)
        self.row_lengths = self.train_rows.lengths()
        self.steps_per_epoch = len(self.train_rows) // data.train_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"data.train_batch_size={data.train_batch_size} is more than the {len(self.train_rows)} training rows"
            )
        self.total_steps = trainer.total_training_steps or self.steps_per_epoch * trainer.total_epochs
        self.learner = self._build_learner()

    def _build_learner(self) -> SFTLearner:
        """The model recipe of the PPO actor's worker: load, LoRA, FSDP, AdamW and verl's lr schedule."""
        model_cfg, engine = self.config.model, self.config.engine
        if model_cfg.external_lib:  # registers custom model classes with transformers' Auto* factories
            importlib.import_module(model_cfg.external_lib)
        torch.manual_seed(engine.seed)
        spec = ModelSpec(
            path=self.model_path,
            role="actor",
            dtype=resolve_dtype(engine.model_dtype, self.device_type),
            use_remove_padding=model_cfg.use_remove_padding,
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
            trust_remote_code=model_cfg.trust_remote_code,
            override_config=dict(model_cfg.override_config),
        )
        model = load_hf_model(spec)
        lora_spec = lora.LoraSpec.from_config(model_cfg)
        if lora_spec is not None:
            model = lora.apply_lora(model, lora_spec)
        compute = resolve_dtype(engine.dtype if self.device_type == "cuda" else "fp32", self.device_type)
        fsdp = FSDPSpec(
            strategy=engine.strategy,
            param_dtype=compute,
            reduce_dtype=torch.float32,
            param_offload=engine.param_offload,
            reshard_after_forward=engine.reshard_after_forward,
            forward_prefetch=engine.forward_prefetch,
        )
        module = wrap_fsdp(model, fsdp, self.dims.fsdp_mesh, self.device_type)
        optimizer = build_optimizer(module, self.config.optim)
        scheduler = build_lr_scheduler(optimizer, self.config.optim, self.total_steps)
        options = ModelOptions(
            use_remove_padding=model_cfg.use_remove_padding,
            use_fused_kernels=model_cfg.use_fused_kernels,
            use_torch_compile=engine.use_torch_compile and self.device_type == "cuda",
            reshard_after_forward=engine.reshard_after_forward,
        )
        return SFTLearner(RoleModel(module, options, optimizer, scheduler), self.config, self._update_plan(), self.dims)

    def _update_plan(self) -> UpdatePlan:
        plan = self.plan
        micro = None if plan.use_dynamic_bsz else plan.micro_batch_size
        return sft_update_plan(plan.rows_per_dp, self.dims, micro, plan.max_token_len, "data.max_token_len_per_gpu")

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train to the last step; the last step's metrics (with `val/loss` where validation ran)."""
        trainer = self.config.trainer
        start = self._resume()
        tracking = None
        if dist.get_rank() == 0:
            tracking = Tracking(
                trainer.project_name,
                trainer.experiment_name,
                list(trainer.logger),
                trainer.default_local_dir,
                dataclasses.asdict(self.config),
            )
            tracking.drop_steps_after(start)  # a resumed run logs the steps after its checkpoint again
            print("\n".join(f"[rlframe sft] {line}" for line in explain(self.config).splitlines()))
        metrics: dict[str, float] = {}
        for step in range(start + 1, self.total_steps + 1):
            batch, num_tokens = self._step_batch(step)
            metrics = self.learner.train_batch(batch)
            metrics["train/global_tokens"] = num_tokens
            last = step == self.total_steps
            if self.val_rows is not None and (last or (trainer.test_freq > 0 and step % trainer.test_freq == 0)):
                metrics["val/loss"] = self.validation_loss()
            if tracking is not None:
                tracking.log(metrics, step)
            if last or (trainer.save_freq > 0 and step % trainer.save_freq == 0):
                self.save(step)
        if tracking is not None:
            tracking.finish()
        return metrics

    def _step_batch(self, step: int) -> tuple:
        """This rank's rows of global step `step` (1-based) as an actor batch, and the step's tokens on all ranks."""
        size = self.config.data.train_batch_size
        epoch, index = divmod(step - 1, self.steps_per_epoch)
        order = torch.randperm(
            len(self.train_rows), generator=torch.Generator().manual_seed(self.config.trainer.seed + epoch)
        )
        rows = order[index * size : (index + 1) * size].tolist()
        lengths = [self.row_lengths[i] for i in rows]
        shares = get_seqlen_balanced_partitions(lengths, self.dims.dp_size, equal_size=True)
        mine = [rows[i] for i in shares[self.dims.dp_rank]]
        batch = sft_batch([self.train_rows[i] for i in mine], self._pad_id())
        return batch.to(self._device()), float(sum(lengths))

    def validation_loss(self) -> float:
        """Mean NLL per trained token over every validation row (all ranks)."""
        dp, rank = self.dims.dp_size, self.dims.dp_rank
        indices = list(range(rank, len(self.val_rows), dp))
        per_rank = -(-len(self.val_rows) // dp)
        chunk = self.learner.plan.mini_batch_size_per_dp
        sums = torch.zeros(2, dtype=torch.float64)
        for start in range(0, per_rank, chunk):  # the same number of calls on every rank
            wanted = range(start, min(start + chunk, per_rank))
            rows = [self.val_rows[indices[i]] if i < len(indices) else _untrained(self.val_rows[0]) for i in wanted]
            sums += self.learner.nll_sums(sft_batch(rows, self._pad_id()).to(self._device())).cpu()
        return float(sums[0] / sums[1].clamp(min=1))

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> str:
        """Write `global_step_N/actor/` through a temporary folder, then the latest pointer; prune old steps."""
        root = self.config.trainer.default_local_dir
        final = os.path.join(root, f"global_step_{step}")
        tmp = final + ".tmp"
        if dist.get_rank() == 0:
            os.makedirs(root, exist_ok=True)
            remove_under(tmp, root)
        dist.barrier()
        learner = self.learner
        ckpt.save_checkpoint(
            os.path.join(tmp, "actor"),
            learner.module,
            learner.optimizer,
            learner.lr_scheduler,
            list(self.config.checkpoint.save_contents),
            self.tokenizer,
            learner.generator,
        )
        if dist.get_rank() == 0:
            remove_under(final, root)
            os.replace(tmp, final)
            with open(os.path.join(root, LATEST + ".tmp"), "w") as f:
                f.write(str(step))
            os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
            self._prune(root)
        dist.barrier()
        return final

    def _prune(self, root: str) -> None:
        keep = self.config.trainer.max_ckpt_to_keep
        if not keep or keep <= 0:
            return
        steps = sorted(int(m.group(1)) for name in os.listdir(root) if (m := _STEP_DIR.fullmatch(name)))
        for step in steps[:-keep]:
            remove_under(os.path.join(root, f"global_step_{step}"), root)

    def _resume(self) -> int:
        """The step training resumes after (0: from the start), its checkpoint loaded (trainer.resume_mode)."""
        trainer = self.config.trainer
        if trainer.resume_mode == "disable":
            return 0
        if trainer.resume_from_path:  # verl: read by auto too, before the latest checkpoint
            folder = trainer.resume_from_path
        else:
            pointer = os.path.join(trainer.default_local_dir, LATEST)
            if not os.path.exists(pointer):
                return 0
            with open(pointer) as f:
                folder = os.path.join(trainer.default_local_dir, f"global_step_{int(f.read().strip())}")
        match = _STEP_DIR.search(os.path.normpath(folder))
        if match is None or not os.path.isdir(os.path.join(folder, "actor")):
            raise ValueError(
                f"trainer.resume_from_path={folder!r} is not an SFT checkpoint (a global_step_N folder with actor/)"
            )
        learner = self.learner
        ckpt.load_checkpoint(
            os.path.join(folder, "actor"),
            learner.module,
            learner.optimizer,
            learner.lr_scheduler,
            list(self.config.checkpoint.load_contents),
            learner.generator,
        )
        return int(match.group(1))

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else 0  # a pad slot is masked out; its id only has to exist

    def _device(self) -> str:
        return "cpu" if self.device_type == "cpu" else f"cuda:{torch.cuda.current_device()}"


def _files(value) -> list[str]:
    files = [value] if isinstance(value, str) else list(value)
    return [os.path.expanduser(str(f)) for f in files]


def _untrained(row: dict) -> dict:
    """`row` with nothing to train: fills a rank's last validation call when the rows ran out first."""
    return {**row, "loss_mask": torch.zeros_like(row["loss_mask"])}


def run_sft(config: SFTTrainerConfig) -> dict[str, float]:
    """Train `config` in this process (a torchrun rank, or alone); the last step's metrics."""
    with process_group(config.trainer.device):
        return SFTTrainer(config).fit()


def main(argv: list[str] | None = None) -> None:
    """The command line: verl's `key=value` overrides of sft_trainer_engine.yaml; `--explain` prints the plan only."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--explain" in argv:
        print(explain(sft_config([arg for arg in argv if arg != "--explain"])))
        return
    run_sft(sft_config(argv))
