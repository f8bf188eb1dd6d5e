"""The fleet page's JSON snapshot, built from a real (unstarted) GatewayRuntime: no network."""

import json
import math

from adapters.base import LoadSnapshot, Role
from orchestrator.clock import VirtualClock
from orchestrator.config import load_config
from orchestrator.fleet.worker import WorkerState
from orchestrator.gateway.runtime import GatewayRuntime
from orchestrator.router.types import RouteRequest
from orchestrator.ui.state import fleet_state, planner_view


def _runtime(clock):
    cfg = load_config({"workers": [
        {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill", "models": ["m"]},
        {"id": "d0", "url": "http://127.0.0.1:2", "role": "decode", "models": ["m"]},
        {"id": "b0", "url": "http://127.0.0.1:3", "role": "both", "models": ["m"]},
    ]}, environ={})
    return GatewayRuntime(cfg, clock=clock)


async def test_snapshot_shows_workers_load_and_newest_decisions_first():
    clock = VirtualClock(100.0)
    rt = _runtime(clock)
    try:
        for w in rt.fleet.workers():
            w.health_ok, w.state = True, WorkerState.HEALTHY
        b0 = rt.fleet.get("b0")
        b0.load = LoadSnapshot(running=3, waiting=2, kv_usage=0.42, prefix_cache_queries=200.0,
                               prefix_cache_hits=50.0, scraped_at=99.0)
        b0.inflight = 4
        d0 = rt.fleet.get("d0")
        d0.health_ok = False
        d0.state = WorkerState.UNHEALTHY
        d0.last_error = "health probe failed"
        d0.target_role = Role.PREFILL
        for i in range(3):
            await rt.router.route(RouteRequest(f"req-{i}", "m", prompt_tokens=100 + i), {}, "chat")
            clock.advance(1.0)
        state = json.loads(json.dumps(fleet_state(rt)))  # must be plain JSON
    finally:
        await rt.http.aclose()

    workers = {w["id"]: w for w in state["workers"]}
    assert set(workers) == {"p0", "d0", "b0"}
    assert [w["role"] for w in state["workers"]] == ["both", "decode", "prefill"]  # grouped by role
    b = workers["b0"]
    assert (b["running"], b["waiting"], b["kv_usage"], b["inflight"]) == (3.0, 2.0, 0.42, 4)
    assert b["cache_hit_ratio"] == 0.25 and b["health"] == "ok" and b["state"] == "healthy"
    assert b["scrape_age_s"] == 4.0  # clock went 100 → 103; scraped at 99
    d = workers["d0"]
    assert (d["health"], d["state"], d["last_error"], d["target_role"]) == \
        ("failing", "unhealthy", "health probe failed", "prefill")
    assert workers["p0"]["cache_hit_ratio"] is None  # engine did not report: unknown, not 0
    assert state["gateway"] == {"policy": "round_robin", "models": ["m"], "workers": 3, "healthy": 2,
                                "inflight": 4}
    ids = [x["request_id"] for x in state["decisions"]]
    assert ids == ["req-2", "req-1", "req-0"]
    assert [x["age_s"] for x in state["decisions"]] == [1.0, 2.0, 3.0]
    assert state["decisions"][0]["prompt_tokens"] == 102
    assert state["decisions"][0]["worker"] in {"p0", "b0"} - {"d0"}
    assert state["planner"] == {"enabled": False, "recommendation": None}


def test_planner_view_uses_last_recommendation_or_history_and_is_json_safe():
    class Actuator:
        name = "recommend"

    class Service:
        actuator = Actuator()
        last_error = None
        history = [{"desired": {"prefill": 1}}, {"desired": {"prefill": 2, "decode": 3}, "x": math.inf}]

    view = planner_view(Service())
    assert view["enabled"] and view["actuator"] == "recommend"
    assert view["recommendation"] == {"desired": {"prefill": 2, "decode": 3}, "x": None}

    class WithLast(Service):
        last_recommendation = {"desired": {"decode": 5}, "role": Role.DECODE}

    assert planner_view(WithLast())["recommendation"] == {"desired": {"decode": 5}, "role": "decode"}


def test_planner_card_has_targets_budget_and_recent_decisions_newest_first():
    from orchestrator.planner.core import PlannerSettings
    from orchestrator.planner.solver import Limits, Targets

    class Actuator:
        name = "role_change"

    class Core:
        settings = PlannerSettings(targets=Targets(ttft_s=0.3, itl_s=0.04), limits=Limits(budget=6), interval_s=30.0)

    def entry(at, rate, desired, actions=()):
        return {"at": at, "observation": {"request_rate": rate, "ttft_p99": 0.41, "itl_mean": 0.02},
                "forecast": {"request_rate": rate * 1.1, "isl": 800.0, "osl": 120.0}, "desired": desired,
                "current": {"prefill": 1, "decode": 2}, "actions": list(actions), "reasons": ["ttft over target"],
                "applied": True}

    class Service:
        actuator = Actuator()
        planner = Core()
        last_error = None
        history = [entry(10.0 * i, 5.0 + i, {"prefill": 1, "decode": 2}) for i in range(10)] + [
            entry(100.0, 20.0, {"prefill": 2, "decode": 2},
                  [{"kind": "set_role", "role": "prefill", "worker_id": "d1", "then": None}])]

    view = json.loads(json.dumps(planner_view(Service(), now=105.0)))
    assert view["targets"] == {"ttft_s": 0.3, "itl_s": 0.04} and view["budget"] == 6 and view["interval_s"] == 30.0
    assert len(view["recent"]) == 8  # the last eight, newest first
    newest = view["recent"][0]
    assert newest["age_s"] == 5.0 and newest["desired"] == {"prefill": 2, "decode": 2}
    assert newest["actions"][0]["worker_id"] == "d1" and newest["observed"]["request_rate"] == 20.0
    assert newest["forecast"] == {"request_rate": 22.0, "isl": 800.0, "osl": 120.0}
    assert [r["age_s"] for r in view["recent"][:3]] == [5.0, 15.0, 25.0]
