"""The gateway's client-facing HTTP/1.1 connection: httptools parsing, ASGI towards the app, one write per step.

uvicorn still runs the server (listening sockets, TLS, lifespan, signals, graceful shutdown, the
``server_state`` it uses to close connections and wait for requests); this module is the protocol
class it runs for every connection (``uvicorn.Config(http=...)``, built by ``http_protocol``). It
replaces uvicorn's ``HttpToolsProtocol`` plus the three subclasses the gateway used to stack on it,
in one class, because per request it is the largest cost left after the gateway's own code
(measured in docs/benchmarks.md, "Request path rebuilt around one attempt", the floor runs):

* **one write per event-loop step** towards the client: a non-streamed answer's head and body leave
  in one ``send`` (on loopback each write wakes the client, often for half an answer);
* **slow clients** (slowloris): a client that takes no byte of its answer for ``write_timeout_s`` (its
  socket buffer stays full) is disconnected, which cancels its request and the engine's; the complete
  header block must arrive within ``header_timeout_s``
  of a connection's (or a keep-alive request's) first moment, and the complete body within
  ``body_timeout_s`` of the headers; otherwise ``408`` (OpenAI error shape) and the connection is
  closed; a request task waiting for the body sees a disconnect. httptools puts no bound on a
  header block, so one larger than ``MAX_HEADER_BYTES`` gets ``431`` and a close. A request
  httptools cannot parse gets ``400`` in the same JSON shape;
* what uvicorn's protocol does that the gateway relies on: keep-alive with uvicorn's idle timeout,
  pipelined requests answered in order (reading pauses while one is in progress), HTTP/1.0,
  ``Connection: close``, ``Expect: 100-continue``, ``HEAD``, chunked answers when the app gives no
  Content-Length (to an HTTP/1.0 request, which cannot read chunks, a body ended by the close instead:
  uvicorn chunks those too), back-pressure from a slow reader (``pause_writing``), graceful ``shutdown()``,
  the ASGI scope uvicorn builds (with its ``ProxyHeadersMiddleware`` around the app, as configured),
  header names and values checked before they are written, and a 500 when the app fails before
  answering. No upgrade is offered (no WebSocket route, no h2c): a request offering one is served as
  plain HTTP, with its body (``UpgradeBody``: uvicorn drops that body, Kludex/uvicorn#2722).

Two shortcuts past the ASGI layers, for the gateway's hot routes (docs/benchmarks.md, issue 13, "the hot
routes straight from the protocol"):

* **direct dispatch**: when the app behind uvicorn's proxy-headers middleware offers ``hot_endpoint`` /
  ``serve_direct`` (``fastpath.GatewayApp``), a request for one of its hot routes is handed to
  ``serve_direct`` with this cycle's ``receive``/``send``, skipping that middleware and the app's ASGI
  dispatch; the middleware's rewrite of the client and scheme from ``X-Forwarded-For``/``-Proto`` (from a
  trusted proxy) is applied by ``apply_forwarded`` with the middleware's own trusted hosts, so requests
  behind a load balancer take this path too; the endpoint, its response and every byte written are the
  same as through ASGI;
* **``dyad.on_disconnect``** (``scope["extensions"]``): the app registers a callback that runs when the
  client leaves before the answer is complete, instead of a task waiting on ``receive``.

``connection_limit.limited_protocol`` wraps this class like any uvicorn protocol.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import re
import urllib.parse
from collections import deque
from typing import Any

import httptools
import orjson
from starlette.requests import ClientDisconnect
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import STATUS_LINE
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

from orchestrator.gateway.lazy_deadline import LazyDeadline

MAX_HEADER_BYTES = 64 * 1024  # request line + headers
HIGH_WATER = 65536  # pause reading a request body beyond this much unread

_HEADER_NAME_BAD = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_HEADER_VALUE_BAD = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_NOTED = frozenset((b"expect", b"x-forwarded-for", b"x-forwarded-proto"))  # request headers the protocol reads
_NAMES_OK: set[bytes] = set()  # header names seen to pass _HEADER_NAME_BAD (bounded)
_logger = logging.getLogger("uvicorn.error")


def error_response(status: bytes, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error answer (OpenAI shape) that closes the connection; ``status``: b"408 Request Timeout"."""
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": code}})
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def timeout_response(what: str, seconds: float) -> bytes:
    return error_response(b"408 Request Timeout", f"The request {what} did not arrive within {seconds:g} s.",
                          "request_timeout")


_INTERNAL_ERROR = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21"),
                   (b"connection", b"close")]


class UpgradeBody:
    """The body of a request that offers an ``Upgrade`` (pure: framing only, no I/O).

    httptools stops at the head of a request with ``Connection: upgrade`` + ``Upgrade`` (it completes the
    message without its body and hands the rest of the bytes over as the new protocol's), but the gateway
    switches to no other protocol: it ignores the offer, as RFC 9110 7.8 lets a server do, and serves the
    request as HTTP/1.1 — its body framed here by its Content-Length or chunked coding. Clients send such
    requests unasked: the JDK's ``HttpClient`` (HTTP/2 by default) offers ``Upgrade: h2c`` on every cleartext
    request, ``curl --http2`` too; their bodies were lost (400 "Request body is empty").
    """

    MAX_LINE = 4096  # a chunk-size line or trailer line longer than this is no HTTP/1.1

    def __init__(self, length: int | None) -> None:
        """``length``: the Content-Length, or None for a chunked body."""
        self.remaining = length or 0
        self.state = "data" if length is not None else "size"  # size | data | crlf | trailers | done
        self.chunked = length is None
        self.buf = b""
        self.trailer_bytes = 0

    def feed(self, data: bytes) -> tuple[list[bytes], bool, bytes]:
        """(body pieces in ``data``, whether the body is complete, the bytes after it); ValueError when the
        framing is broken."""
        pieces: list[bytes] = []
        buf = self.buf + data if self.buf else data
        self.buf = b""
        while True:
            if self.state == "data":
                if self.remaining:
                    take = buf[:self.remaining]
                    if take:
                        pieces.append(take)
                        self.remaining -= len(take)
                        buf = buf[len(take):]
                    if self.remaining:
                        return pieces, False, b""
                self.state = "crlf" if self.chunked else "done"
            elif self.state == "done":
                return pieces, True, buf
            elif self.state == "crlf":
                if len(buf) < 2:
                    self.buf = buf
                    return pieces, False, b""
                if buf[:2] != b"\r\n":
                    raise ValueError("a chunk is not followed by CRLF")
                buf = buf[2:]
                self.state = "size"
            else:  # "size" or "trailers": one line at a time
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > self.MAX_LINE:
                        raise ValueError("a chunk-size or trailer line is too long")
                    self.buf = buf
                    return pieces, False, b""
                line, buf = buf[:end], buf[end + 2:]
                if self.state == "trailers":
                    self.trailer_bytes += len(line)
                    if self.trailer_bytes > MAX_HEADER_BYTES:
                        raise ValueError("the trailers are too large")
                    if not line:
                        self.state = "done"
                    continue
                size = line.split(b";", 1)[0].strip()
                if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
                    raise ValueError("a chunk size is not a hexadecimal number")
                self.remaining = int(size, 16)
                self.state = "data" if self.remaining else "trailers"


def _request_parser(protocol: Any) -> httptools.HttpRequestParser:
    parser = httptools.HttpRequestParser(protocol)
    try:  # answer the first of pipelined requests even when the client half-closed after sending them
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
    except AttributeError:  # httptools < 0.6.3
        pass
    return parser


def _declared_body(headers: list[tuple[bytes, bytes]]) -> UpgradeBody | None:
    """The body a request's head announces (Content-Length above 0, or chunked), as an ``UpgradeBody``."""
    length = 0
    for name, value in headers:
        if name == b"transfer-encoding" and value.strip().lower().endswith(b"chunked"):
            return UpgradeBody(None)
        if name == b"content-length" and value.strip().isdigit():
            length = int(value)
    return UpgradeBody(length) if length else None


class _Cycle:
    """One request/response on a connection: the ASGI ``receive`` and ``send`` of its app call."""

    __slots__ = ("conn", "scope", "body", "more_body", "event", "disconnected", "keep_alive", "continue_100",
                 "started", "complete", "chunked", "remaining", "head", "delivered", "direct", "start_tried",
                 "left_callback", "to_close")

    def __init__(self, conn: HttpProtocol, scope: dict[str, Any], keep_alive: bool, continue_100: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.body = b""
        self.more_body = True
        self.event: asyncio.Future[None] | None = None  # receive() waiting for body or a disconnect
        self.disconnected = False
        self.keep_alive = keep_alive
        self.continue_100 = continue_100
        self.started = False
        self.complete = False
        self.chunked = False
        self.remaining = 0  # Content-Length bytes still to send
        self.to_close = False  # the body ends where the connection closes (an HTTP/1.0 request, no Content-Length)
        self.head = scope["method"] == "HEAD"
        self.delivered = False  # the last http.request message went to the app
        self.direct: Any = None  # the app's hot endpoint, served without the ASGI layers (``HttpProtocol.direct``)
        self.start_tried = False  # the app offered the answer's head to ``send``
        self.left_callback: Any = None  # called once if the client leaves before the answer is complete
        scope["extensions"] = {"dyad.on_disconnect": self.on_disconnect}

    def on_disconnect(self, callback: Any) -> None:
        """ASGI extension ``dyad.on_disconnect``: ``callback()`` runs (once) when the client leaves before
        this answer is complete — at once if it has left already; None unregisters. Saves the app a task
        reading ``receive`` for ``http.disconnect``."""
        self.left_callback = callback
        if callback is not None and self.disconnected and not self.complete:
            self.left_callback = None
            callback()

    def gone(self) -> None:
        """The client left (or its body timed out) before this answer was complete."""
        self.disconnected = True
        self.wake()
        callback = self.left_callback
        if callback is not None:
            self.left_callback = None
            callback()

    def wake(self) -> None:
        event = self.event
        if event is not None and not event.done():
            event.set_result(None)

    async def run(self, app: Any) -> None:
        try:
            if self.direct is not None:
                result = await self.conn.direct.serve_direct(self.direct, self.scope, self.receive, self.send, self)
            else:
                result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            if self.disconnected and not self.started and isinstance(exc, ClientDisconnect):
                return  # the client left, or its body timed out (answered 408): its doing, not the app's failure
            _logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.started:
                await self._send_500()
            else:
                self.conn.transport.close()
        else:
            if result is not None:
                _logger.error("ASGI callable should return None, but returned '%s'.", result)
                self.conn.transport.close()
            elif not self.started and not self.disconnected:
                _logger.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.complete and not self.disconnected:
                _logger.error("ASGI callable returned without completing response.")
                self.conn.transport.close()
        finally:
            # the extension is a method of this cycle held by its own scope: a reference cycle that only the
            # garbage collector would free (with the scope, its headers and whatever the app left in it)
            self.scope["extensions"] = {}
            self.conn.cycle_done(self)

    async def _send_500(self) -> None:
        await self.send({"type": "http.response.start", "status": 500, "headers": _INTERNAL_ERROR})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self.continue_100 and not conn.transport.is_closing():
            conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.continue_100 = False
        if not self.disconnected and not self.complete and (self.delivered or (self.more_body and not self.body)):
            # wait for more body, or (the whole body taken) for the client to leave or our answer to end
            if self.more_body:
                conn.resume_reading()
            self.event = conn.loop.create_future()
            try:
                await self.event
            finally:
                self.event = None
        if self.disconnected or self.complete or self.delivered:
            return {"type": "http.disconnect"}
        body, self.body = self.body, b""
        if not self.more_body:
            self.delivered = True
        elif conn.reading_paused:
            conn.resume_reading()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Any) -> None:
        conn = self.conn
        if not self.started and message["type"] == "http.response.start":
            self.start_tried = True
        if conn.writable is not None and not self.disconnected:
            await conn.writable
        if self.disconnected:
            return
        if not self.started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{message['type']}'.")
            status = message["status"]
            out = [STATUS_LINE[status]]
            length = None
            chunked = close_asked = False
            headers = message.get("headers", ())
            defaults = conn.server_state.default_headers  # (uvicorn's server/date headers; off in the gateway)
            values = []
            for name, value in [*defaults, *headers] if defaults else headers:
                if name not in _NAMES_OK:
                    if _HEADER_NAME_BAD.search(name):
                        raise RuntimeError("Invalid HTTP header name.")
                    if len(_NAMES_OK) < 4096:
                        _NAMES_OK.add(name)
                values.append(value)
                name = name.lower()
                if name == b"content-length" and length is None and not chunked:
                    length = int(value)
                elif name == b"transfer-encoding" and value.lower() == b"chunked":
                    chunked = True
                elif name == b"connection" and b"close" in [t.strip().lower() for t in value.split(b",")]:
                    close_asked = True
                out += (name, b": ", value, b"\r\n")
            if _HEADER_VALUE_BAD.search(b"\t".join(values)):  # (one search for all values: a tab is allowed)
                raise RuntimeError("Invalid HTTP header value.")
            if close_asked:
                self.keep_alive = False
            elif not self.keep_alive:
                out.append(b"connection: close\r\n")
            if chunked:
                length = None
            elif length is None and not self.head and status not in (204, 304):
                if self.scope["http_version"] == "1.0":  # (an HTTP/1.0 client reads no chunks: RFC 9112 6.1)
                    self.to_close = True  # (its connection is never kept alive: the close ends the body)
                else:
                    chunked = True
                    out.append(b"transfer-encoding: chunked\r\n")
            self.chunked = chunked
            self.remaining = length or 0
            self.started = True  # (after the checks: a refused head still leaves room for the 500)
            self.continue_100 = False
            out.append(b"\r\n")
            conn.write(b"".join(out))
            return
        if self.complete:
            raise RuntimeError(f"Unexpected ASGI message '{message['type']}' sent, after response already completed.")
        if message["type"] != "http.response.body":
            raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{message['type']}'.")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.head:
            self.remaining = 0
        elif self.chunked:
            if body:
                conn.write(b"%x\r\n%s\r\n" % (len(body), body) if more else b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            elif not more:
                conn.write(b"0\r\n\r\n")
        elif self.to_close:
            if body:
                conn.write(body)
        else:
            n = len(body)
            if n > self.remaining:
                raise RuntimeError("Response content longer than Content-Length")
            self.remaining -= n
            if n:
                conn.write(body)
        if not more:
            if self.remaining != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.complete = True
            # The answer is complete: its bytes leave now (one write with whatever this step queued before
            # them), not after the rest of the app's step (its accounting after the last send); the flush
            # already scheduled then finds nothing.
            conn._flush()
            self.wake()
            conn.response_complete(self)


class HttpProtocol(asyncio.Protocol):
    """One client connection (uvicorn's protocol-class interface: ``(config, server_state, app_state)``)."""

    header_timeout_s: float | None = None
    body_timeout_s: float | None = None
    write_timeout_s: float | None = None  # a client that takes no byte of the answer for this long is gone

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.loaded:
            config.load()
        self.config = config
        self.app = config.loaded_app
        self.direct = direct_app(self.app)
        # uvicorn's proxy-headers middleware in front of the app: its rewrite, applied here to hot requests
        self.trusted_proxies = self.app.trusted_hosts if isinstance(self.app, ProxyHeadersMiddleware) else None
        self.loop = _loop or asyncio.get_event_loop()
        self.parser = _request_parser(self)
        self.upgrade_body: UpgradeBody | None = None  # the body of a request offering an Upgrade (ignored)
        self.root_path = config.root_path
        self.asgi = {"version": config.asgi_version, "spec_version": "2.3"}
        self.app_state = app_state
        self.keep_alive_s = config.timeout_keep_alive
        self.reset_contextvars = getattr(config, "reset_contextvars", False)
        self.server_state = server_state
        self.connections = server_state.connections
        self.tasks = server_state.tasks
        self.transport: Any = None
        self.server: Any = None
        self.client: Any = None
        self.scheme = "http"
        self.pipeline: deque[_Cycle] = deque()
        self.cycle: _Cycle | None = None  # the request being read (or the last one)
        self.active: _Cycle | None = None  # the request being answered
        self.reading_paused = False
        self.writable: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self._write_stall: asyncio.TimerHandle | None = None  # ends the connection if it stays full (write_timeout_s)
        self._pending: list[bytes] | None = None  # writes of this event-loop step
        # One deadline at a time (header, body or keep-alive idle) on one lazily moved timer: setting a
        # deadline costs no timer operation (three per request else).
        self._deadline = LazyDeadline(self.loop, self._on_deadline)
        self._deadline_what = ""  # "headers" | "body" | "idle"
        self._deadline_s = 0.0
        # per request being parsed
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.headers_too_large = False
        self.expect_continue = False
        self.forwarded = False  # an X-Forwarded-For/-Proto header: uvicorn's proxy-headers middleware applies

    # --- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self.connections.add(self)
        self.transport = transport
        self.server = get_local_addr(transport)
        self.client = get_remote_addr(transport)
        self.scheme = "https" if is_ssl(transport) else "http"
        self._arm(self.header_timeout_s, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self._deadline.cancel()
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None
        for cycle in (self.active, self.cycle, *self.pipeline):
            if cycle is not None:
                if not cycle.complete:
                    cycle.gone()
                else:
                    cycle.wake()
        writable = self.writable
        if writable is not None:
            self.writable = None
            if not writable.done():
                writable.set_result(None)
        if exc is None:
            self.transport.close()
        self.parser = None  # type: ignore[assignment]
        # (each cycle points back here: let go of them, so the connection is freed by reference counts
        # when its last request ends; the cycles still running need nothing from these fields)
        self.active = self.cycle = None
        self.pipeline.clear()

    def eof_received(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        if self._deadline_what == "idle":
            self._deadline.clear()
        if self.upgrade_body is not None:
            self._upgrade_body_received(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:  # (the offer is ignored: the request is served as HTTP/1.1)
            if self.upgrade_body is not None:  # its body follows the head (UpgradeBody)
                self._upgrade_body_received(data[e.args[0]:] if e.args else b"")
        except httptools.HttpParserError:
            self._refuse_unparsable()

    def _upgrade_body_received(self, data: bytes) -> None:
        """Bytes of the body of a request whose Upgrade offer is ignored (``UpgradeBody``); once it is whole,
        the connection goes on with a fresh parser (httptools' own stays in its upgraded state)."""
        body = self.upgrade_body
        assert body is not None
        try:
            pieces, done, rest = body.feed(data)
        except ValueError:
            self.upgrade_body = None
            self._refuse_unparsable()
            return
        for piece in pieces:
            self.on_body(piece)
        if done:
            self.upgrade_body = None
            self.parser = _request_parser(self)
            self.on_message_complete()
            if rest and not self.transport.is_closing():
                self.data_received(rest)

    def pause_writing(self) -> None:
        if self.writable is None:
            self.writable = self.loop.create_future()
            if self.write_timeout_s is not None:
                self._write_stall = self.loop.call_later(self.write_timeout_s, self._write_stalled)

    def _write_stalled(self) -> None:
        """The client took no byte of the answer for ``write_timeout_s``: it is treated as gone (its request
        is cancelled and the engine's with it), so a client that stops reading cannot hold an engine slot
        and the gateway's buffers forever."""
        self._write_stall = None
        if self.writable is not None and not self.transport.is_closing():
            _logger.info("closing a connection whose client read nothing for %g s", self.write_timeout_s)
            self.transport.abort()

    def resume_writing(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None
        writable = self.writable
        if writable is not None:
            self.writable = None
            if not writable.done():
                writable.set_result(None)

    def shutdown(self) -> None:
        """Graceful shutdown (uvicorn): close when idle, else after the answer in progress."""
        cycle = self.active
        if cycle is None or cycle.complete:
            self.transport.close()
        else:
            cycle.keep_alive = False
            self.pipeline.clear()

    # --- writing -------------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._pending is None:
            self._pending = [data]
            self.loop.call_soon(self._flush)
        else:
            self._pending.append(data)

    def _flush(self) -> None:
        pending = self._pending
        self._pending = None
        if pending and not self.transport.is_closing():  # (aborted meanwhile: nothing to send to)
            self.transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        """Send what is pending, then close."""
        self._flush()
        self.transport.close()

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()

    def pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    # --- slow clients ---------------------------------------------------------------------------

    def _arm(self, seconds: float | None, what: str) -> None:
        if seconds is None:
            self._deadline.clear()
            return
        self._deadline_what, self._deadline_s = what, seconds
        self._deadline.set(seconds)

    def _disarm(self) -> None:
        self._deadline.clear()

    def _on_deadline(self) -> None:
        if self._deadline_what == "idle":
            if not self.transport.is_closing():
                self.transport.close()
        else:
            self._expire(self._deadline_what, self._deadline_s)

    def _expire(self, what: str, seconds: float) -> None:
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if what == "body" and (cycle is None or cycle.started or not cycle.more_body):
            return  # the body is complete, or the app answered without it
        if cycle is not None and what == "body":
            cycle.gone()  # the app's receive() now says http.disconnect; its sends are dropped
        self._flush()
        self.transport.write(timeout_response(what, seconds))
        self.transport.close()

    def _refuse_unparsable(self) -> None:
        """400 for a request httptools refused, 431 for one past ``MAX_HEADER_BYTES``; JSON either way."""
        self._disarm()
        if self.headers_too_large:
            response = error_response(b"431 Request Header Fields Too Large",
                                      f"The request line and headers exceed {MAX_HEADER_BYTES} bytes.",
                                      "headers_too_large")
        else:
            _logger.warning("Invalid HTTP request received.")
            response = error_response(b"400 Bad Request", "The request is not valid HTTP/1.1.", "invalid_http")
        self._flush()
        self.transport.write(response)
        self.transport.close()

    # --- httptools callbacks -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.header_bytes = 0
        self.expect_continue = False
        self.forwarded = False
        self._arm(self.header_timeout_s, "headers")

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.header_bytes += len(url)
        if self.header_bytes > MAX_HEADER_BYTES:
            self.headers_too_large = True
            raise ValueError(f"request headers larger than {MAX_HEADER_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            self.headers_too_large = True
            raise ValueError(f"request headers larger than {MAX_HEADER_BYTES} bytes")
        name = name.lower()
        if name in _NOTED:
            if name == b"expect":
                if value.lower() == b"100-continue":
                    self.expect_continue = True
            else:
                self.forwarded = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        version = parser.get_http_version()
        if version == "1.0" and any(name == b"transfer-encoding" for name, _ in self.headers):
            # HTTP/1.0 has no transfer codings (RFC 9112 6.1: such framing is faulty; a proxy in front may frame the
            # same bytes otherwise): refused as invalid HTTP, the connection closed (httptools would read chunks)
            raise ValueError("Transfer-Encoding on an HTTP/1.0 request")
        parsed = httptools.parse_url(self.url)
        raw_path = parsed.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root = self.root_path
        method = parser.get_method().decode("ascii")
        scope = {"type": "http", "asgi": self.asgi, "http_version": version, "server": self.server,
                 "client": self.client, "scheme": self.scheme, "root_path": root, "headers": self.headers,
                 "state": self.app_state.copy(), "method": method,
                 "path": root + path if root else path,
                 "raw_path": root.encode("ascii") + raw_path if root else raw_path,
                 "query_string": parsed.query or b""}
        cycle = self.cycle = _Cycle(self, scope, version != "1.0" and parser.should_keep_alive(),
                                    self.expect_continue)
        if parser.should_upgrade() and method != "CONNECT":  # (an offer the gateway ignores: UpgradeBody)
            self.upgrade_body = _declared_body(self.headers)
        direct = self.direct
        if direct is not None:
            cycle.direct = endpoint = direct.hot_endpoint(method, scope["path"], root)
            if endpoint is not None and self.forwarded and self.trusted_proxies is not None:
                apply_forwarded(scope, self.trusted_proxies)  # (what the bypassed middleware would do)
        self._arm(self.body_timeout_s, "body")  # (disarmed when the message completes, usually at once)
        if self.active is None:
            self._start(cycle)
        else:  # pipelined: answered in order
            self.pause_reading()
            self.pipeline.append(cycle)

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.complete:
            return
        cycle.body = cycle.body + body if cycle.body else body
        if len(cycle.body) > HIGH_WATER:
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        if self.upgrade_body is not None:  # (httptools' end of a request offering an Upgrade: its body follows)
            return
        self._disarm()
        cycle = self.cycle
        if cycle is None or cycle.complete:
            return
        cycle.more_body = False
        cycle.wake()

    # --- requests ---------------------------------------------------------------------------------------

    def _start(self, cycle: _Cycle) -> None:
        self.active = cycle
        coro = cycle.run(self.app)
        if self.reset_contextvars:
            task = self.loop.create_task(coro, context=contextvars.Context())
        else:
            task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def response_complete(self, cycle: _Cycle) -> None:
        """``cycle``'s answer is sent: the next request may start (its app call may still be finishing,
        as with uvicorn), or the connection waits idle, or closes."""
        self.server_state.total_requests += 1
        if not cycle.keep_alive:
            self.close()
            return
        if self.active is not cycle:
            return
        self.active = None
        if self.transport.is_closing():
            return
        self.resume_reading()
        if self.pipeline:
            self._start(self.pipeline.popleft())
        elif self.cycle is cycle:
            self._arm(self.keep_alive_s, "idle")

    def cycle_done(self, cycle: _Cycle) -> None:
        """The app call of ``cycle`` returned (without completing its answer, if it is still the active one:
        the connection was closed or lost then)."""
        if self.active is cycle:
            self.active = None


def direct_app(app: Any) -> Any:
    """The app behind uvicorn's wrappers when it serves some requests without ASGI (``hot_endpoint`` and
    ``serve_direct``: ``fastpath.GatewayApp``), else None. Only uvicorn's proxy-headers middleware may
    stand in between: the protocol bypasses it and applies its rewrite itself (``apply_forwarded``);
    any other wrapper (e.g. uvicorn's trace-level message logger) keeps every request on the ASGI path."""
    if isinstance(app, ProxyHeadersMiddleware):
        app = app.app
    return app if hasattr(app, "hot_endpoint") and hasattr(app, "serve_direct") else None


_SCHEMES = frozenset(("http", "https", "ws", "wss"))


def trusted_proxies() -> Any:
    """The trusted hosts uvicorn's proxy-headers middleware uses (``FORWARDED_ALLOW_IPS``, else loopback: as
    ``uvicorn.Config`` builds them), for a server in front of uvicorn (the native data plane) to apply the same
    rule to the real client (``apply_forwarded``)."""
    return ProxyHeadersMiddleware(None, trusted_hosts=os.environ.get("FORWARDED_ALLOW_IPS",  # type: ignore[arg-type]
                                                                     "127.0.0.1,::1")).trusted_hosts


def apply_forwarded(scope: dict[str, Any], trusted: Any) -> None:
    """Rewrite an HTTP ``scope`` from its X-Forwarded-Proto/-For headers as uvicorn's proxy-headers
    middleware does, for a request the protocol serves without that middleware: only when the peer is
    a trusted proxy (``trusted``: the middleware's own ``trusted_hosts``, so ``--forwarded-allow-ips``
    means the same on both paths); the scheme from the last X-Forwarded-Proto if it is one of
    http/https/ws/wss; the client from the X-Forwarded-For chain (all values, joined), as the
    middleware picks it (the first address from the right that is not a trusted proxy)."""
    peer = scope.get("client")
    if (peer[0] if peer else None) not in trusted:
        return
    proto: bytes | None = None
    chain: list[bytes] = []
    for name, value in scope["headers"]:
        if name == b"x-forwarded-proto":
            proto = value
        elif name == b"x-forwarded-for":
            chain.append(value)
    if proto is not None:
        scheme = proto.decode("latin1").strip()
        if scheme in _SCHEMES:
            scope["scheme"] = scheme
    if chain:
        host, port = trusted.get_trusted_client_address(b", ".join(chain).decode("latin1"))
        if host:
            scope["client"] = (host, port)


def http_protocol(header_timeout_s: float | None = None, body_timeout_s: float | None = None,
                  write_timeout_s: float | None = None) -> type[HttpProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, with the slow-client timeouts (None: no bound)."""
    return type("DyadHttpProtocol", (HttpProtocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
                 "write_timeout_s": write_timeout_s})
