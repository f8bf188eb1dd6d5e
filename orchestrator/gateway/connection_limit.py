"""A bound on open client connections (``gateway.max_connections``), answered with a clear 503.

Each HTTP connection costs the gateway memory and a place in the event loop's work whether or not it
sends requests; a client (or many) holding thousands open starves everyone. Past the bound a new
connection gets a complete ``503`` in OpenAI's error shape naming the limit, with ``Retry-After``, and
is closed at once — never read, never queued. Connections already open are not affected.
"""

from __future__ import annotations

from typing import Any

import orjson

from orchestrator.errors import error_body


def refusal(limit: int, retry_after_s: int) -> bytes:
    body = orjson.dumps(error_body(
        f"The gateway has {limit} client connections open, its limit (gateway.max_connections). "
        "Retry later, or reuse a connection.", "service_unavailable", None, "too_many_connections"))
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (max(1, retry_after_s), len(body), body))


def limited_protocol(base: type, limit: int, retry_after_s: int) -> type:
    """``base`` (a uvicorn HTTP protocol class) refusing connections beyond ``limit`` open ones."""
    state = {"open": 0}
    answer = refusal(limit, retry_after_s)

    def connection_made(self: Any, transport: Any) -> None:
        if state["open"] >= limit:
            self._dyad_counted = False
            transport.write(answer)
            transport.close()
            return
        self._dyad_counted = True
        state["open"] += 1
        base.connection_made(self, transport)

    def connection_lost(self: Any, exc: Exception | None) -> None:
        if not getattr(self, "_dyad_counted", False):
            return  # refused: uvicorn never saw it
        self._dyad_counted = False
        state["open"] -= 1
        base.connection_lost(self, exc)

    def data_received(self: Any, data: bytes) -> None:
        if getattr(self, "_dyad_counted", False):
            base.data_received(self, data)

    return type(f"Limited{base.__name__}", (base,), {"connection_made": connection_made,
                                                     "connection_lost": connection_lost,
                                                     "data_received": data_received})
