"""A worker whose URL is the gateway itself (``orchestrator/gateway/loop_guard.py``), on both data planes.

Before the guard such a worker passed its health probe (the gateway's ``/health`` says ok) and learned its
models from the gateway's ``/v1/models``; a request routed to it came back into the same gateway, which
routed it there again: one client request, with the only real worker drained, went round ~10 000 times
in 8 s (an access-log line each) before ending in a 503. Now: ``POST /admin/workers`` refuses the URL (400
naming it), a configured one is never healthy, and a request that comes back anyway is refused (508) at
once — one client request is one access-log record.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway import loop_guard
from orchestrator.gateway.serve import GatewayThread
from orchestrator.ports import free_port, wait_ready
from orchestrator.sim.server import SimEngineThread
from tests.integration.test_gateway import error_of, wait_until

MODEL = "tiny"
ADMIN = "adm"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def engine():
    e = SimEngineThread(model=MODEL, profile="cpu-tiny", seed=0, kv_events=False).start()
    try:
        yield e
    finally:
        e.stop()


def _config(engine, tmp_path, workers=()):
    return load_config({
        "models": [{"name": MODEL}],
        "workers": [{"id": "w0", "url": engine.url, "engine": "sim", "models": [MODEL]}, *workers],
        "gateway": {"admin_token": ADMIN},
        "router": {"policy": "round_robin"},
        "health": {"interval_s": 0.2},
        "access_log": {"enabled": True, "output": str(tmp_path / "access.log"), "format": "json"},
    }, environ={})


def _records(tmp_path, rid):
    path = tmp_path / "access.log"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["request_id"] == rid]


def test_adding_the_gateway_itself_as_a_worker_is_refused(engine, tmp_path):
    with GatewayThread(_config(engine, tmp_path)) as gw, \
            httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30) as admin:
        for url in (gw.url, gw.url.replace("127.0.0.1", "localhost")):
            r = admin.post("/admin/workers", json={"id": "self", "url": url, "engine": "sim"})
            assert r.status_code == 400, r.text
            err = error_of(r)
            assert err["param"] == "url" and err["code"] == "worker_is_gateway", err
        assert [w.id for w in gw.runtime.fleet.workers()] == ["w0"]
        # an engine is still added as before
        r = admin.post("/admin/workers", json={"id": "again", "url": engine.url.replace("127.0.0.1", "localhost"),
                                               "engine": "sim"})
        assert r.status_code == 201 and r.json()["state"] == "healthy", r.text


def test_a_configured_worker_that_is_the_gateway_never_takes_a_request_round(engine, tmp_path):
    port = free_port()
    own = f"http://127.0.0.1:{port}"
    cfg = _config(engine, tmp_path, [{"id": "self", "url": own, "engine": "sim", "models": [MODEL]}])
    with GatewayThread(cfg, port=port) as gw, httpx.Client(base_url=gw.url, timeout=60) as c:
        assert gw.url == own
        # probed while the gateway serves: refused as a loop, so never healthy
        time.sleep(1.0)  # (five probe rounds at least)
        assert not gw.runtime.fleet.get("self").health_ok
        r = c.post("/admin/workers/w0/drain", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "loop-1"})
        assert r.status_code in (503, 508), r.text
        assert wait_until(lambda: _records(tmp_path, "loop-1"), timeout=10)
        time.sleep(0.5)  # (would a looping request add more records)
        assert len(_records(tmp_path, "loop-1")) == 1, _records(tmp_path, "loop-1")[:3]


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    ("POST", "/v1/embeddings", {"model": MODEL, "input": "hi"}),
])
def test_a_request_marked_by_this_gateway_is_refused_as_a_loop(engine, tmp_path, method, path, body):
    with GatewayThread(_config(engine, tmp_path)) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
        marked = {loop_guard.HEADER: loop_guard.GATEWAY_ID}
        r = c.request(method, path, json=body, headers=marked)
        assert r.status_code == 508, r.text
        assert error_of(r)["code"] == "gateway_loop"
        # another gateway's mark (a gateway in front of this one) is not a loop
        r = c.request(method, path, json=body, headers={loop_guard.HEADER: "0123456789abcdef"})
        assert r.status_code != 508, r.text


@contextlib.contextmanager
def _gateway_process(tmp_path, port, workers):
    """Another gateway in its own process (``dyad serve``: a process' gateway id is its own)."""
    path = tmp_path / f"gw-{port}.yaml"
    path.write_text(json.dumps({"models": [{"name": MODEL}], "workers": workers, "health": {"interval_s": 0.2},
                                "router": {"policy": "round_robin"}, "gateway": {"host": "127.0.0.1", "port": port},
                                "resilience": {"backoff_base_s": 0}}))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_ready(f"http://127.0.0.1:{port}/health", proc), "the second gateway did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_cycle_through_two_gateways_comes_back_once_and_a_chain_is_served(engine, tmp_path):
    port_a, port_b = free_port(), free_port()
    a_url = f"http://127.0.0.1:{port_a}"
    back_to_a = [{"id": "to-a", "url": a_url, "engine": "sim", "models": [MODEL]}]
    cfg = load_config({"models": [{"name": MODEL}],
                       "workers": [{"id": "to-b", "url": f"http://127.0.0.1:{port_b}", "engine": "sim",
                                    "models": [MODEL]}],
                       "router": {"policy": "round_robin"}, "health": {"interval_s": 0.2},
                       "resilience": {"backoff_base_s": 0},
                       "access_log": {"enabled": True, "output": str(tmp_path / "access.log"), "format": "json"}},
                      environ={})
    with GatewayThread(cfg, port=port_a) as gw, _gateway_process(tmp_path, port_b, back_to_a), \
            httpx.Client(base_url=gw.url, timeout=60) as c:
        assert wait_until(lambda: gw.runtime.fleet.get("to-b").health_ok, timeout=30)
        r = c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "cycle-1"})
        assert r.status_code == 508, r.text
        assert error_of(r)["code"] == "gateway_loop" and "other gateway" in error_of(r)["message"]
        assert wait_until(lambda: _records(tmp_path, "cycle-1"), timeout=10)
        time.sleep(0.5)  # (would a looping request add more records)
        assert len(_records(tmp_path, "cycle-1")) == 1
    # a chain without a cycle (this gateway in front of another, in front of an engine) is served
    to_engine = [{"id": "engine", "url": engine.url, "engine": "sim", "models": [MODEL]}]
    with GatewayThread(cfg, port=port_a) as gw, _gateway_process(tmp_path, port_b, to_engine), \
            httpx.Client(base_url=gw.url, timeout=60) as c:
        assert wait_until(lambda: gw.runtime.fleet.get("to-b").health_ok, timeout=30)
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
        r = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        got = c.get(f"/v1/responses/{r.json()['id']}")
        assert got.status_code == 200, got.text


def test_a_chain_of_too_many_gateways_is_refused():
    with GatewayThread(load_config({}, environ={})) as gw:
        chain = ",".join(f"{i:016x}" for i in range(loop_guard.MAX_GATEWAYS))
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={loop_guard.HEADER: chain}, timeout=30)
        # a list that does not hold this gateway's id is the sender's (a client's header): a 400 naming it, no 5xx
        assert r.status_code == 400 and error_of(r)["code"] == "gateway_loop", r.text
        assert error_of(r)["param"] == loop_guard.HEADER, r.text
