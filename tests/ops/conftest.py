"""Fixtures for the operations tests: a real Prometheus, and a live gateway in front of a simulated
fleet (prefill, decode and mixed workers). The simulator stands in for engines this 2-core machine
cannot run side by side (four at once); the real-vLLM tests cover real engines."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from tests.fixtures.prometheus import prometheus_server  # noqa: F401

MODEL = "tiny"
FLEET = [("prefill-0", "prefill"), ("decode-0", "decode"), ("mixed-0", "both"), ("mixed-1", "both")]


@dataclass
class LiveFleet:
    gateway: Any  # GatewayThread
    engines: dict[str, Any]  # worker id → SimEngineThread

    @property
    def url(self) -> str:
        return self.gateway.url


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
        assert c.post("/v1/chat/completions", json={"model": "nope", "messages": []}).status_code in (400, 404)
        assert c.post("/v1/chat/completions", json={"model": MODEL}).status_code == 400


@pytest.fixture(scope="session")
def live_fleet() -> Iterator[LiveFleet]:
    from orchestrator.sim.server import SimEngineThread  # the simulated engine (orchestrator/sim)

    engines: dict[str, Any] = {}
    gateway = None
    try:
        for i, (wid, _) in enumerate(FLEET):
            engines[wid] = SimEngineThread(model=MODEL, profile="gpu-like", seed=i).start()
        config = load_config({
            "models": [{"name": MODEL}],
            "workers": [{"id": wid, "url": engines[wid].url, "engine": "sim", "role": role, "models": [MODEL]}
                        for wid, role in FLEET],
            "health": {"interval_s": 0.5},
            "scrape": {"interval_s": 0.5},
        }, environ={})
        gateway = GatewayThread(config).start()
        ready = httpx.get(f"{gateway.url}/ready", timeout=10.0)
        assert ready.status_code == 200, ready.text
        _send_traffic(gateway.url)
        yield LiveFleet(gateway, engines)
    finally:
        if gateway is not None:
            gateway.stop()
        for e in engines.values():
            e.stop()
