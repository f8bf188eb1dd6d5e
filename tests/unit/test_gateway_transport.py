"""The gateway's HTTP/1.1 transport against raw asyncio servers (real sockets, byte-exact control)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from orchestrator.gateway.transport import FastTransport


class RawServer:
    """Answers each request with ``respond(request_bytes) -> list of (delay, bytes)``; counts connections."""

    def __init__(self, respond, close_after: bool = False) -> None:
        self.respond = respond
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                self.requests.append(head + body)
                for delay, data in self.respond(head + body):
                    if delay:
                        await asyncio.sleep(delay)
                    writer.write(data)
                    await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


def ok(body: bytes = b'{"ok":true}') -> list[tuple[float, bytes]]:
    return [(0, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
             % (len(body), body))]


async def test_keep_alive_reuses_one_connection_and_sends_body():
    srv = RawServer(lambda req: ok(req.split(b"\r\n\r\n", 1)[1]))
    url = await srv.start()
    async with httpx.AsyncClient(transport=FastTransport()) as c:
        for i in range(5):
            r = await c.post(url + "/echo", content=b"x" * (i * 40000))  # crosses the 64 KiB write split
            assert r.status_code == 200 and len(r.content) == i * 40000
    assert srv.connections == 1
    assert srv.requests[0].startswith(b"POST /echo HTTP/1.1\r\n") and b"host: 127.0.0.1" in srv.requests[0].lower()
    await srv.stop()


async def test_chunked_streaming_arrives_in_pieces():
    def respond(req):
        return [(0, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"),
                (0.05, b"6\r\ndata:1\r\n"), (0.05, b"6\r\ndata:2\r\n"), (0, b"0\r\n\r\n")]
    srv = RawServer(respond)
    url = await srv.start()
    async with httpx.AsyncClient(transport=FastTransport()) as c:
        async with c.stream("GET", url) as r:
            assert r.headers["content-type"] == "text/event-stream"
            assert [chunk async for chunk in r.aiter_raw()] == [b"data:1", b"data:2"]
        assert (await c.get(url)).status_code == 200  # connection went back to the pool
    assert srv.connections == 1
    await srv.stop()


async def test_connection_closed_by_server_is_not_reused():
    srv = RawServer(lambda req: ok(), close_after=True)  # server closes after every response
    url = await srv.start()
    transport = FastTransport()
    async with httpx.AsyncClient(transport=transport) as c:
        for _ in range(3):
            await asyncio.sleep(0.02)
            assert (await c.post(url, content=b"{}")).status_code == 200
    assert srv.connections == 3
    await srv.stop()


async def test_errors_map_to_httpx_types():
    transport = FastTransport()
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(1.0, read=0.2)) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get("http://127.0.0.1:1/")
        slow = RawServer(lambda req: [(5, b"")])
        url = await slow.start()
        with pytest.raises(httpx.ReadTimeout):
            await c.get(url)
        await slow.stop()
        cut = RawServer(lambda req: [(0, b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")],
                        close_after=True)
        url = await cut.start()
        with pytest.raises(httpx.ReadError):
            await c.get(url)
        await cut.stop()
        silent = RawServer(lambda req: [], close_after=True)
        url = await silent.start()
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get(url)
        await silent.stop()


async def test_closing_an_unfinished_stream_closes_the_connection():
    def respond(req):
        return [(0, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n"), (10, b"0\r\n\r\n")]
    srv = RawServer(respond)
    url = await srv.start()
    async with httpx.AsyncClient(transport=FastTransport()) as c:
        async with c.stream("GET", url) as r:
            async for chunk in r.aiter_raw():
                assert chunk == b"one"
                break
        r2 = RawServer(lambda req: ok())
        url2 = await r2.start()
        assert (await c.get(url2)).status_code == 200
        await r2.stop()
    await asyncio.sleep(0.05)
    await srv.stop()
