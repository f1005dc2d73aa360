"""Reward model worker: a sequence-classification model scores each (prompt, response).

The checkpoint is loaded as the sequence classifier it was saved as, its trained head run at every token
(`rlframe.models.reward_head`): the per-token scores let us read each row's score at its last valid token
whatever the padding side. The score goes on the last valid response token
(`rm_scores` [bs, response_length]), the same place rule-based rewards go. With
`reward_model.model.use_remove_padding` the valid tokens of a micro-batch are packed into one row
(each sequence attending only to itself through `cu_seqlens`): the same scores without computing the
padding. Both run the actor's and critic's forward (`rlframe.workers.model_forward`) with a value head.

What is scored (`reward_model.use_reward_loop`):
- true (verl 0.9.1's only way, verl 0.8's default): the text verl's reward loop sends to its reward-model
  server (`reward_loop_inputs`): the raw chat (`data.return_raw_chat=true`) plus the response decoded
  with the policy's tokenizer without its EOS text, in the reward model's chat template, tokenized as
  the server tokenizes a text input (special tokens added, once).
- false (verl 0.8's legacy FSDP worker): the policy's own token ids when the two tokenizers have the
  same vocabulary, else the conversation rebuilt from the raw chat plus the decoded response and
  re-tokenized with the reward model's chat template.
"""

from __future__ import annotations

import torch

from rlframe.distributed.padding import position_ids_from_mask
from rlframe.models.reward_head import load_token_score_model
from rlframe.protocol import DataProto
from rlframe.single_controller import Dispatch, register
from rlframe.workers.dtypes import resolve_dtype
from rlframe.workers.fsdp_workers import FSDPWorkerBase
from rlframe.workers.fsdp_wrap import FSDPSpec, wrap_fsdp
from rlframe.workers.model_forward import VALUES, layout_for, score_positions


def last_token_scores(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_remove_padding: bool = False
) -> torch.Tensor:
    """Score [bs] read at each row's last valid token (rows may be left- and right-padded).

    The actor's and critic's forward (`rlframe.workers.model_forward`) with a value head, read at every
    column; `use_remove_padding` runs the packed row instead (the model must use rlframe's varlen attention).
    """
    micro_batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
    }
    layout = layout_for(use_remove_padding)
    values = score_positions(model, micro_batch, VALUES, layout, slice(0, input_ids.shape[1]))["values"]
    last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).long().argmax(-1)
    return values[torch.arange(values.shape[0], device=values.device), last].float()


def load_reward_model(path: str, use_remove_padding: bool):
    """The checkpoint's sequence classifier scoring every token (`TokenScoreModel`), fp32, eval, no gradients."""
    from rlframe.distributed.attention import register_varlen_attention

    refuse_vision_reward_model(path)
    attn = register_varlen_attention() if use_remove_padding else "sdpa"
    model = load_token_score_model(path, dtype=torch.float32, attn_implementation=attn)
    return model.requires_grad_(False).eval()


def refuse_vision_reward_model(path: str) -> None:
    """A vision-language reward model would score the text without its images: refused, naming the key."""
    from transformers import AutoConfig

    from rlframe.models.vision import is_vision_model

    if is_vision_model(AutoConfig.from_pretrained(path)):
        raise ValueError(
            f"reward_model.model.path={path} is a vision-language model (its config has a vision_config); a reward "
            "model of one is not implemented: give reward_model.model.path a text sequence classifier, or score "
            "with a reward function (custom_reward_function.path)"
        )


def place_on_last_response_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[bs] scores -> [bs, response_length] with each score at its last valid response token."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=scores.device)
    lengths = response_mask.long().sum(-1)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, lengths[rows] - 1] = scores[rows]
    return out


def reward_loop_texts(data: DataProto, policy_tokenizer, rm_tokenizer) -> list[str]:
    """The text verl 0.9.1's reward loop scores per row (its `RewardLoopWorker._preprocess_reward_inputs`).

    The response is every token the attention mask keeps (tool turns of a multi-turn row included),
    decoded with special tokens and stripped of the policy's EOS text; the reward model's chat template
    renders the raw chat plus that answer without a generation prompt, and a leading BOS text is cut
    (the server's tokenizer adds it again).
    """
    if "raw_prompt" not in data.non_tensor_batch:
        raise ValueError(
            "reward_model.use_reward_loop=true scores the raw chat plus the response: set data.return_raw_chat=true"
        )
    responses = data.batch["responses"]
    valid_lengths = data.batch["attention_mask"][:, -responses.shape[-1] :].sum(-1).tolist()
    bos, eos = rm_tokenizer.bos_token, policy_tokenizer.eos_token
    texts = []
    for prompt, response, length in zip(data.non_tensor_batch["raw_prompt"], responses, valid_lengths):
        answer = policy_tokenizer.decode(response[:length])
        if eos:
            answer = answer.replace(eos, "")
        chat = [*prompt, {"role": "assistant", "content": answer}]
        text = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
        texts.append(text[len(bos) :] if bos and text.startswith(bos) else text)
    return texts


class RewardModelWorker(FSDPWorkerBase):
    """FSDP-sharded reward model; `compute_rm_score` returns `rm_scores`."""

    # `actor_rollout_ref`: the actor's FSDP strategy and nccl_timeout; `data`: the policy tokenizer's trust flag
    SECTIONS = ("reward_model", "actor_rollout_ref", "data", "trainer")

    def __init__(self, sections: dict, plan):
        super().__init__(sections, plan)
        self._strategy = str(self.config.actor_rollout_ref.actor.strategy)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int) -> None:
        from transformers import AutoTokenizer

        rm_cfg = self.config.reward_model
        fsdp_cfg = rm_cfg.model.fsdp_config
        self._init_dist(self.plan.reward_model_parallel)
        path = str(rm_cfg.model.path)
        self.rm_tokenizer = AutoTokenizer.from_pretrained(path)
        self.policy_tokenizer = AutoTokenizer.from_pretrained(
            str(rm_cfg.model.input_tokenizer), trust_remote_code=bool(self.config.data.trust_remote_code)
        )
        self.same_tokenizer = self.rm_tokenizer.get_vocab() == self.policy_tokenizer.get_vocab()
        self.use_reward_loop = bool(rm_cfg.use_reward_loop)
        if self.rm_tokenizer.pad_token is None:  # padding only fills masked positions
            self.rm_tokenizer.pad_token = self.rm_tokenizer.eos_token
        self.use_remove_padding = bool(rm_cfg.model.use_remove_padding)
        model = load_reward_model(path, self.use_remove_padding)
        spec = FSDPSpec(
            strategy=self._strategy,
            param_dtype=resolve_dtype("auto", self.device_type),
            reduce_dtype=torch.float32,
            param_offload=bool(fsdp_cfg.param_offload),
            reshard_after_forward=bool(fsdp_cfg.reshard_after_forward),
            forward_prefetch=bool(fsdp_cfg.forward_prefetch),
        )
        self.module = wrap_fsdp(model, spec, self.dims.fsdp_mesh, self.device_type, self.shared_memory)
        self.micro_batch_size = int(rm_cfg.micro_batch_size_per_gpu)

    def _rm_inputs(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_reward_loop:  # as the server of verl's reward loop tokenizes a text input: special tokens added
            texts = reward_loop_texts(data, self.policy_tokenizer, self.rm_tokenizer)
            encoded = self.rm_tokenizer(texts, return_tensors="pt", padding=True)
            return encoded["input_ids"], encoded["attention_mask"]
        if self.same_tokenizer:
            return data.batch["input_ids"], data.batch["attention_mask"]
        if "raw_prompt" not in data.non_tensor_batch:
            raise ValueError(
                "the reward model's tokenizer differs from the policy's: set "
                "data.return_raw_chat=true so conversations can be re-tokenized"
            )
        responses = self.policy_tokenizer.batch_decode(
            [r[m.bool()] for r, m in zip(data.batch["responses"], data.batch["response_mask"])],
            skip_special_tokens=True,
        )
        chats = [
            list(prompt) + [{"role": "assistant", "content": text}]
            for prompt, text in zip(data.non_tensor_batch["raw_prompt"], responses)
        ]
        texts = [self.rm_tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]
        encoded = self.rm_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return encoded["input_ids"], encoded["attention_mask"]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        device = "cpu" if self.device_type == "cpu" else torch.cuda.current_device()
        input_ids, attention_mask = self._rm_inputs(data)
        scores = []
        with torch.no_grad():
            for start in range(0, len(input_ids), self.micro_batch_size):
                rows = slice(start, start + self.micro_batch_size)
                ids, mask = input_ids[rows].to(device), attention_mask[rows].to(device)
                scores.append(last_token_scores(self.module, ids, mask, self.use_remove_padding).cpu())
        rm_scores = place_on_last_response_token(torch.cat(scores), data.batch["response_mask"])
        return DataProto.from_dict({"rm_scores": rm_scores})
