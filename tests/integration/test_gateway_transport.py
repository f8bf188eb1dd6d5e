"""The gateway's HTTP/1.1 transport against raw asyncio servers (real sockets, byte-exact control)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from orchestrator.gateway.transport import FastTransport, read_all, send_post


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

    def answer(self, request: bytes, served: int) -> list[tuple[float, bytes]] | None:
        """What to send for ``request``, the connection's ``served``-th answered before it; None
        closes the connection without a byte."""
        return self.respond(request)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                self.requests.append(head + body)
                parts = self.answer(head + body, served)
                if parts is None:
                    break
                served += 1
                for delay, data in parts:
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


class KeepAliveTimer(RawServer):
    """A keep-alive engine whose idle timer fires just as the next request arrives on every connection it
    has already answered once: it reads that request and closes without a byte (the race a pooled
    connection loses when the engine's keep-alive timeout ends as the gateway reuses it)."""

    def __init__(self) -> None:
        # (the delay: so that concurrent requests need connections of their own)
        super().__init__(lambda req: [(0.05, ok()[0][1])])
        self.dropped = 0

    def answer(self, request: bytes, served: int) -> list[tuple[float, bytes]] | None:
        if served:  # the idle timer won: close without answering
            self.dropped += 1
            return None
        return self.respond(request)


@pytest.mark.parametrize("via_post", [False, True])
async def test_pooled_connections_closed_together_are_retried_on_a_fresh_one(via_post):
    """Three pooled connections, all closed by the engine's keep-alive timer as they are reused: each
    request still gets its answer, retried once on a freshly opened connection (never on another pooled
    one, which the same timer closed too), and no caller sees a RemoteProtocolError."""
    srv = KeepAliveTimer()
    url = await srv.start()
    transport = FastTransport()
    async with httpx.AsyncClient(transport=transport, timeout=5) as c:
        async def one() -> int:
            if via_post:
                return (await read_all(await send_post(c, url + "/v1/x", b"{}", {}))) and 200
            return (await c.post(url + "/v1/x", content=b"{}")).status_code
        assert await asyncio.gather(one(), one(), one()) == [200, 200, 200]
        assert srv.connections == 3 and len(transport._idle[("127.0.0.1", int(url.rsplit(":", 1)[1]))]) == 3
        for _ in range(3):  # one after another: each takes a pooled connection the engine drops
            assert await one() == 200
        assert srv.dropped == 3 and len(srv.requests) == 9 and srv.connections == 6
    await srv.stop()


class VanishedPeer(RawServer):
    """An engine restarted behind the same address whose old connections lead nowhere (a host that went away
    sends no FIN or reset): connections opened before ``vanish()`` are never answered again, newer ones are."""

    def __init__(self, body: bytes = b'{"ok":true}') -> None:
        # (the delay: so that concurrent requests need connections of their own)
        super().__init__(lambda req: [(0.05, ok(body)[0][1])])
        self.epoch = 0
        self._opened_in: dict[asyncio.Task, int] = {}  # connection (its handler) -> epoch it was opened in

    def vanish(self) -> None:
        self.epoch += 1

    def answer(self, request: bytes, served: int) -> list[tuple[float, bytes]] | None:
        task = asyncio.current_task()
        assert task is not None
        if not served:
            self._opened_in[task] = self.epoch
        if self._opened_in[task] != self.epoch:
            return [(3600, b"")]  # nothing ever comes back on it
        return self.respond(request)

    async def stop(self) -> None:
        for task in self._opened_in:
            task.cancel()
        await asyncio.gather(*self._opened_in, return_exceptions=True)
        await super().stop()


async def test_a_pooled_connection_that_gives_no_answer_in_time_takes_the_idle_pool_with_it():
    """Pooled connections to a peer that vanished (no FIN, no reset) look open: each would hold a request until
    its read timeout, one after another. The first pooled connection that gives no byte before its timeout
    closes every idle connection to that engine, so the next request opens a fresh one (answered)."""
    srv = VanishedPeer()
    url = await srv.start()
    async with httpx.AsyncClient(transport=FastTransport(), timeout=httpx.Timeout(5, read=1.0)) as c:
        assert [r.status_code for r in await asyncio.gather(*(c.post(url, content=b"{}") for _ in range(5)))] == [200] * 5
        assert srv.connections == 5
        srv.vanish()
        with pytest.raises(httpx.ReadTimeout):
            await c.post(url, content=b"{}")
        assert (await c.post(url, content=b"{}")).status_code == 200  # on a fresh connection
        assert srv.connections == 6
    await srv.stop()


async def test_a_fresh_connection_closed_without_an_answer_is_not_retried():
    """The retry is for a pooled connection only: a connection opened for this request that closes
    without a byte is the engine's answer (the caller sees RemoteProtocolError, one connection)."""
    silent = RawServer(lambda req: [], close_after=True)
    url = await silent.start()
    async with httpx.AsyncClient(transport=FastTransport(), timeout=5) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(url, content=b"{}")
    assert silent.connections == 1
    await silent.stop()


# --- the direct POST path (FastTransport.post / send_post / read_all) ------------------------------

async def test_post_writes_one_exact_request_and_reuses_the_connection():
    srv = RawServer(lambda req: ok(req.split(b"\r\n\r\n", 1)[1]))
    url = await srv.start()
    async with httpx.AsyncClient(transport=FastTransport(), timeout=5) as c:
        for i in range(3):
            r = await send_post(c, url + "/v1/completions", b'{"n":%d}' % i,
                                {"content-type": "application/json", "x-request-id": f"r{i}"})
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            assert await read_all(r) == b'{"n":%d}' % i
            await r.aclose()
    host = url.removeprefix("http://")
    assert srv.requests[1] == (b"POST /v1/completions HTTP/1.1\r\nhost: " + host.encode()
                               + b"\r\ncontent-type: application/json\r\nx-request-id: r1\r\n"
                               b"content-length: 7\r\n\r\n{\"n\":1}")
    assert srv.connections == 1
    await srv.stop()


async def test_post_refuses_header_injection_and_read_all_joins_chunks():
    def respond(req):
        return [(0, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n"),
                (0.02, b"3\r\ntwo\r\n"), (0.02, b"0\r\n\r\n")]
    srv = RawServer(respond)
    url = await srv.start()
    async with httpx.AsyncClient(transport=FastTransport(), timeout=5) as c:
        with pytest.raises(httpx.LocalProtocolError):
            await send_post(c, url + "/x", b"{}", {"x-request-id": "a\r\nevil: 1"})
        r = await send_post(c, url + "/x", b"{}", {})
        assert await read_all(r) == b"onetwo"
        with pytest.raises(httpx.StreamConsumed):
            await r.aread()
        assert (await read_all(await send_post(c, url + "/x", b"{}", {}))) == b"onetwo"
    assert srv.connections == 1  # a fully read body gives its connection back
    await srv.stop()


async def test_send_post_without_a_fast_transport_goes_through_httpx():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), request.headers["x-request-id"], request.content))
        return httpx.Response(201, content=b"made")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        r = await send_post(c, "http://engine:8000/v1/completions", b"{}", {"x-request-id": "q"})
        assert r.status_code == 201 and await read_all(r) == b"made"
    assert seen == [("POST", "http://engine:8000/v1/completions", "q", b"{}")]


async def test_read_all_raises_httpx_errors_when_the_body_breaks_off():
    cut = RawServer(lambda req: [(0, b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")], close_after=True)
    url = await cut.start()
    async with httpx.AsyncClient(transport=FastTransport(), timeout=5) as c:
        r = await send_post(c, url + "/x", b"{}", {})
        with pytest.raises(httpx.ReadError):
            await read_all(r)
        await r.aclose()
    await cut.stop()


async def test_read_timeout_bounds_each_wait_not_the_whole_answer():
    """The read timeout (one lazily re-armed timer per connection) bounds each wait for headers or a
    body chunk: chunks 0.12 s apart pass a 0.3 s timeout however long the answer, a 0.8 s gap fails
    it after ~0.3 s, and a keep-alive connection's next request gets a fresh bound."""
    def respond(req: bytes):
        if b"/stall" in req:
            return [(0, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n"), (0.8, b"0\r\n\r\n")]
        return ([(0.12, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")]
                + [(0.12, b"1\r\nx\r\n")] * 6 + [(0.12, b"0\r\n\r\n")])
    srv = RawServer(respond)
    url = await srv.start()
    async with httpx.AsyncClient(transport=FastTransport(), timeout=httpx.Timeout(5.0, read=0.3)) as c:
        for _ in range(2):  # the same connection twice
            started = time.monotonic()
            r = await c.post(url + "/slow", content=b"{}")
            assert r.content == b"x" * 6 and time.monotonic() - started > 0.8
        started = time.monotonic()
        async with c.stream("POST", url + "/stall", content=b"{}") as r:
            with pytest.raises(httpx.ReadTimeout):
                async for _ in r.aiter_raw():
                    pass
        assert 0.25 < time.monotonic() - started < 0.7
    assert srv.connections == 1  # (keep-alive throughout; the stalled answer closes it)
    await srv.stop()
