"""A lean HTTP/1.1 transport for httpx: asyncio protocols + the httptools parser.

Why: on the request path httpx's default stack (httpcore + h11 + anyio) costs more per request
than the rest of the gateway put together. This transport plugs in underneath the same
``httpx.AsyncClient`` (so every caller keeps httpx's API) and speaks plain-HTTP/1.1 keep-alive to
the engines with a C parser. ``https://`` URLs go to httpx's own transport.

Semantics kept from httpx: timeouts from the request's ``timeout`` extension (connect, read =
longest wait for headers or between body chunks, pool unused: connections are unbounded), errors
as ``httpx.ConnectError`` / ``ConnectTimeout`` / ``ReadTimeout`` / ``ReadError`` /
``RemoteProtocolError``. A pooled keep-alive connection that the engine closed without a response
byte is retried once, always on a freshly opened connection (never a second pooled one: connections
that went idle together are closed together by the engine's keep-alive timer). Only the fresh
connection's failure reaches the caller, so a dead engine still shows as one (refused connect). A
pooled connection that gives no byte at all before its read timeout closes every idle connection to that
engine (``drop_idle``: a vanished peer sends no FIN, so they would each hold a request until its timeout).

What an engine sends is bounded and kept to its own exchange: interim ``1xx`` answers are skipped
(the final answer follows), a status line + headers past ``MAX_HEADER_BYTES`` fail the exchange, a
whole body is read up to a limit (``read_all``), and a connection is reused only when nothing arrived
beyond its answer: bytes after the answer, or on an idle pooled connection, close it (they would
otherwise be taken for the answer to the next request sent on it).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Any

import httptools
import httpx

from orchestrator.gateway.lazy_deadline import LazyDeadline
from orchestrator.loop_thread import foreign_loop

_READ_HIGH_WATER = 1 << 20  # pause reading from the engine when this much body is unconsumed
MAX_HEADER_BYTES = 64 * 1024  # an engine's status line + headers beyond this are no HTTP answer worth reading
_HEADERS_TIMEOUT = "timed out waiting for the engine's response headers"
_BODY_TIMEOUT = "timed out waiting for the engine's response body"


class MalformedAnswer(httpx.RemoteProtocolError):
    """The engine answered, but not in HTTP/1.1 that can be read (bad status line, framing, oversized
    headers, an upgrade): its fault, not a connection that went away."""


def _expire(waiter: asyncio.Future[None], message: str) -> None:
    """Timer callback: a read waited too long (a plain timer costs less than ``asyncio.wait_for``)."""
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout(message))


class _Conn(asyncio.Protocol):
    """One TCP connection to an engine, carrying one request/response at a time."""

    def __init__(self, pool: FastTransport, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # The read timeout (headers, then each body chunk): one lazily moved timer per connection.
        self._deadline = LazyDeadline(asyncio.get_running_loop(), self._on_deadline)
        self._deadline_waiter: asyncio.Future[None] | None = None
        self._deadline_message = ""
        self._reset()

    def _reset(self) -> None:
        if getattr(self, "paused", False) and self.transport is not None:
            # An answer complete but not read to its end (a caller that stopped at its size bound) can leave the
            # socket paused; pooled so, the next request's answer was never read (its try stalled until the
            # watchdog gave up on a live engine). A pooled connection reads again.
            self.transport.resume_reading()
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.headers_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.busy = False  # a request was written and its answer is not yet released (``_put_idle``)
        self.got_bytes = False
        self.head_bytes = 0  # status line + headers received (bounded: MAX_HEADER_BYTES)
        self.interim = False  # parsing a 1xx interim answer (skipped: the final answer follows)
        self.error: Exception | None = None
        self.wakeup: asyncio.Future[None] | None = None
        self.paused = False

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.complete:
            # Bytes nobody asked for (on an idle pooled connection) or past the end of the answer: they
            # would be read as the answer to the next request sent here. The connection is not reused.
            self.keep_alive = False
            if not self.busy:
                self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(MalformedAnswer("an unexpected protocol upgrade"))
        except httptools.HttpParserError as e:
            if self.complete:  # (bytes after the answer: ``on_message_begin`` refused a second message)
                self.keep_alive = False
            elif self.head_bytes > MAX_HEADER_BYTES:
                self._fail(MalformedAnswer(
                    f"its status line and headers exceed {MAX_HEADER_BYTES} bytes"))
            else:
                self._fail(MalformedAnswer(f"unreadable HTTP ({e})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._deadline.cancel()
        self.pool._forget(self)
        if not self.complete and exc is None and self._ends_at_close():
            self.complete = True  # a body delimited by the connection's close (HTTP/1.1 §6.3, rule 8)
            self._wake()
        if not self.complete:
            if not self.got_bytes:
                self._fail(httpx.RemoteProtocolError("server disconnected without sending a response"))
            else:
                self._fail(httpx.ReadError(f"connection to the engine lost mid-response: {exc or 'closed'}"))

    def _ends_at_close(self) -> bool:
        """The response's headers are in and its body has no length of its own (neither Content-Length
        nor chunked): the body is everything until the engine closes the connection."""
        if not self.headers_done.done() or self.error is not None:
            return False
        if self.status in (204, 304) or 100 <= self.status < 200:
            return False
        for name, value in self.headers:
            name = name.lower()
            if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True

    # --- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: refused (``data_received``), never read as ours
            raise ValueError("bytes after the end of the answer")

    def on_status(self, status: bytes) -> None:
        self._count_head(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        self.headers.append((name, value))

    def _count_head(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > MAX_HEADER_BYTES:
            raise ValueError(f"response headers larger than {MAX_HEADER_BYTES} bytes")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # an interim answer (100 Continue, 103 Early Hints...)
            self.interim = True
            self.headers = []
            self.head_bytes = 0
            return
        self.status = status
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _READ_HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:  # the final answer is still to come
            self.interim = False
            return
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message is done
        self.complete = True
        self._wake()

    # --- helpers ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        if not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # mark retrieved: the waiter may be gone (cancelled)
        self._wake()
        self.close()

    def close(self) -> None:
        self._deadline.cancel()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self.pool._forget(self)

    async def next_chunk(self, timeout: float | None) -> bytes | None:
        """The next body chunk, or None at the end of the response."""
        while True:
            if self.body:
                chunk = self.body.popleft()
                self.buffered -= len(chunk)
                if self.paused and self.buffered < _READ_HIGH_WATER // 2 and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return chunk
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            waiter = self.wakeup = asyncio.get_running_loop().create_future()
            if timeout is not None:
                self.wait_until(timeout, waiter, _BODY_TIMEOUT)
            try:
                await waiter
            except httpx.ReadTimeout:
                self.close()
                raise
            finally:
                self.wakeup = None
                self._deadline.clear()

    def wait_until(self, timeout: float, waiter: asyncio.Future[None], message: str) -> None:
        """``waiter`` fails with ``httpx.ReadTimeout(message)`` unless it is done within ``timeout`` s
        (or the deadline is cleared first: ``self._deadline.clear()``)."""
        self._deadline_waiter, self._deadline_message = waiter, message
        self._deadline.set(timeout)

    def _on_deadline(self) -> None:
        if self.closed:
            return
        waiter, self._deadline_waiter = self._deadline_waiter, None
        if waiter is not None:
            _expire(waiter, self._deadline_message)


class _Body(httpx.AsyncByteStream):
    def __init__(self, conn: _Conn, read_timeout: float | None) -> None:
        self.conn = conn
        self.read_timeout = read_timeout
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self.conn.next_chunk(self.read_timeout)
            if chunk is None:
                break
            yield chunk
        self._release()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self.conn
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None:
            conn.pool._put_idle(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._release()  # an unfinished body closes the connection: the engine sees the client leave


class FastTransport(httpx.AsyncBaseTransport):
    def __init__(self, max_idle_per_host: int = 512, https: httpx.AsyncBaseTransport | None = None) -> None:
        """``https``: the transport for ``https://`` engines (default: httpx's, system trust store)."""
        self.max_idle_per_host = max_idle_per_host
        self._https = https
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        # also told when an engine's idle connections are dropped (the native data plane's own pool: native/plane.py)
        self.idle_listeners: list[Callable[[tuple[str, int]], object]] = []
        self._all: set[_Conn] = set()
        self._fallback: httpx.AsyncBaseTransport | None = None

    # --- pool ----------------------------------------------------------------------------------

    def _put_idle(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        conn._reset()
        idle.append(conn)

    def _take_idle(self, key: tuple[str, int]) -> _Conn | None:
        """The most recently used open pooled connection to ``key`` (closed ones are dropped)."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def drop_idle(self, key: tuple[str, int]) -> int:
        """Close every idle pooled connection to ``key``; returns how many. For when one of them gave no
        answer at all in time: the others went idle as it did, and a peer that vanished (a host gone, a
        restarted engine behind the same address) sends no FIN or reset, so they look open and would each
        hold a request until its timeout. The next request opens a fresh connection. Called from the native
        data plane's thread, the closing is handed to the event loop (transports are the loop's: native/loop.py)."""
        loop = foreign_loop()
        if loop is not None:
            loop.call_soon_threadsafe(self.drop_idle, key)
            return 0
        idle = self._idle.pop(key, None)
        for conn in idle or ():
            conn.close()
        for listener in self.idle_listeners:
            listener(key)
        return len(idle or ())

    def _forget(self, conn: _Conn) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def _connect(self, key: tuple[str, int], timeout: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self, key), key[0], key[1]), timeout)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from None
        except OSError as e:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {e.strerror or e}") from None
        self._all.add(conn)
        return conn

    # --- httpx interface ---------------------------------------------------------------------------

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            if self._fallback is None:
                self._fallback = self._https or httpx.AsyncHTTPTransport()
            return await self._fallback.handle_async_request(request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        return await self._exchange((url.host, url.port or 80), _request_head(request), await _request_body(request),
                                    timeouts.get("connect"), timeouts.get("read"), request)

    async def post(self, url: str, content: bytes, headers: dict[str, str], timeout: httpx.Timeout) -> httpx.Response:
        """POST ``content`` to an ``http://`` URL; the response comes back once its headers are in.

        The request head is written straight from ``headers`` (plus Host and Content-Length): no
        ``httpx.Request``, and none of ``AsyncClient.send``'s layers (auth, redirects, cookies, event
        hooks), which engine calls do not use and which cost more than the exchange itself.
        """
        target = _TARGETS.get(url)
        if target is None:
            target = _target(url)
        key, start = target
        lines = [start]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise httpx.LocalProtocolError(f"invalid characters in the {name} header value")
            lines.append(f"{name}: {value}\r\n".encode())
        lines.append(b"content-length: %d\r\n\r\n" % len(content))
        return await self._exchange(key, b"".join(lines), content, timeout.connect, timeout.read, None)

    async def _exchange(self, key: tuple[str, int], head: bytes, body: bytes, connect_timeout: float | None,
                        read_timeout: float | None, request: httpx.Request | None) -> httpx.Response:
        for attempt in range(2):
            # The first try takes a pooled connection if there is one; the retry (after a pooled one
            # closed without answering) always opens a fresh one: connections that went idle together
            # are closed together by the engine's keep-alive timer, so another pooled one is no better.
            conn = self._take_idle(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key, connect_timeout)
            if conn.closed:
                continue
            assert conn.transport is not None
            conn.busy = True
            conn.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.transport.write(body)
            headers_done = conn.headers_done
            if read_timeout is not None:
                conn.wait_until(read_timeout, headers_done, _HEADERS_TIMEOUT)
            try:
                await headers_done  # (cancelled with us: the connection is closed then, nobody else waits on it)
            except httpx.ReadTimeout as e:
                conn.close()
                if reused and not conn.got_bytes:  # (a pooled connection no byte came back on: see drop_idle)
                    self.drop_idle(key)
                if request is not None:
                    e.request = request
                raise
            except httpx.RemoteProtocolError as e:
                if reused and not conn.got_bytes:
                    continue  # a stale keep-alive connection: try once more on a fresh one
                if request is not None:
                    e.request = request
                raise
            except asyncio.CancelledError:
                conn.close()
                raise
            finally:
                conn._deadline.clear()
            if request is not None:
                return httpx.Response(conn.status, headers=conn.headers, stream=_Body(conn, read_timeout),
                                      extensions=_HTTP11, request=request)
            return EngineResponse(conn.status, conn.headers, _Body(conn, read_timeout))
        raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)

    async def aclose(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()


_HTTP11 = {"http_version": b"HTTP/1.1"}


class EngineResponse(httpx.Response):
    """The ``httpx.Response`` of ``FastTransport.post``: the same object to every caller, except that
    its ``headers`` (an ``httpx.Headers``, which normalizes and re-encodes every header on creation and
    on each lookup) are built only if asked for; the hot path reads ``raw_headers`` (``header``)."""

    def __init__(self, status_code: int, raw_headers: list[tuple[bytes, bytes]], stream: _Body) -> None:
        # (httpx.Response.__init__ minus the Headers; the attributes its methods use)
        self.status_code = status_code
        self.raw_headers = raw_headers  # as the engine sent them
        self._headers: httpx.Headers | None = None
        self._request = None
        self.next_request = None
        self.extensions = {"http_version": b"HTTP/1.1"}
        self.history = []
        self.is_closed = False
        self.is_stream_consumed = False
        self.default_encoding = "utf-8"
        self.stream = stream
        self._num_bytes_downloaded = 0

    @property  # type: ignore[override]
    def headers(self) -> httpx.Headers:
        if self._headers is None:
            self._headers = httpx.Headers(self.raw_headers)
        return self._headers

    @headers.setter
    def headers(self, value: Any) -> None:
        self._headers = httpx.Headers(value)

    async def aclose(self) -> None:
        """As ``httpx.Response.aclose``, without its error-wrapping context (``_Body`` releasing its
        connection raises nothing): the connection goes back to the pool, or is closed if unfinished."""
        stream = self.stream
        if not isinstance(stream, _Body):
            await super().aclose()
        elif not self.is_closed:
            self.is_closed = True
            stream._release()


def header(response: httpx.Response, name: bytes) -> bytes | None:
    """The value of header ``name`` (lower-case) of ``response``, without building ``httpx.Headers``."""
    if isinstance(response, EngineResponse) and response._headers is None:
        for k, v in response.raw_headers:
            if k.lower() == name:
                return v
        return None
    value = response.headers.get(name.decode("latin-1"))
    return None if value is None else value.encode("latin-1")


def raw_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    """``response``'s headers as (name, value) bytes pairs, as received."""
    if isinstance(response, EngineResponse) and response._headers is None:
        return response.raw_headers
    return response.headers.raw
_TARGETS: dict[str, tuple[tuple[str, int], bytes]] = {}


def _target(url: str) -> tuple[tuple[str, int], bytes]:
    """(host, port) and the request line + Host header for ``url``, cached (parsing costs more than sending)."""
    parsed = httpx.URL(url)
    if parsed.scheme != "http":
        raise ValueError(f"FastTransport.post takes http:// URLs only: {url}")
    port = parsed.port or 80
    host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    host_header = host if parsed.port is None else f"{host}:{port}"
    start = b"POST " + parsed.raw_path + b" HTTP/1.1\r\nhost: " + host_header.encode("ascii") + b"\r\n"
    if len(_TARGETS) > 4096:
        _TARGETS.clear()
    target = _TARGETS[url] = ((parsed.host, port), start)
    return target


class EngineClient(httpx.AsyncClient):
    """``httpx.AsyncClient`` whose answers leave no reference cycle behind. httpx binds each answer's
    stream to the answer (``BoundAsyncStream`` → response → stream), so every health check, scrape or
    tokenize call would otherwise leave its request, response and headers for the garbage collector.
    A read answer gets a plain copy of its bytes as its stream; a streamed one drops the bond when it is
    closed."""

    async def send(self, request: httpx.Request, *, stream: bool = False, **kwargs: Any) -> httpx.Response:
        response = await super().send(request, stream=stream, **kwargs)
        if stream:
            response.stream = _Unbinding(response)
        elif response.is_closed:
            response.stream = httpx.ByteStream(response.content)
        return response


class _Unbinding(httpx.AsyncByteStream):
    """A streamed answer's stream that, once closed, lets go of the answer (see ``EngineClient``)."""

    def __init__(self, response: httpx.Response) -> None:
        self._response: httpx.Response | None = response
        self._inner: Any = response.stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            response = self._response
            if response is not None:
                self._response = None
                response.stream = _CLOSED


_CLOSED = httpx.ByteStream(b"")


async def send_post(http: httpx.AsyncClient, url: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
    """POST with ``http``'s timeouts and return once the response headers are in (body unread).

    When ``http`` runs on a ``FastTransport`` (the gateway's client) and the URL is plain http, the
    request goes to the transport directly (``FastTransport.post``); otherwise through ``http.send``.
    """
    transport = getattr(http, "_transport", None)
    if isinstance(transport, FastTransport) and url.startswith("http://") and not getattr(http, "_mounts", None):
        return await transport.post(url, content, headers, http.timeout)
    request = httpx.Request("POST", url, content=content, headers=headers,
                            extensions={"timeout": http.timeout.as_dict()})
    return await http.send(request, stream=True)


class AnswerTooLarge(Exception):
    """A body read whole (``read_all``) is longer than the limit it was read with; its connection is closed."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the answer is longer than {limit} bytes")
        self.limit = limit


async def read_all(response: httpx.Response, limit: int | None = None) -> bytes:
    """The whole (raw) body of a response that ``FastTransport`` opened, read from the connection
    directly (no ``aiter_raw`` layers); other responses are read with ``aiter_raw``. Errors are httpx's;
    a body longer than ``limit`` bytes raises ``AnswerTooLarge`` (the response is closed: the
    engine sees the gateway leave) once that much has been read."""
    stream = response.stream
    if isinstance(stream, _Body) and not response.is_stream_consumed:
        response.is_stream_consumed = True
        conn, timeout = stream.conn, stream.read_timeout
        first = await conn.next_chunk(timeout)
        if first is None:
            stream._release()
            return b""
        rest = await conn.next_chunk(timeout)
        if rest is None:
            stream._release()
            if limit is not None and len(first) > limit:
                raise AnswerTooLarge(limit)
            return first
        chunks = [first, rest]
        size = len(first) + len(rest)
        while (chunk := await conn.next_chunk(timeout)) is not None:
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                stream._release()  # (unfinished: the connection is closed)
                raise AnswerTooLarge(limit)
        stream._release()
        if limit is not None and size > limit:
            raise AnswerTooLarge(limit)
        return b"".join(chunks)
    if response.is_stream_consumed:
        body = response.content  # built from bytes (httpx.MockTransport, tests)
        if limit is not None and len(body) > limit:
            raise AnswerTooLarge(limit)
        return body
    chunks = []
    size = 0
    async for chunk in response.aiter_raw():
        chunks.append(chunk)
        size += len(chunk)
        if limit is not None and size > limit:
            await response.aclose()
            raise AnswerTooLarge(limit)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def drop_idle(http: httpx.AsyncClient, url: str) -> int:
    """Close ``http``'s idle pooled connections to the engine at ``url`` (``FastTransport.drop_idle``), so that
    its next request opens a fresh connection; 0 when ``http`` runs on another transport."""
    transport = getattr(http, "_transport", None)
    if not isinstance(transport, FastTransport):
        return 0
    parsed = httpx.URL(url)
    if parsed.scheme != "http":
        return 0
    return transport.drop_idle((parsed.host, parsed.port or 80))


def discard_connection(response: httpx.Response) -> None:
    """``response``'s connection is closed rather than reused when released: its engine answered
    something the gateway refused, so its framing is not to be trusted for the next request."""
    stream = response.stream
    if isinstance(stream, _Body):
        stream.conn.keep_alive = False


def raw_chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """The raw body of a response, chunk by chunk: from the connection directly when ``FastTransport``
    opened it (no ``aiter_raw`` layers per chunk), else ``aiter_raw``. Errors are httpx's."""
    stream = response.stream
    if isinstance(stream, _Body) and not response.is_stream_consumed:
        response.is_stream_consumed = True
        return _Chunks(stream)
    return response.aiter_raw()


class _Chunks:
    """``_Body``'s chunks as a plain async iterator: an async generator costs, per stream, the event
    loop's first-iteration hook (a ``WeakSet`` add, and its removal when collected)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: _Body) -> None:
        self._stream = stream

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        stream = self._stream
        chunk = await stream.conn.next_chunk(stream.read_timeout)
        if chunk is None:
            stream._release()
            raise StopAsyncIteration
        return chunk


def _request_head(request: httpx.Request) -> bytes:
    target = request.url.raw_path
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    for name, value in request.headers.raw:
        lines.append(name + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _request_body(request: httpx.Request) -> bytes:
    """The request body, encoded for the wire (chunked when httpx declared it chunked)."""
    if isinstance(request.stream, httpx.ByteStream):
        return request.content
    chunks = [chunk async for chunk in request.stream]  # type: ignore[union-attr]
    if request.headers.get("transfer-encoding", "").lower() == "chunked":
        out = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks if c)
        return out + b"0\r\n\r\n"
    return b"".join(chunks)
