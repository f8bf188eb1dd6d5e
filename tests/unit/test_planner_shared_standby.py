"""Shared warm standby (``PlannerSettings.standby_shared``): one pool for both roles when a standby
worker can serve either (same hardware and price, a role change faster than a start).

Pure: the planner's decisions on hand-made fleets, and the virtual fleet (simulated engines,
``orchestrator/sim``) carrying a cross-role wake out.
"""

from __future__ import annotations

import pytest

from adapters.base import Role
from orchestrator.planner.core import ROLES, Action, PlanDecision, Planner, PlannerSettings, WorkerView
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.solver import Limits, Targets
from orchestrator.sim.profiles import load_profile
from orchestrator.sim.virtual_time import FleetSpec, SimRequest, VirtualFleet
from tests.unit.test_planner_logic import PROFILE, perf

GPU = load_profile("gpu-like")


def _settings(limits: Limits | None = None, **kw) -> PlannerSettings:
    base = dict(targets=Targets(1.0, 0.05), limits=limits or Limits(budget=20), predictor="constant",
                correct_from_latency=False, standby_prefill=1, standby_decode=1, role_change_s=5.0, start_s=60,
                interval_s=60, standby_shared=True)
    base.update(kw)
    return PlannerSettings(**base)


def _fleet(p: int, d: int, sb_p: int = 0, sb_d: int = 0) -> list[WorkerView]:
    return ([WorkerView(f"p{i}", Role.PREFILL) for i in range(p)] + [WorkerView(f"d{i}", Role.DECODE) for i in range(d)]
            + [WorkerView(f"sp{i}", Role.PREFILL, "standby") for i in range(sb_p)]
            + [WorkerView(f"sd{i}", Role.DECODE, "standby") for i in range(sb_d)])


def _obs(t: float, rate: float, osl: float = 50) -> Observation:
    return Observation(at=t, window_s=60, request_rate=rate, mean_isl=1000, mean_osl=osl)


def _standby_starts(d: PlanDecision) -> list[Role]:
    return [a.role for a in d.actions if a.kind == "start" and a.then == "standby"]


def test_before_the_rise_is_measured_the_shared_pool_is_the_sum():
    per_role = Planner(perf(), _settings(standby_shared=False)).step(_obs(60, 0.1), _fleet(1, 1), 60)
    pl = Planner(perf(), _settings())
    assert pl.standby_pooled()
    shared = pl.step(_obs(60, 0.1), _fleet(1, 1), 60)
    # no history says the roles' shortfalls come apart: as many workers as per-role pools
    assert sorted(r.value for r in _standby_starts(shared)) == sorted(r.value for r in _standby_starts(per_role))
    assert pl.standby_wanted() == {"prefill": 1, "decode": 1, "shared": 2}
    # a pool beyond what is wanted: the extra idle worker is stopped
    d = Planner(perf(), _settings()).step(_obs(60, 0.1), _fleet(1, 1, sb_p=2, sb_d=1), 60)
    assert [(a.kind, a.worker_id) for a in d.actions] == [("stop", "sp1")]


def _measured(history: list[tuple[float, float]], target: dict[Role, int], need: dict[Role, float]) -> Planner:
    """A planner whose proportional insurance is known, over a hand-made history of (5-s peak rate,
    peak decode streams) per interval (horizon = start_s + interval = 2 intervals)."""
    pl = Planner(perf(), _settings())
    pl._absorbed.extend(history)
    pl._recent.append((0.0, dict(need)))
    pl._insured = {r: need[r] * 2 for r in ROLES}  # (only "known" matters to the pool's size)
    pl._target = dict(target)
    return pl


def test_roles_that_rose_apart_share_fewer_workers_than_roles_that_rose_together():
    from orchestrator.planner.core import horizon_ratios

    assert horizon_ratios([1, 1, 2, 2, 1, 1], 2) == [2.0, 1.0, 1.0]
    # prefill's arrivals doubled in some horizons, decode's streams in others, never in the same one
    apart = [(10, 40), (10, 40), (20, 40), (10, 40), (10, 40), (10, 80), (10, 40), (10, 40)] * 3
    together = [(10, 40), (10, 40), (20, 80), (10, 40), (10, 40), (20, 80), (10, 40), (10, 40)] * 3
    target, need = {Role.PREFILL: 2, Role.DECODE: 2}, {Role.PREFILL: 2.0, Role.DECODE: 2.0}
    want = {Role.PREFILL: 2, Role.DECODE: 2}  # each role alone: its need doubles, 2 beyond its target
    assert _measured(apart, target, need)._pool_want(want) == 2  # one role at a time: the larger want
    assert _measured(together, target, need)._pool_want(want) == 4  # both at once: the sum, no saving
    # bounded by the larger want and the sum, whatever the history
    assert _measured(apart, target, need)._pool_want({Role.PREFILL: 3, Role.DECODE: 0}) == 3
    assert _measured(together, target, need)._pool_want({Role.PREFILL: 1, Role.DECODE: 1}) == 2


def test_a_standby_parked_in_prefill_wakes_into_decode_by_a_role_change():
    pl = Planner(perf(), _settings())
    # long outputs at 3 req/s: decode needs a second worker, prefill does not
    d = pl.step(_obs(60, 3.0, osl=500), _fleet(1, 1, sb_p=1), 60)
    assert d.desired == {"prefill": 1, "decode": 2}
    kinds = [(a.kind, a.role, a.worker_id) for a in d.actions]
    # the role change first (serving after role_change_s), then into rotation; no cold decode start
    assert kinds[:2] == [("set_role", Role.DECODE, "sp0"), ("activate", Role.DECODE, "sp0")]
    assert not [a for a in d.actions if a.kind == "start" and a.role is Role.DECODE and a.then is None]
    assert _standby_starts(d)  # and the pool is refilled
    # per-role pools: the prefill standby stays; decode starts cold
    d = Planner(perf(), _settings(standby_shared=False)).step(_obs(60, 3.0, osl=500), _fleet(1, 1, sb_p=1), 60)
    assert ("start", Role.DECODE, None) in [(a.kind, a.role, a.then) for a in d.actions]
    assert not [a for a in d.actions if a.kind == "set_role"]


def test_own_role_standby_is_woken_before_the_other_roles():
    d = Planner(perf(), _settings()).step(_obs(60, 3.0, osl=500), _fleet(1, 1, sb_p=1, sb_d=1), 60)
    assert [(a.kind, a.worker_id) for a in d.actions if a.role is Role.DECODE][:1] == [("activate", "sd0")]
    assert not [a for a in d.actions if a.kind == "set_role"]


def test_when_both_roles_grow_a_standby_serves_its_own_role_first():
    # 10 req/s of long outputs: prefill 1 -> 2 and decode 1 -> 5 in one interval; the pool holds one decode worker
    d = Planner(perf(), _settings()).step(_obs(60, 10.0, osl=500), _fleet(1, 1, sb_d=1), 60)
    assert d.desired["prefill"] == 2 and d.desired["decode"] > 2
    assert ("activate", Role.DECODE, "sd0") in [(a.kind, a.role, a.worker_id) for a in d.actions]
    assert not [a for a in d.actions if a.kind == "set_role"]  # prefill does not take decode's insurance
    assert any(a.kind == "start" and a.role is Role.PREFILL and a.then is None for a in d.actions)


def test_the_load_mode_wakes_the_other_roles_standby():
    pl = Planner(perf(), _settings(fast_interval_s=2.0))
    pl.step(_obs(60, 0.1), _fleet(1, 1, sb_d=1), 60)
    # 40 prompts queued on one prefill worker: prefill is short now; the only standby is parked in decode
    busy = [WorkerView("p0", Role.PREFILL, inflight=40), WorkerView("d0", Role.DECODE),
            WorkerView("sd0", Role.DECODE, "standby")]
    d = pl.react(busy, 62.0)
    assert d is not None and d.mode == "load"
    assert [(a.kind, a.role, a.worker_id) for a in d.actions][:2] == [
        ("set_role", Role.PREFILL, "sd0"), ("activate", Role.PREFILL, "sd0")]


@pytest.mark.parametrize("why", ["decode_profile", "decode_cost", "no_role_change", "slow_role_change"])
def test_no_pooling_when_the_roles_differ_in_hardware_or_cannot_change(why):
    limits, kw, decode_perf = Limits(budget=20), {}, None
    if why == "decode_profile":
        other = dict(PROFILE, prefill=[{**x, "ttft_s": 2 * x["ttft_s"]} for x in PROFILE["prefill"]])
        decode_perf = PerfModel.from_dict(other)
    elif why == "decode_cost":
        limits = Limits(budget=20, decode_cost=2.0)
    elif why == "no_role_change":
        kw = {"role_change_s": None}
    else:
        kw = {"role_change_s": 90.0}  # slower than a cold start (start_s 60)
    pl = Planner(perf(), _settings(limits=limits, **kw), decode_perf=decode_perf)
    assert not pl.standby_pooled()
    d = pl.step(_obs(60, 3.0, osl=500), _fleet(1, 1, sb_p=1), 60)
    assert not [a for a in d.actions if a.kind == "set_role"]  # a prefill machine never wakes as decode
    assert Role.DECODE in _standby_starts(d) or any(a.kind == "start" and a.role is Role.DECODE for a in d.actions)
    assert "shared" not in pl.standby_wanted()


def test_same_profile_loaded_twice_is_the_same_hardware():
    pl = Planner(perf(), _settings(), decode_perf=perf())  # equal models, not the same object
    assert pl.same_hardware() and pl.standby_pooled()


def test_the_virtual_fleet_wakes_a_standby_into_the_other_role_after_the_role_change():
    class Scripted:
        def step(self, obs, fleet, now):
            acts = {10.0: [Action("start", Role.PREFILL, then="standby")],
                    30.0: [Action("set_role", Role.DECODE, "p2"), Action("activate", Role.DECODE, "p2")]}.get(now, [])
            return PlanDecision(now, obs, None, None, {}, {}, acts, {}, {}, [])

    fleet = VirtualFleet(GPU, FleetSpec(1, 1), scaler=Scripted(), interval_s=10, start_s=5, role_change_s=4.0)
    # long outputs at 4 req/s: one decode worker holds many streams, a second takes some once it serves
    reqs = [SimRequest(id=i, arrival=i * 0.25, isl=200, osl=400) for i in range(240)]
    res = fleet.run(reqs)
    assert any(r.decode_worker == "p2" for r in reqs)
    assert not any(r.decode_worker == "p2" and r.arrival < 34.0 for r in reqs)  # not before the role change
    assert not any(r.prefill_worker == "p2" for r in reqs)  # never served as prefill
    ss = res.state_seconds
    assert ss["standby:prefill"] == pytest.approx(20.0)  # started into standby t=10..15, parked until t=30
    # paid during the role change, not serving (booked under the role it is leaving)
    assert ss.get("waking:prefill", 0) + ss.get("waking:decode", 0) == pytest.approx(4.0)


def test_the_live_config_carries_the_option():
    from orchestrator.config import PlannerConfig
    from orchestrator.planner.install import settings_from_config

    assert settings_from_config(PlannerConfig(max_workers=12)).standby_shared is True  # the default (inert here)
    assert not Planner(perf(), settings_from_config(PlannerConfig(max_workers=12))).standby_pooled()
    cmds = {"prefill": "dyad sim-engine --port {port} --role prefill", "decode": "dyad sim-engine --port {port} --role decode"}
    s = settings_from_config(PlannerConfig(max_workers=12, standby_shared=True, role_change_s=2.0, start_s=60,
                                           actuator="local", local_commands=cmds))
    assert s.standby_shared and Planner(perf(), s).standby_pooled()
    # an actuator that cannot change a worker's role (recommend, kubernetes): the option is inert there
    s = settings_from_config(PlannerConfig(max_workers=12, standby_shared=True, role_change_s=2.0, actuator="recommend"))
    assert not Planner(perf(), s).standby_pooled()
