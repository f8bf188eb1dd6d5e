"""Tracing with the OpenTelemetry SDK's in-memory exporter: real spans, parents, traceparent in and out."""

from __future__ import annotations

import asyncio
import builtins
import logging

import pytest

# The OpenTelemetry SDK is in the test extra (and the ``tracing`` extra): missing, this fails, never skips.
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator.config import TracingConfig, load_config
from orchestrator.telemetry import tracing

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"


@pytest.fixture
def exporter():
    exp = InMemorySpanExporter()
    tracing.configure(TracingConfig(enabled=True, service_name="dyad-test"), exporter=exp)
    yield exp
    tracing.shutdown()


def test_off_by_default_spans_are_no_ops_and_inject_adds_nothing():
    tracing.configure(load_config({}, environ={}).tracing)
    assert not tracing.enabled()
    with tracing.span("dyad.request", model="m") as s:
        s.set_attribute("x", 1)
        assert s.trace_id_hex() is None
        assert tracing.inject({}) == {}
        assert tracing.current_trace_id() is None


def test_request_span_tree_attributes_and_resource(exporter):
    with tracing.span("dyad.request", model="tiny", endpoint="chat", stream=None) as root:
        with tracing.span("dyad.admission"):
            pass
        with tracing.span("dyad.route", policy="kv_aware", worker="w1", predicted_cached_tokens=64):
            pass
        with tracing.span("dyad.attempt", worker="w1", role="both") as att:
            att.set_attribute("outcome", "ok")
            headers = tracing.inject({"content-type": "application/json"})
        trace_id = root.trace_id_hex()
        assert tracing.current_trace_id() == trace_id
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"dyad.request", "dyad.admission", "dyad.route", "dyad.attempt"}
    req = spans["dyad.request"]
    assert req.parent is None and format(req.context.trace_id, "032x") == trace_id
    for name in ("dyad.admission", "dyad.route", "dyad.attempt"):
        assert spans[name].parent.span_id == req.context.span_id
        assert spans[name].context.trace_id == req.context.trace_id
    assert dict(spans["dyad.route"].attributes) == {"policy": "kv_aware", "worker": "w1",
                                                     "predicted_cached_tokens": 64}
    assert "stream" not in req.attributes  # None is dropped, not sent as a string
    assert spans["dyad.attempt"].attributes["outcome"] == "ok"
    assert req.resource.attributes["service.name"] == "dyad-test"
    # the engine gets the attempt's span as parent
    version, tid, sid, flags = headers["traceparent"].split("-")
    assert (version, tid) == ("00", trace_id) and int(flags, 16) & 1  # sampled
    assert sid == format(spans["dyad.attempt"].context.span_id, "016x")


@pytest.mark.parametrize("headers", [
    {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01", "tracestate": "vendor=1"},
    [(b"traceparent", f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01".encode()), (b"tracestate", b"vendor=1")],
])
def test_client_traceparent_becomes_the_parent(exporter, headers):
    with tracing.span("dyad.request", incoming=headers):
        out = tracing.inject({})
    [req] = exporter.get_finished_spans()
    assert format(req.context.trace_id, "032x") == CLIENT_TRACE
    assert format(req.parent.span_id, "016x") == CLIENT_PARENT and req.parent.is_remote
    assert out["traceparent"].split("-")[1] == CLIENT_TRACE and out["tracestate"] == "vendor=1"


def test_malformed_traceparent_starts_a_new_trace(exporter):
    with tracing.span("dyad.request", incoming={"traceparent": "00-zz-not-a-trace"}):
        pass
    [req] = exporter.get_finished_spans()
    assert req.parent is None and format(req.context.trace_id, "032x") != CLIENT_TRACE


PARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"


@pytest.mark.parametrize("headers,parent,state", [
    # (found by helper-47's probe: each of these made the OpenTelemetry propagator log a WARNING per request,
    # an invalid tracestate member quoted in it: up to 8 KiB of the client's text a line)
    ({"traceparent": PARENT, "tracestate": "k=" + "v" * 300 + " forged text"}, CLIENT_TRACE, None),
    ({"traceparent": PARENT, "tracestate": "ok=1,Not A Member"}, CLIENT_TRACE, None),
    ({"traceparent": PARENT, "tracestate": ",".join(f"k{i}=v" for i in range(33))}, CLIENT_TRACE, None),
    ({"traceparent": PARENT, "tracestate": "a=b," * 2100}, CLIENT_TRACE, None),
    ({"traceparent": f"01-{CLIENT_TRACE}-{CLIENT_PARENT}-01-" + "x" * 600, "tracestate": "vendor=1"}, None, None),
    # valid ones are kept as they were
    ({"traceparent": PARENT, "tracestate": "vendor=1, tenant@sys=a b"}, CLIENT_TRACE, "vendor=1,tenant@sys=a b"),
    ({"traceparent": f"cc-{CLIENT_TRACE}-{CLIENT_PARENT}-01-future"}, CLIENT_TRACE, None),
])
def test_a_malformed_trace_header_is_dropped_without_a_log_line(exporter, caplog, headers, parent, state):
    with caplog.at_level(logging.DEBUG), tracing.span("dyad.request", incoming=headers):
        out = tracing.inject({})
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    [req] = exporter.get_finished_spans()
    if parent is None:
        assert req.parent is None and format(req.context.trace_id, "032x") != CLIENT_TRACE
    else:
        assert format(req.context.trace_id, "032x") == parent
    assert out.get("tracestate") == state


def test_an_unsampled_client_trace_is_not_recorded_but_still_propagated(exporter):
    with tracing.span("dyad.request", incoming={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-00"}):
        out = tracing.inject({})
    assert exporter.get_finished_spans() == ()
    version, tid, _, flags = out["traceparent"].split("-")
    assert tid == CLIENT_TRACE and not int(flags, 16) & 1


def test_sample_ratio_zero_records_nothing_new():
    exp = InMemorySpanExporter()
    tracing.configure(TracingConfig(enabled=True, sample_ratio=0.0), exporter=exp)
    try:
        for _ in range(20):
            with tracing.span("dyad.request"):
                pass
        assert exp.get_finished_spans() == ()
    finally:
        tracing.shutdown()


def test_exceptions_are_recorded_and_mark_the_span_as_error(exporter):
    with pytest.raises(ValueError), tracing.span("dyad.attempt", worker="w0"):
        raise ValueError("engine went away")
    [s] = exporter.get_finished_spans()
    assert s.status.status_code.name == "ERROR"
    assert s.events[0].name == "exception"


async def test_concurrent_requests_keep_separate_traces(exporter):
    async def one(i):
        with tracing.span("dyad.request", i=i):
            await asyncio.sleep(0.01)
            with tracing.span("dyad.attempt", i=i):
                await asyncio.sleep(0.01)

    await asyncio.gather(*(one(i) for i in range(5)))
    spans = exporter.get_finished_spans()
    roots = {s.attributes["i"]: s for s in spans if s.name == "dyad.request"}
    for s in spans:
        if s.name == "dyad.attempt":
            assert s.parent.span_id == roots[s.attributes["i"]].context.span_id
    assert len({s.context.trace_id for s in roots.values()}) == 5


def test_enabled_without_the_sdk_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_otel_sdk(name, *args, **kwargs):
        if name.startswith("opentelemetry.sdk"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_otel_sdk)
    with pytest.raises(tracing.TracingUnavailable, match=r"pip install 'dyad-serve\[tracing\]'"):
        tracing.configure(TracingConfig(enabled=True))
    assert not tracing.enabled()


async def test_begin_activate_end_spans_two_phases_of_one_request(exporter):
    root = tracing.begin("dyad.request", incoming={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"},
                         model="m")
    with root.activate():  # phase 1: the route handler
        with tracing.span("dyad.admission"):
            await asyncio.sleep(0)
    assert tracing.current_trace_id() is None  # not current between phases
    with root.activate():  # phase 2: the ASGI response
        with tracing.span("dyad.attempt", worker="w0"):
            headers = tracing.inject({})
    assert exporter.get_finished_spans() and all(s.name != "dyad.request" for s in exporter.get_finished_spans())
    root.end()
    root.end()  # idempotent
    spans = {s.name: s for s in exporter.get_finished_spans()}
    req = spans["dyad.request"]
    assert format(req.context.trace_id, "032x") == CLIENT_TRACE == root.trace_id_hex()
    assert spans["dyad.admission"].parent.span_id == req.context.span_id == spans["dyad.attempt"].parent.span_id
    assert headers["traceparent"].split("-")[1] == CLIENT_TRACE


def test_begin_is_a_no_op_while_tracing_is_off():
    tracing.shutdown()
    root = tracing.begin("dyad.request", incoming={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
    with root.activate() as s:
        assert s.trace_id_hex() is None
    root.end()


def test_enabling_tracing_without_the_sdk_is_a_config_error_naming_the_extra(monkeypatch):
    import importlib.util

    from orchestrator.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("opentelemetry.sdk") else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracing: .*pip install 'dyad-serve\[tracing\]'"):
        load_config({"tracing": {"enabled": True}}, environ={})
    assert load_config({"tracing": {"enabled": False}}, environ={}).tracing.enabled is False
