"""A fake OpenAI engine for failure tests: a small real HTTP server (stdlib, its own thread, a free port).

It is a test double, named so: it answers vLLM's wire shapes (completions and chat, streamed and not,
the NIXL prefill hand-off) well enough for the gateway, and misbehaves on demand in the ways real
engines do but cannot be made to on cue here — a stream that ends without ``[DONE]``, a connection
reset mid-stream, a 200 JSON error body to a stream request, garbage bytes, an ``error`` event, a
request that hangs while ``/health`` answers, a 500 for one kind of request only. Every body it
receives is recorded (``bodies``), so tests can check what the gateway forwarded.

``mode`` (settable while running): ok | eof | reset | json_error_200 | garbage | error_event | hang |
status | poison (500 when the prompt contains ``POISON``, else ok) | poison_hang (hang when it does) | poison_reset (drop
the connection before answering when it does) | poison_short (a non-streamed answer that breaks off before its
Content-Length when it does) | poison_midreset (reset mid-stream when it does) | bad_event (a stream event whose
data is not JSON, after one good token) | after_done (events after ``data: [DONE]``) | no_choices (a
200 JSON object without ``choices``) | crlf (a stream whose lines end with CRLF, as SSE allows) | close_delimited (a well-formed answer whose body ends where the
engine closes the connection: no Content-Length, not chunked). ``status`` answers ``status_code``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeEngine:
    def __init__(self, mode: str = "ok", tokens: int = 5, usage: bool = True, status_code: int = 500,
                 kv_producer: bool = True) -> None:
        self.mode = mode
        self.tokens = tokens
        self.usage = usage  # answers usage (non-streamed always; streamed when include_usage is asked)
        self.status_code = status_code
        self.kv_producer = kv_producer
        self.delay_s = 0.0  # wait this long before answering a generation request
        self.token_delay_s = 0.005  # between two streamed tokens
        self.health_delay_s = 0.0  # /health answers this late (an engine whose probe is slow under load)
        self.generated = 0  # tokens generated: one per streamed token, one per 50 ms of delay_s (working on it)
        self.report_generation = False  # /metrics reports ``generated`` as vLLM's generation_tokens_total
        self.kv_params: dict[str, Any] | None = None  # the hand-off a prefill step answers (None: a well-formed one)
        self.healthy = True  # False: /health answers 503 (the health loop marks the worker down)
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []
        self.release = threading.Event()  # set to let hung requests go (they then drop the connection)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FakeEngine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def generation_bodies(self) -> list[dict[str, Any]]:
        return list(self.bodies)

    # --- the handler -------------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    if engine.health_delay_s:
                        time.sleep(engine.health_delay_s)
                    self._send(200 if engine.healthy else 503, b"")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model",
                                                                            "max_model_len": 4096}]}).encode())
                elif self.path == "/metrics":
                    self._send(200, f'vllm:generation_tokens_total{{model_name="m"}} {engine.generated}\n'.encode()
                               if engine.report_generation else b"", "text/plain")
                else:
                    self._send(404, b'{"error": {"message": "no route"}}')

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                body = json.loads(raw or b"{}")
                engine.bodies.append(body)
                engine.paths.append(self.path)
                engine.headers.append(dict(self.headers))
                chat = self.path.endswith("/chat/completions")
                mode = engine.mode
                if engine.delay_s:
                    end = time.monotonic() + engine.delay_s
                    while time.monotonic() < end:
                        time.sleep(0.05)
                        engine.generated += 1
                text = json.dumps(body.get("messages") if chat else body.get("prompt"))
                if mode == "poison":
                    mode = "status" if "POISON" in text else "ok"
                if mode == "poison_garbage":  # an input that trips an engine bug: HTML instead of the answer
                    if "POISON" in text:
                        self._send(200, b"<html>engine tripped over this input</html>", "text/html")
                        return
                    mode = "ok"
                if mode == "poison_hang":  # an input that keeps the engine busy with no sign of work
                    mode = "hang" if "POISON" in text else "ok"
                if mode == "poison_reset" and "POISON" in text:  # an input its engine drops the connection on
                    self.close_connection = True
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    return
                if mode == "poison_reset":
                    mode = "ok"
                if mode == "poison_short":  # an input its engine breaks off on mid-answer (Content-Length unmet)
                    if "POISON" in text and not body.get("stream"):
                        answer = json.dumps(self._completion(chat, body, engine.tokens)).encode()
                        self.send_response(200)
                        self.send_header("content-type", "application/json")
                        self.send_header("content-length", str(len(answer) + 100))
                        self.end_headers()
                        self.wfile.write(answer)
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    mode = "ok"
                if mode == "poison_midreset":  # an input its engine crashes on while generating
                    mode = "reset" if "POISON" in text else "ok"
                if mode == "hang":
                    engine.release.wait(120)
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if mode == "status":
                    self._send(engine.status_code, json.dumps(
                        {"error": {"message": f"fake engine says {engine.status_code}", "type": "BadRequestError",
                                   "param": None, "code": engine.status_code}}).encode())
                    return
                if mode == "garbage" and not body.get("stream"):
                    self._send(200, b"<html>502 upstream garbage</html>", "text/html")
                    return
                if mode == "no_choices" and not body.get("stream"):
                    self._send(200, json.dumps({"id": "cmpl-fake", "object": "text_completion"}).encode())
                    return
                if mode == "close_delimited":
                    self.close_connection = True
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream" if body.get("stream") else "application/json")
                    self.send_header("connection", "close")
                    self.end_headers()
                    if not body.get("stream"):
                        self.wfile.write(json.dumps(self._completion(chat, body, engine.tokens)).encode())
                        return
                    self._chunk = self.wfile.write  # (events written as they are: no chunk framing)
                    self._stream(chat, body, engine.tokens, "ok", head=False)
                    return
                if mode == "json_error_200":
                    self._send(200, json.dumps({"error": {"message": "engine failed quietly", "type": "InternalError",
                                                          "param": None, "code": 500}}).encode())
                    return
                kvp = body.get("kv_transfer_params")
                if isinstance(kvp, dict) and kvp.get("do_remote_decode") and not body.get("stream"):
                    out = self._completion(chat, body, 1)
                    if engine.kv_producer:
                        out["kv_transfer_params"] = engine.kv_params or {
                            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "fake",
                            "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 1}
                    self._send(200, json.dumps(out).encode())
                    return
                n = body.get("max_tokens") or body.get("max_completion_tokens") or engine.tokens
                n = min(int(n), engine.tokens)
                if not body.get("stream"):
                    self._send(200, json.dumps(self._completion(chat, body, n)).encode())
                    return
                self._stream(chat, body, n, mode)

            def _completion(self, chat: bool, body: dict[str, Any], n: int) -> dict[str, Any]:
                words = " ".join(f"w{i}" for i in range(n))
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": words}
                else:
                    choice["text"] = words
                out: dict[str, Any] = {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                                       "created": 1, "model": body.get("model"), "choices": [choice]}
                if engine.usage:
                    out["usage"] = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                return out

            def _chunk(self, data: bytes) -> None:
                if engine.mode == "crlf":
                    data = data.replace(b"\n", b"\r\n")
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _stream(self, chat: bool, body: dict[str, Any], n: int, mode: str, head: bool = True) -> None:
                if head:
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                if mode == "garbage":
                    self._chunk(b"this is not server-sent events\n\nnor is this\n\n")
                    self._chunk(b"")
                    return
                if mode == "error_event":
                    self._chunk(b'data: {"error": {"message": "engine error mid-stream", "type": "InternalError", '
                                b'"param": null, "code": 500}}\n\n')
                    self._chunk(b"data: [DONE]\n\n")
                    self._chunk(b"")
                    return
                obj = "chat.completion.chunk" if chat else "text_completion"
                if chat:
                    self._chunk(b"data: " + json.dumps({"id": "c", "object": obj, "created": 1, "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}).encode()
                                + b"\n\n")
                cut = 2 if mode in ("eof", "reset") else n
                if mode == "bad_event":
                    cut = 1
                for i in range(min(n, cut)):
                    piece = f"w{i} "
                    choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
                    if chat:
                        choice["delta"] = {"content": piece}
                    else:
                        choice["text"] = piece
                    self._chunk(b"data: " + json.dumps({"id": "c", "object": obj, "created": 1,
                                                        "choices": [choice]}).encode() + b"\n\n")
                    engine.generated += 1
                    time.sleep(engine.token_delay_s)
                if mode == "eof":
                    self._chunk(b"")  # a clean end of the HTTP body, without data: [DONE]
                    return
                if mode == "bad_event":  # then a well-formed rest: only the one event is bad
                    self._chunk(b"data: {this is not json\n\n")
                    self._chunk(b"data: [DONE]\n\n")
                    self._chunk(b"")
                    return
                if mode == "reset":
                    self.close_connection = True
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    return
                so = body.get("stream_options") or {}
                if so.get("include_usage") and engine.usage:
                    self._chunk(b"data: " + json.dumps({"id": "c", "object": obj, "created": 1, "choices": [],
                                                        "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                                  "total_tokens": 7 + n}}).encode() + b"\n\n")
                self._chunk(b"data: [DONE]\n\n")
                if mode == "after_done":
                    self._chunk(b"data: " + json.dumps({"id": "c", "object": obj, "created": 1, "choices": [
                        {"index": 0, "text": "AFTER", "delta": {"content": "AFTER"}, "finish_reason": None}]}).encode()
                                + b"\n\n")
                    self._chunk(b"not even server-sent events\n\n")
                self._chunk(b"")

        return Handler
