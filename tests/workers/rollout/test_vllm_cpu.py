"""The vLLM rollout on the real engine: vLLM's CPU build, SmolLM2-135M-Instruct in fp32 (head size 64, GQA 9/3, tied).

One engine per module, in a one-process gloo world as a worker's (`external_launcher`). What a first GPU run would hit
and what a CPU can show: the weight sync is real (after updates that move the model far, vLLM's greedy tokens are HF's
and its sampled-token probabilities are the actor's to fp32 noise, as at the start); the tied `lm_head` follows the
synced embedding; a tied alias arriving in a bucket without its embedding is refused by vLLM's loader (the defect of
the GPU path's buckets, reproduced on vLLM's own loader) and the sync leaves it out; per-request seeds; the async
server and the tool agent's turns on the engine.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.rollout import load_tokenizer, make_prompts
from helpers.vllm_cpu import (
    PROB_DIFF_MAX,
    PROB_DIFF_MEAN,
    ROLLOUT,
    hf_greedy,
    hf_token_log_probs,
    rollout_cfg,
    updated,
    vllm_rows,
)

pytestmark = pytest.mark.vllm
# fp32 on both sides: vLLM's CPU kernels (oneDNN GEMMs, its paged attention) against transformers' SDPA forward. The
# differences of token probabilities measured here were ~1e-6 mean, ~2e-5 max; 1e-4 / 1e-3 leave room for
# another CPU's kernels while a stale weight (any weight of one update ago) moves them by 1e-2 or more.


@pytest.fixture(scope="module")
def engine(world, smollm2_path):
    from rlframe.workers.rollout import build_rollout

    # room for the tool agent's test (a 300-token prompt): the other tests' rows are 24 + 16 tokens
    cfg = rollout_cfg(f"{ROLLOUT}.max_model_len=512")
    rollout = build_rollout("vllm", cfg, smollm2_path, load_tokenizer(smollm2_path), "cpu")
    yield rollout
    rollout.shutdown()


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_sync_is_real_after_updates_greedy_tokens_and_probabilities(engine, hf_model):
    """Four high-lr 'updates': after each sync vLLM's greedy tokens are HF generate's, and the probabilities of its
    sampled tokens are the actor's within fp32 noise at step 4 as at step 1 (verl's rollout_probs_diff)."""
    from rlframe.algorithms.rollout_correction import probs_diff_metrics

    diffs, previous = [], None
    for step in range(4):
        if step:
            updated(hf_model, step)
        engine.update_weights(hf_model.state_dict().items())
        greedy = engine.generate_sequences(make_prompts(seed=step, do_sample=False))
        assert vllm_rows(greedy) == hf_greedy(hf_model, make_prompts(seed=step), 16, engine.eos_ids)
        torch.manual_seed(step)
        sampled = engine.generate_sequences(make_prompts(seed=10 + step, do_sample=True))
        mask = sampled.batch["response_mask"]
        actor = hf_token_log_probs(hf_model, sampled)
        metrics = probs_diff_metrics(actor, sampled.batch["rollout_log_probs"], mask)
        diffs.append((metrics["training/rollout_probs_diff_mean"], metrics["training/rollout_probs_diff_max"]))
        assert diffs[-1][0] < PROB_DIFF_MEAN and diffs[-1][1] < PROB_DIFF_MAX, (step, diffs)
        if previous is not None:  # the sync took effect: the weights of one update ago score these tokens apart
            stale = probs_diff_metrics(hf_token_log_probs(previous, sampled), sampled.batch["rollout_log_probs"], mask)
            assert stale["training/rollout_probs_diff_max"] > 10 * PROB_DIFF_MAX
        previous = _copy(hf_model)
    print("vLLM-CPU vs actor, |p - p'| mean/max per step:", [f"{m:.1e}/{x:.1e}" for m, x in diffs])


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_tied_head_follows_the_synced_embedding(engine, hf_model):
    """Only the tied embedding changes (SmolLM2 ties lm_head to it): vLLM's logits must use the new one."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(99)
        embedding = hf_model.get_input_embeddings().weight
        embedding.add_(0.2 * embedding.std() * torch.randn(embedding.shape, generator=gen))
    assert hf_model.lm_head.weight is embedding
    import logging

    from rlframe.workers.rollout.vllm_cpu import ExpectedUnloadedLayers

    records: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = records.append
    logger = logging.getLogger(ExpectedUnloadedLayers.LOGGER)
    logger.addHandler(catch)
    try:
        engine.update_weights(hf_model.state_dict().items())
    finally:
        logger.removeHandler(catch)
    # vLLM's "<layer>: Failed to load weights" for the head and the rotary cache, expected, is not shown; another
    # layer's would be
    assert not [r for r in records if "Failed to load" in r.getMessage()], [r.getMessage() for r in records]
    other = logging.LogRecord(
        logger.name, logging.WARNING, "", 0, "%s: Failed to load weights", ("QKVParallelLinear",), None
    )
    assert ExpectedUnloadedLayers({"ParallelLMHead"}).filter(other)
    torch.manual_seed(0)
    out = engine.generate_sequences(make_prompts(seed=4, do_sample=True))
    metrics = out.batch["response_mask"]
    diff = (hf_token_log_probs(hf_model, out).exp() - out.batch["rollout_log_probs"].exp()).abs()[metrics.bool()]
    assert diff.max() < PROB_DIFF_MAX


def test_tied_alias_in_a_bucket_without_its_embedding_is_refused_by_vllm_and_left_out_by_the_sync(engine, hf_model):
    """The GPU path's defect on vLLM's own loader: a bucket holding lm_head.weight without model.embed_tokens.weight
    (the last bucket of any tied model above one bucket) raises in vLLM; the sync's stream leaves the alias out."""
    from rlframe.workers.rollout.vllm_rollout import _worker_load_weights, weight_buckets

    embedding = hf_model.get_input_embeddings().weight.detach()
    stream = [("model.embed_tokens.weight", embedding.clone()), ("lm_head.weight", embedding.clone())]
    buckets = list(weight_buckets(stream, bucket_bytes=1))  # one tensor per bucket, as a small bucket size gives
    assert [len(b) for b in buckets] == [1, 1]
    engine.llm.collective_rpc(_worker_load_weights, args=(buckets[0],))  # the embedding loads (it is not repacked)
    with pytest.raises(ValueError, match="lm_head.weight' was skipped because it is tied"):
        engine.llm.collective_rpc(_worker_load_weights, args=(buckets[1],))
    assert engine._tied_aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    kept = [name for name, _ in stream if name not in engine._tied_aliases]
    assert kept == ["model.embed_tokens.weight"]
    engine.update_weights(hf_model.state_dict().items())  # and the whole sync goes through


def test_seeds_rerun_batch_independence_and_replicas(engine, hf_model, smollm2_path):
    """The same torch seed samples the same tokens; a row's tokens do not depend on its batch; another DP replica
    (engine seed + its index, as verl seeds replicas) samples other tokens."""
    engine.update_weights(hf_model.state_dict().items())
    prompts = make_prompts(seed=7, do_sample=True)
    torch.manual_seed(5)
    first = engine.generate_sequences(prompts)
    torch.manual_seed(5)
    again = engine.generate_sequences(prompts)
    assert torch.equal(first.batch["responses"], again.batch["responses"])
    seeds = engine.sample_seeds(len(prompts))
    whole = engine._generate(prompts, engine.sampling_for({}), engine.eos_ids, engine.pad_id, seeds)[0]
    half = len(prompts) // 2
    part = engine._generate(prompts[:half], engine.sampling_for({}), engine.eos_ids, engine.pad_id, seeds[:half])[0]
    assert torch.equal(whole[:half], part)
    engine.dp_rank = 1  # the second replica's seeds
    try:
        torch.manual_seed(5)
        other = engine.generate_sequences(prompts)
    finally:
        engine.dp_rank = 0
    assert not torch.equal(first.batch["responses"], other.batch["responses"])


def test_async_server_samples_what_sync_samples(engine, hf_model):
    """rollout.mode=async on the real engine (requests added to vLLM's LLMEngine and stepped, continuous batching):
    the same tokens as the synchronous LLM.generate path under the same seeds, for 1 and 4 agent-loop workers.
    Log-probs within fp32 noise: vLLM promises equal numerics across batch compositions only in its batch-invariant
    mode, and a continuous batch is composed differently."""
    from rlframe.workers.rollout import generate_in_tp_group
    from rlframe.workers.rollout.agent_loop import AgentLoopRollout

    engine.update_weights(hf_model.state_dict().items())
    prompts = make_prompts(seed=5, do_sample=True)
    torch.manual_seed(3)
    expected = generate_in_tp_group(engine, prompts)
    for workers in (1, 4):
        torch.manual_seed(3)
        out = generate_in_tp_group(AgentLoopRollout(engine, workers), prompts)
        for key in ("responses", "response_mask", "attention_mask"):
            assert torch.equal(out.batch[key], expected.batch[key]), (workers, key)
        diff = (out.batch["rollout_log_probs"] - expected.batch["rollout_log_probs"]).abs().max()
        assert diff < 1e-4, (workers, float(diff))


def test_tool_agent_turns_on_the_real_engine(engine, smollm2_path, monkeypatch):
    """The tool agent on vLLM: built-in calc_multiply prompts (one worked call in the prompt), temperature 1.
    Trajectories call the calculator and get its answer as context; the policy turns' log-probs from vLLM are the
    actor's on the whole trajectory (the engine saw exactly the tokens that are trained); the async agent loops
    give the turn-synchronous loop's trajectories."""
    import numpy as np

    from rlframe.data.tool_tasks import calc_multiply_rows
    from rlframe.protocol import DataProto
    from rlframe.workers.rollout.agent_loop import AgentLoopRollout
    from rlframe.workers.rollout.multi_turn import build_multi_turn

    tools = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "tools", "calculator.yaml")
    cfg = rollout_cfg(
        "data.max_prompt_length=320",
        "data.max_response_length=64",
        f"{ROLLOUT}.agent.default_agent_loop=tool_agent",
        f"{ROLLOUT}.multi_turn.tool_config_path={tools}",
        f"{ROLLOUT}.multi_turn.max_assistant_turns=2",
    )
    monkeypatch.setattr(engine, "config", cfg)  # the lengths of this config
    from transformers import AutoModelForCausalLM

    # the pretrained weights (the module's hf_model was moved far by the other tests: it no longer calls tools)
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, attn_implementation="sdpa")
    engine.update_weights(hf_model.eval().state_dict().items())
    rows = calc_multiply_rows("train", 8, seed=0)
    raw = np.empty(len(rows), dtype=object)
    raw[:] = [row["prompt"] for row in rows]
    ids = torch.ones(len(rows), 4, dtype=torch.long)  # the tool agent renders raw_prompt itself
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(4).repeat(8, 1)},
        {"raw_prompt": raw, "agent_name": np.array(["tool_agent"] * len(rows), dtype=object)},
    )
    tokenizer = load_tokenizer(smollm2_path)
    torch.manual_seed(1)
    sync = build_multi_turn(engine, tokenizer).generate_sequences(prompts)
    metrics = sync.meta_info["metrics"]
    calls = metrics["multi_turn/tool_calls_per_trajectory"]  # one value per trajectory
    calls_per_trajectory = sum(calls) / len(calls)
    assert calls_per_trajectory > 0, metrics
    tool_tokens = (sync.batch["attention_mask"][:, -64:] - sync.batch["response_mask"]).sum()
    assert tool_tokens > 0  # tool turns are in the responses, masked out of training
    mask = sync.batch["response_mask"].bool()
    diff = (hf_token_log_probs(hf_model, sync).exp() - sync.batch["rollout_log_probs"].exp()).abs()[mask]
    assert diff.mean() < PROB_DIFF_MEAN and diff.max() < PROB_DIFF_MAX, (diff.mean(), diff.max())
    torch.manual_seed(1)
    loops = AgentLoopRollout(engine, 4, build_multi_turn(engine, tokenizer)).generate_sequences(prompts)
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(loops.batch[key], sync.batch[key]), key
    print(
        f"tool agent on vLLM-CPU: {calls_per_trajectory:.2f} calls per trajectory, "
        f"|p - p'| {diff.mean():.1e} mean / {diff.max():.1e} max over {int(mask.sum())} policy tokens"
    )


class _InterruptAfter:
    """An `interrupt` that says stop after `steps` questions (one question per engine step)."""

    def __init__(self, steps: int):
        self.left = steps

    def __call__(self) -> bool:
        self.left -= 1
        return self.left < 0


@pytest.mark.parametrize("server", [False, True], ids=["sync", "async-server"])
def test_partial_rollout_cuts_and_continues_on_the_real_engine(engine, hf_model, server):
    """The rollout pool's partial rollout on vLLM (sync path: the engine stepped by generate_tokens; async: the
    server's loop). An interrupt after 4 engine steps cuts every row short of EOS and budget, with the tokens it had
    and their log-probs (the actor's to fp32 noise); continued on the same weights (`continue_generation`: prompt +
    prefix prefilled, the row's rest of the budget) greedy rows are the uncut rows token for token, the prefix keeps
    its version and the continuation carries the new one."""
    import numpy as np

    from rlframe.workers.rollout import generate_in_tp_group
    from rlframe.workers.rollout.agent_loop import AgentLoopRollout
    from rlframe.workers.rollout.base import SEED_KEY
    from rlframe.workers.rollout.partial import VERSIONS_KEY, continue_generation, interrupted

    engine.update_weights(hf_model.state_dict().items())
    rollout = AgentLoopRollout(engine, 2) if server else engine
    prompts = make_prompts(seed=11, do_sample=False)
    uncut = generate_in_tp_group(rollout, prompts)
    engine.interrupt = _InterruptAfter(4)
    try:
        torch.manual_seed(0)
        cut = generate_in_tp_group(rollout, prompts)
    finally:
        engine.interrupt = None
    lengths = cut.batch["response_mask"].sum(-1)
    response_length = cut.batch["responses"].shape[1]
    assert 0 < int(lengths.max()) <= 4 < response_length
    assert interrupted(cut).all()  # the engine's own stop reason: aborted before the end
    for row, count in enumerate(lengths.tolist()):  # the prefix is the uncut row's start
        assert torch.equal(cut.batch["responses"][row, :count], uncut.batch["responses"][row, :count])
    mask = cut.batch["response_mask"].bool()
    assert _probs_diff_max(hf_model, cut) < PROB_DIFF_MAX
    cut.batch[VERSIONS_KEY] = torch.zeros(mask.shape, dtype=torch.int32).masked_fill(~mask, -1)
    cut.non_tensor_batch[SEED_KEY] = np.array(engine.sample_seeds(len(cut)), dtype=object)
    cut.meta_info = {"do_sample": False}  # greedy, as the call that cut them
    done = continue_generation(engine, cut, version=1)
    assert torch.equal(done.batch["responses"], uncut.batch["responses"])
    assert torch.equal(done.batch["response_mask"], uncut.batch["response_mask"])
    assert not interrupted(done).any()
    versions = done.batch[VERSIONS_KEY]
    for row, count in enumerate(lengths.tolist()):
        real = int(done.batch["response_mask"][row].sum())
        assert (versions[row, :count] == 0).all() and (versions[row, count:real] == 1).all()
    assert _probs_diff_max(hf_model, done) < PROB_DIFF_MAX


def _probs_diff_max(model, out) -> float:
    from rlframe.algorithms.rollout_correction import probs_diff_metrics

    actor = hf_token_log_probs(model, out)
    metrics = probs_diff_metrics(actor, out.batch["rollout_log_probs"], out.batch["response_mask"])
    return metrics["training/rollout_probs_diff_max"]


def test_a_budget_the_context_limit_shortened_stops_context_limit_and_is_not_continued(engine, hf_model):
    """A 500-token context within max_model_len=512 leaves 12 of 16 new tokens (`max_tokens_for`): that row stops
    `Stop.CONTEXT_LIMIT` (finished, not interrupted), the short row `Stop.LENGTH`. The EOS is a token greedy
    decoding never picks here, so both rows run to their budgets."""
    from rlframe.workers.rollout.base import Stop

    engine.update_weights(hf_model.state_dict().items())
    prompts = make_prompts(lengths=(500, 8), width=500, seed=3)
    params = engine.sampling_for({"do_sample": False})
    never = [hf_model.config.vocab_size - 1]
    tokens, lengths, _, stops = engine.generate_tokens(prompts, params, never, engine.pad_id, [1, 2])
    assert lengths.tolist() == [12, params.response_length] and params.response_length == 16
    assert [Stop(int(s)) for s in stops] == [Stop.CONTEXT_LIMIT, Stop.LENGTH]
