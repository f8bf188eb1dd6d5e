"""Prompt length without a tokenizer: about four characters per token.

Good enough for load accounting (in-flight prefill tokens); prefix-aware routing replaces it with
real token ids when a tokenizer or the engine's /tokenize is available.
"""

from __future__ import annotations

from typing import Any

CHARS_PER_TOKEN = 4


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # multi-part content: [{"type": "text", "text": ...}, ...]
        total = 0
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    total += len(text)
            elif isinstance(part, str):
                total += len(part)
        return total
    return 0


def estimate_prompt_tokens(endpoint: str, body: dict[str, Any]) -> int:
    """Estimated prompt tokens of a chat or completions body (token-id prompts are counted exactly)."""
    if endpoint.endswith("chat/completions"):
        chars = 0
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                chars += _text_chars(m.get("content"))
        return max(1, chars // CHARS_PER_TOKEN)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return max(1, len(prompt) // CHARS_PER_TOKEN)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return len(prompt)  # already token ids
        if isinstance(first, list):
            return sum(len(p) for p in prompt if isinstance(p, list))
        return max(1, sum(len(p) for p in prompt if isinstance(p, str)) // CHARS_PER_TOKEN)
    return 1
