#!/usr/bin/env python3
"""The floor under the gateway: the least a Python proxy on the same machinery can cost per request.

Not a gateway: a benchmark target for ``scripts/bench_gateway_ab.py --floor``. It forwards every
``POST`` body unchanged to one engine URL through the gateway's own ``FastTransport`` (keep-alive,
httptools) and relays the answer (whole, or chunk by chunk for a stream) — no parsing, routing,
accounting, logging or checks. Two servers in front of it:

- ``--mode asgi``: uvicorn with uvloop and its httptools protocol, and a bare ASGI callable;
- ``--mode asgi-dyad``: the same on the gateway's own connection protocol (``http_server.py``);
- ``--mode protocol``: an ``asyncio.Protocol`` with the httptools request parser, no ASGI at all.

The difference between the gateway and ``asgi-dyad`` is Dyad's own code; between ``asgi`` and
``protocol``, uvicorn's ASGI machinery.

    python scripts/bench_gateway_floor.py --engine http://127.0.0.1:8001 --port 9000 --mode asgi
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import httptools
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.gateway.transport import FastTransport, read_all  # noqa: E402

TIMEOUT = httpx.Timeout(30.0)
HEADERS = {"content-type": "application/json"}


def asgi_app(engine: str) -> Any:
    transport = FastTransport()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["method"] == "GET":  # /health, /ready
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        response = await transport.post(engine + scope["path"], b"".join(chunks), HEADERS, TIMEOUT)
        ctype = response.headers.get("content-type", "")
        if "event-stream" in ctype:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(b"content-type", ctype.encode())]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            body = await read_all(response)
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

    return app


class FloorProtocol(asyncio.Protocol):
    """One client connection: parse with httptools, forward, write the answer (keep-alive only)."""

    def __init__(self, engine: str, transport: FastTransport) -> None:
        self.engine = engine
        self.pool = transport
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.url = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        if self.parser.get_method() == b"GET":
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            return
        asyncio.ensure_future(self.forward(self.url.decode(), body))

    async def forward(self, path: str, body: bytes) -> None:
        response = await self.pool.post(self.engine + path, body, HEADERS, TIMEOUT)
        ctype = response.headers.get("content-type", "")
        head = b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\n" % (response.status_code, ctype.encode())
        if "event-stream" in ctype:
            self.transport.write(head + b"transfer-encoding: chunked\r\n\r\n")
            async for chunk in response.aiter_raw():
                self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.transport.write(b"0\r\n\r\n")
        else:
            data = await read_all(response)
            self.transport.write(head + b"content-length: %d\r\n\r\n" % len(data) + data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="engine base URL (http://host:port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=["asgi", "asgi-dyad", "protocol"], default="asgi")
    args = ap.parse_args()
    import uvloop
    if args.mode.startswith("asgi"):
        import uvicorn

        from orchestrator.gateway.http_server import http_protocol
        http: Any = http_protocol() if args.mode == "asgi-dyad" else "httptools"
        uvicorn.run(asgi_app(args.engine), host=args.host, port=args.port, loop="uvloop", http=http,
                    access_log=False, log_level="warning", lifespan="on")
        return 0

    async def run() -> None:
        pool = FastTransport()
        server = await asyncio.get_running_loop().create_server(lambda: FloorProtocol(args.engine, pool),
                                                                args.host, args.port)
        await server.serve_forever()

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
