"""Requests and engine behaviours the other request-path suites do not send (session 19's probes).

A real gateway over real sockets, in front of ``ScriptedEngine``: a test double that speaks HTTP/1.1 by hand
on a plain socket and answers every generation request with the bytes a test gives it (a function of the
request), so a test can write any answer shape — SSE fields around ``[DONE]``, framing — byte for byte.
Runs on both data planes (the Makefile's NATIVE_SUITES).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import httpx

from orchestrator.sim.server import SimEngineThread
from tests.integration.socket_engine import STREAM_HEAD, SocketEngine, chunk, event
from tests.integration.test_request_path_failures import MODEL, gateway, healthy

HEAD = STREAM_HEAD


class ScriptedEngine(SocketEngine):
    """Answers each POST with ``answer(request body, chat)`` (raw bytes: status line, headers, body), then
    keeps the connection for the next request; GETs (health) get an empty 200."""

    def __init__(self, answer: Callable[[dict[str, Any], bool], bytes]) -> None:
        self.answer = answer
        self.generations = 0
        super().__init__()

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        if method == "GET":
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return True
        self.generations += 1
        conn.sendall(self.answer(json.loads(body or b"{}"), path.endswith("/chat/completions")))
        return True


def stream_body(chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "stream": True}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    return body


# --- engine: how a stream says [DONE] ------------------------------------------------------------------

DONE_SHAPES = {  # the [DONE] event as SSE allows it, beyond the exact bytes "data: [DONE]"
    "id after the data": b"data: [DONE]\nid: 3\n\n",
    "a comment after the data": b"data: [DONE]\n: bye\n\n",
    "trailing space": b"data: [DONE] \n\n",
    "two spaces": b"data:  [DONE]\n\n",
}


def test_a_done_event_with_other_sse_fields_ends_the_stream_whole_and_blames_nobody():
    """The Python plane took ``[DONE]`` as the end only as the exact bytes ``data: [DONE]`` (the screen passed
    any event whose data is ``[DONE]``, the native plane ends there, and so does the client's SDK): an engine
    whose ``[DONE]`` event also carried an ``id:`` line (or a comment, or spaces) had every stream judged
    broken after it — events after it relayed, the break held against the worker — and after three complete
    answers each, both workers' breakers were open: 503 ``no_healthy_worker`` for a fleet that answers
    every request. Now the event whose data is ``[DONE]`` ends the stream, whatever fields it carries."""
    for name, done in DONE_SHAPES.items():
        def answer(req: dict[str, Any], chat: bool, done: bytes = done) -> bytes:
            late = event(chat, "LATE", "stop")  # (never relayed: after the stream's end)
            return HEAD + chunk(event(chat, "a ") + event(chat, "b", "stop")) + chunk(done + late) + chunk(b"")

        with gateway([ScriptedEngine(answer), ScriptedEngine(answer)]) as gw:
            healthy(gw)
            for i in range(8):
                chat = bool(i % 2)
                path = "/v1/chat/completions" if chat else "/v1/completions"
                r = httpx.post(gw.url + path, json=stream_body(chat), timeout=30)
                where = f"{name} #{i}: {r.status_code} {r.text!r}"
                assert r.status_code == 200, where
                assert r.text.endswith(done.decode()) and "LATE" not in r.text and '"error"' not in r.text, where
                assert r.text.count("[DONE]") == 1, where
            assert gw.runtime.breakers.snapshot() == {}, (name, gw.runtime.breakers.snapshot())


# --- client: HTTP/1.0 ----------------------------------------------------------------------------------

def _http10(port: int, body: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        out = b""
        while data := s.recv(65536):  # (an HTTP/1.0 answer without a length ends where the gateway closes)
            out += data
    return out


def test_a_stream_to_an_http_1_0_client_is_not_chunked():
    """HTTP/1.0 has no chunked transfer coding (RFC 9112 6.1: a server must not send one to an HTTP/1.0
    request): the Python plane chunked a stream's answer to such a client (as uvicorn does), whose reader then
    found chunk sizes between the events (``c4\\r\\ndata: ...``). Now the body ends where the connection
    closes, as the native plane does it; a whole answer keeps its Content-Length."""
    from orchestrator.config import load_config
    from orchestrator.gateway.serve import GatewayThread

    engine = SimEngineThread(model=MODEL, profile="cpu-tiny", kv_events=False).start()
    config = load_config({"models": [{"name": MODEL, "block_size": 16}],
                          "workers": [{"id": "s0", "url": engine.url, "engine": "sim", "models": [MODEL]}],
                          "health": {"interval_s": 30}}, environ={})
    gw = GatewayThread(config).start()
    try:
        healthy(gw)
        raw = _http10(gw.port, json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode())
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")), raw[:300]
        assert b"transfer-encoding" not in head.lower(), head
        events = [e for e in body.split(b"\n\n") if e]
        assert events and all(e.startswith(b"data: ") for e in events), body[:300]
        assert events[-1] == b"data: [DONE]" and all(json.loads(e[6:]) for e in events[:-1]), body[-300:]
        raw = _http10(gw.port, json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3}).encode())
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"content-length: %d" % len(body) in head.lower() and json.loads(body)["choices"], raw[:300]
    finally:
        gw.stop()
        engine.stop()


# --- client: a request offering an Upgrade (h2c) -------------------------------------------------------

def _exchange(port: int, pieces: list[bytes], answers: int) -> list[tuple[bytes, bytes]]:
    """Send ``pieces`` (separate writes) on one connection; read ``answers`` answers (head, body) back."""
    import time

    out: list[tuple[bytes, bytes]] = []
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        for piece in pieces:
            s.sendall(piece)
            time.sleep(0.05)
        data = b""
        while len(out) < answers:
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                head = data[:head_end].lower()
                length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(data) >= head_end + 4 + length:
                    out.append((head, data[head_end + 4:head_end + 4 + length]))
                    data = data[head_end + 4 + length:]
                    continue
            more = s.recv(65536)
            assert more, (out, data)
            data += more
    return out


def test_a_request_offering_an_h2c_upgrade_is_served_as_http_1_1_with_its_body():
    """The JDK's HttpClient (HTTP/2 by default) sends every cleartext request with ``Connection: Upgrade,
    HTTP2-Settings`` + ``Upgrade: h2c`` (``curl --http2`` too). httptools stops at such a request's head, so the
    Python plane served it without its body: 400 "Request body is empty" for every request such a client sent
    (uvicorn's known defect, Kludex/uvicorn#2722; the native plane serves them). Now the offer is ignored (RFC 9110
    7.8) and the body read by its Content-Length or chunks, then the connection goes on: a request pipelined
    after it is answered too."""
    from orchestrator.config import load_config
    from orchestrator.gateway.serve import GatewayThread

    engine = SimEngineThread(model=MODEL, profile="cpu-tiny", kv_events=False).start()
    config = load_config({"models": [{"name": MODEL, "block_size": 16}],
                          "workers": [{"id": "s0", "url": engine.url, "engine": "sim", "models": [MODEL]}],
                          "health": {"interval_s": 30}}, environ={})
    gw = GatewayThread(config).start()
    offer = b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAEAAEAAAAIAAAAAAAMAAABkAAQBAAAAAAUAAEAA\r\n"
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    plain = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body), body)
    try:
        healthy(gw)
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + offer
        by_length = [head + b"content-length: %d\r\n\r\n%s" % (len(body), body) + plain]  # (one write, then pipelined)
        chunked = [head + b"transfer-encoding: chunked\r\n\r\n", b"%x;ext=1\r\n%s\r\n" % (10, body[:10]),
                   b"%x\r\n%s\r\n" % (len(body) - 10, body[10:]), b"0\r\nx-trailer: t\r\n\r\n" + plain]
        for name, pieces in (("content-length", by_length), ("chunked", chunked)):
            answers = _exchange(gw.port, pieces, 2)
            for h, b in answers:
                assert h.startswith(b"http/1.1 200"), (name, h, b)
                assert json.loads(b)["choices"], (name, b)
            assert b"upgrade" not in answers[0][0], answers[0][0]
        # a chunked body whose framing is broken is refused, not taken for a shorter body
        answers = _exchange(gw.port, [head + b"transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"], 1)
        assert answers[0][0].startswith(b"http/1.1 400"), answers
        # a request offering an upgrade without a body is served as before
        get = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + offer + b"\r\n"
        answers = _exchange(gw.port, [get], 1)
        assert answers[0][0].startswith(b"http/1.1 200") and json.loads(answers[0][1])["data"], answers
    finally:
        gw.stop()
        engine.stop()
