"""The Rust data plane (``native/dataplane``, module ``dyad_dataplane``) on the wire, against its contract
(dataplane_spec.md): a scripted lane object (a test double, not Dyad's ``NativeLane``) answers its callbacks,
real local servers play the engines (``RawServer``) and the Python gateway behind it (``Fallback``).

Callbacks run on the plane's own thread, so the tests wait for them with ``until``. Without the built module
these tests skip, and fail under ``CI=true`` naming ``scripts/build_dataplane.sh``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from orchestrator.gateway import native
from tests.fixtures import deps
from tests.integration.raw_engine import STREAM_HEAD, _chunk
from tests.integration.test_gateway_transport import RawServer, ok

dp = native.load()
SECRET = "s3cret"
CHAT = "/v1/chat/completions"
LIMITS: dict[str, Any] = {
    "hot_paths": [CHAT, "/v1/completions"], "max_body_bytes": 1 << 20, "body_too_large": b'{"error": "too large"}',
    "max_connections": 0, "overloaded": b'{"error": "overloaded"}', "header_timeout_s": 5.0, "keepalive_s": 30.0,
    "server_error": b'{"error": "server error"}',
}
EV = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
EV2 = b'data: {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}]}\n\n'
USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}\n\n'
DONE = b"data: [DONE]\n\n"
END = b'data: {"error": {"message": "broken"}}\n\ndata: [DONE]\n\n'


@pytest.fixture(autouse=True)
def _built() -> None:
    if dp is None:
        deps.missing("the native data plane (dyad_dataplane, orchestrator/gateway/native/dyad_dataplane.so)",
                     "scripts/build_dataplane.sh")


async def until(cond: Callable[[], Any], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.01)


def refused_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def stream_answer(*chunks: bytes, end: bool = True, delay: float = 0.0) -> list[tuple[float, bytes]]:
    """A chunked SSE 200: each element is one chunk of the body (written separately)."""
    parts = [(0.0, STREAM_HEAD)] + [(delay, _chunk(c)) for c in chunks]
    return parts + [(0.0, b"0\r\n\r\n")] if end else parts


class Attempt:
    """A scripted attempt: the contract's attributes, and callbacks that record their arguments and return what
    ``then`` says (a step, or a function of the callback's arguments)."""

    DEFAULTS: dict[str, Any] = {"failed": ("reply", 502, [], b'{"error": "failed"}'), "answered": ("relay",),
                                "stream_broken": ("end", END)}

    def __init__(self, url: str, path: str = CHAT, then: dict[str, Any] | None = None, **attrs: Any) -> None:
        self.url = url + path
        self.body = b'{"model": "m"}'
        self.headers = [(b"content-type", b"application/json"), (b"x-test", b"1")]
        self.stream = False
        self.delay_s = 0.0
        self.first_byte_timeout: float | None = None
        self.idle_timeout: float | None = None
        self.deadline_s: float | None = None
        self.max_answer_bytes = 1 << 20
        self.error_body_bytes = 4096
        self.reply_headers = [(b"x-dyad-worker", b"w1")]
        self.strip_usage = False
        self.__dict__.update(attrs)
        self.then = then or {}
        self.calls: list[tuple[Any, ...]] = []
        self.first_events: list[float] = []  # first_event(first_s): once per streamed try, after its first data event
        self.gaps: list[float] | None = None  # the inter-token gaps of the stream's end (stream_timing.TokenTimer)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def _step(self, name: str, *args: Any) -> Any:
        self.calls.append((name, *args))
        then = self.then.get(name, self.DEFAULTS.get(name))
        if isinstance(then, BaseException):
            raise then
        return then(*args) if callable(then) else then

    def failed(self, kind: str, detail: str) -> Any:
        return self._step("failed", kind, detail)

    def answered(self, status: int, headers: list, body: bytes | None) -> Any:
        return self._step("answered", status, headers, body)

    def streaming(self) -> None:
        self._step("streaming")

    def first_event(self, first_s: float) -> None:  # (kept apart from ``calls``: see ``first_events``)
        self.first_events.append(first_s)

    def stream_done(self, usage: str | None, events: int, first_s: float | None, last_s: float | None,
                    gaps: list[float]) -> None:
        self.gaps = gaps
        self._step("stream_done", usage, events, first_s, last_s)

    def stream_broken(self, kind: str, detail: str, sent: bytes, usage: str | None, events: int,
                      first_s: float | None, last_s: float | None, gaps: list[float]) -> Any:
        self.gaps = gaps
        return self._step("stream_broken", kind, detail, sent, usage, events, first_s, last_s)

    def client_gone(self) -> None:
        self._step("client_gone")


class Lane:
    """``admit`` returns ``decide(path, query, headers, body, peer, cancel)``; records internal errors."""

    def __init__(self, decide: Callable[..., Any]) -> None:
        self.decide = decide
        self.admitted: list[tuple[Any, ...]] = []
        self.cancels: list[Any] = []
        self.errors: list[tuple[str, BaseException]] = []

    def admit(self, path: str, query: str, headers: list, body: bytes, peer: str, cancel: Any) -> Any:
        self.admitted.append((path, query, headers, body, peer))
        self.cancels.append(cancel)
        return self.decide(path, query, headers, body, peer, cancel)

    def internal_error(self, where: str, exc: BaseException) -> None:
        self.errors.append((where, exc))


def send(attempt: Attempt) -> Lane:
    return Lane(lambda *_: ("send", attempt))


class Fallback:
    """The Python gateway's stand-in: answers 201 with a chunked body whose first chunk is the request's head
    (sent as soon as the head arrives) and whose next chunks echo the request's body as it arrives."""

    def __init__(self, answer: Callable[[bytes], bytes] | None = None) -> None:
        self.answer = answer  # a whole answer for a request (head + body) instead of the echo
        self.requests: list[bytes] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                low = head.lower()
                self.requests.append(head)
                if self.answer is not None:
                    n = int(low.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in low else 0
                    self.requests[-1] += await reader.readexactly(n)
                    writer.write(self.answer(self.requests[-1]))
                    await writer.drain()
                    continue
                writer.write(b"HTTP/1.1 201 Created\r\ncontent-type: text/plain\r\nx-from: fallback\r\n"
                             b"transfer-encoding: chunked\r\n\r\n" + _chunk(head))
                await writer.drain()
                if b"transfer-encoding: chunked" in low:
                    while (size := int((await reader.readuntil(b"\r\n"))[:-2], 16)) > 0:
                        writer.write(_chunk(await reader.readexactly(size)))
                        await writer.drain()
                        await reader.readexactly(2)
                    await reader.readexactly(2)
                elif b"content-length:" in low:
                    n = int(low.split(b"content-length:")[1].split(b"\r\n")[0])
                    if n:
                        writer.write(_chunk(await reader.readexactly(n)))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()


@pytest.fixture
async def plane():
    """``await plane(lane, fallback=..., **limits)`` -> the plane's base URL; stopped after the test."""
    started: list[Any] = []

    async def make(lane: Lane, fallback: str = "127.0.0.1:9", **limits: Any) -> str:
        p = dp.Plane("127.0.0.1", 0, lane, fallback, SECRET, {**LIMITS, **limits})
        port = p.start()
        started.append(p)
        return f"http://127.0.0.1:{port}"

    make.started = started  # type: ignore[attr-defined]
    yield make
    for p in started:
        await asyncio.to_thread(p.stop, 0.2)


async def post(base: str, path: str = CHAT, body: bytes = b'{"model": "m"}', **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as c:
        return await c.post(base + path, content=body, **kw)


# --- the fallback -------------------------------------------------------------------------------------------


async def test_a_route_that_is_not_hot_is_proxied_to_the_fallback_streamed_both_ways(plane):
    fb = Fallback()
    lane = Lane(lambda *_: pytest.fail("admit is only for hot routes"))
    base = await plane(lane, fallback=await fb.start())
    port = int(base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"PUT /admin/x?y=1 HTTP/1.1\r\nhost: a\r\nx-dyad-native-secret: forged\r\nX-Dyad-Native-Peer: 6.6.6.6:1\r\n"
                 b"x-keep: yes\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(b"first "))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")  # the answer starts before the request's body has ended
    assert head.startswith(b"HTTP/1.1 201") and b"x-from: fallback" in head
    size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
    seen = (await reader.readexactly(size + 2))[:-2]  # the fallback's echo of the request head
    writer.write(_chunk(b"second") + b"0\r\n\r\n")
    await writer.drain()
    rest = b""
    while not rest.endswith(b"0\r\n\r\n"):
        rest += await reader.read(4096)
    writer.close()
    low = seen.lower()
    assert seen.startswith(b"PUT /admin/x?y=1 HTTP/1.1")
    assert b"x-dyad-native-secret: s3cret" in low and b"forged" not in low
    assert b"x-dyad-native-peer: 127.0.0.1:" in low and b"6.6.6.6" not in low
    assert b"x-keep: yes" in low
    assert b"first " in rest and b"second" in rest
    await fb.stop()


async def test_the_fallback_step_forwards_the_read_request_and_an_unreachable_fallback_is_a_502_that_says_so(plane):
    fb = Fallback()
    lane = Lane(lambda *_: ("fallback",))
    base = await plane(lane, fallback=await fb.start())
    r = await post(base, CHAT + "?q=1", b'{"model": "x"}', headers={"x-dyad-native-secret": "forged"})
    assert r.status_code == 201 and r.content.startswith(b"POST /v1/chat/completions?q=1 HTTP/1.1")
    assert b"x-dyad-native-secret: s3cret" in r.content.lower() and r.content.endswith(b'{"model": "x"}')
    path, query, headers, body, peer = lane.admitted[0]
    assert (path, query, body) == (CHAT, "q=1", b'{"model": "x"}') and peer.startswith("127.0.0.1:")
    assert all(not k.startswith(b"x-dyad-native-") for k, _ in headers), "forged headers are removed before admit"
    await fb.stop()
    gone = await plane(Lane(lambda *_: ("fallback",)), fallback=refused_url()[7:])
    for path in (CHAT, "/v1/models"):  # (was a 503 with the connection limit's words: not the cause)
        r = await post(gone, path)
        err = r.json()["error"]
        assert r.status_code == 502 and err["code"] == "fallback_unreachable", r.text
        assert "could not reach its own fallback" in err["message"]


# --- steps and one try --------------------------------------------------------------------------------------


async def test_reply_step(plane):
    base = await plane(Lane(lambda *_: ("reply", 418, [(b"x-a", b"1"), (b"content-type", b"text/plain")], b"tea")))
    r = await post(base)
    assert (r.status_code, r.content, r.headers["x-a"], r.headers["content-type"]) == (418, b"tea", "1", "text/plain")


async def test_send_then_relay_writes_the_engine_answer_with_reply_headers(plane):
    eng = RawServer(lambda req: ok(b'{"answer": 1}'))
    url = await eng.start()
    a = Attempt(url, body=b'{"model": "m", "x": 2}')
    r = await post(await plane(send(a)))
    assert r.status_code == 200 and r.content == b'{"answer": 1}'
    assert r.headers["content-type"] == "application/json" and r.headers["x-dyad-worker"] == "w1"
    name, status, headers, body = a.calls[0]
    assert (name, status, body) == ("answered", 200, b'{"answer": 1}') and (b"content-type", b"application/json") in headers
    req = eng.requests[0].lower()
    assert req.startswith(b"post /v1/chat/completions http/1.1") and b"x-test: 1" in req
    assert b"host: 127.0.0.1:" in req and b"content-length: 22" in req and req.endswith(b'{"model": "m", "x": 2}')
    await eng.stop()


async def test_a_failed_try_is_followed_by_the_next_send_on_another_server(plane):
    eng = RawServer(lambda req: ok(b'{"second": true}'))
    url = await eng.start()
    second = Attempt(url)
    first = Attempt(refused_url(), then={"failed": ("send", second)})
    r = await post(await plane(send(first)))
    assert r.status_code == 200 and r.content == b'{"second": true}'
    assert first.calls[0][:2] == ("failed", "connect") and second.names() == ["answered"]
    await eng.stop()


HEAD_PART = b"HTTP/1.1 200 OK\r\ncontent-"


@pytest.mark.parametrize("case", ["connect", "reset", "bad_http", "timeout", "deadline", "stalled_body"])
async def test_a_try_without_a_usable_head_fails_with_its_kind(plane, case):
    answers: dict[str, list[tuple[float, bytes]] | None] = {
        "reset": [(0, HEAD_PART)], "bad_http": [(0, b"SPDY/9 hello there\r\n\r\n")], "timeout": [(2, b"")],
        "deadline": [(2, b"")],
        "stalled_body": [(0, b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345"), (2, b"")]}
    eng = RawServer(lambda req: answers[case], close_after=True)
    url = refused_url() if case == "connect" else await eng.start()
    a = Attempt(url, first_byte_timeout=0.3 if case in ("timeout", "stalled_body") else None,
                deadline_s=0.3 if case == "deadline" else None)
    began = time.monotonic()
    r = await post(await plane(send(a)))
    assert r.status_code == 502 and a.names() == ["failed"] and a.calls[0][1] == case, a.calls
    assert time.monotonic() - began < 1.5
    if case != "connect":
        await eng.stop()


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one(plane):
    class ClosesSecond(RawServer):
        def answer(self, request: bytes, served: int) -> list[tuple[float, bytes]] | None:
            return ok() if served == 0 else None  # the second request on a kept-alive connection: closed unanswered

    eng = ClosesSecond(None)
    url = await eng.start()
    attempts = [Attempt(url), Attempt(url)]
    queue = iter(attempts)
    base = await plane(Lane(lambda *_: ("send", next(queue))))
    for _ in attempts:
        assert (await post(base)).status_code == 200
    assert [a.names() for a in attempts] == [["answered"], ["answered"]]
    assert eng.connections == 2 and len(eng.requests) == 3  # first, the stale try, its retry on a fresh connection
    await eng.stop()


async def test_an_answer_over_its_bound_is_none_and_an_error_body_is_cut(plane):
    eng = RawServer(lambda req: ok(b"x" * 100) if b"big" in req else
                    [(0, b"HTTP/1.1 500 X\r\ncontent-length: 100\r\n\r\n" + b"e" * 100)])
    url = await eng.start()
    big = Attempt(url, body=b"big", max_answer_bytes=10, then={"answered": ("reply", 502, [], b"judged")})
    r = await post(await plane(send(big)))
    assert r.content == b"judged" and big.calls[0][1] == 200 and big.calls[0][3] is None
    err = Attempt(url, body=b"err", error_body_bytes=7)
    r = await post(await plane(send(err)))
    assert r.status_code == 500 and r.content == b"eeeeeee" and err.calls[0][3] == b"eeeeeee"
    await eng.stop()


# --- streams ------------------------------------------------------------------------------------------------


async def stream(base: str) -> tuple[int, dict[str, str], bytes]:
    async with httpx.AsyncClient(timeout=10) as c, c.stream("POST", base + CHAT, content=b"{}") as r:
        body = b"".join([b async for b in r.aiter_raw()])
        return r.status_code, dict(r.headers), body


async def run_stream(plane, chunks: list[bytes], end: bool = True, **attrs: Any) -> tuple[Attempt, bytes, dict]:
    eng = RawServer(lambda req: stream_answer(*chunks, end=end, delay=0.02))
    url = await eng.start()
    a = Attempt(url, stream=True, **attrs)
    status, headers, body = await stream(await plane(send(a)))
    assert status == 200
    await until(lambda: a.names()[-1:] in (["stream_done"], ["stream_broken"]))
    await eng.stop()
    return a, body, headers


async def test_a_good_stream_is_relayed_and_done_reports_usage_events_and_times(plane):
    a, body, headers = await run_stream(plane, [EV, EV2, USAGE, DONE])
    assert body == EV + EV2 + USAGE + DONE
    assert headers["content-type"] == "text/event-stream" and headers["cache-control"] == "no-cache"
    assert headers["x-dyad-worker"] == "w1"
    name, usage, events, first_s, last_s = a.calls[-1]
    assert a.names() == ["streaming", "stream_done"]
    assert json.loads(usage) == {"prompt_tokens": 2, "completion_tokens": 2} and events == 2
    assert 0 < first_s < last_s < 2
    assert a.first_events == [first_s]  # once, with the first data event (TTFT; the stall watchdog stands down)
    # one ITL gap: the second token event's write after the first's (written apart: the engine sent them apart)
    assert a.gaps is not None and len(a.gaps) == 1 and a.gaps[0] >= 0


async def test_the_usage_chunk_is_withheld_with_strip_usage_and_events_split_across_chunks_are_whole(plane):
    whole = EV + EV2 + USAGE + DONE
    pieces = [whole[:7], whole[7:70], whole[70:71], whole[71:]]
    a, body, _ = await run_stream(plane, pieces, strip_usage=True)
    assert body == EV + EV2 + DONE and a.calls[-1][0] == "stream_done" and a.calls[-1][2] == 2
    assert json.loads(a.calls[-1][1])["completion_tokens"] == 2


async def test_crlf_line_ends_are_relayed_as_lf(plane):
    crlf = (EV + DONE).replace(b"\n", b"\r\n")
    a, body, _ = await run_stream(plane, [crlf[:len(EV) + 1], crlf[len(EV) + 1:]])
    assert body == EV + DONE and a.names()[-1] == "stream_done"


@pytest.mark.parametrize("case", ["garbage", "no_choice", "eof", "idle"])
async def test_a_broken_stream_ends_with_stream_broken_and_what_the_client_got(plane, case):
    chunks = {"garbage": [EV, EV2 + b"data: {nope\n\n"], "no_choice": [USAGE, DONE], "eof": [EV, EV2],
              "idle": [EV]}[case]
    a, body, _ = await run_stream(plane, chunks, end=case != "idle", idle_timeout=0.3 if case == "idle" else None)
    name, kind, detail, sent, usage, events, first_s, last_s = a.calls[-1]
    assert name == "stream_broken" and kind == ("garbage" if case == "no_choice" else case), detail
    assert body == sent + END
    assert sent == {"garbage": EV + EV2, "no_choice": USAGE, "eof": EV + EV2, "idle": EV}[case]
    assert events == {"garbage": 2, "no_choice": 0, "eof": 2, "idle": 1}[case]
    if case == "no_choice":
        assert "without any choice" in detail and usage is not None


async def test_a_broken_stream_continues_with_the_fallbacks_body(plane):
    cont = b'data: {"choices": [{"index": 0, "delta": {"content": "c"}}]}\n\n' + DONE
    fb = Fallback(lambda req: b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s"
                  % (len(cont), cont))
    eng = RawServer(lambda req: stream_answer(EV))
    url = await eng.start()
    a = Attempt(url, stream=True,
                then={"stream_broken": lambda *args: ("continue", "/continue/x", [(b"x-c", b"1")], b"cbody")})
    status, _, body = await stream(await plane(send(a), fallback=await fb.start()))
    assert body == EV + cont and a.calls[-1][1] == "eof"
    req = fb.requests[0].lower()
    assert req.startswith(b"post /continue/x http/1.1") and b"x-dyad-native-secret: s3cret" in req
    assert b"x-c: 1" in req and req.endswith(b"cbody")
    await fb.stop()
    await eng.stop()


async def test_cancel_from_another_thread_ends_the_current_operation(plane):
    eng = RawServer(lambda req: stream_answer(EV, EV2, delay=3) if b"stream" in req else
                    ok() if b"good" in req else [(3, b"")])
    url = await eng.start()
    lane: Lane

    def again(kind: str, detail: str) -> tuple:
        lane.cancels[0].cancel("hedge")  # idempotent: the same reason does not cancel the next try
        return ("send", after)

    after = Attempt(url, body=b"good")
    before = Attempt(url, body=b"head", then={"failed": again})
    lane = send(before)
    base = await plane(lane)
    task = asyncio.create_task(post(base))
    await until(lambda: lane.cancels and eng.requests)
    threading.Thread(target=lane.cancels[0].cancel, args=("hedge",)).start()
    r = await task
    assert before.calls[0][1] == "cancelled:hedge" and lane.cancels[0].cancelled
    assert r.status_code == 200 and after.names() == ["answered"]
    during = Attempt(url, body=b"stream", stream=True)
    lane2 = send(during)
    base2 = await plane(lane2)
    task = asyncio.create_task(stream(base2))
    await until(lambda: during.names() == ["streaming"])
    await asyncio.sleep(0.1)
    t = threading.Thread(target=lane2.cancels[0].cancel, args=("drain",))
    t.start()
    t.join()
    lane2.cancels[0].cancel("drain")
    _, _, body = await task
    assert during.calls[-1][:2] == ("stream_broken", "cancelled:drain") and body == END
    await eng.stop()


async def test_a_client_that_goes_away_cancels_the_engine_request(plane):
    closed: list[str] = []
    received: list[bytes] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        req = await reader.readuntil(b"\r\n\r\n")
        received.append(req)
        if b"stream" in req.lower():
            writer.write(STREAM_HEAD + _chunk(EV))
        await reader.read()  # (returns at EOF: the plane closed its connection)
        closed.append("stream" if b"stream" in req.lower() else "head")
        writer.close()

    srv = await asyncio.start_server(engine, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    for kind in ("head", "stream"):
        a = Attempt(url, stream=kind == "stream", path="/" + kind)
        base = await plane(send(a))
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" % CHAT.encode())
        if kind == "stream":
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        else:
            await until(lambda: len(received) == 1)  # waiting for the engine's head
        writer.close()
        await until(lambda kind=kind: kind in closed)
        await until(lambda a=a: a.names()[-1:] == ["client_gone"])
    srv.close()


# --- limits and errors --------------------------------------------------------------------------------------


async def test_a_body_over_max_body_bytes_is_413(plane):
    lane = Lane(lambda *_: pytest.fail("not admitted"))
    base = await plane(lane, max_body_bytes=10)
    r = await post(base, body=b"x" * 11)
    assert r.status_code == 413 and r.content == LIMITS["body_too_large"] and not lane.admitted


async def test_connections_over_max_connections_get_503_and_close(plane):
    base = await plane(Lane(lambda *_: ("reply", 200, [], b"ok")), max_connections=1)
    port = int(base.rsplit(":", 1)[1])
    r1, w1 = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.sleep(0.05)
    r2, w2 = await asyncio.open_connection("127.0.0.1", port)
    w2.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = await asyncio.wait_for(r2.read(), 5)  # read to EOF: the connection is closed after the 503
    assert answer.startswith(b"HTTP/1.1 503") and b"connection: close" in answer.lower()
    assert answer.endswith(LIMITS["overloaded"])
    w1.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" % CHAT.encode())
    assert (await r1.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    w1.close()
    w2.close()


async def test_a_callback_that_raises_is_500_server_error_and_reported(plane):
    lane = Lane(lambda *_: 1 / 0)
    r = await post(await plane(lane))
    assert r.status_code == 500 and r.content == LIMITS["server_error"]
    assert lane.errors[0][0] == "admit" and isinstance(lane.errors[0][1], ZeroDivisionError)
    eng = RawServer(lambda req: ok())
    url = await eng.start()
    a = Attempt(url, then={"answered": RuntimeError("judge broke")})
    lane2 = send(a)
    r = await post(await plane(lane2))
    assert r.status_code == 500 and isinstance(lane2.errors[0][1], RuntimeError)
    bad = Lane(lambda *_: ("nonsense",))
    r = await post(await plane(bad))
    assert r.status_code == 500 and bad.errors
    await eng.stop()


async def test_stats_and_stop(plane):
    base = await plane(Lane(lambda *_: ("reply", 200, [], b"ok")))
    for _ in range(3):
        await post(base)
    p = plane.started[-1]
    assert p.stats()["requests"] == 3 and p.stats()["in_flight"] == 0
    await asyncio.to_thread(p.stop, 0.5)
    with pytest.raises(httpx.ConnectError):
        await post(base)


async def test_a_stream_whole_by_done_is_complete_and_its_open_connection_is_closed_not_reused(plane):
    closed = asyncio.Event()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(STREAM_HEAD + _chunk(EV + DONE))  # [DONE], but the body never ends
        await reader.read()
        closed.set()
        writer.close()

    srv = await asyncio.start_server(engine, "127.0.0.1", 0)
    a = Attempt(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", stream=True)
    began = time.monotonic()
    _, _, body = await stream(await plane(send(a)))
    assert body == EV + DONE and time.monotonic() - began < 0.9, "the client does not wait for the body's end"
    await until(lambda: a.names() == ["streaming", "stream_done"])
    await asyncio.wait_for(closed.wait(), 3)  # closed after the 1 s grace
    assert time.monotonic() - began >= 0.9
    srv.close()


@pytest.mark.parametrize("case", ["deadline", "raises"])
async def test_a_stream_past_its_deadline_or_whose_callback_raises_ends_with_an_error_event(plane, case):
    eng = RawServer(lambda req: [(0, STREAM_HEAD + _chunk(EV)), (1.0, _chunk(EV2) + b"0\r\n\r\n")])
    url = await eng.start()
    a = Attempt(url, stream=True, deadline_s=0.5 if case == "deadline" else None,
                then={"stream_broken": RuntimeError("no") if case == "raises" else ("end", END)})
    lane = send(a)
    _, _, body = await stream(await plane(lane))
    if case == "deadline":
        assert a.calls[-1][:2] == ("stream_broken", "deadline") and body == EV + END
    else:
        assert a.calls[-1][:2] == ("stream_broken", "eof")
        assert body.startswith(EV + EV2) and b'"code": "internal_error"' in body and body.endswith(DONE)
        assert lane.errors[0][0] == "stream_broken"
    await eng.stop()


async def test_idle_keepalive_connections_and_slow_heads_are_closed(plane):
    base = await plane(Lane(lambda *_: ("reply", 200, [], b"ok")), keepalive_s=0.3, header_timeout_s=0.3,
                       body_timeout_s=0.3)  # (a body's own bound since test_surface_unseen_slow_body)
    port = int(base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" % CHAT.encode())
    answer = await reader.readuntil(b"ok")
    assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" not in answer.lower()
    assert await asyncio.wait_for(reader.read(), 2) == b""  # idle past keepalive_s: closed
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\n" % CHAT.encode())  # a head that never ends
    await asyncio.wait_for(reader.read(), 2)
    assert reader.at_eof()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 20\r\n\r\n{}" % CHAT.encode())  # a body that stops
    slow = await asyncio.wait_for(reader.read(), 2)
    assert slow.startswith(b"HTTP/1.1 408")


async def test_start_on_a_port_in_use_raises_oserror(plane):
    base = await plane(Lane(lambda *_: ("reply", 200, [], b"ok")))
    taken = dp.Plane("127.0.0.1", int(base.rsplit(":", 1)[1]), Lane(lambda *_: None), "127.0.0.1:9", SECRET, LIMITS)
    with pytest.raises(OSError):
        taken.start()


async def test_stop_waits_for_requests_in_flight(plane):
    eng = RawServer(lambda req: [(0.3, ok()[0][1])])
    url = await eng.start()
    base = await plane(send(Attempt(url)))
    task = asyncio.create_task(post(base))
    await until(lambda: eng.requests)
    await asyncio.to_thread(plane.started[-1].stop, 2.0)
    assert (await task).status_code == 200
    await eng.stop()
