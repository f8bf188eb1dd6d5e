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
    __slots__ = ("_observe", "_last")

    def __init__(self, histogram: Any) -> None:
        self._observe = histogram.observe
        self._last: float | None = None

    def on_bytes(self, body: bytes) -> None:
        events = body.count(_EVENT)
        if not events:
            return
        events -= body.count(_NO_TOKENS)
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
