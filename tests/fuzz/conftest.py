"""A gateway over one simulated engine for the fuzz tests (the engine's behaviour is not under test:
the gateway's intake is; the simulator keeps valid requests fast and deterministic)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread

ADMIN = "fuzz-admin"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="session")
def fuzz_gateway() -> Iterator[GatewayThread]:
    engine = SimEngineThread(model="m", profile="zero", kv_events=False).start()
    config = load_config({
        "models": [{"name": "m", "aliases": ["m-alias"]}],
        # "spare" never answers (stays unhealthy, never routed to): the fuzzer's drains and role changes act
        # on a real worker without taking the only serving one away
        "workers": [{"id": "sim", "url": engine.url, "engine": "sim", "models": ["m"]},
                    {"id": "spare", "url": "http://127.0.0.1:9", "engine": "sim", "models": ["m"]}],
        "gateway": {"admin_token": ADMIN, "max_body_bytes": MAX_BODY, "request_timeout_s": 20},
        "resilience": {"header_timeout_s": 1.0, "body_timeout_s": 1.0, "stream_timeout_s": 20},
        "health": {"interval_s": 30},
        "planner": {"enabled": True, "interval_s": 3600},  # /admin/planner answers (recommend-only, idle)
    }, environ={})
    with GatewayThread(config) as gw:
        yield gw
    engine.stop()
