"""A test agent written only with the `openai` package: two chat turns, the second extending the first."""

import openai


async def agent(base_url, sample):
    api = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    models = await api.models.list()
    messages = list(sample["prompt"])
    first = await api.chat.completions.create(model=models.data[0].id, messages=messages, max_tokens=6)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    await api.chat.completions.create(model=models.data[0].id, messages=messages, max_tokens=6)
    return None  # the configured reward function scores the conversation
