"""Worker checkpoints through PyTorch Distributed Checkpoint: resharding, plain-data loading, clear errors.

A checkpoint is saved after two AdamW steps at one world size and strategy and loaded into a fresh
model and optimizer at another. "Equal" across world sizes means: the full (unsharded) parameters
and the full optimizer state after loading are bitwise the ones saved, the loss of a fixed batch is
bitwise the same, the lr scheduler continues where it was, and rank r's RNG streams are saved rank
r % saved_world's. Single-process pieces run in the test process; multi-process ones on gloo.
"""

from __future__ import annotations

import os
import pickle
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from helpers.world import spawned_world

from rlframe.distributed.parallel_dims import build_fsdp_mesh
from rlframe.utils.manifest import write_manifest
from rlframe.workers import checkpoint as ckpt
from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
from rlframe.workers.model_loading import ModelSpec, load_hf_model

TRAIN_STEPS = 2


@dataclass(frozen=True)
class Layout:
    world: int
    strategy: str = "fsdp2"  # fsdp2 | fsdp | none (plain module, no process group)
    fsdp_size: int = -1  # -1: shard over all ranks; else HSDP

    def __str__(self) -> str:
        hsdp = f"-hsdp{self.fsdp_size}" if self.fsdp_size != -1 else ""
        return f"{self.strategy}{hsdp}x{self.world}"


# ---------------------------------------------------------------- one rank's work
def build(layout: Layout, model_path: str):
    """The tiny actor wrapped as `layout` says, with AdamW, a LambdaLR and a shuffle generator."""
    torch.manual_seed(0)
    model = load_hf_model(ModelSpec(path=model_path, role="actor", dtype=torch.float32, use_remove_padding=False))
    if layout.strategy != "none":
        mesh = build_fsdp_mesh("cpu", layout.world, layout.fsdp_size)
        model = wrap_fsdp(model, FSDPSpec(layout.strategy, torch.float32, torch.float32, False, True), mesh, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return model, optimizer, scheduler, torch.Generator().manual_seed(0)


def fixed_batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


def train(model, optimizer, scheduler, generator, rank: int) -> None:
    """A few AdamW steps (every rank the same data) so that parameters and moments are non-trivial."""
    vocab = model.config.vocab_size
    for step in range(TRAIN_STEPS):
        ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(100 + step))
        loss_of(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        torch.randperm(8, generator=generator)
    torch.manual_seed(1000 + rank)  # distinct per-rank RNG streams, as after generation in a real run
    import random

    import numpy as np

    random.seed(2000 + rank)
    np.random.seed(3000 + rank)


def full_state(model, optimizer) -> dict:
    """Full parameters and optimizer state on CPU (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    params = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    return {
        "params": {k: v.detach().cpu().clone() for k, v in params.items()},
        "optim": {
            "state": {fqn: {k: v.detach().cpu().clone() for k, v in s.items()} for fqn, s in optim["state"].items()},
            "param_groups": optim["param_groups"],
        },
    }


def rng_snapshot(generator) -> dict:
    import random

    import numpy as np

    return {
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
        "numpy": torch.from_numpy(np.random.get_state()[1].astype("int64")),
        "random": torch.tensor(random.getstate()[1]),
    }


def rank_record(rank: int, phase: str, layout: Layout, model_path: str, ckpt_dir: str) -> dict:
    """Save (after training) or load a checkpoint at `layout`: what the test compares."""
    model, optimizer, scheduler, generator = build(layout, model_path)
    if phase == "save":
        train(model, optimizer, scheduler, generator, rank)
        record = {"rng": rng_snapshot(generator)}
        ckpt.save_checkpoint(
            ckpt_dir,
            model,
            optimizer,
            scheduler,
            ("model", "optimizer", "extra"),
            generator=generator,
        )
    else:
        ckpt.load_checkpoint(ckpt_dir, model, optimizer, scheduler, generator=generator)
        record = {"rng": rng_snapshot(generator)}
    record["lr_scheduler"] = scheduler.state_dict()
    record["lr"] = optimizer.param_groups[0]["lr"]
    record["full"] = full_state(model, optimizer)
    with torch.no_grad():
        record["loss"] = loss_of(model, fixed_batch(model.config.vocab_size))
    if rank != 0:
        record.pop("full")
    return record


def run_ranks(phase: str, layout: Layout, model_path: str, ckpt_dir: str) -> list[dict]:
    """`rank_record` on every rank of `layout`: a session's gloo world, or, for the plain module, a fresh process
    without a process group."""
    if layout.strategy == "none":
        with ProcessPoolExecutor(1, mp_context=torch.multiprocessing.get_context("spawn")) as pool:
            return [pool.submit(_plain_record, phase, layout, model_path, ckpt_dir).result()]
    return spawned_world(layout.world).run(rank_record, phase, layout, model_path, ckpt_dir)


def _plain_record(*args) -> dict:
    torch.set_num_threads(1)
    return rank_record(0, *args)


# ---------------------------------------------------------------- resharding
SAVED = {
    "fsdp2x2": Layout(2),
    "fsdp2x1": Layout(1),
    "fsdpx2": Layout(2, "fsdp"),
    "fsdp2-hsdp2x4": Layout(4, fsdp_size=2),
}
# shrink, grow (from one rank and to four), FSDP1 -> FSDP2, HSDP (FSDP2) -> FSDP1, sharded -> plain module
CASES = [
    ("fsdp2x2", Layout(1)),
    ("fsdp2x1", Layout(2)),
    ("fsdp2x2", Layout(4)),
    ("fsdpx2", Layout(2)),
    ("fsdp2-hsdp2x4", Layout(2, "fsdp")),
    ("fsdp2x2", Layout(1, "none")),
]


@pytest.fixture(scope="module")
def saved(tiny_model_path, tmp_path_factory):
    """Each saved layout's checkpoint folder and per-rank records, written once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            root = tmp_path_factory.mktemp(f"saved_{name}")
            records = run_ranks("save", SAVED[name], tiny_model_path, str(root / "ckpt"))
            cache[name] = (str(root / "ckpt"), records)
        return cache[name]

    return get


def assert_same_tree(a, b, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values are bitwise equal."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.slow
@pytest.mark.parametrize("source,target", CASES, ids=[f"{s}-to-{t}" for s, t in CASES])
def test_checkpoint_loads_at_another_world_size_and_strategy(saved, tiny_model_path, source, target):
    ckpt_dir, before = saved(source)
    after = run_ranks("load", target, tiny_model_path, ckpt_dir)
    assert_same_tree(after[0]["full"]["params"], before[0]["full"]["params"], "params")
    assert_same_tree(after[0]["full"]["optim"], before[0]["full"]["optim"], "optimizer")
    saved_world = len(before)
    for rank, record in enumerate(after):
        assert torch.equal(record["loss"], before[0]["loss"]), f"rank {rank}: loss of the fixed batch differs"
        assert record["lr"] == before[0]["lr"] and record["lr_scheduler"] == before[0]["lr_scheduler"]
        assert_same_tree(record["rng"], before[rank % saved_world]["rng"], f"rank {rank} rng")
    # the offline reader sees the same full tensors (what an HF merge of the checkpoint would write)
    assert_same_tree(ckpt.read_full_tensors(os.path.join(ckpt_dir, "model")), before[0]["full"]["params"], "offline")
    offline_optim = ckpt.read_full_tensors(os.path.join(ckpt_dir, "optimizer"))
    expected = {
        f"state.{fqn}.{key}": value
        for fqn, state in before[0]["full"]["optim"]["state"].items()
        for key, value in state.items()
    }
    assert_same_tree(offline_optim, expected, "offline optimizer")


# ---------------------------------------------------------------- single process: plain data, clear errors
@pytest.fixture
def plain_checkpoint(tiny_model_path, tmp_path):
    """A checkpoint of the plain (unsharded) tiny model, saved in this process without a process group."""
    model, optimizer, scheduler, generator = build(Layout(1, "none"), tiny_model_path)
    train(model, optimizer, scheduler, generator, 0)
    path = str(tmp_path / "ckpt")
    ckpt.save_checkpoint(path, model, optimizer, scheduler, ("model", "optimizer", "extra"), generator=generator)
    return path


def test_layout_is_dcp_folders_and_plain_extra_state(plain_checkpoint):
    assert sorted(os.listdir(plain_checkpoint)) == ["extra_state", "model", "optimizer"]
    assert ".metadata" in os.listdir(os.path.join(plain_checkpoint, "model"))
    extra = torch.load(os.path.join(plain_checkpoint, "extra_state", "rank_0.pt"), weights_only=True)
    assert extra["world_size"] == 1 and extra["lr_scheduler"]["last_epoch"] == TRAIN_STEPS


def test_rng_state_round_trips_through_plain_data():
    import random

    import numpy as np

    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    state = ckpt.rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    ckpt.set_rng_state(state)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


class _RunsCode:
    """Unpickling this calls os.system: what a crafted checkpoint file would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_pickle_in_extra_state_is_refused(plain_checkpoint, tiny_model_path, tmp_path):
    marker = tmp_path / "pwned"
    torch.save(
        {"world_size": 1, "rng": _RunsCode(str(marker))}, os.path.join(plain_checkpoint, "extra_state", "rank_0.pt")
    )
    model, optimizer, scheduler, generator = build(Layout(1, "none"), tiny_model_path)
    with pytest.raises(pickle.UnpicklingError, match="rank_0.pt is not plain data"):
        ckpt.load_checkpoint(plain_checkpoint, model, optimizer, scheduler, generator=generator)
    assert not marker.exists()


def test_crafted_dcp_metadata_is_refused(plain_checkpoint, tiny_model_path, tmp_path):
    marker = tmp_path / "pwned"
    with open(os.path.join(plain_checkpoint, "model", ".metadata"), "wb") as f:
        pickle.dump(_RunsCode(str(marker)), f)
    model, optimizer, scheduler, generator = build(Layout(1, "none"), tiny_model_path)
    with pytest.raises(pickle.UnpicklingError, match="not part of a checkpoint index"):
        ckpt.load_checkpoint(plain_checkpoint, model, optimizer, scheduler, generator=generator)
    with pytest.raises(pickle.UnpicklingError, match="not part of a checkpoint index"):
        ckpt.read_full_tensors(os.path.join(plain_checkpoint, "model"))
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:Detected an existing checkpoint")
def test_crafted_non_tensor_value_in_dcp_is_refused(tiny_model_path, tmp_path):
    # DCP stores non-tensor values (optimizer hyperparameters) with torch.save; torch loads them with
    # weights_only=False by default. A checkpoint whose "lr" runs code must be refused.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, optimizer, scheduler, generator = build(Layout(1, "none"), tiny_model_path)
    train(model, optimizer, scheduler, generator, 0)
    path = tmp_path / "ckpt"
    ckpt.save_checkpoint(str(path), model, optimizer, scheduler, ("model", "optimizer"))
    crafted = get_optimizer_state_dict(model, optimizer)
    marker = tmp_path / "pwned"
    crafted["param_groups"][0]["lr"] = _RunsCode(str(marker))
    dcp.save(crafted, checkpoint_id=str(path / "optimizer"), no_dist=True)
    with pytest.raises(RuntimeError, match="is not plain data"):
        ckpt.load_checkpoint(str(path), model, optimizer, scheduler)
    assert not marker.exists()


def test_incomplete_folder_names_the_folder_and_the_missing_file(plain_checkpoint, tiny_model_path, tmp_path):
    model, optimizer, scheduler, generator = build(Layout(1, "none"), tiny_model_path)
    os.remove(os.path.join(plain_checkpoint, "optimizer", ".metadata"))
    missing = r"optimizer/\.metadata is missing \(optimizer/ holds \['__0_0\.distcp'\]\)"
    with pytest.raises(FileNotFoundError, match=rf"{plain_checkpoint} is not a complete checkpoint: {missing}"):
        ckpt.load_checkpoint(plain_checkpoint, model, optimizer, scheduler)
    shutil.rmtree(os.path.join(plain_checkpoint, "optimizer"))  # allowed: save_contents may leave it out
    os.remove(os.path.join(plain_checkpoint, "extra_state", "rank_0.pt"))
    torch.save({}, os.path.join(plain_checkpoint, "extra_state", "rank_1.pt"))
    with pytest.raises(
        FileNotFoundError,
        match=r"extra_state/ should hold rank_0\.pt .. rank_<W-1>\.pt but has "
        r"ranks \[1\]",
    ):
        ckpt.load_checkpoint(plain_checkpoint, model, None, scheduler, load_contents=("extra",))
    with pytest.raises(FileNotFoundError, match=rf"checkpoint folder {tmp_path / 'nowhere'} does not exist"):
        ckpt.load_checkpoint(str(tmp_path / "nowhere"), model)


def load_and_report(rank: int, layout: Layout, model_path: str, ckpt_dir: str) -> str | None:
    """Load the checkpoint at `layout`; the error this rank raised, or None (returning at all: no rank waits)."""
    model, optimizer, scheduler, generator = build(layout, model_path)
    try:
        ckpt.load_checkpoint(ckpt_dir, model, optimizer, scheduler, generator=generator)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_nan_in_a_loaded_shard_is_named_by_the_rank_holding_it(plain_checkpoint, tiny_model_path, strategy):
    model, optimizer, scheduler, generator = build(Layout(1, "none"), tiny_model_path)
    ckpt.load_checkpoint(plain_checkpoint, model, optimizer, scheduler, generator=generator)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")  # row 0: rank 0's shard at world size 2
    ckpt.save_checkpoint(plain_checkpoint, model, optimizer, scheduler, generator=generator)
    reports = spawned_world(2).run(load_and_report, Layout(2, strategy), tiny_model_path, plain_checkpoint)
    assert reports[1] is None
    assert reports[0].startswith(f"{plain_checkpoint}/model: tensor 'model.norm.weight' holds 1 NaN/inf value(s)")


def test_hf_export_replaces_an_old_folder_and_refuses_a_symlink(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlframe.utils.safe_files import UnsafePathError

    model, *_ = build(Layout(1, "none"), tiny_model_path)
    out = tmp_path / "step" / "actor" / "huggingface"
    out.mkdir(parents=True)
    (out / "stale.bin").write_text("an earlier export")
    ckpt.export_hf(str(out), model)
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(exported[name], value) for name, value in model.state_dict().items())
    assert "stale.bin" not in os.listdir(out) and os.listdir(out.parent) == ["huggingface"]
    shutil.rmtree(out)
    os.symlink(tmp_path, out)
    with pytest.raises(UnsafePathError, match=f"{out} is a symlink"):
        ckpt.export_hf(str(out), model)
    assert sorted(os.listdir(tmp_path)) == ["step"] and os.listdir(out.parent) == ["huggingface"]


def test_old_per_rank_layout_is_refused_with_a_clear_message(tiny_model_path, tmp_path):
    old = tmp_path / "actor"
    old.mkdir()
    torch.save({}, old / "model_world_size_2_rank_0.pt")
    model, *_ = build(Layout(1, "none"), tiny_model_path)
    with pytest.raises(ValueError, match="per-rank torch.save files .* a layout rlframe no longer reads"):
        ckpt.load_checkpoint(str(old), model)


# ---------------------------------------------------------------- the trainer's data.pt
class _RecordingGroup:
    """Stands in for a worker group: records the folders it was asked to save to / load from."""

    def __init__(self):
        self.calls = []

    def save_checkpoint(self, path):
        os.makedirs(path)
        self.calls.append(("save", path))

    def load_checkpoint(self, path):
        self.calls.append(("load", path))


class _Loader:
    def __init__(self, state):
        self.state, self.loaded = state, None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


def _checkpointer(root):
    from types import SimpleNamespace

    from rlframe.trainer.checkpointing import TrainerCheckpointer

    return TrainerCheckpointer(
        SimpleNamespace(
            default_local_dir=str(root),
            resume_mode="auto",
            resume_from_path=None,
            max_actor_ckpt_to_keep=None,
            max_critic_ckpt_to_keep=None,
        )
    )


def test_data_pt_is_plain_data_and_round_trips(tmp_path):
    import numpy as np

    # a StatefulDataLoader-like state (a sampler's generator state is a uint8 tensor) and a numpy KL coefficient
    sampler = {"generator": torch.Generator().manual_seed(3).get_state(), "yielded": 8}
    loader_state = {"_num_yielded": 2, "_sampler_iter_state": sampler, "dataset_state": None}
    checkpointer = _checkpointer(tmp_path)
    driver_state = {"global_step": 1, "kl_coef": np.float64(0.05)}
    checkpointer.save(1, _RecordingGroup(), None, _Loader(loader_state), driver_state)
    actor, loader = _RecordingGroup(), _Loader(None)
    driver = checkpointer.maybe_resume(actor, None, loader)
    assert driver == {"global_step": 1, "kl_coef": 0.05} and type(driver["kl_coef"]) is float
    assert_same_tree(loader.loaded, loader_state, "dataloader")
    assert actor.calls == [("load", str(tmp_path / "global_step_1" / "actor"))]


def test_data_pt_refuses_what_a_weights_only_load_would_refuse_at_save_time(tmp_path):
    with pytest.raises(TypeError, match=r"checkpoint entry data.pt\['driver'\]\['kl_ctrl'\] is a object"):
        _checkpointer(tmp_path).save(1, _RecordingGroup(), None, _Loader({}), {"kl_ctrl": object()})


def test_crafted_data_pt_is_refused_before_any_worker_loads(tmp_path):
    checkpointer = _checkpointer(tmp_path)
    checkpointer.save(1, _RecordingGroup(), None, _Loader({}), {"global_step": 1})
    marker = tmp_path / "pwned"
    torch.save({"dataloader": {}, "driver": _RunsCode(str(marker))}, tmp_path / "global_step_1" / "data.pt")
    write_manifest(str(tmp_path / "global_step_1"))  # whoever can write the folder can rewrite its manifest
    actor = _RecordingGroup()
    with pytest.raises(pickle.UnpicklingError, match=r"global_step_1/data.pt is not plain data"):
        checkpointer.maybe_resume(actor, None, _Loader(None))
    assert actor.calls == [] and not marker.exists()


# ---------------------------------------------------------------- rlframe merge: a Hugging Face folder, offline
@pytest.mark.slow
@pytest.mark.parametrize("source", ["fsdp2x2", "fsdpx2", "fsdp2x1"])
def test_merge_writes_a_hugging_face_folder_from_any_world_size(saved, tiny_model_path, tmp_path, source):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlframe.cli import main

    ckpt_dir, before = saved(source)
    out = tmp_path / "hf"
    assert main(["merge", ckpt_dir, str(out), "--model", tiny_model_path]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    expected = before[0]["full"]["params"]
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[name], expected[name]) for name in expected), "parameters differ"
    assert AutoTokenizer.from_pretrained(out).pad_token_id is not None


def test_merge_of_a_step_folder_reads_the_run_config_and_checks_the_manifest(tiny_model_path, tmp_path):
    from helpers.faults_harness import LocalRole, run_steps
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from rlframe.trainer.merge import merge

    root = tmp_path / "run"
    (tmp_path / "records").mkdir()
    run_steps(str(root), tiny_model_path, 1, str(tmp_path / "records"))
    OmegaConf.save({"actor_rollout_ref": {"model": {"path": tiny_model_path}}}, root / "config.yaml")
    merge(str(root / "global_step_1"), str(tmp_path / "hf"))
    role = LocalRole(tiny_model_path, 0)
    role.load_checkpoint(str(root / "global_step_1" / "actor"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(merged[name], value) for name, value in role.model.state_dict().items())
    with open(root / "global_step_1" / "data.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match=r"global_step_1/data.pt is \d+ bytes, the manifest says"):
        merge(str(root / "global_step_1"), str(tmp_path / "hf2"))


def test_merge_of_the_critic_writes_its_value_head(tiny_model_path, tmp_path):
    from transformers import AutoModelForTokenClassification

    from rlframe.trainer.merge import merge

    torch.manual_seed(0)
    critic = load_hf_model(
        ModelSpec(path=tiny_model_path, role="critic", dtype=torch.float32, use_remove_padding=False)
    )
    with torch.no_grad():
        critic.score.weight.add_(1.0)  # not the init: the merge must carry the trained head
    ckpt.save_checkpoint(str(tmp_path / "step" / "critic"), critic, save_contents=("model",))
    merge(str(tmp_path / "step"), str(tmp_path / "hf"), role="critic", model=tiny_model_path)
    merged = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf", num_labels=1).state_dict()
    expected = critic.state_dict()
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[name], expected[name]) for name in expected)
