"""A fake engine that writes raw bytes (a test double, named so): one faulty answer shape per ``mode``.

``FakeEngine`` (fake_engine.py) misbehaves through Python's HTTP server; this one speaks HTTP/1.1 by
hand on a plain socket so that it can also break the framing itself — a truncated Content-Length body,
an invalid chunk size, a bad status line, a body delimited by the connection's close — and answer
shapes no test was written for. ``MODES`` lists them; ``WORKER_FAULTS`` are the ones a good worker
next to it must hide from the client completely.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

MODES = ("truncated", "close_before_headers", "bad_json_event", "bad_chunk_size", "status_429", "status_503",
         "status_400", "status_404", "empty_200", "array_200", "string_200", "no_choices_200",
         "stream_answered_whole", "close_delimited", "after_done", "html", "bad_status_line",
         "no_done_after_finish", "comment_events", "crlf")
# answers a good worker next to it must make invisible (tried there, or continued there)
WORKER_FAULTS = frozenset(MODES) - {"status_400", "status_404", "close_delimited", "after_done",
                                    "no_done_after_finish", "comment_events", "crlf"}
# well-formed answers, merely unusual: served whole by the engine itself
WELL_FORMED = frozenset({"close_delimited", "after_done", "no_done_after_finish", "comment_events", "crlf"})


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


class RawEngine:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.generations = 0  # generation requests answered (in any way)
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                method, path = line.decode().split(" ")[:2]
                headers = {}
                while (h := f.readline()) not in (b"\r\n", b"\n", b""):
                    k, v = h.decode().split(":", 1)
                    headers[k.strip().lower()] = v.strip()
                body = f.read(int(headers.get("content-length", 0)))
                if method == "GET":
                    out = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode() \
                        if path == "/v1/models" else b""
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(out), out))
                    continue
                self.generations += 1
                req = json.loads(body or b"{}")
                if not self._answer(conn, req.get("stream") is True, path.endswith("/chat/completions")):
                    return
        except OSError:
            pass
        finally:
            conn.close()

    def _answer(self, conn: socket.socket, stream: bool, chat: bool) -> bool:
        """Write one answer; False when the connection is to be closed after it."""
        m = self.mode

        def whole(status: int, body: bytes, ctype: bytes = b"application/json") -> bool:
            conn.sendall(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\nretry-after: 1\r\n\r\n%s"
                         % (status, ctype, len(body), body))
            return True

        good = _event(_piece(chat, "a ")) + _event(_piece(chat, "b", "stop"))  # (the answer: "a b")
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
        }[m]
        conn.sendall(STREAM_HEAD + b"".join(_chunk(e + sep) for e in events) + _chunk(b""))
        return True
