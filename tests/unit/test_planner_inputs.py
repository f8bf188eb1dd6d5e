"""Inputs or no action: the planner plans only on fresh inputs and otherwise holds its sizes, says why
(``/admin/planner`` ``held``, ``dyad_planner_held_total{reason}``, one log line per change of reason)."""

from __future__ import annotations

import logging

from adapters.base import Role
from orchestrator.clock import VirtualClock
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView
from orchestrator.planner.inputs import (
    ISL_MISSING,
    LATENCY_MISSING,
    OSL_MISSING,
    RATE_MISSING,
    SOURCE_UNAVAILABLE,
    Hold,
    InputGate,
)
from orchestrator.planner.metrics_source import Observation, prometheus_queries
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.service import PlannerService
from orchestrator.planner.solver import Limits
from orchestrator.telemetry.metrics import DyadMetrics
from tests.unit.test_planner_logic import PROFILE


def full(at: float, rate: float = 40.0, **kw) -> Observation:
    base = dict(at=at, window_s=10.0, request_rate=rate, mean_isl=2000.0, mean_osl=200.0, ttft_mean=0.3,
                itl_mean=0.02)
    base.update(kw)
    return Observation(**base)


def test_gate_passes_complete_inputs_and_a_measured_zero_load():
    g = InputGate(max_age_s=30)
    assert isinstance(g.check(full(10), 10), Observation)
    zero = Observation(at=20, window_s=10, request_rate=0.0)  # nothing arrived: lengths not needed
    assert g.check(zero, 20) is zero


def test_gate_holds_without_a_measured_rate():
    g = InputGate(max_age_s=30)
    primed = g.check(Observation(at=0, window_s=0.0, request_rate=None), 0)
    assert isinstance(primed, Hold) and primed.reason == RATE_MISSING
    unknown = g.check(full(10, rate=None), 10)
    assert isinstance(unknown, Hold) and unknown.reason == RATE_MISSING


def test_gate_holds_when_lengths_or_latency_were_never_seen():
    g = InputGate(max_age_s=30)
    cases = [(dict(mean_isl=None), ISL_MISSING), (dict(mean_osl=None), OSL_MISSING),
             (dict(ttft_mean=None, ttft_p90=None), LATENCY_MISSING), (dict(itl_mean=None), LATENCY_MISSING)]
    for missing, reason in cases:
        out = InputGate(max_age_s=30).check(full(10, **missing), 10)
        assert isinstance(out, Hold) and out.reason == reason, (missing, out)
    # latency is not needed when the planner does not correct from it
    assert isinstance(InputGate(30, need_latency=False).check(full(10, ttft_mean=None, itl_mean=None), 10),
                      Observation)
    assert isinstance(g.check(full(10), 10), Observation)


def test_gate_carries_lengths_for_at_most_max_age():
    """An overloaded interval finishes nothing (no OSL of its own): the last OSL is used while it is
    fresh, then the planner holds rather than plan with a default OSL of 1 token."""
    g = InputGate(max_age_s=30)
    assert isinstance(g.check(full(10, mean_osl=300.0), 10), Observation)
    busy = full(30, mean_osl=None, ttft_mean=None, itl_mean=None, ttft_p90=None)
    out = g.check(busy, 30)
    assert isinstance(out, Observation) and out.mean_osl == 300.0 and out.mean_isl == 2000.0
    assert out.ttft_mean is None  # latency is never carried into the correction
    stale = g.check(full(50, mean_osl=None), 50)
    assert isinstance(stale, Hold) and stale.reason == OSL_MISSING and "40 s ago" in stale.detail


def _fleet(p: int, d: int) -> list[WorkerView]:
    return ([WorkerView(f"p{i}", Role.PREFILL) for i in range(p)] +
            [WorkerView(f"d{i}", Role.DECODE) for i in range(d)])


class Script:
    """A source that answers from a list (an exception in the list is raised)."""

    def __init__(self, answers):
        self.answers = list(answers)

    async def observe(self, now):
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a(now)


class Recorder:
    name = "local"

    def __init__(self):
        self.decisions = []

    async def apply(self, decision):
        self.decisions.append(decision)
        return [a.kind for a in decision.actions]


async def test_service_holds_says_why_and_plans_again_when_inputs_return(caplog):
    clock = VirtualClock()
    metrics = DyadMetrics()
    planner = Planner(PerfModel.from_dict(PROFILE),
                      PlannerSettings(interval_s=10, limits=Limits(budget=16), scale_in_intervals=1))
    calls = []
    real_step = planner.step

    def step(obs, fleet, now):
        calls.append(obs)
        return real_step(obs, fleet, now)

    planner.step = step
    source = Script([
        lambda now: Observation(at=now, window_s=0.0, request_rate=None),       # priming scrape
        lambda now: full(now, mean_osl=None),                                   # OSL never seen
        lambda now: full(now, mean_osl=None),                                   # same reason: no new log line
        RuntimeError("prometheus down"),                                        # source failed
        lambda now: full(now, rate=200.0),                                      # fresh: plan
    ])
    actuator = Recorder()
    svc = PlannerService(planner, source, actuator, fleet=lambda: _fleet(1, 1), clock=clock, metrics=metrics)
    reasons = []
    with caplog.at_level(logging.INFO, logger="dyad.planner"):
        for i in range(5):
            clock.set(10.0 * (i + 1))
            await svc.run_once()
            reasons.append(svc.status()["held"]["reason"] if svc.status()["held"] else None)
    assert reasons == [RATE_MISSING, OSL_MISSING, OSL_MISSING, SOURCE_UNAVAILABLE, None]
    assert len(calls) == 1  # the planner was asked only once, with complete inputs
    for d in actuator.decisions[:4]:
        assert d.actions == [] and d.desired == {"prefill": 1, "decode": 1}  # sizes held
        assert d.reasons[0].startswith("held (")
    assert actuator.decisions[4].desired["prefill"] > 1  # 200 req/s of 2,000-token prompts: scale out
    text = metrics.render().decode()
    assert 'dyad_planner_held_total{reason="osl_missing"} 2.0' in text
    assert 'dyad_planner_held_total{reason="source_unavailable"} 1.0' in text
    lines = [r.getMessage() for r in caplog.records if r.name == "dyad.planner"]
    assert len(lines) == 4, lines  # rate, osl, source, fresh again: one per change of reason
    assert "prometheus down" in lines[2]
    assert svc.status()["history"][1]["reasons"][0].startswith("held (osl_missing)")


async def test_holding_still_completes_drains_the_planner_started():
    """Holding keeps sizes; a worker the planner already drained is still stopped once idle."""
    planner = Planner(PerfModel.from_dict(PROFILE), PlannerSettings(interval_s=10, scale_in_intervals=1))
    fleet = [WorkerView("p0", Role.PREFILL, inflight=3), WorkerView("p1", Role.PREFILL, inflight=2),
             WorkerView("d0", Role.DECODE)]
    d = planner.step(full(10, rate=0.01, mean_isl=100.0, mean_osl=10.0), fleet, 10)
    busy = [a.worker_id for a in d.actions if a.kind == "drain"]
    assert busy == ["p1"], d.actions
    idle = [WorkerView(w.id, w.role, "draining" if w.id in busy else "healthy") for w in fleet]
    svc = PlannerService(planner, Script([lambda now: full(now, mean_isl=None)]), Recorder(),
                         fleet=lambda: idle, clock=VirtualClock())
    out = await svc.run_once()
    assert [(a.kind, a.worker_id) for a in out.actions] == [("stop", w) for w in busy]


def test_prometheus_rate_and_isl_are_demand_not_throughput():
    q = prometheus_queries("60s", "m")
    assert q["request_rate"] == 'sum(rate(dyad_request_arrivals_total{model="m"}[60s]))'
    assert "dyad_request_arrival_prompt_tokens_total" in q["mean_isl"] and "arrivals_total" in q["mean_isl"]
    assert "dyad_request_arrivals_total" in q["peak_rate"]
    assert "dyad_request_generation_tokens" in q["mean_osl"]  # lengths of what finished: only OSL
    assert "e2e_seconds_count" in q["finished_rate"]


def test_the_virtual_fleet_holds_like_the_live_service():
    """Same gate in virtual time: while nothing has finished yet (no OSL measured) the planner holds;
    once streams finish it plans."""
    from orchestrator.sim.profiles import GPU_LIKE
    from orchestrator.sim.virtual_time import FleetSpec, SimRequest, VirtualFleet, sweep_profile

    planner = Planner(PerfModel.from_dict(sweep_profile(GPU_LIKE)),
                      PlannerSettings(interval_s=5, limits=Limits(budget=8), correct_from_latency=False))
    # 2,000-token outputs at ~7 ms a token: nothing finishes before ~14 s
    reqs = [SimRequest(id=i, arrival=0.5 * i, isl=1000, osl=2000) for i in range(60)]
    fleet = VirtualFleet(GPU_LIKE, FleetSpec(prefill=1, decode=1), scaler=planner, interval_s=5, start_s=5)
    fleet.run(reqs)
    reasons = [d.reasons[0] if d.reasons else "" for d in fleet.decisions]
    assert reasons[0].startswith("held (osl_missing)") and reasons[1].startswith("held (osl_missing)")
    assert any(not r.startswith("held") for r in reasons[3:]), reasons
