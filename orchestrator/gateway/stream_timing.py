"""Inter-token latency as the client sees it, measured on the bytes of a relayed SSE stream.

Cheap by design: no JSON decoding per chunk. Every ``data: {`` event is a chunk of generated text
(OpenAI streams one event per engine step), except the usage-only event (``"choices":[]``) and
``data: [DONE]``. The gap between the arrival of successive token events is one ITL observation;
several events relayed in one write arrived together, so the ones after the first observe 0.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

_EVENT = b"data: {"
_NO_TOKENS = b'"choices":[]'


class TokenTimer:
    """``event``/``no_tokens``: what marks a token event in this stream's protocol (stream_protocol.py;
    the defaults are OpenAI chunks')."""

    __slots__ = ("_observe", "_last", "_event", "_no_tokens")

    def __init__(self, histogram: Any, event: bytes = _EVENT, no_tokens: bytes | None = _NO_TOKENS) -> None:
        self._observe = histogram.observe
        self._last: float | None = None
        self._event = event
        self._no_tokens = no_tokens

    def on_bytes(self, body: bytes) -> None:
        events = body.count(self._event)
        if not events:
            return
        if self._no_tokens is not None:
            events -= body.count(self._no_tokens)
        if events <= 0:
            return
        now = time.perf_counter()
        if self._last is not None:  # (the first token's wait is TTFT, not ITL)
            self._observe(now - self._last)
        for _ in range(events - 1):
            self._observe(0.0)
        self._last = now

    def wrap(self, send: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        """``send`` that times the token events of every body it passes on."""

        async def timed_send(message: Any) -> None:
            body = message.get("body")
            if body:
                self.on_bytes(body)
            await send(message)

        return timed_send
