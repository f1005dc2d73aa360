"""LoRA (docs/lora.md): a PEFT adapter on the frozen actor, with verl 0.9.1's keys and meaning.

Exactness against a single-process, unsharded, padded PEFT reference on the same batch and adapter:
log-probs, the reference policy's log-probs (adapter disabled) and the adapter's gradients agree to
1e-5 relative under dp 2 (FSDP1, FSDP2), Ulysses sp 2, remove-padding and dynamic micro-batching; the
reference policy is the base model; merged weights are PEFT's merge, bitwise, and leave the adapter
untouched; checkpoints hold the adapter and its optimizer state and resume bitwise.

The adapter used starts from a random B: a fresh one has B = 0, where the gradient of every A is zero
and would compare trivially.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from helpers.equivalence import assert_matches
from helpers.fsdp_harness import Scenario, make_batch, relative_error, run_distributed, run_scenario
from helpers.lora import _scores, base_model, randomize_b
from transformers import AutoConfig

from rlframe.workers import checkpoint as ckpt
from rlframe.workers import lora
from rlframe.workers.optimizer import build_optimizer
from rlframe.workers.weight_sync import copied_weights, load_rollout_weights, rollout_weights, sync_lora_to_rollout

RTOL = 1e-5
NUM_SEQS = 8
RANK, ALPHA = 4, 8
MODEL = "actor_rollout_ref.model"


def fresh_lora(path: str, seed: int = 0, **spec):
    torch.manual_seed(seed)
    settings = dict(rank=RANK, alpha=ALPHA, target_modules="all-linear", exclude_modules=None) | spec
    return lora.apply_lora(base_model(path), lora.LoraSpec(**settings))


@pytest.fixture(scope="module")
def adapter(tiny_model_path, tmp_path_factory):
    """A rank-4 adapter on every linear layer with a random B, saved as PEFT saves it."""
    peft_model = fresh_lora(tiny_model_path)
    randomize_b(peft_model, seed=1)
    folder = str(tmp_path_factory.mktemp("adapter"))
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    return make_batch(AutoConfig.from_pretrained(tiny_model_path).vocab_size, NUM_SEQS)


@pytest.fixture(scope="module")
def reference(tiny_model_path, batch, adapter):
    sc = Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS, lora_adapter=adapter)
    return run_scenario(sc, tiny_model_path, batch)


# ---------------------------------------------------------------- config
def test_verls_lora_keys_are_taken_and_its_megatron_lora_section_refused():
    from rlframe.trainer.config import compose, typed

    cfg = typed(compose([f"{MODEL}.lora_rank=32", f"{MODEL}.lora_alpha=32", f"{MODEL}.target_modules=[q_proj,v_proj]"]))
    assert cfg.actor_rollout_ref.model.lora_rank == 32 and list(cfg.actor_rollout_ref.model.target_modules) == [
        "q_proj",
        "v_proj",
    ]
    with pytest.raises(ValueError, match="Megatron-backend LoRA"):
        compose([f"{MODEL}.lora.rank=8"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([f"{MODEL}.lora_rank=-1"], "lora_rank=-1 must be >= 0"),
        ([f"{MODEL}.lora_rank=4", f"{MODEL}.target_modules=3"], "target_modules=3 must be a string"),
        ([f"{MODEL}.lora_adapter_path=/tmp"], "lora_adapter_path=/tmp needs .*lora_rank > 0"),
        ([f"{MODEL}.lora_rank=4", f"{MODEL}.lora_adapter_path=/tmp"], "not a PEFT adapter folder"),
        (
            [
                f"{MODEL}.lora_rank=4",
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.dtype=fp32",
                "trainer.device=cuda",
            ],
            "vLLM's CUDA LoRA kernels have no fp32",
        ),
    ],
)
def test_bad_lora_settings_fail_before_ray_naming_the_key(overrides, message):
    from rlframe.trainer.config import compose, typed

    with pytest.raises(ValueError, match=message):
        typed(compose(overrides))


# ---------------------------------------------------------------- single process
def test_only_the_adapter_gets_gradients(reference):
    assert reference["grads"] and all(lora.is_adapter_tensor(name) for name in reference["grads"])
    assert all(g.norm() > 0 for g in reference["grads"].values())  # A's too: B is not zero


def test_reference_policy_is_the_base_model(tiny_model_path, batch, reference):
    base = run_scenario(
        Scenario(strategy="none", use_remove_padding=False, micro_batch_size=NUM_SEQS), tiny_model_path, batch
    )
    assert torch.equal(reference["outputs"]["ref_log_probs"], base["outputs"]["log_probs"])
    assert relative_error(reference["outputs"]["log_probs"], base["outputs"]["log_probs"]) > 1e-3  # the adapter acts


@pytest.mark.parametrize("dynamic, checkpointing", [(False, False), (True, False), (False, True)])
def test_remove_padding_and_micro_batching_match_reference(
    tiny_model_path, batch, reference, adapter, dynamic, checkpointing
):
    sc = Scenario(
        strategy="none",
        micro_batch_size=3,
        use_dynamic_bsz=dynamic,
        max_token_len=24,
        gradient_checkpointing=checkpointing,  # verl's default; frozen inputs need no require-grad hook
        lora_adapter=adapter,
    )
    assert_matches(run_scenario(sc, tiny_model_path, batch), reference)


def test_optimizer_state_is_kept_for_the_adapter_only(tiny_model_path):
    from omegaconf import OmegaConf

    model = fresh_lora(tiny_model_path)
    optim_cfg = OmegaConf.create({"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.01})
    optimizer = build_optimizer(model, optim_cfg)
    model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=False).logits.pow(2).mean().backward()
    optimizer.step()
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == trained
    assert {id(p) for p in optimizer.state} == trained
    assert all(not p.requires_grad for name, p in model.named_parameters() if not lora.is_adapter_tensor(name))


def test_merged_weights_are_peft_merge_bitwise_and_leave_the_adapter_untouched(tiny_model_path, adapter):
    model = lora.apply_lora(base_model(tiny_model_path), lora.LoraSpec(1, 1, "all-linear", None, adapter))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    merged = dict(lora.merged_params(model.state_dict().items(), lora.lora_scalings(model)))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[name], expected[name]) for name in expected)
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    # and the merged model computes what the adapter does
    plain = base_model(tiny_model_path)
    plain.load_state_dict(merged)
    ids = torch.tensor([[5, 9, 13, 2, 7, 11]])
    with torch.no_grad():
        assert relative_error(plain(input_ids=ids).logits, model(input_ids=ids).logits) <= RTOL


def test_fresh_adapter_honours_target_and_exclude_modules(tiny_model_path):
    model = fresh_lora(tiny_model_path, target_modules=["q_proj", "v_proj"], exclude_modules=r".*layers\.0\..*")
    adapted = sorted(lora.lora_scalings(model))
    assert adapted == [f"base_model.model.model.layers.1.self_attn.{m}" for m in ("q_proj", "v_proj")]
    assert set(lora.lora_scalings(model).values()) == {ALPHA / RANK}
    # a fresh adapter starts as the base model (B = 0)
    ids = torch.tensor([[5, 9, 13, 2]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base_model(tiny_model_path)(input_ids=ids).logits)


class RecordingRollout:
    """Records what a weight sync sends; `takes_lora_adapter` as vLLM's engine sets it."""

    def __init__(self, takes_lora_adapter: bool):
        self.takes_lora_adapter, self.needs_base_weights = takes_lora_adapter, True
        self.weights, self.adapters = [], []

    def update_weights(self, named_tensors):
        self.weights.append(dict(named_tensors))
        self.needs_base_weights = False

    def update_lora_adapter(self, tensors, peft_config):
        self.adapters.append((tensors, peft_config))


def test_hf_rollout_receives_merged_weights(tiny_model_path, adapter):
    model = lora.apply_lora(base_model(tiny_model_path), lora.LoraSpec(1, 1, "all-linear", None, adapter))
    rollout = RecordingRollout(takes_lora_adapter=False)
    sync_lora_to_rollout(rollout, model, rollout.takes_lora_adapter)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    (sent,) = rollout.weights
    assert sent.keys() == expected.keys() and all(torch.equal(sent[k], expected[k]) for k in expected)
    assert rollout.adapters == []


def test_vllm_rollout_receives_the_base_once_then_the_adapter(tiny_model_path, adapter):
    from safetensors.torch import load_file

    model = lora.apply_lora(base_model(tiny_model_path), lora.LoraSpec(1, 1, "all-linear", None, adapter))
    rollout = RecordingRollout(takes_lora_adapter=True)
    sync_lora_to_rollout(rollout, model, rollout.takes_lora_adapter)
    sync_lora_to_rollout(rollout, model, rollout.takes_lora_adapter)
    (base,) = rollout.weights  # the base once: it never changes
    assert base.keys() == base_model(tiny_model_path).state_dict().keys()
    assert all(torch.equal(t, base_model(tiny_model_path).state_dict()[k]) for k, t in base.items())
    assert len(rollout.adapters) == 2
    tensors, config = rollout.adapters[-1]
    on_disk = load_file(os.path.join(adapter, "adapter_model.safetensors"))  # PEFT's own file names
    assert tensors.keys() == on_disk.keys() and all(torch.equal(tensors[k], on_disk[k]) for k in on_disk)
    assert config.r == RANK and config.lora_alpha == ALPHA


@pytest.mark.parametrize("adapter_engine", [False, True], ids=["merged", "adapter"])
def test_the_rollout_pool_loads_a_copy_of_what_the_colocated_rollout_receives(tiny_model_path, adapter, adapter_engine):
    """separate_async: `export_weights` copies `rollout_weights` (the base only with_base, at the first push) and the
    rollout pool's `load_weights` loads the copy: the same tensors a colocated engine receives, in pushes of the same
    form, and CPU tensors of their own (not views of the gather's reused buffer)."""
    model = lora.apply_lora(base_model(tiny_model_path), lora.LoraSpec(1, 1, "all-linear", None, adapter))
    colocated, pool = RecordingRollout(adapter_engine), RecordingRollout(adapter_engine)
    for first in (True, False):
        sync_lora_to_rollout(colocated, model, adapter_engine)
        pushed = copied_weights(rollout_weights(model, adapter_engine, with_base=first))
        load_rollout_weights(pool, pushed)
    assert len(pool.weights) == len(colocated.weights) == (1 if adapter_engine else 2)
    for sent, expected in zip(pool.weights, colocated.weights):
        assert sent.keys() == expected.keys() and all(torch.equal(sent[k], expected[k]) for k in expected)
    assert len(pool.adapters) == len(colocated.adapters) == (2 if adapter_engine else 0)
    for (sent, config), (expected, expected_config) in zip(pool.adapters, colocated.adapters):
        assert sent.keys() == expected.keys() and all(torch.equal(sent[k], expected[k]) for k in expected)
        assert config.to_dict() == expected_config.to_dict()
    storages = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    received = [*pool.weights[-1].values(), *(pool.adapters[-1][0].values() if adapter_engine else ())]
    assert not storages & {t.untyped_storage().data_ptr() for t in received}


def test_vllm_names_and_engine_arguments():
    assert lora.vllm_lora_engine_kwargs(0) == {}
    assert lora.vllm_lora_engine_kwargs(4) == {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    assert lora.vllm_max_lora_rank(64) == 64 and lora.vllm_max_lora_rank(65) == 128
    with pytest.raises(ValueError, match="lora_rank=600.*up to rank 512"):
        lora.vllm_max_lora_rank(600)


def test_hf_export_writes_the_merged_model_and_the_adapter(tiny_model_path, adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = lora.apply_lora(base_model(tiny_model_path), lora.LoraSpec(1, 1, "all-linear", None, adapter))
    out = str(tmp_path / "huggingface")
    ckpt.export_hf(out, model, AutoTokenizer.from_pretrained(tiny_model_path))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert all(torch.equal(merged.state_dict()[k], t) for k, t in expected.items())
    reloaded = PeftModel.from_pretrained(base_model(tiny_model_path), os.path.join(out, lora.ADAPTER_DIR))
    assert all(torch.equal(reloaded.state_dict()[k], t) for k, t in model.state_dict().items())
    assert AutoTokenizer.from_pretrained(out).pad_token_id is not None


def _train_steps(model, optimizer, steps: range) -> None:
    for step in steps:
        ids = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, use_cache=False).logits.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_checkpoint_holds_the_adapter_and_resumes_exactly(tiny_model_path, tmp_path):
    from omegaconf import OmegaConf

    optim_cfg = OmegaConf.create({"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1})
    straight = fresh_lora(tiny_model_path)
    optimizer = build_optimizer(straight, optim_cfg)
    _train_steps(straight, optimizer, range(2))
    ckpt.save_checkpoint(str(tmp_path), straight, optimizer, save_contents=["model", "optimizer"])
    saved = ckpt.read_full_tensors(str(tmp_path / ckpt.MODEL_DIR))
    assert saved and all(lora.is_adapter_tensor(name) for name in saved)  # the adapter, not the frozen base
    at_save = copy.deepcopy(straight)
    _train_steps(straight, optimizer, range(2, 4))

    resumed = fresh_lora(tiny_model_path, seed=123)  # another fresh A: all of it comes from the checkpoint
    resumed_optimizer = build_optimizer(resumed, optim_cfg)
    ckpt.load_checkpoint(str(tmp_path), resumed, resumed_optimizer, load_contents=("model", "optimizer"))
    _train_steps(resumed, resumed_optimizer, range(2, 4))
    final, expected = resumed.state_dict(), straight.state_dict()
    assert all(torch.equal(final[name], tensor) for name, tensor in expected.items())

    # offline (rlframe merge): the checkpoint's adapter on the base model, merged as the HF export merges
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "merged")
    lora.merge_lora_checkpoint(str(tmp_path), saved, tiny_model_path, out)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(merged[name], t) for name, t in at_save.merge_and_unload().state_dict().items())
    assert os.path.isfile(os.path.join(out, lora.ADAPTER_DIR, "adapter_model.safetensors"))


# ---------------------------------------------------------------- multi-process (gloo + FSDP)
DISTRIBUTED = {  # two spawns cover both strategies, dp 2, sp 2, remove-padding, static and dynamic micro-batches
    "dp2_fsdp2_static": dict(world=2, micro_batch_size=2),
    "sp2_fsdp1_dynamic": dict(world=2, sp=2, strategy="fsdp", use_dynamic_bsz=True, max_token_len=16),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DISTRIBUTED))
def test_distributed_lora_matches_single_process_peft(tiny_model_path, batch, reference, adapter, tmp_path, name):
    sc = Scenario(lora_adapter=adapter, **DISTRIBUTED[name])
    assert_matches(run_distributed(sc, tiny_model_path, batch, str(tmp_path)), reference)


# ---------------------------------------------------------------- a LoRA GRPO run through Ray
@pytest.mark.slow
def test_lora_grpo_run_learns_and_exports_adapter_and_merged_model(tmp_path, cache_dir):
    from helpers.runs import read_metrics, run_main
    from helpers.small_config import SMALL
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlframe.models.builtin import prepare_builtin

    steps = 15
    out = run_main(
        [
            *SMALL,
            "data.train_files=builtin://countdown_add",
            "data.val_files=builtin://countdown_add",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.model.lora_rank=16",
            "actor_rollout_ref.model.lora_alpha=32",
            # the tiny random model learns "a digit first" through its output layer, which all-linear leaves out
            "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.actor.use_kl_loss=true",  # ref log-probs: the actor with its adapter disabled
            "trainer.n_gpus_per_node=2",
            f"trainer.total_training_steps={steps}",
            f"trainer.save_freq={steps}",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.logger=[jsonl]",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={tmp_path}",
        ],
        cache_dir,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rewards = [m["critic/score/mean"] for m in read_metrics(tmp_path) if "critic/score/mean" in m]
    assert len(rewards) == steps
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.05, rewards  # measured: 0.042 -> 0.153 (docs/lora.md)
    kl = [m["actor/kl_loss"] for m in read_metrics(tmp_path) if "actor/kl_loss" in m]
    assert kl[-1] > 0  # the reference (base) and the trained policy have parted

    actor = tmp_path / f"global_step_{steps}" / "actor"
    saved = ckpt.read_full_tensors(str(actor / ckpt.MODEL_DIR))
    assert saved and all(lora.is_adapter_tensor(name) for name in saved)  # the checkpoint holds the adapter
    export = actor / ckpt.HF_DIR
    merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(prepare_builtin("tiny", str(cache_dir)), dtype=torch.float32)
    trained = PeftModel.from_pretrained(base, str(export / lora.ADAPTER_DIR))
    assert all(torch.equal(trained.state_dict()[name], tensor) for name, tensor in saved.items())
    expected = trained.merge_and_unload().state_dict()
    assert all(torch.equal(merged.state_dict()[name], tensor) for name, tensor in expected.items())


@pytest.mark.gpu
def test_vllm_serves_the_adapter_across_updates_and_sleeps(tiny_model_path, adapter, monkeypatch):
    """vLLM (bf16: its LoRA kernels have no fp32) samples from the adapted policy, not the base: its log-probs of
    its own greedy tokens are those of the PEFT model, after the first sync (base + adapter), after a new
    adapter, and after a sleep (level 1 keeps the base, which is not sent again)."""
    pytest.importorskip("vllm", reason="vllm not installed")
    from helpers.rollout import load_tokenizer, make_prompts, rollout_config
    from helpers.world import free_port

    from rlframe.workers.rollout import ServedModel, build_rollout

    # vLLM's external launcher reads the torch.distributed env of a (here 1-process) world
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))

    cfg = rollout_config(
        "actor_rollout_ref.rollout.dtype=bf16",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    )  # load_format stays verl's dummy: the base weights must arrive through the sync
    model = lora.apply_lora(base_model(tiny_model_path), lora.LoraSpec(1, 1, "all-linear", None, adapter))
    base = base_model(tiny_model_path)
    engine = build_rollout(
        "vllm", cfg, ServedModel(tiny_model_path, lora_rank=RANK), load_tokenizer(tiny_model_path), "cuda"
    )
    prompts = make_prompts(seed=5, do_sample=False)
    for update in range(3):
        if update == 1:
            randomize_b(model, seed=7)  # a new adapter version
        if update == 2:
            engine.release()
            engine.resume()
        sync_lora_to_rollout(engine, model, adapter=True)
        assert not engine.needs_base_weights
        out = engine.generate_sequences(prompts)
        served = out.batch["rollout_log_probs"].cpu()
        to_adapted = (served - _scores(model, out)).abs().sum() / out.batch["response_mask"].sum()
        to_base = (served - _scores(base, out)).abs().sum() / out.batch["response_mask"].sum()
        assert to_adapted < 0.02 and to_base > 5 * to_adapted, (update, float(to_adapted), float(to_base))


@pytest.mark.usefixtures("cuda_less_gpu")
def test_vllm_rollout_lora_path_with_a_stand_in_engine(monkeypatch, tiny_model_path, tmp_path):
    """The vLLM side without vLLM (test_vllm_engine's stand-in): LoRA engine arguments, level-1 sleep, base
    weights under the checkpoint's names (vLLM's loader maps them onto its LoRA-wrapped layers), and each adapter
    version served as a new LoRA request."""
    import types
    from dataclasses import dataclass

    from helpers.rollout import load_tokenizer, rollout_config
    from helpers.vllm_stub import _fake_vllm
    from safetensors.torch import load_file

    from rlframe.workers.rollout import ServedModel, build_rollout

    @dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    record: dict = {}
    modules = _fake_vllm(record)
    modules["vllm.lora"] = types.ModuleType("vllm.lora")
    modules["vllm.lora.request"] = types.ModuleType("vllm.lora.request")
    modules["vllm.lora.request"].LoRARequest = LoRARequest
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("RLFRAME_SHM_DIR", str(tmp_path))
    killed, running = tmp_path / "rlframe-lora" / "999999999-v3", tmp_path / "rlframe-lora" / f"{os.getppid()}-v1"
    killed.mkdir(parents=True)  # what a killed process left (no process has that pid), and a running one's
    running.mkdir()
    cfg = rollout_config("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.free_cache_engine=true")
    rollout = build_rollout(
        "vllm", cfg, ServedModel(tiny_model_path, lora_rank=RANK), load_tokenizer(tiny_model_path), "cuda"
    )
    engine = rollout.engine  # the engine inside the agent loops (rollout.mode=async)
    engine.device = torch.device("cpu")  # where update_weights puts tensors: cuda:0 on a GPU
    assert not killed.exists() and running.exists()
    removed = []
    engine.llm.llm_engine = types.SimpleNamespace(remove_lora=removed.append)
    assert {k: record["kwargs"][k] for k in ("enable_lora", "max_loras", "max_lora_rank")} == {
        "enable_lora": True,
        "max_loras": 1,
        "max_lora_rank": 8,
    }
    assert engine._sleep_level == 1 and engine.takes_lora_adapter and engine.needs_base_weights  # dummy weights

    loaded_names = []
    worker_model = record["worker"].model
    load = worker_model.load_weights
    monkeypatch.setattr(worker_model, "load_weights", lambda w: loaded_names.extend(n for n, _ in w) or load(w))
    weights = [("a.weight", torch.ones(2, 2)), ("b.weight", torch.ones(2, 2))]
    engine.update_weights([*weights, ("model.layers.0.self_attn.q_proj.weight", torch.ones(2, 2))])
    assert loaded_names[-1] == "model.layers.0.self_attn.q_proj.weight" and not engine.needs_base_weights

    model = fresh_lora(tiny_model_path)  # not loaded from a file: safetensors would pin memory on the fake GPU
    tensors = lora.peft_adapter_files(model, lora.full_adapter_state(model))
    config = model.peft_config[lora.ADAPTER]
    engine.update_lora_adapter(tensors, config)
    first = engine._lora_request
    engine.update_lora_adapter(tensors, config)
    second = engine._lora_request
    assert (first.lora_int_id, second.lora_int_id) == (1, 2) and removed == [1]
    assert not os.path.exists(first.lora_path)
    served = load_file(os.path.join(second.lora_path, "adapter_model.safetensors"))
    assert served.keys() == tensors.keys() and all(torch.equal(served[k], tensors[k]) for k in tensors)
    import json

    with open(os.path.join(second.lora_path, "adapter_config.json")) as f:
        written = json.load(f)
    assert written["r"] == RANK and written["lora_alpha"] == ALPHA
    assert sorted(written["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    engine.llm.llm_engine.engine_core = types.SimpleNamespace(shutdown=lambda: None)
    engine.shutdown()  # the last adapter's folder goes with the engine
    assert not os.path.exists(second.lora_path) and os.listdir(tmp_path / "rlframe-lora") == [running.name]
