"""Intake through a running gateway: hashed keys and allow-lists, rate limits, the bounded queue, TTFT
admission control, the ITL metric and request ids in JSON logs.

The engine is the project's simulated engine (zero-cost profile, or a fault-injected prefill delay
to hold slots), because these paths are about the gateway, not engine timing.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging
import socket
import time

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.auth import hash_key
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from orchestrator.telemetry.logging import configure_logging

MODEL = "intake-model"
OTHER = "other-model"


@pytest.fixture(scope="module")
def engine():
    with SimEngineThread(model=MODEL, profile="zero", kv_events=False) as e:
        yield e


def _gateway(engine, **sections) -> GatewayThread:
    cfg = {"workers": [{"id": "s0", "url": engine.url, "engine": "sim", "models": [MODEL, OTHER]}],
           "gateway": {"admin_token": "admin-secret"}, "health": {"interval_s": 5}} | sections
    return GatewayThread(load_config(cfg, environ={})).start()


def _metric(gw: GatewayThread, line_start: str) -> float:
    for line in gw.runtime.metrics.render().decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _complete(url: str, key: str | None = None, model: str = MODEL, **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    headers.update(body.pop("headers", {}))
    return httpx.post(url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": model, "prompt": "hi", "max_tokens": 2} | body)


def test_hashed_keys_and_model_allow_lists(engine):
    keys = [{"name": "team-a", "sha256": hash_key("key-a"), "models": [MODEL]},
            {"name": "team-b", "sha256": hash_key("key-b")}]
    gw = _gateway(engine, auth={"keys": keys})
    try:
        assert _complete(gw.url, "key-a").status_code == 200
        assert _complete(gw.url, "key-b").status_code == 200
        r = _complete(gw.url, "key-a", model=OTHER)
        err = r.json()["error"]
        assert r.status_code == 403 and err["param"] == "model" and f"'{OTHER}'" in err["message"]
        assert err["code"] == "model_not_allowed"
        assert _complete(gw.url).status_code == 401
        assert _complete(gw.url, hash_key("key-a")).status_code == 401  # the stored digest is not a key
        models = httpx.get(gw.url + "/v1/models", headers={"authorization": "Bearer key-a"}).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        # a client key never opens the admin API
        r = httpx.get(gw.url + "/admin/workers", headers={"authorization": "Bearer key-a"})
        assert r.status_code == 403
        assert _metric(gw, 'dyad_rejected_requests_total{reason="model_not_allowed"}') == 1
    finally:
        gw.stop()


def test_rate_limited_key_gets_429_with_retry_after(engine):
    keys = [{"name": "slow", "sha256": hash_key("k"), "rpm": 2}, {"name": "fast", "sha256": hash_key("f")}]
    gw = _gateway(engine, auth={"keys": keys})
    try:
        answers = [_complete(gw.url, "k") for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200]
        assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["1", "0"]
        assert answers[0].headers["x-ratelimit-limit-requests"] == "2"
        r = _complete(gw.url, "k")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rpm_exceeded"
        assert r.headers["x-ratelimit-remaining-requests"] == "0" and r.headers["x-ratelimit-limit-requests"] == "2"
        assert 1 <= int(r.headers["retry-after"]) <= 30
        assert _complete(gw.url, "f").status_code == 200  # other keys are not affected
        assert _metric(gw, 'dyad_rejected_requests_total{reason="rpm_exceeded"}') == 1
    finally:
        gw.stop()


# A request the test holds in flight: the engine delays it (``prefill_delay_s``) until its client hangs
# up, and the test hangs up when it is done looking. The delay is a liveness bound, never waited out:
# on a loaded machine a short delay could end before the test has seen the state it asserts.
HOLD_S = 120.0


def _faults(engine, **faults) -> None:
    httpx.post(engine.url + "/sim/faults", json=faults, timeout=30).raise_for_status()


def _hold(url: str) -> socket.socket:
    """Send a completion on a raw connection and return the connection; ``close()`` is the client hanging up."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    return conn


def test_bounded_queue_refuses_with_retry_after_when_full(engine):
    gw = _gateway(engine, limits={"max_inflight_per_worker": 1, "queue_size": 1, "queue_timeout_s": HOLD_S})
    gate = gw.runtime.intake.gate
    _faults(engine, prefill_delay_s=HOLD_S)
    holder = None
    try:
        holder = _hold(gw.url)  # takes the only slot and keeps it until it hangs up
        _until(lambda: gate.active.get(MODEL) == 1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_complete, gw.url)
            _until(lambda: gate.queued == 1)
            refused = _complete(gw.url)  # one dispatched, one queued: the queue (size 1) is full
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "queue_full" and refused.headers["retry-after"] == "1"
            _faults(engine, prefill_delay_s=0)
            holder.close()  # the slot frees: the queued request takes it
            r = waiting.result()
            assert r.status_code == 200, r.text
        assert _metric(gw, "dyad_admission_queue_wait_seconds_count") == 1
        _until(lambda: gate.active.get(MODEL) == 0 and gate.queued == 0)
    finally:
        if holder is not None:
            holder.close()
        _faults(engine, prefill_delay_s=0)
        gw.stop()


def test_a_client_that_hangs_up_while_queued_gives_its_place_back(engine):
    gw = _gateway(engine, limits={"max_inflight_per_worker": 1, "queue_size": 1, "queue_timeout_s": HOLD_S})
    gate = gw.runtime.intake.gate
    _faults(engine, prefill_delay_s=HOLD_S)
    holder = quitter = None
    try:
        holder = _hold(gw.url)
        _until(lambda: gate.active.get(MODEL) == 1)
        quitter = _hold(gw.url)
        _until(lambda: gate.queued == 1)
        quitter.close()
        # the queued request's client is gone: its place is free now, not when the slot frees
        _until(lambda: gate.queued == 0)
        assert gate.active.get(MODEL) == 1  # the slot is still held (until the test hangs up the holder)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            late = pool.submit(_complete, gw.url)  # the queue (size 1) takes it instead of answering queue_full
            _until(lambda: gate.queued == 1)
            _faults(engine, prefill_delay_s=0)
            holder.close()
            r = late.result()
            assert r.status_code == 200, r.text
        assert _metric(gw, 'dyad_rejected_requests_total{reason="client_closed_request"}') == 1
        _until(lambda: gate.active.get(MODEL) == 0 and gate.queued == 0)
    finally:
        for conn in (holder, quitter):
            if conn is not None:
                conn.close()
        _faults(engine, prefill_delay_s=0)
        gw.stop()


def _until(check, timeout_s: float = 60.0) -> None:
    """Wait for ``check()``; the bound is for liveness only (a loaded 2-core machine can be slow)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_admission_control_refuses_what_would_miss_the_ttft_slo_and_logs_it(engine):
    gw = _gateway(engine, limits={"ttft_slo_s": 1.0, "prefill_tokens_per_s": 1000})
    buf = io.StringIO()
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    handler = configure_logging(json=True, level="INFO", stream=buf)
    try:
        long_prompt = "word " * 2000  # ≈ 2,500 tokens by the gateway's estimate: 2.5 s at 1k tokens/s
        r = _complete(gw.url, prompt=long_prompt, headers={"x-request-id": "req-slo-1"})
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "ttft_slo" and "limits.ttft_slo_s" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert _complete(gw.url, prompt="short prompt").status_code == 200
        lines = [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
        refused = [x for x in lines if x["msg"].startswith("admission: refused")]
        assert refused and refused[0]["request_id"] == "req-slo-1" and refused[0]["level"] == "info"
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        gw.stop()


def test_itl_is_recorded_for_streams():
    # cpu-tiny profile: one decode step ≈ 12 ms, so tokens usually arrive as separate events; an
    # engine that falls behind (a loaded machine) sends several tokens in one event, as vLLM does.
    with SimEngineThread(model=MODEL, profile="cpu-tiny", kv_events=False) as engine:
        _itl_through(engine)


def _itl_through(engine: SimEngineThread) -> None:
    gw = _gateway(engine)
    try:
        started = time.perf_counter()
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 6, "stream": True,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
            body = r.read()
        elapsed = time.perf_counter() - started
        events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
        token_events = sum(1 for e in events if e["choices"])
        assert events[-1]["usage"]["completion_tokens"] == 6  # every token came, in 1 to 6 events
        assert 1 <= token_events <= 6
        label = f'{{model="{MODEL}"}}'
        # one ITL observation per token event after the first (stream_timing.py), however they came
        assert _metric(gw, "dyad_request_itl_seconds_count" + label) == token_events - 1
        assert _metric(gw, "dyad_request_ttft_seconds_count" + label) == 1
        # the gaps lie between the first and the last token event, inside what the client waited
        assert 0.0 <= _metric(gw, "dyad_request_itl_seconds_sum" + label) <= elapsed
    finally:
        gw.stop()
