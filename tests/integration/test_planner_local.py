"""The gateway's planner with the local-process actuator: it starts a simulated engine process
(``dyad sim-engine`` from a command template) when prefill load needs one, the engine joins the
registry and serves, and once the load is gone it is stopped and leaves the registry. Inputs come
from the gateway's own metrics (DirectSource, the embedded default). Simulated engines stand in for
real ones (the real-vLLM local start is covered by the actuator's own tests)."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread
from tests.integration.test_planner_prometheus import drive, prefill_heavy

pytestmark = [pytest.mark.timeout(180)]

MODEL = "sim"


def test_local_actuator_starts_and_stops_engines():
    engines = [SimEngineThread(model=MODEL, profile="gpu-like", seed=i, kv_events=False).start() for i in range(2)]
    cmd = f"{sys.executable} -m orchestrator.cli sim-engine --port {{port}} --model {MODEL} --profile gpu-like --no-kv-events"
    gw = None
    try:
        config = load_config({
            "models": [{"name": MODEL}],
            "workers": [{"id": "p0", "url": engines[0].url, "engine": "sim", "role": "prefill", "models": [MODEL]},
                        {"id": "d0", "url": engines[1].url, "engine": "sim", "role": "decode", "models": [MODEL]}],
            "health": {"interval_s": 0.3},
            "scrape": {"interval_s": 0.5},
            "planner": {
                "enabled": True, "interval_s": 1.0, "actuator": "local", "max_workers": 4,
                "local_commands": {"prefill": cmd, "decode": cmd}, "local_engine": "sim", "local_models": [MODEL],
                "ttft_target_s": 0.3, "itl_target_s": 0.05, "predictor": "constant", "scale_in_intervals": 1,
                "scale_in_margin": 0.0, "correct_from_latency": False,
            },
        }, environ={})
        gw = GatewayThread(config).start()
        fleet = gw.runtime.fleet

        def local_healthy() -> bool:
            return any(w.id.startswith("local-prefill") and w.state.value == "healthy" for w in fleet.workers())

        sent, failures = asyncio.run(drive(gw.url, prefill_heavy, rate=6, max_s=40, until=local_healthy))
        assert failures == [], failures[:3]
        assert local_healthy(), [(w.id, w.state.value) for w in fleet.workers()]
        started = [w for w in fleet.workers() if w.id.startswith("local-prefill")]
        # the new engine takes traffic: send a little more and see requests counted by the engine itself
        sent2, failures2 = asyncio.run(drive(gw.url, prefill_heavy, rate=6, max_s=3, until=lambda: False))
        assert failures2 == []
        served = [line for line in httpx.get(f"{started[0].url}/metrics", timeout=5).text.splitlines()
                  if line.startswith("vllm:request_success_total") and not line.endswith(" 0.0")]
        assert served, "the started engine never served a request"
        # no load: the planner stops what it started and the registry forgets it
        service = gw.runtime.planner
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(w.id.startswith("local-") for w in fleet.workers()):
            time.sleep(0.2)
        assert not any(w.id.startswith("local-") for w in fleet.workers()), service.status()["last"]
        assert not service.actuator.local.processes
        assert {w.id for w in fleet.workers()} == {"p0", "d0"}
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()
