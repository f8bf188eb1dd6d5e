"""A fake engine that writes raw bytes (a test double, named so): one faulty answer shape per ``mode``.

``FakeEngine`` (fake_engine.py) misbehaves through Python's HTTP server; this one speaks HTTP/1.1 by
hand on a plain socket so that it can also break the framing itself — a truncated Content-Length body,
an invalid chunk size, a bad status line, a body delimited by the connection's close — and answer
shapes no test was written for. ``MODES`` lists them; ``WORKER_FAULTS`` are the ones a good worker
next to it must hide from the client completely.
"""

from __future__ import annotations

import gzip
import json
import socket
import time
from typing import Any

from tests.integration.socket_engine import SocketEngine

MODES = ("truncated", "close_before_headers", "bad_json_event", "bad_chunk_size", "status_429", "status_503",
         "status_400", "status_404", "empty_200", "array_200", "string_200", "no_choices_200",
         "stream_answered_whole", "close_delimited", "after_done", "html", "bad_status_line",
         "no_done_after_finish", "comment_events", "crlf", "lone_cr", "interim_1xx", "trailers", "gzip",
         "huge_headers", "empty_choices", "short_length", "redirect", "status_401")
# well-formed answers, merely unusual: served whole by the engine itself
WELL_FORMED = frozenset({"close_delimited", "after_done", "no_done_after_finish", "comment_events", "crlf",
                         "lone_cr", "interim_1xx", "trailers"})
# answers a good worker next to it must make invisible (tried there, or continued there)
WORKER_FAULTS = frozenset(MODES) - {"status_400", "status_404"} - WELL_FORMED
# more shapes, for the tests that need their own bounds (test_request_path_failures.py): "good" (a plain
# answer), "unsolicited" (a good answer, then a second answer nobody asked for), "huge_body" (a JSON answer of
# HUGE bytes), "huge_error" (a 500 of HUGE bytes), "dribble" (a stream that sends one byte at a time and never
# ends its event), "keepalive_only" (a stream that sends comments and never data), "flood" (a stream of 256 MiB sent
# as fast as the gateway takes it)
HUGE = 4 << 20


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _piece(chat: bool, text: str, finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return {"id": "raw", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
            "choices": [choice]}


def _whole(chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    if chat:
        choice["message"] = {"role": "assistant", "content": "a b"}
    else:
        choice["text"] = "a b"
    return {"id": "raw", "object": "chat.completion" if chat else "text_completion", "created": 1,
            "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class RawEngine(SocketEngine):
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.generations = 0  # generation requests answered (in any way)
        self.flood_sent = 0  # bytes of "flood" answers the gateway took
        self.flood_closed = False  # the gateway closed a "flood" answer's connection before its end
        self.stored_status = 0  # when set: what GET/POST /v1/responses/{id}[/cancel] answer (an error status)
        super().__init__()

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        if path.startswith("/v1/responses/") and self.stored_status:  # a stored response's GET/cancel
            out = json.dumps({"error": {"message": f"raw engine says {self.stored_status}", "type": "X",
                                        "code": self.stored_status}}).encode()
            conn.sendall(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                         b"retry-after: 7\r\n\r\n%s" % (self.stored_status, len(out), out))
            return True
        if method == "GET":
            out = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode() \
                if path == "/v1/models" else b""
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(out), out))
            return True
        self.generations += 1
        req = json.loads(body or b"{}")
        return self._answer(conn, req.get("stream") is True, path.endswith("/chat/completions"))

    def _answer(self, conn: socket.socket, stream: bool, chat: bool) -> bool:
        """Write one answer; False when the connection is to be closed after it."""
        m = self.mode

        def whole(status: int, body: bytes, ctype: bytes = b"application/json") -> bool:
            conn.sendall(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\nretry-after: 1\r\n\r\n%s"
                         % (status, ctype, len(body), body))
            return True

        good = _event(_piece(chat, "a ")) + _event(_piece(chat, "b", "stop"))  # (the answer: "a b")
        whole_good = json.dumps(_whole(chat)).encode()
        if m in ("good", "unsolicited"):
            if stream:
                conn.sendall(STREAM_HEAD + _chunk(good + b"data: [DONE]\n\n") + _chunk(b""))
            else:
                whole(200, whole_good)
            if m == "unsolicited":  # (on the connection, idle in the gateway's pool by now)
                time.sleep(0.2)
                whole(200, json.dumps({**_whole(chat), "id": "UNSOLICITED"}).encode())
            return True
        if m == "huge_body":
            return whole(200, json.dumps({**_whole(chat), "pad": "x" * HUGE}).encode())
        if m == "huge_error":
            return whole(500, json.dumps({"error": {"message": "x" * HUGE, "type": "X", "code": 500}}).encode())
        if m == "flood":  # a long answer as fast as the socket takes it (64 KiB events, 256 MiB in all)
            event = _chunk(_event(_piece(chat, "x" * 65536)))
            try:
                conn.sendall(STREAM_HEAD)
                for _ in range(4096):
                    conn.sendall(event)
                    self.flood_sent += len(event)
            except OSError:
                self.flood_closed = True
            return False
        if m in ("dribble", "keepalive_only"):
            conn.sendall(STREAM_HEAD + _chunk(_event(_piece(chat, "a "))))
            try:
                for _ in range(600):  # (a minute at most: the gateway is expected to leave long before)
                    conn.sendall(_chunk(b"x" if m == "dribble" else b": keep-alive\n\n"))
                    time.sleep(0.1)
            except OSError:
                pass
            return False
        if m == "interim_1xx":  # interim answers first (skipped by HTTP clients), then the answer itself
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            time.sleep(0.05)
            conn.sendall(b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n")
            time.sleep(0.05)
            if not stream:
                return whole(200, whole_good)
            conn.sendall(STREAM_HEAD + _chunk(good) + _chunk(b"data: [DONE]\n\n") + _chunk(b""))
            return True
        if m == "trailers":  # a chunked body ended with trailer fields
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\ntrailer: x-t\r\n\r\n%s"
                         b"0\r\nx-t: done\r\n\r\n" % (b"text/event-stream" if stream else b"application/json",
                                                      _chunk(good + b"data: [DONE]\n\n" if stream else whole_good)))
            return True
        if m == "gzip":  # compressed although the gateway asked for identity
            body = gzip.compress(good + b"data: [DONE]\n\n" if stream else whole_good)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s"
                         % (b"text/event-stream" if stream else b"application/json", len(body), body))
            return True
        if m == "huge_headers":
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                for i in range(4096):  # 16 MiB of headers, unless the gateway leaves first
                    conn.sendall(b"x-h%d: %s\r\n" % (i, b"v" * 4096))
            except OSError:
                pass
            return False
        if m == "empty_choices":  # events (or an answer) without any choice
            if not stream:
                return whole(200, json.dumps({**_whole(chat), "choices": []}).encode())
            empty = _event({"id": "raw", "object": "chat.completion.chunk", "created": 1, "choices": []})
            conn.sendall(STREAM_HEAD + _chunk(empty) + _chunk(empty + b"data: [DONE]\n\n") + _chunk(b""))
            return True
        if m == "short_length":  # Content-Length shorter than the body: the rest is left on the connection
            body = good + b"data: [DONE]\n\n" if stream else whole_good
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                         % (b"text/event-stream" if stream else b"application/json", len(body) - 40, body))
            return True
        if m == "redirect":  # a 307 (an ingress sending its clients elsewhere) whose body looks like an answer
            body = good + b"data: [DONE]\n\n" if stream else whole_good
            conn.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://elsewhere:8000/v1\r\ncontent-type: %s\r\n"
                         b"content-length: %d\r\n\r\n%s"
                         % (b"text/event-stream" if stream else b"application/json", len(body), body))
            return True
        if m == "truncated":
            if stream:
                conn.sendall(STREAM_HEAD + _chunk(_event(_piece(chat, "a "))) + b"20\r\ndata: {")
            else:
                b = json.dumps(_whole(chat)).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(b), b[: len(b) // 2]))
            return False
        if m == "close_before_headers":
            return False
        if m == "bad_json_event":
            if not stream:
                return whole(200, b'{"id": "raw", "choices": [')
            conn.sendall(STREAM_HEAD + _chunk(_event(_piece(chat, "a "))) + _chunk(b"data: {not json\n\n")
                         + _chunk(_event(_piece(chat, "b", "stop"))) + _chunk(b"data: [DONE]\n\n") + _chunk(b""))
            return True
        if m == "bad_chunk_size":
            if not stream:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                             b"zz\r\n{}\r\n")
                return False
            conn.sendall(STREAM_HEAD + _chunk(_event(_piece(chat, "a "))) + b"zz\r\nhello\r\n")
            return False
        if m.startswith("status_"):
            status = int(m[7:])
            return whole(status, json.dumps({"error": {"message": f"raw engine says {status}", "type": "X",
                                                       "param": None, "code": status}}).encode())
        if m == "empty_200":
            return whole(200, b"")
        if m == "array_200":
            return whole(200, b"[1, 2, 3]")
        if m == "string_200":
            return whole(200, b'"a b"')
        if m == "no_choices_200":
            return whole(200, b'{"id": "raw", "object": "text_completion"}')
        if m == "stream_answered_whole":
            return whole(200, json.dumps(_whole(chat)).encode()) if stream else whole(200, b"{}")
        if m == "html":
            return whole(200, b"<html>bad gateway</html>", b"text/html")
        if m == "bad_status_line":
            conn.sendall(b"HTTTP/9 what\r\n\r\n")
            return False
        if m == "close_delimited":
            ctype = b"text/event-stream" if stream else b"application/json"
            body = good + b"data: [DONE]\n\n" if stream else json.dumps(_whole(chat)).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\nconnection: close\r\n\r\n%s" % (ctype, body))
            return False
        if not stream:
            return whole(200, json.dumps(_whole(chat)).encode())
        done = b"data: [DONE]"
        first, last = _event(_piece(chat, "a "))[:-2], _event(_piece(chat, "b", "stop"))[:-2]
        events, sep = {
            "after_done": ([first, last, done, _event(_piece(chat, "LATE"))[:-2], b"junk"], b"\n\n"),
            "no_done_after_finish": ([first, last], b"\n\n"),
            "comment_events": ([b": keep-alive", first, b": ping", b"event: message\n" + last, done], b"\n\n"),
            "crlf": ([first, last, done], b"\r\n\r\n"),
            "lone_cr": ([first, last, done], b"\r\r"),  # (SSE allows a lone CR)
        }[m]
        conn.sendall(STREAM_HEAD + b"".join(_chunk(e + sep) for e in events) + _chunk(b""))
        return True
