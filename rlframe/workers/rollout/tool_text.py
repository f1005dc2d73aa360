"""What a tool answers enters the conversation as text: never chat structure, never terminal control.

Two steps, both before the answer reaches the model, the console or the logs:

- `visible_text`: ANSI escape sequences are removed; other control characters (and the bidirectional overrides
  that reorder how a console shows a line) are written as visible escapes (`\\x07`, `\\u202e`).
- `split_rendering` + `encode_pieces`: the chat template renders the conversation; the text it wrote for each
  `tool` message's content is found exactly (by rendering with unguessable placeholders in its place), and that
  text is tokenized with the template's control tokens switched off. A tool answer that spells `<|im_end|>`
  becomes the tokens of the characters `<`, `|`, `im`, ...; the `<|im_end|>` the template writes around it stays
  the special token. Everything else is tokenized exactly as the plain `tokenizer.encode` of the rendering would.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

TOOL_ROLE = "tool"
Piece = tuple[str, bool]  # (text, whether a tool wrote it)

# ECMA-48 escape sequences: CSI (colours, cursor moves, erasing), the string commands (OSC window titles and
# hyperlinks, DCS, SOS, PM, APC) up to their terminator, then every other ESC + intermediates + final byte. An
# unterminated string command loses only its introducer, never the text after it.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[ -/]*[0-~]")
# C0 controls but tab and newline, DEL, C1 controls, and the bidirectional embeddings, overrides and isolates
_INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def visible_text(text: str) -> str:
    """`text` without ANSI escape sequences, CRLF as LF, and every other control character as a visible escape."""
    text = _ANSI_ESCAPE.sub("", text).replace("\r\n", "\n")
    return _INVISIBLE.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)


def split_rendering(render: Callable[[list[dict]], str], messages: list[dict]) -> list[Piece]:
    """`render(messages)` cut into pieces: the template's own text, and what it wrote for each tool's content.

    A tool message's content is rendered as a placeholder first, then alone in its place; the text between the
    template's known prefix and suffix is what the template made of it (verbatim, trimmed, JSON-quoted: any
    transformation). The pieces must join to the real rendering, or the template is refused.
    """
    nonce = secrets.token_hex(8)  # a tool cannot guess it, so no answer can spell a placeholder
    marks = {
        index: f"rlframe{nonce}tool{index}end"  # "tool1end" is no part of "tool10end"
        for index, message in enumerate(messages)
        if message.get("role") == TOOL_ROLE and isinstance(message.get("content"), str)
    }
    masked = [{**message, "content": marks[i]} if i in marks else message for i, message in enumerate(messages)]
    skeleton = render(masked)
    pieces, start = [], 0
    for index, mark in marks.items():
        at = skeleton.find(mark, start)
        if at < 0:
            continue  # the template does not write this message's content (checked below)
        prefix, suffix = skeleton[:at], skeleton[at + len(mark) :]
        if mark in suffix:
            raise ValueError("the chat template writes a tool message's content twice; rlframe cannot tokenize it")
        alone = render([messages[i] if i == index else m for i, m in enumerate(masked)])
        if len(alone) < len(prefix) + len(suffix) or not (alone.startswith(prefix) and alone.endswith(suffix)):
            raise ValueError("the chat template renders the rest of the conversation differently by a tool's answer")
        pieces += [(skeleton[start:at], False), (alone[len(prefix) : len(alone) - len(suffix)], True)]
        start = at + len(mark)
    pieces.append((skeleton[start:], False))
    if "".join(text for text, _ in pieces) != (skeleton if not marks else render(messages)):
        raise ValueError("the chat template renders tool answers in a way rlframe cannot locate in its output")
    return pieces


@dataclass(frozen=True)
class AddedTokens:
    """A tokenizer's added tokens: where the template's text is cut into tokens, and what a tool's text may hold."""

    ids: dict[str, int]
    in_template_text: re.Pattern  # every added token, as the plain encode matches them
    in_tool_text: re.Pattern  # only those that are not control tokens

    @classmethod
    def of(cls, tokenizer, chat_template: str) -> AddedTokens:
        """Control tokens: the special ones, and every added token the chat template's source writes (Qwen2.5's
        `<tool_response>` is not special, yet closing it would forge the end of the tool's answer)."""
        added = {token.content: index for index, token in tokenizer.added_tokens_decoder.items()}
        control = {
            token.content
            for token in tokenizer.added_tokens_decoder.values()
            if token.special or (token.content in chat_template and not token.content.isspace())
        }
        return cls(added, _alternation(added), _alternation(set(added) - control))


def _alternation(tokens) -> re.Pattern:
    """A pattern matching any of `tokens`, the longest where several start at one place (as the tokenizer matches
    them); built as a trie, so thousands of added tokens cost one branch per character. Never matches if none."""
    trie: dict = {}
    for token in tokens:
        node = trie
        for char in token:
            node = node.setdefault(char, {})
        node[""] = {}  # a token ends here

    def pattern(node: dict) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in node.items() if char]
        if not branches:
            return ""
        group = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{group})?" if "" in node else group  # greedy: the longer token first, the shorter if it fails

    return re.compile(pattern(trie) or "(?!)")


def encode_pieces(tokenizer, added: AddedTokens, pieces: list[Piece]) -> list[int]:
    """Token ids of the joined pieces: the text between added tokens is tokenized whole, across pieces, and an
    added token counts only where it may appear (anywhere in the template's text; no control token in a tool's)."""
    ids, run = [], []
    for text, from_tool in pieces:
        pattern = added.in_tool_text if from_tool else added.in_template_text
        start = 0
        for match in pattern.finditer(text):
            run.append(text[start : match.start()])
            ids += _plain_ids(tokenizer, "".join(run))
            ids.append(added.ids[match.group()])
            run, start = [], match.end()
        run.append(text[start:])
    return ids + _plain_ids(tokenizer, "".join(run))


def _plain_ids(tokenizer, text: str) -> list[int]:
    """What the tokenizer's pipeline (normalizer, pre-tokenizer, model) makes of text holding no added token."""
    if not text:
        return []
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    words = [word for word, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
    return [token.id for word in words for token in backend.model.tokenize(word)]
