"""The GPU checks (`pytest -m gpu`; scripts/gpu_check.sh runs each group in its own process).

Each test catches one way the first GPU run could fail (docs/gpu.md lists them): nccl with FSDP2
offload, bf16 through the packed (remove-padding) path, flash-attn's varlen kernel against SDPA,
torch's own varlen_attn against the padded reference, and the vLLM rollout (LOCAL_RANK of a second
worker, RNG, level-2 sleep and a full weight sync) on SmolLM2's shape. Numbers are compared within
the error of the reference's own bf16 arithmetic: a path passes when it is no further from the fp32
result than bf16 itself puts the plain HF forward (at most `BF16_SLACK` times that, plus a small
floor), never bit for bit across kernels.
A test whose package is missing is skipped with "<package> not installed".
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.gpu_logprobs import BF16_SLACK, FLOOR, _hf_log_probs, _mean_abs
from helpers.world import free_port, join_tp2_gpu_world

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_world(monkeypatch):
    """A one-process nccl world on cuda:0, torn down afterwards."""
    import torch.distributed as dist

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batch(vocab: int, seqs: int = 4, prompt: int = 16, response: int = 16, seed: int = 0) -> dict:
    """Left-padded prompts and right-padded responses, as the actor receives them."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(vocab, 500), (seqs, prompt + response), generator=gen)
    mask = torch.ones_like(ids)
    for i in range(seqs):
        mask[i, : i * 2] = 0  # prompt padding
        mask[i, prompt + response - i :] = 0  # response padding
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "position_ids": position_ids,
        "responses": (ids * mask)[:, prompt:],
    }


# ---------------------------------------------------------------------------------------- nccl, offload
def test_nccl_fsdp2_param_and_optimizer_offload_step(smollm2, nccl_world):
    """Issue 18 items 5, 6, 9: offloaded shards meet nccl only on CUDA; Adam's state stays with its parameter."""
    from rlframe.distributed.parallel_dims import build_fsdp_mesh
    from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
    from rlframe.workers.full_tensors import iter_full_params
    from rlframe.workers.model_loading import ModelSpec, load_hf_model
    from rlframe.workers.optimizer import clip_grad_norm, move_optimizer_state

    mesh = build_fsdp_mesh("cuda", 1, -1)
    spec = ModelSpec(smollm2, "actor", torch.float32, use_remove_padding=False)
    offloaded = wrap_fsdp(
        load_hf_model(spec), FSDPSpec("fsdp2", torch.bfloat16, torch.float32, True, True), mesh, "cuda"
    )
    assert all(p.device.type == "cpu" for p in offloaded.parameters())
    optimizer = torch.optim.AdamW(offloaded.parameters(), lr=1e-4)
    ids = torch.randint(3, 500, (2, 32), device="cuda")
    for _ in range(2):  # the second step is the one that mixed devices
        move_optimizer_state(optimizer, torch.cuda.current_device())  # _load_optimizer
        offloaded(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        norm = clip_grad_norm(offloaded, 1e-3)  # a reduction over nccl of CPU-held grads
        assert torch.isfinite(norm)
        optimizer.step()
        optimizer.zero_grad()
        move_optimizer_state(optimizer, "cpu")  # _offload_optimizer; synchronizes before returning
    assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())
    streamed = dict(iter_full_params(offloaded))  # the weight sync's all-gathers
    assert streamed and all(t.is_cuda for t in streamed.values())

    on_gpu = wrap_fsdp(load_hf_model(spec), FSDPSpec("fsdp2", torch.bfloat16, torch.float32, False, True), mesh, "cuda")
    assert all(p.device.type == "cuda" for p in on_gpu.parameters())  # fully_shard moved each module


# ---------------------------------------------------------------------------------------- bf16, packed rows
def test_bf16_packed_log_probs_within_bf16_error(smollm2):
    """The remove-padding path in bf16 is as close to fp32 as transformers' own bf16 forward."""
    from transformers import AutoModelForCausalLM

    from rlframe.distributed.attention import register_varlen_attention, varlen_kernel
    from rlframe.workers.model_forward import LOG_PROBS, forward_micro_batch, layout_for

    batch = {k: v.cuda() for k, v in _batch(49152).items()}
    mask = batch["attention_mask"][:, -16:]
    out = {}
    for name, dtype, packed in (
        ("fp32", torch.float32, False),
        ("hf_bf16", torch.bfloat16, False),
        ("packed_bf16", torch.bfloat16, True),
    ):
        model = AutoModelForCausalLM.from_pretrained(
            smollm2, dtype=dtype, attn_implementation=register_varlen_attention() if packed else "sdpa"
        ).cuda()
        with torch.no_grad():
            out[name] = forward_micro_batch(model, batch, 16, LOG_PROBS, layout_for(packed))["log_probs"]
        del model
    reference_error = _mean_abs(out["hf_bf16"], out["fp32"], mask)
    packed_error = _mean_abs(out["packed_bf16"], out["fp32"], mask)
    kernel = varlen_kernel("cuda", torch.bfloat16)
    print(f"attention {kernel}: packed bf16 error {packed_error:.2e}, HF bf16 error {reference_error:.2e}")
    assert torch.isfinite(out["packed_bf16"]).all()
    assert packed_error <= BF16_SLACK * reference_error + FLOOR


# ---------------------------------------------------------------------------------------- flash-attn
def test_flash_attn_varlen_matches_sdpa_on_smollm2_heads(monkeypatch):
    """flash-attn's varlen kernel and the SDPA fallback agree within bf16 error (head size 64, GQA 9/3)."""
    pytest.importorskip("flash_attn", reason="flash-attn not installed")
    from rlframe.distributed import attention

    assert attention.varlen_kernel("cuda", torch.bfloat16) == "flash-attn varlen"
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 128, 5, 300, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    total = sum(lengths)
    q32 = torch.randn(total, 9, 64, device="cuda", generator=gen)
    k32, v32 = (torch.randn(total, 3, 64, device="cuda", generator=gen) for _ in range(2))
    grad = torch.randn(total, 9, 64, device="cuda", generator=gen)

    def run(dtype: torch.dtype, flash: bool):
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q32, k32, v32))
        with monkeypatch.context() as m:
            if not flash:  # SDPA per sequence: neither flash kernel
                m.setattr(attention, "_flash_attn_varlen_func", lambda: None)
                m.setattr(attention, "_torch_varlen_attn", lambda: None)
            out = attention.varlen_causal_attention(q, k, v, cu, max(lengths), 64**-0.5)
        out.backward(grad.to(dtype))
        return out.detach().float(), q.grad.float(), k.grad.float()

    reference = run(torch.float32, flash=False)
    sdpa = run(torch.bfloat16, flash=False)
    flash = run(torch.bfloat16, flash=True)
    for name, ref, got_sdpa, got_flash in zip(("out", "dq", "dk"), reference, sdpa, flash):
        sdpa_error, flash_error = _mean_abs(got_sdpa, ref), _mean_abs(got_flash, ref)
        print(f"{name}: flash-attn error {flash_error:.2e}, bf16 SDPA error {sdpa_error:.2e}")
        assert flash_error <= BF16_SLACK * sdpa_error + FLOOR, name


# ---------------------------------------------------------------------------------------- torch varlen_attn
def test_torch_varlen_attn_matches_the_padded_reference(smollm2, monkeypatch):
    """Issue 43: without flash-attn, packed bf16 runs torch's varlen_attn; on SmolLM2's heads (64, GQA 9/3) its
    output and gradients, causal and with a 64-token window, and the packed model's log-probs are within bf16
    error of the fp32 reference (per-sequence SDPA; the padded forward)."""
    from transformers import AutoModelForCausalLM

    from rlframe.distributed import attention
    from rlframe.workers.model_forward import LOG_PROBS, forward_micro_batch, layout_for

    if attention._torch_varlen_attn() is None:
        pytest.skip("torch varlen_attn not usable here (torch without flash attention, or a GPU before sm80)")
    monkeypatch.setattr(attention, "_flash_attn_varlen_func", lambda: None)  # as on a machine without flash-attn
    assert attention.varlen_kernel("cuda", torch.bfloat16) == attention.TORCH_VARLEN_ATTN
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 128, 5, 300, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    q32 = torch.randn(sum(lengths), 9, 64, device="cuda", generator=gen)
    k32, v32 = (torch.randn(sum(lengths), 3, 64, device="cuda", generator=gen) for _ in range(2))
    grad = torch.randn(sum(lengths), 9, 64, device="cuda", generator=gen)

    def run(dtype: torch.dtype, window: int | None, kernel_on: bool):
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q32, k32, v32))
        with monkeypatch.context() as m:
            if not kernel_on:
                m.setattr(attention, "_torch_varlen_attn", lambda: None)
            out = attention.varlen_causal_attention(q, k, v, cu, max(lengths), 64**-0.5, sliding_window=window)
        out.backward(grad.to(dtype))
        return out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()

    for window in (None, 64):
        reference = run(torch.float32, window, kernel_on=False)
        sdpa = run(torch.bfloat16, window, kernel_on=False)
        varlen = run(torch.bfloat16, window, kernel_on=True)
        for name, ref, got_sdpa, got_varlen in zip(("out", "dq", "dk", "dv"), reference, sdpa, varlen):
            sdpa_error, varlen_error = _mean_abs(got_sdpa, ref), _mean_abs(got_varlen, ref)
            print(f"window {window} {name}: varlen_attn error {varlen_error:.2e}, bf16 SDPA error {sdpa_error:.2e}")
            assert varlen_error <= BF16_SLACK * sdpa_error + FLOOR, (window, name)

    batch = {k: v.cuda() for k, v in _batch(49152).items()}
    mask = batch["attention_mask"][:, -16:]
    out = {}
    for name, dtype, packed in (("fp32", torch.float32, False), ("hf_bf16", torch.bfloat16, False)):
        model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=dtype, attn_implementation="sdpa").cuda()
        with torch.no_grad():
            out[name] = forward_micro_batch(model, batch, 16, LOG_PROBS, layout_for(packed))["log_probs"]
    calls = []
    kernel = attention._torch_varlen_attn()
    monkeypatch.setattr(attention, "_torch_varlen_attn", lambda: lambda *a, **k: calls.append(1) or kernel(*a, **k))
    model = AutoModelForCausalLM.from_pretrained(
        smollm2, dtype=torch.bfloat16, attn_implementation=attention.register_varlen_attention()
    ).cuda()
    with torch.no_grad():
        packed = forward_micro_batch(model, batch, 16, LOG_PROBS, layout_for(True))["log_probs"]
    assert calls, "the packed forward did not reach varlen_attn"
    packed_error, reference_error = _mean_abs(packed, out["fp32"], mask), _mean_abs(out["hf_bf16"], out["fp32"], mask)
    print(f"torch varlen_attn: packed bf16 error {packed_error:.2e}, HF bf16 error {reference_error:.2e}")
    assert torch.isfinite(packed).all()
    assert packed_error <= BF16_SLACK * reference_error + FLOOR


def test_vllm_rollout_on_a_second_worker_with_weight_sync(smollm2, monkeypatch, tmp_path):
    """Issue 18 items 1, 7, 8 and the weight-load check: LOCAL_RANK=1 with one visible GPU, RNG untouched,
    level-2 sleep then a full sync in one-tensor buckets (issue 24: SmolLM2's tied head); the engine's log-probs
    match HF's within bf16 error, before and after."""
    pytest.importorskip("vllm", reason="vllm not installed")
    from helpers.rollout import load_tokenizer, make_prompts
    from transformers import AutoModelForCausalLM

    from rlframe.workers.rollout import build_rollout, vllm_rollout

    # the second worker on a node: Ray shows it one GPU (index 0), the worker group sets LOCAL_RANK=1
    for key, value in dict(RANK="0", LOCAL_RANK="1", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = _vllm_config("actor_rollout_ref.rollout.load_format=dummy")
    torch.manual_seed(1234)
    rng_before = (torch.get_rng_state(), torch.cuda.get_rng_state())
    engine = build_rollout("vllm", cfg, smollm2, load_tokenizer(smollm2), "cuda")
    try:
        assert torch.equal(torch.get_rng_state(), rng_before[0]) and torch.equal(
            torch.cuda.get_rng_state(), rng_before[1]
        )
        assert os.environ["LOCAL_RANK"] == "1"
        vllm = engine.unwrapped  # the engine under rollout.mode=async's agent loops
        print(f"vLLM attention backends: {vllm.attention_backends()}; sleep level {vllm._sleep_level}")
        assert vllm._sleep_level == 2

        base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).state_dict()
        moved = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # by parameter: the tied head moves with its embedding, as an update moves it
            for param in moved.parameters():
                param.add_(0.5 * param.std() * torch.randn(param.shape, generator=gen))
        perturbed = moved.state_dict()
        # one tensor per bucket: the tied alias lm_head.weight would arrive in a load_weights call without its
        # embedding, which vLLM's loader refuses (the crash of every tied model above one 512 MiB bucket)
        monkeypatch.setattr(vllm_rollout, "WEIGHT_BUCKET_BYTES", 1)
        previous = None
        for state in (base, perturbed):
            engine.release()  # level 2: the weights are dropped; every one must come back
            engine.resume()
            engine.update_weights(state.items())
            out = engine.generate_sequences(make_prompts(seed=3, do_sample=True)).batch
            batch = {k: out[k].cpu() for k in ("input_ids", "attention_mask", "position_ids", "responses")}
            mask = out["response_mask"].cpu()
            engine_lp = out["rollout_log_probs"].cpu()
            fp32 = _hf_log_probs(smollm2, state, batch, torch.float32)
            bf16 = _hf_log_probs(smollm2, state, batch, torch.bfloat16)
            engine_error, reference_error = _mean_abs(engine_lp, fp32, mask), _mean_abs(bf16, fp32, mask)
            print(f"vLLM log-prob error {engine_error:.2e}, HF bf16 error {reference_error:.2e}")
            assert engine_error <= BF16_SLACK * reference_error + FLOOR
            if previous is not None:  # the second sync took effect: HF under the old weights disagrees
                old_state_lp = _hf_log_probs(smollm2, previous, batch, torch.float32)
                assert _mean_abs(engine_lp, old_state_lp, mask) > BF16_SLACK * reference_error + FLOOR
            previous = state
    finally:
        engine.shutdown()
        from vllm.distributed.parallel_state import destroy_distributed_environment

        destroy_distributed_environment()  # the default process group vLLM started for this world of one


def test_vllm_async_server_gives_the_sync_samples(smollm2, monkeypatch):
    """Issue 14: rollout.mode=async on vLLM (requests added to the in-process LLMEngine and stepped, continuous
    batching) samples what the synchronous LLM.generate path samples under the same seed, for 1 and 4
    agent-loop workers: the idle engine starts with every request, as LLM.generate does.

    What vLLM promises in bf16 (without its batch-invariant mode) is the same seeds, not the same numerics across
    batch compositions: a continuous batch is composed differently, so a log-prob moves within bf16 noise and a
    token sampled at a near-tie may flip and change the rest of its row. So: all rows but at most one equal, and
    the equal rows' log-probs within twice what a bf16 forward may be from fp32 (the bound of the other tests)."""
    pytest.importorskip("vllm", reason="vllm not installed")
    from helpers.rollout import load_tokenizer, make_prompts

    from rlframe.workers.rollout import build_rollout, generate_in_tp_group
    from rlframe.workers.rollout.agent_loop import AgentLoopRollout

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = _vllm_config("actor_rollout_ref.rollout.mode=sync", "actor_rollout_ref.rollout.load_format=auto")
    engine = build_rollout("vllm", cfg, smollm2, load_tokenizer(smollm2), "cuda")
    try:
        prompts = make_prompts(seed=5, do_sample=True)
        torch.manual_seed(3)
        expected = generate_in_tp_group(engine, prompts).to("cpu")
        assert expected.batch["response_mask"].sum() > 0
        batch = {k: expected.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
        fp32 = _hf_log_probs(smollm2, None, batch, torch.float32)
        bf16 = _hf_log_probs(smollm2, None, batch, torch.bfloat16)
        bound = 2 * (BF16_SLACK * _mean_abs(bf16, fp32, expected.batch["response_mask"]) + FLOOR)
        for workers in (1, 4):
            torch.manual_seed(3)
            out = generate_in_tp_group(AgentLoopRollout(engine, workers), prompts).to("cpu")
            same = (out.batch["responses"] == expected.batch["responses"]).all(-1)
            assert int((~same).sum()) <= 1, (workers, same)
            for key in ("response_mask", "attention_mask"):
                assert torch.equal(out.batch[key][same], expected.batch[key][same]), (workers, key)
            mask = expected.batch["response_mask"][same]
            error = _mean_abs(out.batch["rollout_log_probs"][same], expected.batch["rollout_log_probs"][same], mask)
            assert error <= bound, (workers, error, bound)
            metrics = out.meta_info["metrics"]
            print(
                f"vLLM async: {workers} workers, batch {metrics['rollout/server_batch_size_mean']:.1f}, "
                f"{metrics['rollout/server_tokens_per_s']:.0f} tokens/s, {int(same.sum())}/{len(same)} rows equal, "
                f"log-prob difference {error:.1e} (bound {bound:.1e})"
            )
    finally:
        engine.shutdown()
        from vllm.distributed.parallel_state import destroy_distributed_environment

        destroy_distributed_environment()


def _vllm_config(*overrides: str):
    from helpers.rollout import typed_rollout

    from rlframe.config.loader import load_config

    base = [
        "data.max_prompt_length=16",
        "data.max_response_length=24",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=bf16",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.max_model_len=64",
    ]
    return typed_rollout(load_config([*base, *overrides]))


def _tp2_worker(rank: int, port: int, model: str, out_dir: str) -> None:
    """One of two processes, each shown one GPU as Ray shows it, LOCAL_RANK its index on the node."""
    import torch.distributed as dist

    tp_group = join_tp2_gpu_world(rank, port)
    from helpers.rollout import load_tokenizer, make_prompts

    from rlframe.workers.rollout import build_rollout, generate_in_tp_group

    cfg = _vllm_config(
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.load_format=auto"
    )
    engine = build_rollout("vllm", cfg, model, load_tokenizer(model), "cuda", tp_group)
    try:
        out = generate_in_tp_group(engine, make_prompts(seed=4, do_sample=False).to("cuda"), tp_group).batch
        keys = ("input_ids", "attention_mask", "position_ids", "responses", "rollout_log_probs", "response_mask")
        torch.save({k: out[k].cpu() for k in keys}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        engine.shutdown()
        dist.destroy_process_group()


def test_vllm_tp2_one_visible_gpu_per_process(tmp_path):
    """Issue 18 item 2: TP=2 where each process sees one GPU (custom and P2P all-reduces off); log-probs as HF's."""
    pytest.importorskip("vllm", reason="vllm not installed")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from helpers.gpu_models import tp2_stand_in

    model = tp2_stand_in(str(tmp_path / "model"))
    torch.multiprocessing.spawn(_tp2_worker, args=(free_port(), model, str(tmp_path)), nprocs=2, join=True)
    shares = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for share in shares:
        batch = {k: share[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
        mask = share["response_mask"]
        fp32 = _hf_log_probs(model, None, batch, torch.float32)
        bf16 = _hf_log_probs(model, None, batch, torch.bfloat16)
        engine_error, reference_error = _mean_abs(share["rollout_log_probs"], fp32, mask), _mean_abs(bf16, fp32, mask)
        assert engine_error <= BF16_SLACK * reference_error + FLOOR
    print(f"tp2 log-prob error {engine_error:.2e}, HF bf16 error {reference_error:.2e}")
