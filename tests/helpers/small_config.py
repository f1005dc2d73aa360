"""The small CPU run the tests build on. rlframe's defaults are verl 0.9.1's (sized for GPU clusters), so a
test that wants the tiny model's scale says so, here, once: the same values the CPU examples set."""

SMALL = [
    "algorithm.adv_estimator=grpo",
    "data.max_prompt_length=64",
    "data.max_response_length=16",
    "data.train_batch_size=8",
    "data.filter_overlong_prompts=true",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_max_token_len_per_gpu=1024",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "critic.model.enable_gradient_checkpointing=false",
    "trainer.total_epochs=1",
]
