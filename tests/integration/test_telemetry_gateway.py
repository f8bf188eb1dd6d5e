"""Access log and tracing end to end: a real gateway (uvicorn, loopback) in front of simulated engines
(``dyad sim-engine`` stands in for vLLM here: the subject is the gateway's telemetry, and the real-vLLM
tests cover the engines), a real OpenTelemetry collector (rotel, from PyPI) receiving OTLP/HTTP."""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import pytest

from orchestrator.config import TracingConfig, load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from orchestrator.telemetry import tracing
from tests.fixtures.otel_collector import RotelCollector

MODEL = "tiny"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture(scope="module")
def engines():
    engs = [SimEngineThread(model=MODEL, profile="cpu-tiny", seed=i).start() for i in range(2)]
    try:
        yield engs
    finally:
        for e in engs:
            e.stop()


def _gateway(engines, **sections):
    config = load_config({
        "models": [{"name": MODEL}],
        "workers": [{"id": f"w{i}", "url": e.url, "engine": "sim", "models": [MODEL]} for i, e in enumerate(engines)],
        "router": {"policy": "round_robin", "debug_headers": True},
        "health": {"interval_s": 0.5},
        **sections,
    }, environ={})
    gw = GatewayThread(config).start()
    assert httpx.get(f"{gw.url}/ready", timeout=10).status_code == 200
    return gw


def _read_lines(path, n, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"expected {n} access log lines, got {len(lines)}: {lines}")


def test_the_otlp_exporter_reaches_a_real_collector(tmp_path):
    """The tracing module alone, against rotel: what the collector decodes from the wire."""
    with RotelCollector(tmp_path / "otel") as otel:
        tracing.configure(TracingConfig(enabled=True, endpoint=otel.traces_endpoint, service_name="dyad-it",
                                        batch_delay_s=0.1, resource_attributes={"deployment.environment": "test"}))
        try:
            with tracing.span("dyad.request", incoming={"traceparent": TRACEPARENT}, model="m") as root:
                with tracing.span("dyad.route", policy="kv_aware", worker="w1", predicted_cached_tokens=96):
                    pass
                with tracing.span("dyad.attempt", worker="w1", role="both"):
                    sent = tracing.inject({})
            assert root.trace_id_hex() == CLIENT_TRACE
        finally:
            tracing.shutdown()  # flushes
        spans = otel.wait_for(lambda s: {"dyad.request", "dyad.route", "dyad.attempt"} <= {x["name"] for x in s})
    by_name = {s["name"]: s for s in spans}
    req = by_name["dyad.request"]
    assert req["trace_id"] == CLIENT_TRACE and req["parent_id"] == CLIENT_SPAN
    assert req["resource"]["service.name"] == "dyad-it" and req["resource"]["deployment.environment"] == "test"
    assert by_name["dyad.route"]["parent_id"] == req["span_id"]
    assert by_name["dyad.route"]["attributes"] == {"policy": "kv_aware", "worker": "w1", "predicted_cached_tokens": "96"}
    assert sent["traceparent"].split("-")[2] == by_name["dyad.attempt"]["span_id"]


def test_access_log_one_line_per_request_with_what_happened(engines, tmp_path):
    log = tmp_path / "access.log"
    gw = _gateway(engines, access_log={"enabled": True, "output": str(log), "format": "json"})
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            whole = c.post("/v1/chat/completions", headers={"x-request-id": "it-whole"}, json={
                "model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hello there"}]})
            assert whole.status_code == 200
            with c.stream("POST", "/v1/completions", headers={"x-request-id": "it-stream"}, json={
                    "model": MODEL, "prompt": "one two three four", "max_tokens": 6, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                streamed_worker = r.headers["x-dyad-worker"]
                list(r.iter_lines())
            bad = c.post("/v1/chat/completions", headers={"x-request-id": "it-bad"},
                         json={"model": MODEL, "messages": [], "max_tokens": -1})
            assert bad.status_code == 400
            missing = c.post("/v1/completions", headers={"x-request-id": "it-nomodel"},
                             json={"model": "nope", "prompt": "x"})
            assert missing.status_code == 404
        lines = _read_lines(log, 4)
    finally:
        gw.stop()
    recs = {r["request_id"]: r for r in map(json.loads, lines)}
    assert set(recs) == {"it-whole", "it-stream", "it-bad", "it-nomodel"}, lines  # one line each
    w = recs["it-whole"]
    usage = whole.json()["usage"]
    assert (w["model"], w["status"], w["stream"], w["error_class"]) == (MODEL, 200, False, None)
    assert w["workers"] and w["workers"][0]["id"] == whole.headers["x-dyad-worker"] and w["attempts"] >= 1
    assert w["prompt_tokens"] == usage["prompt_tokens"] and w["generated_tokens"] == usage["completion_tokens"]
    assert 0 < w["total_s"] < 30 and w["client_key_id"] in (None, "anonymous")  # an open gateway
    s = recs["it-stream"]
    assert s["stream"] is True and s["status"] == 200 and s["workers"][0]["id"] == streamed_worker
    assert s["generated_tokens"] == 6 and 0 < s["ttft_s"] <= s["total_s"] and s["itl_mean_s"] > 0
    assert recs["it-bad"]["status"] == 400 and recs["it-bad"]["error_class"]
    assert recs["it-nomodel"]["status"] == 404 and recs["it-nomodel"]["workers"] == []
    assert all(r["ts"].endswith("Z") for r in recs.values())


def test_access_log_sampling_keeps_errors_and_never_prints_the_key(engines, tmp_path):
    log = tmp_path / "access.kv"
    key = "sk-secret-" + "x" * 24
    gw = _gateway(engines, access_log={"enabled": True, "output": str(log), "format": "kv", "sample_rate": 0.0},
                  auth={"keys": [{"name": "team-a", "sha256": hashlib.sha256(key.encode()).hexdigest()}]})
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            auth = {"authorization": f"Bearer {key}"}
            for i in range(5):  # sampled out
                assert c.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": f"p{i}",
                                                                    "max_tokens": 2}).status_code == 200
            assert c.post("/v1/completions", headers={"authorization": "Bearer wrong", "x-request-id": "it-401"},
                          json={"model": MODEL, "prompt": "p"}).status_code == 401
            assert c.post("/v1/completions", headers={**auth, "x-request-id": "it-400"},
                          json={"model": MODEL, "prompt": "p", "max_tokens": "x"}).status_code == 400
        lines = _read_lines(log, 2)
        time.sleep(0.3)
        lines = log.read_text().splitlines()
    finally:
        gw.stop()
    assert len(lines) == 2, lines  # only the two errors
    assert "request_id=it-401" in lines[0] + lines[1] and "request_id=it-400" in lines[0] + lines[1]
    assert "client_key_id=team-a" in "".join(lines)
    assert key not in log.read_text() and "wrong" not in log.read_text()


def test_one_trace_from_the_client_through_the_gateway_to_the_engine(engines, tmp_path):
    with RotelCollector(tmp_path / "otel") as otel:
        gw = _gateway(engines, tracing={"enabled": True, "endpoint": otel.traces_endpoint,
                                        "service_name": "dyad-gateway-it", "batch_delay_s": 0.1},
                      access_log={"enabled": True, "output": str(tmp_path / "access.log")})
        try:
            r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                           headers={"traceparent": TRACEPARENT, "x-request-id": "it-trace"},
                           json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            worker = r.headers["x-dyad-worker"]
            eng = engines[int(worker.removeprefix("w"))]
            forwarded = [h for h in eng.app.received_headers if h.get("x-request-id", "").startswith("it-trace")]
            assert forwarded, "the engine got the request"
            spans = otel.wait_for(lambda s: any(x["name"] == "dyad.attempt" and x["trace_id"] == CLIENT_TRACE
                                                for x in s))
            line = json.loads(_read_lines(tmp_path / "access.log", 1)[0])
        finally:
            gw.stop()
    mine = [s for s in spans if s["trace_id"] == CLIENT_TRACE]
    by_name = {s["name"]: s for s in mine}
    req = by_name["dyad.request"]
    assert req["parent_id"] == CLIENT_SPAN  # the client's trace continues
    assert req["resource"]["service.name"] == "dyad-gateway-it"
    ids = {s["span_id"] for s in mine}
    assert all(s["parent_id"] in ids for s in mine if s is not req)  # one tree under dyad.request
    attempt = by_name["dyad.attempt"]
    assert attempt["attributes"]["worker"] == worker
    # the engine was handed the same trace, with a gateway span as parent
    version, trace_id, parent, flags = forwarded[-1]["traceparent"].split("-")
    assert trace_id == CLIENT_TRACE and parent in ids and int(flags, 16) & 1
    assert line["request_id"] == "it-trace" and line["trace_id"] == CLIENT_TRACE
