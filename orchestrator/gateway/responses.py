"""Small ASGI helpers for answers the gateway writes itself (errors, JSON)."""

from __future__ import annotations

from typing import Any

import orjson

from orchestrator.errors import ApiError, error_body

JSON = b"application/json"


def error_payload(err: ApiError) -> bytes:
    return orjson.dumps(err.body())


async def send_bytes(send: Any, status: int, body: bytes, content_type: bytes = JSON,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        raw.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Any, err: ApiError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    extra = [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    await send_bytes(send, err.status, error_payload(err), headers=(headers or []) + extra)


def engine_error_body(status: int, raw: bytes) -> bytes:
    """An engine's error answer in OpenAI's shape, keeping its message (and type/param/code if any).

    vLLM/SGLang answer either ``{"error": {...}}`` (passed through as is) or the older
    ``{"object": "error", "message": ..., "type": ..., "code": ...}``; anything else is wrapped.
    """
    try:
        data = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return raw
        message = data.get("message") or data.get("detail") or (err if isinstance(err, str) else None)
        if message is not None:
            if not isinstance(message, str):
                message = orjson.dumps(message).decode()
            return orjson.dumps(error_body(message, str(data.get("type") or "upstream_error"),
                                           data.get("param"), data.get("code")))
    text = raw.decode("utf-8", "replace").strip()[:1000] or f"engine answered HTTP {status}"
    return orjson.dumps(error_body(text, "upstream_error", None, None))
