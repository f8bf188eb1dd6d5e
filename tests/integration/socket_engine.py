"""The scaffolding of the test doubles that speak HTTP/1.1 by hand on a plain socket (named so: fakes).

``RawEngine`` (raw_engine.py: one faulty answer shape per mode), ``ScriptedEngine`` (test_unseen_inputs.py:
the bytes a test gives it) and ``BreakingEngine`` (test_stream_memory.py: a stream it breaks) differ only in
what they answer; reading requests off the socket is here. A subclass answers in ``respond``.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(chat: bool, text: str, finish: str | None = None, ident: str = "scripted") -> bytes:
    """One OpenAI stream event carrying ``text`` (a chat delta or a completion's text)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    obj = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
           "choices": [choice]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class SocketEngine:
    """Listens on a loopback port (``url``), one thread per connection; each request is read whole (request line,
    headers by lower-case name, a Content-Length body) and handed to ``respond``, which writes the answer to the
    connection and returns False to close it (True: the next request on the same connection)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def start(self) -> SocketEngine:
        return self

    def stop(self) -> None:
        self._sock.close()

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        raise NotImplementedError

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
            while line := f.readline():
                method, path = line.decode().split(" ")[:2]
                headers = {}
                while (h := f.readline()) not in (b"\r\n", b"\n", b""):
                    k, v = h.decode("latin-1").split(":", 1)
                    headers[k.strip().lower()] = v.strip()
                body = f.read(int(headers.get("content-length", 0)))
                if not self.respond(conn, method, path, headers, body):
                    return
        except OSError:
            pass
        finally:
            conn.close()
