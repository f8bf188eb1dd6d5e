"""Actuators and metric sources: real child processes for the local actuator, the gateway-metrics
arithmetic of the direct source. (The Kubernetes actuator is tested against FakeKubeApiServer in
tests/integration/test_kubernetes_actuator.py and test_kubernetes_loop.py.)"""

from __future__ import annotations

import sys

import httpx
import pytest

from adapters.base import Role
from orchestrator.planner.actuators import (
    LocalProcessActuator,
    RecommendOnly,
    RoleChangeActuator,
)
from orchestrator.planner.core import Action, PlanDecision
from orchestrator.planner.metrics_source import observation_from_scrapes, parse_gateway_metrics
from orchestrator.planner.predictors import LoadForecast
from orchestrator.telemetry.metrics import DyadMetrics


def decision(actions=(), desired=None) -> PlanDecision:
    return PlanDecision(at=0.0, observation=None, forecast=LoadForecast(3.0, 1000, 100), sizing=None,
                        desired=desired or {"prefill": 2, "decode": 3}, current={"prefill": 1, "decode": 1},
                        actions=list(actions), correction={}, predictors={}, reasons=[])


async def test_local_process_actuator_starts_and_stops_real_processes():
    # a real child process per worker (a Python HTTP server standing in for an engine command line)
    cmd = f"{sys.executable} -m http.server {{port}} --bind 127.0.0.1"
    started = []
    act = LocalProcessActuator({Role.PREFILL: cmd, Role.DECODE: cmd}, on_started=lambda p: started.append(p))
    try:
        done = await act.apply(decision([Action("start", Role.PREFILL), Action("start", Role.DECODE)]))
        assert len(done) == 2 and len(act.processes) == 2
        p = started[0]
        async with httpx.AsyncClient() as c:
            for _ in range(100):
                try:
                    r = await c.get(p.url + "/")
                    break
                except httpx.TransportError:
                    import asyncio
                    await asyncio.sleep(0.05)
            assert r.status_code == 200
        await act.apply(decision([Action("stop", Role.PREFILL, p.worker_id)]))
        assert p.proc.poll() is not None and p.worker_id not in act.processes
    finally:
        await act.close()
    assert not act.processes


async def test_role_change_actuator_calls_set_role_once_per_move():
    calls = []
    fallback = RecommendOnly()
    act = RoleChangeActuator(set_role=lambda wid, role: calls.append((wid, role)), fallback=fallback)
    # the planner drains w1 towards decode; later, once idle, it emits set_role for it
    await act.apply(decision([Action("drain", Role.PREFILL, "w1", then="decode"), Action("start", Role.DECODE)]))
    assert calls == [("w1", Role.DECODE)]
    assert [a.kind for a in fallback.last.actions] == ["start"]
    await act.apply(decision([Action("set_role", Role.DECODE, "w1")]))
    assert calls == [("w1", Role.DECODE)]  # not twice
    await act.apply(decision([Action("set_role", Role.PREFILL, "w2")]))
    assert calls[-1] == ("w2", Role.PREFILL)


async def test_recommend_only_exports_planner_metrics():
    m = DyadMetrics()
    await RecommendOnly(m).apply(decision([Action("start", Role.DECODE)]))
    text = m.render().decode()
    assert 'dyad_planner_desired_workers{role="decode"} 3.0' in text
    assert 'dyad_planner_predicted{quantity="request_rate"} 3.0' in text
    assert 'dyad_planner_decisions_total{action="start"} 1.0' in text


def test_direct_source_differences_two_gateway_scrapes():
    m = DyadMetrics()
    before = parse_gateway_metrics(m.render().decode(), at=100.0)
    # demand: 5 requests arrived (3 are still queued or were refused), 2 finished
    m.arrivals.labels("m").inc(5)
    m.arrival_prompt_tokens.labels("m").inc(5 * 1200)
    for isl, out, ttft in ((1000, 10, 0.2), (3000, 30, 0.4)):
        m.prompt_tokens.labels("m").observe(isl)
        m.generation_tokens.labels("m").observe(out)
        m.ttft.labels("m").observe(ttft)
        m.e2e.labels("m", "chat").observe(1.0)
    m.routed_prompt_tokens.labels("m").inc(4000)
    m.predicted_cached_tokens.labels("m").inc(1000)
    m.worker_waiting.labels("w0").set(3)
    m.worker_waiting.labels("w1").set(2)
    after = parse_gateway_metrics(m.render().decode(), at=110.0)
    obs = observation_from_scrapes(before, after)
    assert obs.window_s == 10
    assert obs.request_rate == pytest.approx(0.5)  # arrivals, not the 0.2 req/s that finished
    assert obs.finished_rate == pytest.approx(0.2)
    assert obs.mean_isl == pytest.approx(1200)  # what arrived, not what finished (2000)
    assert obs.mean_osl == pytest.approx(20)
    assert obs.ttft_mean == pytest.approx(0.3)
    assert obs.queue_len == 5
    assert obs.prefix_hit_ratio == pytest.approx(0.25)
