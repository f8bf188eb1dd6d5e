"""What a stream keeps for its continuation is bounded (``gateway.max_answer_bytes``), on both data planes.

The relay keeps what the client was sent so that a stream whose engine breaks can be continued on another worker
(the continuation replays the text). It kept every byte, however long the stream (one 256 MiB stream held
256 MiB): now it keeps at most ``gateway.max_answer_bytes``; past it the stream is relayed on, and a break ends
it with an SSE error event naming the limit instead of a continuation. An event without an end (no blank line)
is bounded too (1 MiB: a broken stream, continued as any other).

A real gateway over real sockets, in front of ``BreakingEngine``: a test double speaking HTTP/1.1 by hand that
answers a first request with a stream it breaks (events, then the connection closed without the body's end)
and a continuation (a request carrying the text already sent) with a short complete stream. Runs on both data
planes (the Makefile's NATIVE_SUITES).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.integration.socket_engine import STREAM_HEAD, SocketEngine, chunk, event
from tests.integration.test_request_path_failures import MODEL, gateway, healthy

HEAD = STREAM_HEAD
BOUND = 4096  # gateway.max_answer_bytes in these tests
PROMPT = "hi"


def is_continuation(req: dict[str, Any], chat: bool) -> bool:
    return bool(req.get("continue_final_message")) if chat else req.get("prompt") != PROMPT


class BreakingEngine(SocketEngine):
    """Answers a first request with ``first(chat, write)`` (it writes raw bytes after the head; the connection is
    then closed: the body never ends), and a continuation with " END" and ``[DONE]``. ``sent``: bytes written."""

    def __init__(self, first: Callable[[bool, Callable[[bytes], None]], None]) -> None:
        self.first = first
        self.requests: list[dict[str, Any]] = []
        self.sent = 0
        super().__init__()

    def _write(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        if method == "GET":
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return True
        req = json.loads(body or b"{}")
        chat = path.endswith("/chat/completions")
        self.requests.append(req)
        if not path.endswith("/responses") and is_continuation(req, chat):
            conn.sendall(HEAD + chunk(event(chat, " END", "stop") + b"data: [DONE]\n\n") + chunk(b""))
            return True
        conn.sendall(HEAD)
        self.first(chat, lambda data: self._write(conn, chunk(data)))
        return False  # (closed without the body's last chunk: the stream broke)


def words(n: int) -> Callable[[bool, Callable[[bytes], None]], None]:
    """A first answer of ``n`` one-word events (about 130 bytes each), then the break."""
    def first(chat: bool, write: Callable[[bytes], None]) -> None:
        for i in range(n):
            write(event(chat, f"w{i} "))
    return first


def post(gw: Any, chat: bool) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 10_000, "stream": True}
    body.update({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})
    return httpx.post(gw.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=30)


def payloads(text: str) -> list[Any]:
    out = []
    for line in text.split("\n"):
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def content(events: list[Any], chat: bool) -> str:
    pieces = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            pieces.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    return "".join(pieces)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_longer_than_the_bound_that_breaks_ends_with_an_error_event_not_a_continuation(chat):
    """Past ``gateway.max_answer_bytes`` the stream is relayed whole (every event reaches the client) but no longer
    kept: when it breaks it ends with an error event naming the limit and ``[DONE]``; nothing is continued.
    (Before: the relay kept every byte and continued it.)"""
    n = 100  # ~13 KB, three times the bound
    fleet = [BreakingEngine(words(n)), BreakingEngine(words(n))]
    with gateway(fleet, gateway={"max_answer_bytes": BOUND}) as gw:
        healthy(gw)
        r = post(gw, chat)
        assert r.status_code == 200, r.text[:300]
        evs = payloads(r.text)
        assert evs[-1] == "[DONE]", r.text[-300:]
        err = evs[-2]
        assert isinstance(err, dict) and "error" in err, r.text[-500:]
        message = err["error"]["message"]
        assert "too long to continue" in message and "gateway.max_answer_bytes" in message, message
        assert content(evs, chat) == "".join(f"w{i} " for i in range(n))  # everything relayed, nothing more
        assert sum(len(e.requests) for e in fleet) == 1  # no continuation was asked for
        assert gw.runtime.metrics.registry.get_sample_value(
            "dyad_stream_failovers_total", {"outcome": "error_event"}) == 1.0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_that_breaks_below_the_bound_is_continued_on_the_other_worker(chat):
    """Below the bound nothing changes: the continuation replays the text sent and the client gets one stream."""
    n = 10  # ~1.3 KB
    fleet = [BreakingEngine(words(n)), BreakingEngine(words(n))]
    with gateway(fleet, gateway={"max_answer_bytes": BOUND}) as gw:
        healthy(gw)
        r = post(gw, chat)
        assert r.status_code == 200, r.text[:300]
        evs = payloads(r.text)
        assert evs[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in evs), r.text[-500:]
        sent = "".join(f"w{i} " for i in range(n))
        assert content(evs, chat) == sent + " END"
        continuation = [q for e in fleet for q in e.requests if is_continuation(q, chat)]
        assert len(continuation) == 1, [e.requests for e in fleet]
        replayed = continuation[0]["messages"][-1]["content"] if chat else continuation[0]["prompt"][len(PROMPT):]
        assert replayed == sent and continuation[0]["max_tokens"] == 10_000 - n


def test_an_event_without_an_end_is_bounded_and_the_stream_ends_honestly():
    """An engine that sends one event without ever ending it (no blank line) is not held in memory without bound:
    past 1 MiB it is a broken stream (garbage), continued on the other worker as any break; the gateway lets go of
    the engine, which could not write the 64 MiB it meant to."""
    huge = 64 << 20

    def first(chat: bool, write: Callable[[bytes], None]) -> None:
        write(event(chat, "a "))
        write(b'data: {"choices": [{"index": 0, "text": "')
        piece = b"x" * (64 << 10)
        for _ in range(huge // len(piece)):
            write(piece)

    fleet = [BreakingEngine(first), BreakingEngine(first)]
    with gateway(fleet, gateway={"max_answer_bytes": BOUND}) as gw:
        healthy(gw)
        r = post(gw, False)
        assert r.status_code == 200, r.text[:300]
        evs = payloads(r.text)
        assert evs[-1] == "[DONE]" and content(evs, False) == "a  END", r.text[-500:]
        assert not any(isinstance(e, dict) and "error" in e for e in evs), r.text[-500:]
        assert max(e.sent for e in fleet) < huge // 4, [e.sent for e in fleet]  # (the gateway let go early)


def test_a_responses_preamble_that_never_reaches_a_token_is_bounded():
    """A Responses stream's opening events are held back until its first token (stream_protocol.py): an engine
    that sends opening events without end is not held without bound (each data event kept the first-token wait
    open): past ``gateway.max_answer_bytes`` it is a broken stream, started over on the other worker, which does
    the same: the stream ends with ``event: error`` + ``response.failed``. Both engines were let go early."""
    huge = 64 << 20

    def first(chat: bool, write: Callable[[bytes], None]) -> None:
        seq = 0
        while seq * 100 < huge:
            data = {"type": "response.in_progress", "sequence_number": seq,
                    "response": {"id": "resp_x", "object": "response", "status": "in_progress"}}
            write(b"event: response.in_progress\ndata: " + json.dumps(data).encode() + b"\n\n")
            seq += 1

    fleet = [BreakingEngine(first), BreakingEngine(first)]
    with gateway(fleet, gateway={"max_answer_bytes": BOUND}) as gw:
        healthy(gw)
        r = httpx.post(gw.url + "/v1/responses", json={"model": MODEL, "input": PROMPT, "stream": True}, timeout=30)
        assert "event: error\n" in r.text and "event: response.failed\n" in r.text, r.text[-500:]
        assert "response.in_progress" not in r.text, r.text[:300]  # (nothing of the preamble reached the client)
        assert sum(len(e.requests) for e in fleet) == 2, [len(e.requests) for e in fleet]
        assert max(e.sent for e in fleet) < huge // 4, [e.sent for e in fleet]
