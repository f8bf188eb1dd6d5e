"""Where worker-hours go (``dyad plan``'s breakdown) and warm standby net of the serving pool's spare.

Pure: the planner's decisions on hand-made fleets, and the virtual fleet (simulated engines,
``orchestrator/sim``) replaying small traces in virtual time.
"""

from __future__ import annotations

import pytest

from adapters.base import Role
from orchestrator.planner.core import Action, PlanDecision, Planner, PlannerSettings, WorkerView
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.plan_cli import breakdown
from orchestrator.planner.solver import Limits, Targets
from orchestrator.sim.profiles import load_profile
from orchestrator.sim.virtual_time import FleetSpec, SimRequest, SimResult, VirtualFleet, sweep_profile
from tests.unit.test_planner_logic import perf

GPU = load_profile("gpu-like")


def _fleet(p: int, d: int, standby_p: int = 0) -> list[WorkerView]:
    return ([WorkerView(f"p{i}", Role.PREFILL) for i in range(p)] + [WorkerView(f"d{i}", Role.DECODE) for i in range(d)]
            + [WorkerView(f"sb{i}", Role.PREFILL, "standby") for i in range(standby_p)])


def _obs(t: float, rate: float) -> Observation:
    return Observation(at=t, window_s=60, request_rate=rate, mean_isl=1000, mean_osl=50)


def _settings(**kw) -> PlannerSettings:
    return PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=20), predictor="constant",
                           correct_from_latency=False, standby_prefill=1, **kw)


# ---------------------------------------------------------------- standby net of spare

def test_a_spare_serving_worker_replaces_the_standby_pool_and_the_last_one_is_parked():
    pl = Planner(perf(), _settings(scale_in_intervals=1, scale_in_step=1))
    # 0.1 req/s needs 1 prefill worker; 3 are serving and one is in standby
    d1 = pl.step(_obs(60, 0.1), _fleet(3, 1, standby_p=1), 60)
    assert d1.desired["prefill"] == 2  # one back per interval
    assert d1.sized["prefill"] == 1 and d1.floored["prefill"] == 1
    kinds = [(a.kind, a.worker_id) for a in d1.actions if a.role is Role.PREFILL]
    # a serving worker beyond the need is warm capacity already: the idle standby goes, the surplus is stopped
    assert ("stop", "sb0") in kinds and sum(k == "stop" for k, _ in kinds) == 2
    assert not [a for a in d1.actions if a.kind == "start"]
    # next interval: the fleet is at its need plus one; giving that one back parks it (the pool is short again)
    d2 = pl.step(_obs(120, 0.1), _fleet(2, 1), 120)
    assert ("park", Role.PREFILL) in [(a.kind, a.role) for a in d2.actions]
    assert not [a for a in d2.actions if a.kind == "start"]  # no cold start to refill it


def test_scale_in_step_0_goes_to_the_need_after_hysteresis_and_parks_one_for_the_pool():
    pl = Planner(perf(), _settings(scale_in_step=0))  # scale_in_intervals 2
    d1 = pl.step(_obs(60, 0.1), _fleet(4, 1), 60)
    assert d1.desired["prefill"] == 4  # first interval below: hold
    d2 = pl.step(_obs(120, 0.1), _fleet(4, 1), 120)
    assert d2.desired["prefill"] == 1  # then straight to the need (plus margin), not one a step
    kinds = sorted(a.kind for a in d2.actions if a.role is Role.PREFILL)
    assert kinds == ["park", "stop", "stop"]  # the pool is short once the spare is gone: one is parked


def test_without_spare_the_standby_pool_is_kept_and_refilled():
    pl = Planner(perf(), _settings())
    d = pl.step(_obs(60, 0.1), _fleet(1, 1), 60)  # at its need: no spare
    assert ("start", Role.PREFILL, "standby") in [(a.kind, a.role, a.then) for a in d.actions]
    d = Planner(perf(), _settings()).step(_obs(60, 0.1), _fleet(1, 1, standby_p=1), 60)
    assert not [a for a in d.actions if a.kind in ("start", "stop")]  # the pool is what is wanted


def test_fixed_standby_pool_when_netting_is_off():
    pl = Planner(perf(), _settings(scale_in_intervals=1, standby_net_of_spare=False))
    d = pl.step(_obs(60, 0.1), _fleet(3, 1, standby_p=1), 60)
    assert ("stop", "sb0") not in [(a.kind, a.worker_id) for a in d.actions]


# ---------------------------------------------------------------- the breakdown

def test_state_seconds_cover_every_worker_second_and_floor_and_hold_lie_within_serving():
    s = PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=12), interval_s=10, predictor="constant",
                        start_s=5, standby_prefill=1, standby_decode=1, burst_window_s=60, fast_interval_s=2)
    pl = Planner(PerfModel.from_dict(sweep_profile(GPU)), s)
    # 20 s at 2 req/s, 20 s at 12 req/s, 60 s at 1 req/s: a burst the floor then holds for 60 s
    reqs, t, i = [], 0.0, 0
    for dur, rate in ((20, 2.0), (20, 12.0), (60, 1.0)):
        end = t + dur
        while t < end:
            reqs.append(SimRequest(id=i, arrival=t, isl=3000, osl=30))
            t += 1 / rate
            i += 1
    res = VirtualFleet(GPU, FleetSpec(1, 1), scaler=pl, interval_s=10, start_s=5).run(reqs)
    ss = res.state_seconds
    paid = sum(v for k, v in ss.items() if k.split(":")[0] in ("serving", "starting", "waking", "standby"))
    assert paid == pytest.approx(res.worker_seconds, rel=1e-9)
    for role in ("prefill", "decode"):
        assert ss.get(f"floor:{role}", 0) + ss.get(f"hold:{role}", 0) <= ss.get(f"serving:{role}", 0) + 1e-9
    assert ss.get("standby:prefill", 0) > 0  # the pool was kept at some point
    assert ss.get("floor:prefill", 0) > 0  # the burst floor held prefill workers after the burst
    b = breakdown(res, static_wh=0.01)
    parts = b["standby"] + b["starting"] + b["waking"] + b["floor"] + b["hold"] + b["sized"]
    assert parts == pytest.approx(res.worker_seconds / 3600, abs=1e-3)
    assert b["excess_over_static"] == pytest.approx(res.worker_seconds / 3600 - 0.01, abs=1e-3)


def test_breakdown_counts_cold_starts_and_activated_standby_apart():
    class Scripted:
        def step(self, obs, fleet, now):
            acts = {10.0: [Action("start", Role.PREFILL), Action("start", Role.DECODE, then="standby")],
                    30.0: [Action("activate", Role.DECODE, "d3")]}.get(now, [])
            return PlanDecision(now, obs, None, None, {}, {}, acts, {}, {}, [])

    fleet = VirtualFleet(GPU, FleetSpec(1, 1), scaler=Scripted(), interval_s=10, start_s=5)
    fleet.standby_wake_s = 2.0
    res = fleet.run([SimRequest(id=i, arrival=i * 0.5, isl=500, osl=10) for i in range(100)])
    ss = res.state_seconds
    assert ss["starting:prefill"] == pytest.approx(5.0)  # p2: t=10..15
    assert ss["standby:decode"] == pytest.approx(20.0)  # d3: starting into standby t=10..15, standby until t=30
    assert ss["waking:decode"] == pytest.approx(2.0)  # activated at t=30, serving at t=32
    b = breakdown(SimResult([], res.duration_s, res.worker_seconds, 0.0, state_seconds=ss))
    assert b["starting"] == pytest.approx(5.0 / 3600, abs=1e-4) and b["standby"] == pytest.approx(20 / 3600, abs=1e-4)
    assert "static" not in b


def test_timeline_row_shows_what_the_floor_held():
    s = PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=20), predictor="constant",
                        correct_from_latency=False, burst_window_s=600)
    pl = Planner(perf(), s)
    fleet = _fleet(1, 1)
    for t, peak in ((60, 12.0), (120, 1.0), (180, 1.0), (240, 1.0)):
        obs = _obs(t, 1.0)
        obs.peak_rate = peak
        d = pl.step(obs, fleet, t)
        fleet = _fleet(d.desired["prefill"], d.desired["decode"])
    row = d.timeline_row()
    assert row["floor_held"]["prefill"] >= 1  # the 5-s peak of the first interval still sizes prefill
    assert d.floored["prefill"] > d.sized["prefill"]


# ---------------------------------------------------------------- timeline row fields, config

def test_timeline_row_has_the_latency_source_and_a_forced_flag():
    pl = Planner(perf(), PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=20), predictor="constant",
                                         correct_from_latency=False))
    obs = _obs(60, 6)
    obs.latency_source = "engines"
    d = pl.step(obs, _fleet(1, 1), 60)
    row = d.timeline_row()
    assert row["latency_source"] == "engines" and row["forced"] is False
    assert all("(forced)" not in a for a in row["actions"])
    d.actions.append(Action("stop", Role.PREFILL, "p0", force=True))
    row = d.timeline_row()
    assert row["forced"] is True and row["actions"][-1] == "stop prefill p0 (forced)"
    assert d.to_dict()["actions"][-1]["force"] is True
    assert Planner(perf()).step(None, _fleet(1, 1), 1).timeline_row()["latency_source"] is None


def test_opt_in_settings_come_from_the_config_file():
    from orchestrator.config import PlannerConfig
    from orchestrator.planner.install import settings_from_config

    s = settings_from_config(PlannerConfig(max_workers=12))
    assert (s.burst_window_s, s.scale_in_step, s.standby_auto, s.rise_quantile, s.cold_backlog,
            s.standby_net_of_spare) == (0.0, 1, False, 0.0, "observed", True)
    s = settings_from_config(PlannerConfig(
        max_workers=12, burst_window_s="auto", scale_in_step=0, standby_auto=True, rise_quantile=0.9,
        cold_backlog="forecast", standby_net_of_spare=False))
    assert s.scale_in_step == 0 and Planner(perf(), s).settings.scale_in_step == 0
    assert s.burst_window_s is None and Planner(perf(), s).burst_window() == s.start_s + s.interval_s
    assert (s.standby_auto, s.rise_quantile, s.cold_backlog, s.standby_net_of_spare) == (True, 0.9, "forecast", False)
    for bad in ({"burst_window_s": -1}, {"burst_window_s": "soon"}, {"rise_quantile": 1.0}, {"cold_backlog": "x"}):
        with pytest.raises(ValueError):
            PlannerConfig(**bad)
