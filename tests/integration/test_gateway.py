"""The gateway end to end over real HTTP: errors, streaming, retries, disconnects.

The engine here is a small local app in this file that speaks just enough of vLLM's OpenAI API
(until the project's simulated engine, orchestrator/sim/server.py, lands). What it does is driven
by the prompt text: "SLOW" holds the request open and records whether it was cancelled.
Real-vLLM runs of the same paths are in tests/integration.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from orchestrator.config import load_config
from orchestrator.fleet.worker import WorkerState
from orchestrator.gateway.serve import GatewayThread, bind_socket

KEY = "client-key"
ADMIN = "admin-secret"


class Engine:
    """A tiny vLLM look-alike on a free port in a thread. ``state`` is shared with the tests."""

    def __init__(self, name: str, model: str = "m") -> None:
        self.name = name
        self.model = model
        self.fail_status: int | None = None  # answer every completion with this status
        self.healthy = True
        self.seen: list[dict[str, Any]] = []  # (headers, body) of completion requests
        self.active = 0
        self.cancelled = 0
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.complete, methods=["POST"]),
            Route("/v1/completions", self.complete, methods=["POST"]),
            Route("/health", self.health), Route("/v1/models", self.models), Route("/metrics", self.metrics),
        ])
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        cfg = uvicorn.Config(self.app, log_level="error", access_log=False, lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> Engine:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()

    async def health(self, request: Request) -> Response:
        return Response(b"", status_code=200 if self.healthy else 503)

    async def models(self, request: Request) -> Response:
        return Response(orjson.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}),
                        media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        text = (f'vllm:num_requests_running{{engine="0",model_name="{self.model}"}} {self.active}\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="{self.model}"}} 0\n')
        return Response(text.encode(), media_type="text/plain")

    async def complete(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.seen.append({"headers": dict(request.headers), "body": body})
        if self.fail_status:
            return Response(orjson.dumps({"object": "error", "message": f"{self.name} is failing",
                                          "type": "InternalError", "code": self.fail_status}),
                            status_code=self.fail_status, media_type="application/json")
        text = body.get("prompt") if "prompt" in body else body["messages"][-1].get("content")
        if text == "BAD":
            return Response(orjson.dumps({"error": {"message": "engine says no", "type": "BadRequestError",
                                                    "param": "temperature", "code": 400}}),
                            status_code=400, media_type="application/json")
        chunk = {"id": "cmpl-1", "object": "chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}],
                 "engine": self.name, "x_extra": {"kept": True}}
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        if text == "SLOW":
            return await self.slow(request, bool(body.get("stream")), chunk)
        if body.get("stream"):
            include = (body.get("stream_options") or {}).get("include_usage")

            async def gen():
                for _ in range(2):
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                if include:
                    yield b"data: " + orjson.dumps({"id": "cmpl-1", "choices": [], "usage": usage}) + b"\n\n"
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        return Response(orjson.dumps({"id": "cmpl-1", "object": "chat.completion", "engine": self.name,
                                      "choices": [{"index": 0, "message": {"content": "hi"}}],
                                      "usage": usage, "kv_transfer_params": None}),
                        media_type="application/json")

    async def slow(self, request: Request, stream: bool, chunk: dict) -> Response:
        self.active += 1
        if stream:
            async def gen():
                try:
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                    for _ in range(600):
                        await asyncio.sleep(0.05)
                        yield b": keep-alive\n\n"
                except BaseException:
                    self.cancelled += 1
                    raise
                finally:
                    self.active -= 1
            return StreamingResponse(gen(), media_type="text/event-stream")
        try:
            for _ in range(600):
                await asyncio.sleep(0.05)
                if await request.is_disconnected():
                    self.cancelled += 1
                    return Response(b"")
            return Response(b"{}")
        finally:
            self.active -= 1


def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture(scope="module")
def engines():
    a, b = Engine("A").start(), Engine("B").start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def gateway(engines):
    a, b = engines
    cfg = load_config({
        "models": [{"name": "m", "aliases": ["m-alias"]}, {"name": "ghost"}],
        "workers": [{"id": "a", "url": a.url, "models": ["m"]}, {"id": "b", "url": b.url}],
        "gateway": {"api_keys": [KEY], "admin_token": ADMIN, "max_body_bytes": 4096, "retry_after_s": 3},
        "router": {"policy": "round_robin", "debug_headers": True},
        "health": {"interval_s": 0.2, "failure_threshold": 2, "success_threshold": 1},
        "scrape": {"interval_s": 0.2},
    })
    with GatewayThread(cfg) as g:
        yield g


@pytest.fixture
def client(gateway, engines):
    for e in engines:
        e.fail_status, e.healthy = None, True
    for w in gateway.runtime.fleet.workers():
        if w.state is WorkerState.DRAINING:
            gateway.runtime.fleet.undrain(w.id)
    assert wait_until(lambda: all(w.state is WorkerState.HEALTHY for w in gateway.runtime.fleet.workers()))
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {KEY}"}, timeout=10) as c:
        yield c


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# --- happy paths ------------------------------------------------------------------------------------

def test_chat_non_streaming_passes_engine_fields_and_request_id(client, engines):
    r = client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "req-123"})
    assert r.status_code == 200
    body = r.json()
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert "kv_transfer_params" in body and body["engine"] in ("A", "B")
    assert r.headers["x-request-id"] == "req-123"
    engine = engines[0] if body["engine"] == "A" else engines[1]
    assert engine.seen[-1]["headers"]["x-request-id"] == "req-123"
    assert engine.seen[-1]["body"] == CHAT  # forwarded untouched
    assert "authorization" not in engine.seen[-1]["headers"]  # the client's key is not the engine's
    assert r.headers["x-dyad-worker"] in ("a", "b")


def test_generated_request_id_is_echoed_and_forwarded(client, engines):
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert len(rid) >= 16
    assert any(s["headers"].get("x-request-id") == rid for e in engines for s in e.seen)


def test_streaming_bytes_pass_through_with_usage(client):
    body = dict(CHAT, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert orjson.loads(events[0][6:])["x_extra"] == {"kept": True}
    assert orjson.loads(events[-2][6:])["usage"]["total_tokens"] == 7


def test_round_robin_uses_both_workers_and_alias_is_resolved(client, engines):
    seen = {client.post("/v1/chat/completions", json=dict(CHAT, model="m-alias")).json()["engine"]
            for _ in range(4)}
    assert seen == {"A", "B"}
    assert engines[0].seen[-1]["body"]["model"] == "m"


def test_models_lists_configured_and_discovered(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["m", "ghost"]  # b's models discovered as "m"


def test_health_ready_and_metrics(client, gateway):
    assert client.get("/health").json() == {"status": "ok"}
    r = client.get("/ready")
    assert r.status_code == 503  # "ghost" is configured but nobody serves it
    assert r.json()["models"] == {"m": {"healthy_workers": 2, "usable_workers": 2},
                                  "ghost": {"healthy_workers": 0, "usable_workers": 0}}
    assert r.json()["status"] == "unready" and "ghost" in r.json()["reason"]
    client.post("/v1/chat/completions", json=CHAT)
    text = client.get("/metrics").text
    assert 'dyad_requests_total{endpoint="chat",model="m",status="200"}' in text
    assert 'dyad_worker_healthy{worker="a"} 1.0' in text
    assert 'dyad_worker_state{state="healthy",worker="b"} 1.0' in text


# --- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("payload, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": 3, "messages": []}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (dict(CHAT, stream="yes"), "stream"),
    (dict(CHAT, max_tokens="10"), "max_tokens"),
    (dict(CHAT, max_tokens=True), "max_tokens"),
    (dict(CHAT, max_tokens=0), "max_tokens"),
    (dict(CHAT, temperature="hot"), "temperature"),
    (dict(CHAT, stream_options=[1]), "stream_options"),
])
def test_chat_field_errors_name_the_field(client, payload, param):
    r = client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 400
    err = error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [None, 5, [], [1, "a"], [[1], [2, "x"]], [1.5]])
def test_completions_prompt_errors(client, prompt):
    body = {"model": "m"} if prompt is None else {"model": "m", "prompt": prompt}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json_is_400(client, raw):
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"


def test_unknown_model_is_404(client):
    r = client.post("/v1/chat/completions", json=dict(CHAT, model="nope"))
    assert r.status_code == 404
    err = error_of(r)
    assert err["param"] == "model" and err["code"] == "model_not_found" and "nope" in err["message"]


def test_body_over_limit_is_413_with_and_without_content_length(client):
    big = dict(CHAT, messages=[{"role": "user", "content": "x" * 5000}])
    r = client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and error_of(r)["code"] == "payload_too_large"

    def chunks():
        data = orjson.dumps(big)
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]
    r = client.post("/v1/chat/completions", content=chunks())  # chunked: no Content-Length
    assert r.status_code == 413 and error_of(r)["code"] == "payload_too_large"


def test_no_healthy_worker_is_503_with_retry_after(client):
    r = client.post("/v1/chat/completions", json=dict(CHAT, model="ghost"))
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert error_of(r)["code"] == "no_healthy_worker"


def test_client_api_key_required(gateway):
    with httpx.Client(base_url=gateway.url) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 401 and error_of(r)["code"] == "missing_api_key"
        r = c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        r = c.get("/v1/models", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 401  # the admin token is not a client key
        assert c.get("/health").status_code == 200  # probes stay open


def test_engine_error_keeps_status_and_message(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": "BAD"})
    assert r.status_code == 400
    err = error_of(r)
    assert err["message"] == "engine says no" and err["param"] == "temperature"


def test_unknown_route_and_method_are_openai_shaped(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and error_of(r)
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and error_of(r)


# --- failures upstream -------------------------------------------------------------------------------

def test_5xx_before_first_byte_is_retried_on_another_worker(client, engines, gateway):
    a, b = engines
    a.fail_status = 503
    for _ in range(4):
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["engine"] == "B"
    text = client.get("/metrics").text
    assert 'dyad_upstream_errors_total{kind="http_503",worker="a"}' in text
    assert 'dyad_retries_total{model="m"}' in text


def test_engine_500_everywhere_returns_the_engine_error(client, engines):
    for e in engines:
        e.fail_status = 500
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    assert "is failing" in error_of(r)["message"]


def test_dead_worker_is_retried_and_taken_out(engines):
    """A worker whose process is gone (connection refused) costs no client request."""
    a, _ = engines
    a.fail_status, a.healthy = None, True
    dead = Engine("dead").start()
    cfg = load_config({"workers": [{"id": "dead", "url": dead.url}, {"id": "a", "url": a.url}],
                       "health": {"interval_s": 30}})
    with GatewayThread(cfg) as g, httpx.Client(base_url=g.url, timeout=10) as c:
        assert g.runtime.fleet.get("dead").state is WorkerState.HEALTHY
        dead.stop()
        results = [c.post("/v1/chat/completions", json=CHAT) for _ in range(4)]
        assert [r.status_code for r in results] == [200] * 4
        assert all(r.json()["engine"] == "A" for r in results)
        assert g.runtime.fleet.get("dead").state is WorkerState.UNHEALTHY
        assert 'dyad_upstream_errors_total{kind="connect",worker="dead"}' in c.get("/metrics").text


def test_health_loop_flips_worker_after_failure_threshold(client, engines, gateway):
    a, _ = engines
    a.healthy = False
    assert wait_until(lambda: gateway.runtime.fleet.get("a").state is WorkerState.UNHEALTHY)
    assert {client.post("/v1/chat/completions", json=CHAT).json()["engine"] for _ in range(3)} == {"B"}
    a.healthy = True
    assert wait_until(lambda: gateway.runtime.fleet.get("a").state is WorkerState.HEALTHY)


def test_scrape_loop_fills_worker_load(gateway):
    assert wait_until(lambda: all(w.load.scraped_at > 0 for w in gateway.runtime.fleet.workers()))


# --- client disconnects ----------------------------------------------------------------------------

def _disconnects(c: httpx.Client) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith('dyad_client_disconnects_total{model="m"}'):
            return float(line.split()[-1])
    return 0.0


def test_streaming_client_disconnect_cancels_upstream(client, engines, gateway):
    before = sum(e.cancelled for e in engines), _disconnects(client)
    with client.stream("POST", "/v1/completions", json={"model": "m", "prompt": "SLOW", "stream": True}) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # keep a reference: a collected iterator closes the connection at once
        next(chunks)  # first chunk arrived: the request is running on an engine
        assert sum(e.active for e in engines) == 1
    # leaving the block closes the client connection mid-stream
    assert wait_until(lambda: sum(e.cancelled for e in engines) == before[0] + 1)
    assert wait_until(lambda: sum(e.active for e in engines) == 0)
    assert wait_until(lambda: _disconnects(client) == before[1] + 1)
    assert all(w.inflight == 0 for w in gateway.runtime.fleet.workers())


def test_non_streaming_client_disconnect_cancels_upstream(client, engines, gateway):
    before = sum(e.cancelled for e in engines), _disconnects(client)
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"model": "m", "prompt": "SLOW"}, timeout=0.5)
    assert wait_until(lambda: sum(e.cancelled for e in engines) == before[0] + 1)
    assert wait_until(lambda: _disconnects(client) == before[1] + 1)
    assert all(w.inflight == 0 for w in gateway.runtime.fleet.workers())
