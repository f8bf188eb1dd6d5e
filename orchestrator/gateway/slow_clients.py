"""A bound on slow clients (slowloris): request headers and bodies must arrive in time.

uvicorn arms a timer only between keep-alive requests; a client that opens a connection and then
trickles a header byte every few seconds (or declares a body it never sends) holds a connection,
a parser and, once headers are in, a request task for ever. ``guarded_protocol`` subclasses
uvicorn's httptools protocol with two timers:

* from the connection's first moment (or a keep-alive request's first byte) the complete header
  block must arrive within ``header_timeout_s``;
* after the headers, the complete body must arrive within ``body_timeout_s``.

On expiry the client gets ``408 Request Timeout`` (OpenAI error shape) and the connection is
closed; a request task waiting for the body sees a disconnect. A connection that sent nothing at
all is closed the same way. Timers are plain ``loop.call_later`` handles: no per-byte cost.

httptools itself puts no bound on the size of a header block, so the protocol also refuses one
larger than ``MAX_HEADER_BYTES`` with ``431 Request Header Fields Too Large`` and closes: memory per
connection stays bounded. That answer, and uvicorn's for a request httptools cannot parse (400),
are written here in the OpenAI error shape like every other refusal (uvicorn's own is plain text).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 64 * 1024  # request line + headers


def _error_response(status: bytes, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error answer (OpenAI shape) that closes the connection; ``status``: b"408 Request Timeout"."""
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": code}})
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def _timeout_response(what: str, seconds: float) -> bytes:
    return _error_response(b"408 Request Timeout", f"The request {what} did not arrive within {seconds:g} s.",
                           "request_timeout")


class _GuardedProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._headers_too_large = False

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._guard = self.loop.call_later(seconds, self._expire, what, seconds)

    def _disarm(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None

    def _expire(self, what: str, seconds: float) -> None:
        self._guard = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if what == "body" and (cycle is None or cycle.response_started or not cycle.more_body):
            return  # the body is complete, or the app answered without it
        if cycle is not None and what == "body":
            cycle.disconnected = True  # the app's receive() now says http.disconnect; its sends are dropped
            cycle.message_event.set()
        self.transport.write(_timeout_response(what, seconds))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s, "headers")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._arm(self.header_timeout_s, "headers")

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            # httptools turns this into HttpParserCallbackError, and uvicorn calls send_400_response.
            self._headers_too_large = True
            raise ValueError(f"request headers larger than {MAX_HEADER_BYTES} bytes")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request the parser refused: 431 for our header cap, else 400; JSON either way."""
        self._disarm()
        if self._headers_too_large:
            response = _error_response(b"431 Request Header Fields Too Large",
                                       f"The request line and headers exceed {MAX_HEADER_BYTES} bytes.",
                                       "headers_too_large")
        else:
            response = _error_response(b"400 Bad Request", "The request is not valid HTTP/1.1.", "invalid_http")
        self.transport.write(response)
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body:
            self._arm(self.body_timeout_s, "body")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_protocol(header_timeout_s: float, body_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the two timeouts (pass as ``uvicorn.Config(http=...)``)."""
    return type("GuardedHttpToolsProtocol", (_GuardedProtocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})
