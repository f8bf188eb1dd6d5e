"""OpenAI chat message content → the text a chat template sees: one rule for every tokenizer.

A string is itself; a list of parts becomes its text parts (``{"type": "text"}``, the Responses-style
``{"type": "input_text"}``, or bare strings) joined by newlines, as vLLM gives a "string"-format chat
template. Any other part (an image, audio, a file) makes the content untokenizable here: the engine
expands it into placeholder tokens the router cannot reproduce, so a router-side token count or block
hash would be wrong. The router then routes that request without a prefix lookup; a simulated engine
refuses it as a text-only model does.
"""

from __future__ import annotations

from typing import Any

TEXT_PART_TYPES = ("text", "input_text")


class Untokenizable(Exception):
    """This request's content cannot be tokenized locally (non-text parts, template error)."""


def message_text(content: Any) -> str:
    """One message's ``content`` → its text (see the module docstring); raises ``Untokenizable``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES:
                texts.append(str(part.get("text", "")))
            else:
                raise Untokenizable("non-text message part")
        return "\n".join(texts)
    raise Untokenizable("message content of unexpected type")
