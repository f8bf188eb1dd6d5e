"""A bounded LRU of token ids, keyed by model and a hash of the content, in front of engine tokenizers.

Tokenizing over HTTP costs a round trip per request; chats repeat (system prompts, multi-turn
histories), so the router asks the engine once per distinct content. Keys are a fixed-size digest
of the canonical JSON of the content (the content itself could be megabytes); entries hold token
ids as tuples so a caller cannot mutate a cached value.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import orjson


def content_key(model: str, kind: str, content: Any, options: dict[str, Any] | None = None) -> bytes:
    """Digest of (model, kind, content, options); equal inputs give equal keys across processes."""
    payload = orjson.dumps([model, kind, content, options or {}], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(payload, digest_size=16).digest()


class TokenizeCache:
    """LRU mapping ``content_key`` → token ids, at most ``max_entries`` entries."""

    def __init__(self, max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._data: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: bytes) -> list[int] | None:
        tokens = self._data.get(key)
        if tokens is None:
            self.misses += 1
            return None
        self._data.move_to_end(key)
        self.hits += 1
        return list(tokens)

    def put(self, key: bytes, tokens: list[int]) -> None:
        self._data[key] = tuple(tokens)
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()
