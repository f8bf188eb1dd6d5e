"""What each request path leaves behind: its access-log record and its spans, field by field (issue 13/15).

A real gateway (uvicorn, loopback) in front of two simulated engines (``dyad sim-engine`` stands in
for vLLM: the subject is the gateway's telemetry), with the OpenTelemetry SDK's real
``InMemorySpanExporter`` receiving the spans. For chat, completions and responses, streamed and
not, one request each: the access-log record must name the endpoint, model, stream flag, the worker
that answered (the same one the debug header names), one attempt, status 200, the engine's usage as
prompt/generated tokens, a TTFT for streams and the trace id of the request's span; the spans must be
one tree (``dyad.request`` → ``dyad.admission``, ``dyad.route``, ``dyad.attempt``) with the policy,
the chosen worker and the endpoint as attributes.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator.config import TracingConfig, load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from orchestrator.telemetry import tracing

MODEL = "tiny"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    engines = [SimEngineThread(model=MODEL, profile="cpu-tiny", seed=i, kv_events=False).start() for i in range(2)]
    log = tmp_path_factory.mktemp("paths") / "access.log"
    exporter = InMemorySpanExporter()
    tracing.configure(TracingConfig(enabled=True, service_name="dyad-paths"), exporter=exporter)
    gw = GatewayThread(load_config({
        "models": [{"name": MODEL}],
        "workers": [{"id": f"w{i}", "url": e.url, "engine": "sim", "models": [MODEL]} for i, e in enumerate(engines)],
        "router": {"policy": "round_robin", "debug_headers": True},
        "health": {"interval_s": 30},
        "access_log": {"enabled": True, "output": str(log), "format": "json"},
    }, environ={})).start()
    try:
        yield gw, log, exporter
    finally:
        gw.stop()
        tracing.shutdown()
        for e in engines:
            e.stop()


def _record(log, rid, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in (log.read_text().splitlines() if log.exists() else []):
            rec = json.loads(line)
            if rec["request_id"] == rid:
                return rec
        time.sleep(0.05)
    raise AssertionError(f"no access-log record for {rid}")


def _usage_of(path, stream, r):
    if not stream:
        u = r.json()["usage"]
    else:
        u = None
        for line in r.text.split("\n"):
            if line.startswith("data: {") and '"usage"' in line:
                obj = json.loads(line[6:])
                cand = obj.get("usage") or (obj.get("response") or {}).get("usage")
                if cand:
                    u = cand
    assert u, r.text
    if path == "/v1/responses":
        return u["input_tokens"], u["output_tokens"]
    return u["prompt_tokens"], u["completion_tokens"]


PATHS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5},
    "/v1/completions": {"prompt": "one two three four", "max_tokens": 5},
    "/v1/responses": {"input": "hello there", "instructions": "be brief", "max_output_tokens": 5},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", list(PATHS))
def test_access_record_and_spans_of_each_path(setup, path, stream):
    gw, log, exporter = setup
    rid = f"paths{path.replace('/', '-')}-{'s' if stream else 'w'}"
    body = {"model": MODEL, "stream": stream, **PATHS[path]}
    if stream and path != "/v1/responses":
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(gw.url + path, json=body, headers={"x-request-id": rid}, timeout=30)
    assert r.status_code == 200, r.text
    worker = r.headers["x-dyad-worker"]
    prompt, generated = _usage_of(path, stream, r)

    rec = _record(log, rid)
    assert (rec["endpoint"], rec["model"], rec["stream"], rec["status"], rec["error_class"]) == \
        (path, MODEL, stream, 200, None)
    assert rec["workers"] == [{"id": worker, "role": "both"}] and rec["attempts"] == 1
    assert (rec["prompt_tokens"], rec["generated_tokens"]) == (prompt, generated) and generated == 5
    assert 0 < rec["total_s"] < 30
    if stream:
        assert 0 < rec["ttft_s"] <= rec["total_s"] and rec["itl_mean_s"] > 0
    assert rec["trace_id"] and len(rec["trace_id"]) == 32

    tracing.force_flush()
    spans = [s for s in exporter.get_finished_spans() if format(s.context.trace_id, "032x") == rec["trace_id"]]
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"dyad.request", "dyad.admission", "dyad.route", "dyad.attempt"}, sorted(by_name)
    root = by_name["dyad.request"]
    assert root.parent is None or root.parent.span_id not in {s.context.span_id for s in spans}
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id
               for s in spans if s is not root)  # one tree under the request
    assert root.attributes["endpoint"] == path and root.attributes["model"] == MODEL
    assert root.attributes["stream"] is stream
    route = by_name["dyad.route"].attributes
    assert route["policy"] == "round_robin" and route["worker"] == worker
    attempt = by_name["dyad.attempt"].attributes
    assert attempt["worker"] == worker and attempt["outcome"] == "answered"
    assert by_name["dyad.admission"].attributes["model"] == MODEL
