"""What keeps the gateway's request path cheap (measured in docs/benchmarks.md, "Gateway overhead").

- ``GatewayApp``: the two hot endpoints, dispatched ahead of FastAPI's middleware stack and router;
- ``new_request_id``, ``child`` (cached metric children), ``usage_of`` (usage without parsing it all).

Every request to ``POST /v1/chat/completions`` or ``POST /v1/completions`` would otherwise pass
through about ten ASGI layers (FastAPI telemetry, server-error and exception middleware, the body
limit and exit-stack middleware, route matching, Starlette's request/response wrapper), each one a
coroutine call per request and a wrapped ``send`` per message: together more CPU than the proxying
itself. ``GatewayApp.__call__`` answers those paths directly and hands everything else to
FastAPI unchanged; on the gateway's own connection protocol (``http_server.py``) they do not even
go through ``__call__`` and uvicorn's proxy-headers middleware: the protocol calls ``serve_direct``
(the same code, measured in docs/benchmarks.md, issue 13, "the hot routes straight from the protocol"). The routes stay declared on the app (``app.add_route``; their request schemas in
``/openapi.json`` come from ``openapi.py`` as before), and any scope this fast path does not take (a
``root_path`` mount, other methods) is FastAPI's as before.

Error handling is the app's own: the handlers registered with ``add_exception_handler`` for
``ApiError``, ``HTTPException`` and ``Exception`` render every failure, exactly as FastAPI's
middleware would call them; an exception after the response started is re-raised (the server
closes the connection), as Starlette does.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.requests import Request, empty_send
from starlette.responses import Response

from orchestrator.telemetry.children import child  # noqa: F401 - re-exported (request metrics)

Endpoint = Callable[[Request], Awaitable[Any]]


class HotHeaders(Headers):
    """Starlette's ``Headers`` with lookups by a dict built once (Starlette's scans the list on every
    ``get``: two Python calls and a loop; a hot request makes five to seven lookups). The first value
    of a repeated name wins, as in Starlette; ``raw``/``getlist``/``items`` are Starlette's."""

    def __init__(self, raw: Any) -> None:
        self._list = raw if isinstance(raw, list) else list(raw)
        self._first: dict[str, str] | None = None

    def _lookup(self) -> dict[str, str]:
        first = self._first = {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(self._list)}
        return first

    def get(self, key: str, default: Any = None) -> Any:
        return (self._first or self._lookup()).get(key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return (self._first or self._lookup())[key.lower()]

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, str) and key.lower() in (self._first or self._lookup())


class HotRequest(Request):
    """A Starlette ``Request`` for the hot routes, built without its checks and with ``HotHeaders``."""

    headers = None  # type: ignore[assignment]  # (shadows Starlette's property: a plain attribute here)

    def __init__(self, scope: Any, receive: Any, send: Any = empty_send) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self._stream_consumed = False
        self._is_disconnected = False
        self._form = None
        self.headers = HotHeaders(scope["headers"])  # type: ignore[assignment]


class GatewayApp(FastAPI):
    """FastAPI, except for the POST routes registered with ``add_hot_route``.

    Those are served two ways, with the same code: through ``__call__`` (ASGI, as any app), or — on the
    gateway's own connection protocol (``http_server.py``), for a request that uvicorn's proxy-headers
    middleware would leave as it is — straight from the protocol through ``serve_direct``, which skips
    that middleware and this class's dispatch. Either way the endpoint and its ASGI response are the
    same objects and write through the same ``send``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hot: dict[str, Endpoint] = {}

    def hot_endpoint(self, method: str, path: str, root_path: str) -> Endpoint | None:
        """The endpoint ``serve_direct`` may run for this request, if any (the same test as ``__call__``)."""
        if method == "POST" and not root_path:
            return self._hot.get(path)
        return None

    async def serve_direct(self, endpoint: Endpoint, scope: Any, receive: Any, send: Any, cycle: Any) -> None:
        """Run ``endpoint`` and its response; ``cycle.start_tried`` says whether the answer's head was offered
        to ``send`` (after which an error can no longer be rendered: it is re-raised and the server closes
        the connection). The connection protocol passes its request cycle; ``__call__`` a ``_TrackedSend``."""
        scope["app"] = self
        request = HotRequest(scope, receive, send)
        try:
            response = await endpoint(request)
            await response(scope, receive, send)
        except Exception as exc:
            handler = self._handler(exc)
            if cycle.start_tried or handler is None:
                raise
            error_response = await handler(request, exc)
            await error_response(scope, receive, send)
            if self._handler_is_catch_all(exc):
                raise  # as Starlette's ServerErrorMiddleware: the server logs it too

    def add_hot_route(self, path: str, endpoint: Endpoint) -> None:
        """``POST path`` served by ``endpoint`` without FastAPI's layers (and declared as a normal route)."""
        self._hot[path] = endpoint
        self.add_route(path, endpoint, methods=["POST"])

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self._hot.get(scope["path"])
            if endpoint is not None:
                await self._serve_hot(endpoint, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _handler(self, exc: Exception) -> Callable[[Request, Exception], Awaitable[Response]] | None:
        for cls in type(exc).__mro__:
            handler = self.exception_handlers.get(cls)
            if handler is not None:
                return handler  # type: ignore[no-any-return]
        return None

    async def _serve_hot(self, endpoint: Endpoint, scope: Any, receive: Any, send: Any) -> None:
        tracked = _TrackedSend(send)
        await self.serve_direct(endpoint, scope, receive, tracked, tracked)

    def _handler_is_catch_all(self, exc: Exception) -> bool:
        for cls in type(exc).__mro__:
            if cls in self.exception_handlers:
                return cls is Exception
        return False


class _TrackedSend:
    """An ASGI ``send`` that remembers whether the answer's head went out (``start_tried``)."""

    __slots__ = ("send", "start_tried")

    def __init__(self, send: Any) -> None:
        self.send = send
        self.start_tried = False

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.start_tried = True
        await self.send(message)


# --- small per-request helpers ------------------------------------------------------------------

_RID_PREFIX = os.urandom(8).hex()  # 64 random bits per process: ids stay unique across gateway replicas
_RID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """A fresh request id: this process's random prefix + a counter (``uuid4().hex`` costs several
    times as much: an ``os.urandom`` syscall and a ``UUID`` object per request)."""
    return f"{_RID_PREFIX}{next(_RID_COUNTER):016x}"


_USAGE = b'"usage"'


def usage_of(body: bytes) -> Any:
    """The ``usage`` object of an OpenAI JSON answer, without parsing the whole answer.

    The last ``"usage"`` key is located from the end (an escaped quote inside generated text can
    never match; OpenAI, vLLM and SGLang answers have that key once, at the top level) and only its
    object is parsed; anything unexpected falls back to parsing the whole answer.
    Returns None when there is no usage object.
    """
    idx = body.rfind(_USAGE)
    if idx < 0:
        return None
    start = body.find(b"{", idx + len(_USAGE))
    end = body.find(b"}", start + 1) if start >= 0 else -1
    if start >= 0 and end > 0 and body[idx + len(_USAGE):start].strip() == b":":
        # usage holds numbers and at most one level of nested objects (``*_tokens_details``)
        while body.count(b"{", start, end) > body.count(b"}", start, end + 1):
            end = body.find(b"}", end + 1)
            if end < 0:
                break
        if end > 0:
            try:
                return orjson.loads(body[start:end + 1])
            except orjson.JSONDecodeError:
                pass
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data.get("usage") if isinstance(data, dict) else None
