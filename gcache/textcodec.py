"""Text <-> token ids for the toy engine (``gcache-engine``) and anyone routing to it.

A byte-level tokenizer: a token id is one byte of the UTF-8 text (0..255), so no
vocabulary file is needed and every text has exactly one encoding. Chat messages
are rendered with a ChatML-style template in which each message is a fixed
string, so the prompt of a conversation's next turn starts with the exact tokens
of the previous turn's prompt and reply (its prefix is cached):

    <|im_start|>system\\n{content}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n

The engine generates only printable ASCII (``GENERATED``) so that a reply decoded
to text and sent back in the next turn encodes to the very ids that were generated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from gcache.errors import GCacheError

VOCAB: Final = 256
GENERATED: Final = range(32, 127)  # printable ASCII
ROLES: Final = frozenset({"system", "user", "assistant", "tool", "developer"})


class PromptError(GCacheError):
    """A request whose prompt or messages cannot be turned into tokens."""


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content", "")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text parts only
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise PromptError("only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise PromptError(f"message content must be a string or a list of parts, got {content!r}")


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat (see the module doc for the template)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise PromptError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise PromptError("each message must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise PromptError(f"unknown message role {role!r}")
        out.append(f"<|im_start|>{role}\n{_content(m)}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def prompt_ids(prompt: Any) -> list[int]:
    """Token ids of an OpenAI ``prompt``: a string, or a list of token ids."""
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt_ids(prompt[0])  # a batch of one
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise PromptError("prompt must be a string or a list of token ids (one prompt)")
