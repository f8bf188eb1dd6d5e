"""The planner in the gateway: config → settings/source/actuator, the fixed-fleet re-split, the burst
floor, and a real gateway (GatewayThread) running the planner loop behind /admin/planner."""

from __future__ import annotations

import time

import httpx
import pytest

from adapters.base import Role
from orchestrator.config import ConfigError, load_config
from orchestrator.planner.actuators import RecommendOnly, RoleChangeActuator
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView
from orchestrator.planner.install import settings_from_config
from orchestrator.planner.metrics_source import DirectSource, Observation, PrometheusSource
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.solver import Limits, Targets
from tests.unit.test_planner_logic import PROFILE


def _planner_cfg(**planner):
    return load_config({"planner": planner}, environ={}).planner


def test_config_maps_to_settings():
    s = settings_from_config(_planner_cfg(enabled=True, max_workers=6, min_decode=2, ttft_target_s=2,
                                          burst_window_s=900, actuator="role_change"))
    assert s.limits.budget == 6 and s.limits.min_decode == 2 and s.targets.ttft_s == 2
    assert s.fixed_fleet and s.role_change_s is not None and s.burst_window_s == 900
    # recommend-only cannot move roles; local moves them only when told a role change is fast
    assert settings_from_config(_planner_cfg(role_change_s=1)).role_change_s is None
    local = _planner_cfg(actuator="local", local_commands={"prefill": "x {port}", "decode": "x {port}"},
                         role_change_s=1, start_s=30)
    assert settings_from_config(local).role_change_s == 1 and not settings_from_config(local).fixed_fleet


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="local_commands"):
        _planner_cfg(actuator="local")
    with pytest.raises(ConfigError, match="max_workers"):
        _planner_cfg(max_workers=2, min_prefill=2, min_decode=1)
    with pytest.raises(ConfigError, match="planner.predictor"):
        _planner_cfg(predictor="crystal_ball")


def _obs(t: float, rate: float, isl: float, osl: float) -> Observation:
    return Observation(at=t, window_s=60, request_rate=rate, mean_isl=isl, mean_osl=osl)


def _fleet(p: int, d: int) -> list[WorkerView]:
    return ([WorkerView(f"p{i}", Role.PREFILL) for i in range(p)]
            + [WorkerView(f"d{i}", Role.DECODE) for i in range(d)])


def test_fixed_fleet_only_moves_workers_between_roles():
    settings = PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=20), predictor="constant",
                               scale_in_intervals=1, role_change_s=1.0, fixed_fleet=True,
                               correct_from_latency=False)
    pl = Planner(PerfModel.from_dict(PROFILE), settings)
    fleet = _fleet(1, 3)
    d = pl.step(_obs(60, 2, 8000, 20), fleet, 60)  # prefill-heavy, light overall: no start, no stop
    assert {a.kind for a in d.actions} == {"set_role"}
    assert all(a.role is Role.PREFILL for a in d.actions)
    assert sum(d.desired.values()) == 4 and d.desired["prefill"] >= 2
    # decode-heavy now: the same four workers move the other way
    fleet = [WorkerView(w.id, Role.PREFILL if any(a.worker_id == w.id for a in d.actions) else w.role)
             for w in fleet]
    d2 = pl.step(_obs(120, 2, 200, 2000), fleet, 120)
    assert d2.actions and all(a.kind == "set_role" and a.role is Role.DECODE for a in d2.actions)
    assert d2.desired["decode"] > d2.desired["prefill"] and sum(d2.desired.values()) == 4


def test_burst_sizing_uses_the_peak_rate_for_prefill_only():
    def planner(window: float) -> Planner:
        return Planner(PerfModel.from_dict(PROFILE), PlannerSettings(
            targets=Targets(1.0, 0.05), limits=Limits(budget=40), predictor="constant", scale_in_intervals=1,
            scale_in_margin=0.0, burst_window_s=window, correct_from_latency=False))

    bursty = _obs(60, 2, 4096, 200)
    bursty.peak_rate = 8.0  # 2 req/s over the interval, 8 req/s over a few seconds of it
    plain = planner(0).step(bursty, _fleet(1, 1), 60)
    floored = planner(300).step(bursty, _fleet(1, 1), 60)
    assert floored.sizing.prefill > plain.sizing.prefill
    assert floored.sizing.decode == plain.sizing.decode
    assert any("peak 8.00" in r for r in floored.reasons)


def test_direct_source_needs_one_input():
    with pytest.raises(ValueError):
        DirectSource()
    with pytest.raises(ValueError):
        DirectSource("http://x/metrics", read=lambda: "")


def _gateway_config(**planner):
    return load_config({
        "models": [{"name": "m"}],
        # an engine that is not there: the planner must keep running on an empty, unhealthy fleet
        "workers": [{"id": "p0", "url": "http://127.0.0.1:9", "engine": "sim", "role": "prefill", "models": ["m"]},
                    {"id": "d0", "url": "http://127.0.0.2:9", "engine": "sim", "role": "decode", "models": ["m"]}],
        "gateway": {"admin_token": "adm"},
        "health": {"interval_s": 5, "timeout_s": 0.2},
        "planner": {"enabled": True, "interval_s": 0.1, **planner},
    }, environ={})


def test_gateway_runs_the_planner_and_serves_admin_planner():
    from orchestrator.gateway.serve import GatewayThread

    with GatewayThread(_gateway_config()) as gw:
        service = gw.runtime.planner
        assert service is not None and isinstance(service.actuator, RecommendOnly)
        assert isinstance(service.source, DirectSource)
        h = {"Authorization": "Bearer adm"}
        deadline = time.monotonic() + 10
        while len(service.history) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.get(f"{gw.url}/admin/planner", headers=h, timeout=5)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["actuator"] == "recommend" and len(body["history"]) >= 3 and body["last_error"] is None
        assert body["last"]["current"] == {"prefill": 0, "decode": 0}  # both unhealthy: not counted
        assert httpx.get(f"{gw.url}/admin/planner", timeout=5).status_code == 401
        text = httpx.get(f"{gw.url}/metrics", timeout=5).text
        assert "dyad_planner_max_workers 8.0" in text


def test_gateway_planner_with_prometheus_and_role_change():
    from orchestrator.gateway.serve import GatewayThread

    cfg = _gateway_config(prometheus_url="http://127.0.0.1:9", actuator="role_change", interval_s=30)
    with GatewayThread(cfg) as gw:
        service = gw.runtime.planner
        assert isinstance(service.source, PrometheusSource) and service.source.window_s == 30
        assert isinstance(service.actuator, RoleChangeActuator)
        assert service.planner.settings.fixed_fleet


def test_gateway_without_planner_answers_404():
    from orchestrator.gateway.serve import GatewayThread

    cfg = _gateway_config()
    cfg.planner.enabled = False
    with GatewayThread(cfg) as gw:
        assert gw.runtime.planner is None
        r = httpx.get(f"{gw.url}/admin/planner", headers={"Authorization": "Bearer adm"}, timeout=5)
        assert r.status_code == 404 and r.json()["error"]["code"] == "planner_disabled"


async def test_stopping_the_service_closes_the_actuator():
    """Engines a local actuator started must not outlive the gateway: cancelling the loop closes it."""
    import asyncio

    from orchestrator.clock import VirtualClock
    from orchestrator.planner.service import PlannerService

    class Closable:
        name = "local"
        closed = False

        async def apply(self, decision):
            return []

        async def close(self):
            self.closed = True

    class NoLoad:
        async def observe(self, now):
            return Observation(at=now, window_s=0.0)

    actuator = Closable()
    planner = Planner(PerfModel.from_dict(PROFILE), PlannerSettings(interval_s=0.01))
    service = PlannerService(planner, NoLoad(), actuator, fleet=lambda: _fleet(1, 1), clock=VirtualClock())
    task = asyncio.create_task(service.run())
    while not service.history:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert actuator.closed
