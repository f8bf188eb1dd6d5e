"""The word tokenizer of Dyad's simulated engines: one token per whitespace-separated word.

It lives in ``kv`` (production code) because the gateway tokenizes for simulated engines with it;
the simulator (``orchestrator/sim``, a leaf that production code never imports) re-exports it from
``orchestrator.sim.tokenizer``.

Deterministic across processes and machines (crc32, not Python's salted ``hash``), needs no files,
and is fast. The gateway's router-side tokenization and the benchmark's trace synthesizer use this
exact class for simulated engines, so router and engine agree on token ids (and therefore on block
hashes) without calling the engine.

``decode`` emits fake words (``q`` + the id spelled in syllables) that ``encode`` maps straight back,
so ``encode(decode(ids)) == ids``: text the simulator generates can be fed back in a later chat turn
and hits the same cached blocks, as with a real model.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from orchestrator.kv.message_content import message_text

DEFAULT_VOCAB_SIZE = 32000

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "su", "do", "ha", "ji", "fu", "be", "xo")


_SYLLABLE_VALUE = {s: i for i, s in enumerate(_SYLLABLES)}
_FAKE_WORD_CACHE: dict[int, str] = {}


def _fake_word(n: int) -> str:
    """The word ``decode`` emits for id n: ``q`` + n spelled in base-16 syllables (``qkalo``)."""
    w = _FAKE_WORD_CACHE.get(n)
    if w is None:
        parts = []
        m = n
        while True:
            m, r = divmod(m, 16)
            parts.append(_SYLLABLES[r])
            if m == 0:
                break
        w = _FAKE_WORD_CACHE[n] = "q" + "".join(reversed(parts))
    return w


def _fake_word_value(word: str) -> int | None:
    """Inverse of ``_fake_word``; None when the word is not one of ours."""
    if len(word) < 3 or len(word) % 2 == 0 or word[0] != "q":
        return None
    n = 0
    for i in range(1, len(word), 2):
        v = _SYLLABLE_VALUE.get(word[i : i + 2])
        if v is None:
            return None
        n = n * 16 + v
    return n


MEMO_WORDS = 1_000_000


class _WordIds(dict[str, int]):
    """word → id, memoized (bounded): a subscript of a known word stays in C, a new word computes its id."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def __missing__(self, word: str) -> int:
        fake = _fake_word_value(word) if word[0] == "q" else None
        if fake is not None and fake < self.vocab_size:
            tid = fake
        else:
            tid = zlib.crc32(word.encode("utf-8")) % self.vocab_size
        if len(self) < MEMO_WORDS:  # bounded memo
            self[word] = tid
        return tid


class SimTokenizer:
    """Word-level tokenizer. ``id = crc32(word) mod vocab_size`` (our own decoded words map back)."""

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        if vocab_size < 16:
            raise ValueError("vocab_size must be at least 16")
        self.vocab_size = vocab_size
        self._word_ids = _WordIds(vocab_size)

    # --- text → ids -------------------------------------------------------------------------
    def token_id(self, word: str) -> int:
        return self._word_ids[word]

    def encode(self, text: str) -> list[int]:
        # One C-level pass: known words are dict hits, new ones go through ``_WordIds.__missing__``.
        return list(map(self._word_ids.__getitem__, text.split()))

    def count(self, text: str) -> int:
        return len(text.split())

    # --- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Iterable[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """A simple role-tagged template: ``<|role|> content <|end|>`` per message, then
        ``<|assistant|>`` when a reply is to be generated."""
        parts = []
        for m in messages:
            role = str(m.get("role", "user"))
            parts.append(f"<|{role}|> {message_text(m.get('content'))} <|end|>")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return " ".join(parts)

    def encode_chat(self, messages: Iterable[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

    # --- ids → text -------------------------------------------------------------------------
    def decode_token(self, token_id: int) -> str:
        return _fake_word(token_id % self.vocab_size)

    def decode(self, ids: Sequence[int]) -> str:
        v = self.vocab_size
        return " ".join([_fake_word(i % v) for i in ids])


def output_token_ids(seed: int, start: int, count: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """The tokens a simulated engine generates: a pure function of a per-request seed and the
    position, so the same prompt under the same engine seed always yields the same text."""
    base = (seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return [(((base + i * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF) >> 29) % vocab_size for i in range(start, start + count)]
