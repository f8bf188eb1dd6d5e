"""The gateway's client-facing HTTP/1.1 protocol (``http_server.py``), driven byte by byte.

No sockets: the protocol gets a recording transport and a real ASGI app, exactly as uvicorn would
hand it a connection. What is checked is what a client sees on the wire.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from orchestrator.gateway.http_server import MAX_HEADER_BYTES, http_protocol


class Transport:
    def __init__(self) -> None:
        self.out = b""
        self.writes = 0
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.out += data
        self.writes += 1

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)


class Config:
    loaded = True
    root_path = ""
    asgi_version = "3.0"
    timeout_keep_alive = 5

    def __init__(self, app: Any) -> None:
        self.loaded_app = app


class ServerState:
    def __init__(self) -> None:
        self.connections: set[Any] = set()
        self.tasks: set[Any] = set()
        self.total_requests = 0
        self.default_headers: list[tuple[bytes, bytes]] = []


async def echo(scope: Any, receive: Any, send: Any) -> None:
    """Answers with the method, path and body it read; ``/stream`` answers in chunks (no length)."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    answer = orjson.dumps({"method": scope["method"], "path": scope["path"], "body": body.decode()})
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for part in (b"a", b"b"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if scope["path"] == "/boom":
        raise RuntimeError("boom")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


def connect(app: Any = echo, header_timeout_s: float | None = None, body_timeout_s: float | None = None,
            keep_alive_s: float = 5):
    state = ServerState()
    config = Config(app)
    config.timeout_keep_alive = keep_alive_s
    proto = http_protocol(header_timeout_s, body_timeout_s)(config, state, {}, asyncio.get_running_loop())
    t = Transport()
    proto.connection_made(t)
    return proto, t, state


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)


async def test_one_write_per_answer_and_keep_alive():
    proto, t, state = connect()
    proto.data_received(post("/v1/completions", b'{"a":1}'))
    await settle()
    assert t.writes == 1  # head and body in one send
    head, body = t.out.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK") and b"connection: close" not in head
    assert orjson.loads(body) == {"method": "POST", "path": "/v1/completions", "body": '{"a":1}'}
    assert not t.closed and state.total_requests == 1
    t.out = b""
    proto.data_received(post("/second", b"x"))  # the same connection serves the next request
    await settle()
    assert b'"path":"/second"' in t.out


async def test_pipelined_requests_are_answered_in_order():
    proto, t, _ = connect()
    proto.data_received(post("/one", b"1") + post("/two", b"22") + post("/three", b""))
    await settle()
    paths = [orjson.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1")[0])["path"]
             for part in t.out.split(b"HTTP/1.1 200 OK")[1:]]
    assert paths == ["/one", "/two", "/three"]
    assert t.reading  # reading resumed once the queue drained


async def test_body_in_pieces_and_chunked_answer():
    proto, t, _ = connect()
    full = post("/stream", b"0123456789")
    proto.data_received(full[:-6])
    await settle()
    assert t.out == b""  # the app waits for the rest of the body
    proto.data_received(full[-6:])
    await settle()
    assert b"transfer-encoding: chunked" in t.out and t.out.endswith(b"1\r\na\r\n1\r\nb\r\n0\r\n\r\n")


async def test_http10_closes_and_head_has_no_body():
    proto, t, _ = connect()
    proto.data_received(b"POST /x HTTP/1.0\r\ncontent-length: 0\r\n\r\n")
    await settle()
    assert b"connection: close" in t.out and t.closed
    proto, t, _ = connect()
    proto.data_received(b"HEAD /x HTTP/1.1\r\nhost: x\r\n\r\n")
    await settle()
    assert t.out.endswith(b"\r\n\r\n") and b"content-length:" in t.out


async def test_expect_100_continue():
    proto, t, _ = connect()
    proto.data_received(b"POST /x HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
    await settle()
    assert t.out == b"HTTP/1.1 100 Continue\r\n\r\n"
    proto.data_received(b"ok")
    await settle()
    assert b'"body":"ok"' in t.out


async def test_unparsable_and_oversized_requests_get_json_errors():
    proto, t, _ = connect()
    proto.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    assert t.closed and t.out.startswith(b"HTTP/1.1 400 Bad Request")
    assert orjson.loads(t.out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_http"
    proto, t, _ = connect()
    proto.data_received(b"GET / HTTP/1.1\r\nx-big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n\r\n")
    assert t.closed and t.out.startswith(b"HTTP/1.1 431")


async def test_slow_headers_and_slow_body_get_408():
    proto, t, _ = connect(header_timeout_s=0.01, body_timeout_s=0.01)
    proto.data_received(b"POST /x HTTP/1.1\r\nhost")
    await asyncio.sleep(0.05)
    assert t.closed and t.out.startswith(b"HTTP/1.1 408") and b"headers" in t.out
    got: list[Any] = []

    async def reader(scope: Any, receive: Any, send: Any) -> None:
        got.append(await receive())
        got.append(await receive())

    proto, t, _ = connect(reader, header_timeout_s=1, body_timeout_s=0.01)
    proto.data_received(b"POST /x HTTP/1.1\r\ncontent-length: 10\r\n\r\n12345")
    await asyncio.sleep(0.05)
    assert t.closed and t.out.startswith(b"HTTP/1.1 408") and b"body" in t.out
    assert got == [{"type": "http.request", "body": b"12345", "more_body": True}, {"type": "http.disconnect"}]


async def test_client_leaving_is_seen_by_the_app_and_app_errors_are_500():
    seen: list[Any] = []

    async def waits(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        seen.append(await receive())  # the body is read: the next message is the client leaving

    proto, t, state = connect(waits)
    proto.data_received(post("/x", b"1"))
    await settle()
    assert seen == [] and len(state.tasks) == 1
    proto.connection_lost(None)
    await settle()
    assert seen == [{"type": "http.disconnect"}] and proto not in state.connections
    proto, t, _ = connect()
    proto.data_received(post("/boom", b""))
    await settle()
    assert t.out.startswith(b"HTTP/1.1 500") and t.closed


async def test_graceful_shutdown_closes_after_the_answer_in_progress():
    release = asyncio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    proto, t, _ = connect(slow)
    proto.data_received(post("/x", b""))
    await settle()
    proto.shutdown()
    assert not t.closed
    release.set()
    await settle()
    assert b"connection: close" in t.out and t.out.endswith(b"ok") and t.closed
    proto, t, _ = connect()
    proto.shutdown()  # idle: closed at once
    assert t.closed


@pytest.mark.parametrize("value", [b"a\rb", b"a\nb"])
async def test_header_values_with_line_breaks_are_refused(value: bytes):
    async def bad(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-bad", value)]})

    proto, t, _ = connect(bad)
    proto.data_received(post("/x", b""))
    await settle()
    assert b"x-bad" not in t.out and t.out.startswith(b"HTTP/1.1 500")


@pytest.mark.parametrize("headers", [
    [(b"x-ok", b"1"), (b"x bad", b"1")],
    [(b"x-ok", b"1"), (b"x-ok\r\nx-injected", b"1")],
    [(b"x-ok", b"fine"), (b"x-ok", b"also\tfine"), (b"x-later", b"bad\x00")],
])
async def test_bad_header_names_and_values_are_refused_wherever_they_are(headers: list[tuple[bytes, bytes]]):
    async def bad(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})

    for _ in range(2):  # (the second time, the good names are known)
        proto, t, _ = connect(bad)
        proto.data_received(post("/x", b""))
        await settle()
        assert b"x-ok" not in t.out and t.out.startswith(b"HTTP/1.1 500")


async def test_idle_keep_alive_connection_is_closed_and_a_new_request_moves_the_deadlines():
    proto, t, _ = connect(header_timeout_s=0.15, body_timeout_s=0.15, keep_alive_s=0.3)
    for _ in range(3):  # requests 0.1 s apart: no header, body or idle deadline of an earlier one fires
        proto.data_received(post("/x", b"1"))
        await asyncio.sleep(0.1)
        assert not t.closed
    assert t.out.count(b"HTTP/1.1 200 OK") == 3
    await asyncio.sleep(0.35)  # idle past the keep-alive timeout: closed, with no 408
    assert t.closed and b"408" not in t.out


# --- the hot routes, served straight from the protocol (fastpath.GatewayApp.serve_direct) -----------------

def _gateway_app(trusted: str = "127.0.0.1") -> Any:
    from starlette.responses import JSONResponse
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    from orchestrator.errors import ApiError
    from orchestrator.gateway.fastpath import GatewayApp

    class App(GatewayApp):
        asgi_calls = 0

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            App.asgi_calls += 1
            await super().__call__(scope, receive, send)

    app = App()

    async def hot(request: Any) -> Any:
        body = await request.body()
        if body == b"refuse":
            raise ApiError("refused by the endpoint", status=400, code="refused")
        if body == b"late":
            class Late:
                async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                    await send({"type": "http.response.start", "status": 200, "headers": []})
                    raise RuntimeError("after the head")
            return Late()
        return JSONResponse({"client": request.client.host, "scheme": request.url.scheme,
                             "auth": request.headers.get("Authorization"), "body": body.decode()})

    async def api_error(request: Any, exc: Any) -> Any:
        return JSONResponse(exc.body(), status_code=exc.status)

    app.add_exception_handler(ApiError, api_error)
    app.add_hot_route("/v1/completions", hot)
    return App, ProxyHeadersMiddleware(app, trusted_hosts=trusted)


async def test_hot_route_is_served_without_asgi_and_answers_as_through_it():
    App, wrapped = _gateway_app()
    proto, t, _ = connect(wrapped)
    assert proto.direct is not None
    proto.data_received(post("/v1/completions", b"hi", b"Authorization: Bearer k\r\n"))
    await settle()
    direct = orjson.loads(t.out.split(b"\r\n\r\n", 1)[1])
    assert direct == {"client": "127.0.0.1", "scheme": "http", "auth": "Bearer k", "body": "hi"}
    assert App.asgi_calls == 0
    # X-Forwarded-For from a trusted peer: served directly too, rewritten as the middleware would
    t.out = b""
    proto.data_received(post("/v1/completions", b"hi", b"x-forwarded-for: 10.1.2.3\r\nx-forwarded-proto: https\r\n"))
    await settle()
    forwarded = orjson.loads(t.out.split(b"\r\n\r\n", 1)[1])
    assert forwarded["client"] == "10.1.2.3" and forwarded["scheme"] == "https" and App.asgi_calls == 0
    # other paths: ASGI
    t.out = b""
    proto.data_received(post("/v1/other", b""))
    await settle()
    assert t.out.startswith(b"HTTP/1.1 404") and App.asgi_calls == 1


FORWARDED_CASES = [
    b"",
    b"x-forwarded-for: 10.1.2.3\r\n",
    b"x-forwarded-proto: https\r\n",
    b"x-forwarded-proto: ftp\r\nx-forwarded-for: 10.1.2.3:4444\r\n",  # not a scheme it takes; a port
    b"x-forwarded-for: 203.0.113.7, 127.0.0.1\r\n",  # a chain ending in a trusted proxy
    b"x-forwarded-for: 203.0.113.7\r\nx-forwarded-for: 198.51.100.2\r\n",  # repeated: joined in order
    b"x-forwarded-proto: http\r\nx-forwarded-proto: wss\r\n",  # repeated: the last one counts
    b"x-forwarded-for: \r\n",  # empty: the peer stays the client
    b"x-forwarded-for: [2001:db8::1]:80\r\n",
]


@pytest.mark.parametrize("trusted", ["127.0.0.1", "10.0.0.1", "*", "127.0.0.0/8"])
async def test_forwarded_headers_give_the_same_client_and_scheme_direct_and_through_the_middleware(trusted):
    """The direct path applies uvicorn's proxy-headers rewrite itself (``apply_forwarded``): for every
    trust setting (the peer here is 127.0.0.1: trusted, untrusted, everyone, a network) and header
    combination, the endpoint sees what it sees through the middleware."""
    for extra in FORWARDED_CASES:
        seen = []
        for direct in (True, False):
            App, wrapped = _gateway_app(trusted)
            proto, t, _ = connect(wrapped)
            if not direct:
                proto.direct = None  # every request through ASGI and the middleware
            proto.data_received(post("/v1/completions", b"hi", extra))
            await settle()
            assert App.asgi_calls == (0 if direct else 1)
            seen.append(orjson.loads(t.out.split(b"\r\n\r\n", 1)[1]))
        assert seen[0] == seen[1], (trusted, extra)


async def test_hot_route_errors_are_rendered_by_the_apps_handlers_and_late_ones_close():
    App, wrapped = _gateway_app()
    proto, t, _ = connect(wrapped)
    proto.data_received(post("/v1/completions", b"refuse"))
    await settle()
    head, body = t.out.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400") and orjson.loads(body)["error"]["code"] == "refused" and not t.closed
    t.out = b""
    proto.data_received(post("/v1/completions", b"late"))
    await settle()
    assert b"500" not in t.out and t.closed and App.asgi_calls == 0  # (the head was out: no error answer, a close)


async def test_on_disconnect_extension_calls_back_once_when_the_client_leaves_mid_answer():
    calls: list[str] = []
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        scope["extensions"]["dyad.on_disconnect"](lambda: calls.append(scope["path"]))
        await release.wait()
        if scope["path"] == "/late":  # registering after the client left: called at once
            scope["extensions"]["dyad.on_disconnect"](lambda: calls.append("late-registered"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    proto, t, _ = connect(app)
    proto.data_received(post("/left", b""))
    await settle()
    proto.connection_lost(None)
    proto.connection_lost(None)  # (twice: still one call)
    await settle()
    assert calls == ["/left"]
    release.set()
    await settle()

    calls.clear()
    release.clear()
    proto, t, _ = connect(app)
    proto.data_received(post("/late", b""))
    await settle()
    proto.connection_lost(None)
    release.set()
    await settle()
    assert calls == ["/late", "late-registered"]

    calls.clear()
    proto, t, _ = connect(app)  # answered in full, then the connection goes: no call
    proto.data_received(post("/done", b""))
    await settle()
    assert t.out.startswith(b"HTTP/1.1 200")
    proto.connection_lost(None)
    await settle()
    assert calls == []
