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


def test_bounded_queue_refuses_with_retry_after_when_full(engine):
    gw = _gateway(engine, limits={"max_inflight_per_worker": 1, "queue_size": 1, "queue_timeout_s": 10})
    httpx.post(engine.url + "/sim/faults", json={"prefill_delay_s": 0.6}).raise_for_status()
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(_complete, gw.url) for _ in range(3)]
            statuses = sorted(f.result().status_code for f in futures)
        refused = [f.result() for f in futures if f.result().status_code != 200]
        assert statuses == [200, 200, 503]  # one dispatched, one waited for the slot, one refused
        assert refused[0].json()["error"]["code"] == "queue_full" and refused[0].headers["retry-after"] == "1"
        assert _metric(gw, "dyad_admission_queue_wait_seconds_count") == 1
        assert gw.runtime.intake.gate.active[MODEL] == 0 and gw.runtime.intake.gate.queued == 0
    finally:
        httpx.post(engine.url + "/sim/faults", json={"prefill_delay_s": 0})
        gw.stop()


def test_a_client_that_hangs_up_while_queued_gives_its_place_back(engine):
    gw = _gateway(engine, limits={"max_inflight_per_worker": 1, "queue_size": 1, "queue_timeout_s": 30})
    httpx.post(engine.url + "/sim/faults", json={"prefill_delay_s": 3.0}).raise_for_status()
    gate = gw.runtime.intake.gate
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            holder = pool.submit(_complete, gw.url)  # holds the only slot for ~3 s
            _until(lambda: gate.active.get(MODEL) == 1)
            with httpx.Client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
                c.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            # the queued request's client is gone: its place is free now, not when the slot frees
            _until(lambda: gate.queued == 0, timeout_s=1.5)
            assert not holder.done()
            late = pool.submit(_complete, gw.url)  # the queue (size 1) takes it instead of answering queue_full
            assert holder.result().status_code == 200
            r = late.result()
            assert r.status_code == 200, r.text
        assert _metric(gw, 'dyad_rejected_requests_total{reason="client_closed_request"}') == 1
        assert gate.active[MODEL] == 0 and gate.queued == 0
    finally:
        httpx.post(engine.url + "/sim/faults", json={"prefill_delay_s": 0})
        gw.stop()


def _until(check, timeout_s: float = 5.0) -> None:
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
    # cpu-tiny profile: one decode step ≈ 12 ms, so tokens arrive as separate events
    with SimEngineThread(model=MODEL, profile="cpu-tiny", kv_events=False) as engine:
        _itl_through(engine)


def _itl_through(engine: SimEngineThread) -> None:
    gw = _gateway(engine)
    try:
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 6, "stream": True}) as r:
            body = r.read()
        token_events = body.count(b"data: {") - body.count(b'"choices":[]')
        assert token_events >= 6
        label = f'{{model="{MODEL}"}}'
        assert _metric(gw, "dyad_request_itl_seconds_count" + label) == token_events - 1
        assert _metric(gw, "dyad_request_ttft_seconds_count" + label) == 1
        assert _metric(gw, "dyad_request_itl_seconds_sum" + label) > 0.005 * (token_events - 1)
    finally:
        gw.stop()
