"""Fixtures for the operations tests: a real Prometheus, and a live gateway in front of a simulated
fleet (prefill, decode and mixed workers). The simulator stands in for engines this 2-core machine
cannot run side by side (four at once); the real-vLLM tests cover real engines.

The gateway runs what an operator's dashboards show: ``kv_aware`` routing with the prefix index fed
by the mixed workers' KV events (the P/D pair gets approximate entries), and the planner in
recommend-only mode on a short interval, so that every index, KV-event and planner series has
samples after the fixture's traffic. The mixed workers serve a model of their own: while a model
has a prefill and a decode pool, pair selection sends all of its requests there."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from tests.fixtures.prometheus import prometheus_server  # noqa: F401

MODEL = "tiny"  # served by the P/D pair
MIXED_MODEL = "tiny-mixed"  # served by the mixed workers (aggregated, kv_aware)
FLEET = [("prefill-0", "prefill"), ("decode-0", "decode"), ("mixed-0", "both"), ("mixed-1", "both")]
KV_EVENTS = {"mixed-0", "mixed-1"}  # workers whose KV events feed the index
PLANNER_INTERVAL_S = 0.3


@dataclass
class LiveFleet:
    gateway: Any  # GatewayThread
    engines: dict[str, Any]  # worker id → SimEngineThread

    @property
    def url(self) -> str:
        return self.gateway.url


def _model_of(worker_id: str) -> str:
    return MIXED_MODEL if worker_id in KV_EVENTS else MODEL


def _send_traffic(url: str) -> None:
    """Requests of every kind, so that labelled series (status, endpoint, policy, mode) exist."""
    system = "You are a helpful assistant. " * 20  # long shared prefix: routable, worth disaggregating
    with httpx.Client(base_url=url, timeout=30.0) as c:
        for i in range(6):
            r = c.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 8,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]})
            assert r.status_code == 200, r.text
        with c.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "stream please " * 40}]}) as r:
            assert r.status_code == 200
            assert any(line.startswith("data: ") for line in r.iter_lines())
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hello " * 50, "max_tokens": 4})
        assert r.status_code == 200, r.text
        for i in range(4):  # a shared prefix on the mixed workers: KV events, then predicted hits
            r = c.post("/v1/completions", json={"model": MIXED_MODEL, "prompt": system + f"q{i}", "max_tokens": 4})
            assert r.status_code == 200, r.text
        assert c.post("/v1/chat/completions", json={"model": "nope", "messages": []}).status_code in (400, 404)
        assert c.post("/v1/chat/completions", json={"model": MODEL}).status_code == 400


def _wait_for_events_and_a_plan(gateway: Any, timeout_s: float = 15.0) -> None:
    """Until KV events from a mixed worker are ingested and the planner has made a decision
    on observed traffic (its first interval only primes the gateway-metrics baseline)."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"{gateway.url}/metrics", timeout=10.0).text
        events = re.search(r'^dyad_kv_events_total\{.*type="BlockStored"', text, re.M) is not None
        planned = any(h.get("forecast") for h in list(gateway.runtime.planner.history))
        if events and planned:
            return
        time.sleep(0.1)
    raise AssertionError(f"no KV events or no planner decision after {timeout_s} s:\n{text}")


@pytest.fixture(scope="session")
def live_fleet() -> Iterator[LiveFleet]:
    from orchestrator.sim.server import SimEngineThread  # the simulated engine (orchestrator/sim)

    engines: dict[str, Any] = {}
    gateway = None
    try:
        for i, (wid, _) in enumerate(FLEET):
            engines[wid] = SimEngineThread(model=_model_of(wid), profile="gpu-like", seed=i).start()
        workers = []
        for wid, role in FLEET:
            w: dict[str, Any] = {"id": wid, "url": engines[wid].url, "engine": "sim", "role": role,
                                 "models": [_model_of(wid)]}
            if wid in KV_EVENTS:
                w["kv_events"] = {"endpoint": engines[wid].kv_events_endpoint,
                                  "replay_endpoint": engines[wid].replay_endpoint}
            workers.append(w)
        config = load_config({
            "models": [{"name": m, "block_size": 16} for m in (MODEL, MIXED_MODEL)],  # gpu-like's block size
            "workers": workers,
            "router": {"policy": "kv_aware"},
            "health": {"interval_s": 0.5},
            "scrape": {"interval_s": 0.5},
            "planner": {"enabled": True, "actuator": "recommend", "interval_s": PLANNER_INTERVAL_S},
            "ui": {"history_interval_s": 0.5, "history_window_s": 2.0},  # the page's charts fill in seconds
        }, environ={})
        gateway = GatewayThread(config).start()
        ready = httpx.get(f"{gateway.url}/ready", timeout=10.0)
        assert ready.status_code == 200, ready.text
        _send_traffic(gateway.url)
        _wait_for_events_and_a_plan(gateway)
        yield LiveFleet(gateway, engines)
    finally:
        if gateway is not None:
            gateway.stop()
        for e in engines.values():
            e.stop()
