"""Made-up log-probabilities for the simulated engine, in vLLM's OpenAI shapes.

The values are a pure function of (token id, position): the same answer always carries the same
logprobs. The sampled token is the most likely one (rank 1), so it is always the first entry of
``top_logprobs``; the other entries are decreasingly likely made-up words. Token strings are the
pieces of the answer's text (a leading space on every token but the first), so joining them gives
the text back, as with a real tokenizer.

Chat (``logprobs: true``, ``top_logprobs: k``)::

    {"content": [{"token": "kalo", "logprob": -0.41, "bytes": [...],
                  "top_logprobs": [{"token": "kalo", "logprob": -0.41, "bytes": [...]}, ...k]}]}

Completions (``logprobs: k``; vLLM always includes the sampled token, so ``max(k, 1)`` entries)::

    {"text_offset": [0, 4, ...], "token_logprobs": [-0.41, ...], "tokens": ["kalo", " vemi", ...],
     "top_logprobs": [{"kalo": -0.41, ...}, ...]}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def _logprob(token_id: int, position: int, rank: int) -> float:
    base = ((token_id * 2654435761 + position * 40503) % 997) / 997.0  # 0..1
    return round(-(0.05 + 1.5 * base) - 0.9 * rank, 4)


def _alternative(token_id: int, rank: int, vocab: int) -> int:
    return (token_id + rank * 7919) % vocab


def token_pieces(words: Sequence[str], first_position: int) -> list[str]:
    return [w if first_position + i == 0 else " " + w for i, w in enumerate(words)]


def chat_logprobs(token_ids: Sequence[int], first_position: int, top: int,
                  decode_token: Callable[[int], str], vocab: int) -> dict[str, Any]:
    pieces = token_pieces([decode_token(t) for t in token_ids], first_position)
    content = []
    for i, (tid, piece) in enumerate(zip(token_ids, pieces, strict=True)):
        pos = first_position + i
        lp = _logprob(tid, pos, 0)
        alts = []
        for rank in range(top):
            t = tid if rank == 0 else _alternative(tid, rank, vocab)
            text = piece if rank == 0 else (" " if pos else "") + decode_token(t)
            alts.append({"token": text, "logprob": _logprob(tid, pos, rank), "bytes": list(text.encode())})
        content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": alts})
    return {"content": content}


def completion_logprobs(token_ids: Sequence[int], first_position: int, top: int, text_offset: int,
                        decode_token: Callable[[int], str], vocab: int) -> dict[str, Any]:
    """``text_offset`` is where these tokens start in the whole answer's text."""
    pieces = token_pieces([decode_token(t) for t in token_ids], first_position)
    offsets, lps, tops = [], [], []
    at = text_offset
    for i, (tid, piece) in enumerate(zip(token_ids, pieces, strict=True)):
        pos = first_position + i
        offsets.append(at)
        at += len(piece)
        lps.append(_logprob(tid, pos, 0))
        entry = {piece: _logprob(tid, pos, 0)}
        for rank in range(1, max(top, 1)):
            entry[(" " if pos else "") + decode_token(_alternative(tid, rank, vocab))] = _logprob(tid, pos, rank)
        tops.append(entry)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": pieces, "top_logprobs": tops}
