"""Chat templates rendered under bounds: a template is a program (Jinja) that may loop or allocate without end.

transformers renders a template in Jinja's sandbox, which keeps it from reaching Python's internals but bounds
neither time nor size: nested `range` loops run for hours and `'x' * 10**9` allocates a gigabyte. So a dataset's
prompts are rendered in one forked child process, which streams each row's text back in order, and three bounds
hold there:

- time: the parent waits at most `RENDER_TIMEOUT_S` for each row, then kills the child;
- memory: the child's address space may grow by at most `RENDER_MEMORY_BYTES` (`RLIMIT_AS`), so a huge value
  fails with a MemoryError instead of taking the machine's memory;
- length: a text over `MAX_RENDERED_CHARS` characters is refused (far beyond any model's context window).

Forking shares the tokenizer and the prompts with the child without copying them; the child only renders (the
parent tokenizes while it does). On the tiny tokenizer this costs ~80 ms per dataset (the fork, and the template
compiled again in the child), and rows go faster than rendered in-process on two cores (docs/data_and_rewards.md).
Each error names the row (`where`) and the bound.
"""

from __future__ import annotations

import multiprocessing
import os
import reprlib
import resource
from collections.abc import Iterator
from typing import NamedTuple

RENDER_TIMEOUT_S = 10.0  # one row's rendering; a real template takes well under a millisecond
RENDER_MEMORY_BYTES = 512 * 2**20  # growth of the rendering process: a few copies of the longest text
MAX_RENDERED_CHARS = 2**24  # ~16.8 M characters, a few million tokens


class ChatRender(NamedTuple):
    """One rendering: the messages, and `apply_chat_template`'s keyword arguments besides `tokenize=False`."""

    messages: list
    kwargs: dict
    user_first: bool = False  # on a failure, render after an empty user turn and cut it off (verl's fallback)


# an empty user turn, for templates that refuse a conversation not opened by a user (verl's fallback, Qwen3.5's)
EMPTY_USER = {"role": "user", "content": [{"type": "text", "text": ""}]}


class _Failure(NamedTuple):
    """A row the child could not render: what went wrong, as text (an exception may not pickle)."""

    kind: str  # error | memory | length
    message: str


def render_chat_prompts(tokenizer, conversations: list, template_kwargs: dict, wheres: list[str]) -> Iterator[str]:
    """Each conversation rendered by the tokenizer's chat template (with the generation prompt), in order, bounded.

    `wheres[i]` names row i in errors (file, row, column). Raises ValueError on the first row that fails, runs past
    RENDER_TIMEOUT_S, needs more than RENDER_MEMORY_BYTES or renders more than MAX_RENDERED_CHARS characters.
    """
    kwargs = {"add_generation_prompt": True, **template_kwargs}
    return render_chat(tokenizer, [ChatRender(messages, kwargs) for messages in conversations], wheres)


def render_chat(tokenizer, renders: list[ChatRender], wheres: list[str], noun: str = "prompt") -> Iterator[str]:
    """Each rendering's text, in order, under the three bounds; `wheres[i]` names rendering i (and `noun` what it
    renders) in errors."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(  # daemon: never outlives the parent, even if the iterator is left unfinished
        target=_render_all,
        args=(sender, tokenizer, renders),
        name="rlframe-chat-template",
        daemon=True,
    )
    child.start()
    sender.close()  # the child holds the only writer: its death ends the pipe
    try:
        for row, where in enumerate(wheres):
            if not receiver.poll(RENDER_TIMEOUT_S):
                raise ValueError(
                    f"{where}: the chat template did not finish rendering this {noun} within {RENDER_TIMEOUT_S:g} s, "
                    "the bound on one row (RENDER_TIMEOUT_S in rlframe/data/template.py): a loop without end in the "
                    "template (nested range?). Fix the tokenizer's chat template (data.tokenizer)"
                )
            try:
                result = receiver.recv()
            except EOFError:
                child.join(5)
                raise ValueError(
                    f"{where}: the process rendering the chat template died on this {noun} (exit code "
                    f"{child.exitcode}; killed by the kernel for memory?)"
                ) from None
            if isinstance(result, _Failure):
                raise ValueError(_failure_message(result, where, renders[row].messages, noun))
            yield result
    finally:
        receiver.close()
        if child.is_alive():
            child.kill()
        child.join()


def _failure_message(failure: _Failure, where: str, messages, noun: str) -> str:
    if failure.kind == "memory":
        return (
            f"{where}: the chat template needed more than {RENDER_MEMORY_BYTES // 2**20} MiB to render this {noun}, "
            "the bound on one row (RENDER_MEMORY_BYTES in rlframe/data/template.py): it builds a huge value "
            "(e.g. 'x' * 10**9). Fix the tokenizer's chat template (data.tokenizer)"
        )
    if failure.kind == "length":
        return (
            f"{where}: the chat template rendered this {noun} as {failure.message} characters, more than the bound "
            f"of {MAX_RENDERED_CHARS:,} (MAX_RENDERED_CHARS in rlframe/data/template.py). Fix the tokenizer's chat "
            f"template (data.tokenizer) or shorten the {noun}"
        )
    return (
        f"{where}: the tokenizer's chat template failed on this {noun} ({failure.message}); "
        f"the {noun} was {reprlib.repr(messages)}"
    )


def _render_all(sender, tokenizer, renders: list[ChatRender]) -> None:
    """In the child: cap the address space, then send each rendering's text (or a _Failure), in order."""
    _limit_address_space(RENDER_MEMORY_BYTES)
    for render in renders:
        sender.send(_render_one(tokenizer, render))
    sender.close()


def _render_one(tokenizer, render: ChatRender):
    try:
        try:
            text = tokenizer.apply_chat_template(render.messages, tokenize=False, **render.kwargs)
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001 - a template that wants a user turn first: render after an empty one
            if not render.user_first:
                raise
            kwargs = {**render.kwargs, "add_generation_prompt": False}
            prefix = tokenizer.apply_chat_template([EMPTY_USER], tokenize=False, **kwargs)
            text = tokenizer.apply_chat_template([EMPTY_USER, *render.messages], tokenize=False, **render.kwargs)
            text = text[len(prefix) :]
    except MemoryError:
        return _Failure("memory", "")
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError (raise_exception), or any error inside the template
        return _Failure("error", f"{type(e).__name__}: {e}")
    if not isinstance(text, str):
        return _Failure("error", f"it returned {type(text).__name__} {reprlib.repr(text)}, not text")
    if len(text) > MAX_RENDERED_CHARS:
        return _Failure("length", f"{len(text):,}")
    return text


def _limit_address_space(growth_bytes: int) -> None:
    """Let this process's virtual memory grow by at most `growth_bytes` from its size now (Linux only)."""
    if not os.path.exists("/proc/self/statm"):  # no procfs to read the size from: the other bounds still hold
        return
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + growth_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
