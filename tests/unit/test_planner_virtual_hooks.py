"""The planner's hooks in the virtual fleet (simulated engines, ``orchestrator/sim``): warm standby
out of rotation, the load-reactive loop, per-role hardware and worker-seconds, the search's early stop."""

from __future__ import annotations

import pytest

from adapters.base import Role
from orchestrator.planner.core import Action, PlanDecision, Planner, PlannerSettings
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.solver import Limits, Targets
from orchestrator.sim.profiles import load_profile
from orchestrator.sim.virtual_time import FleetSpec, SimRequest, VirtualFleet, sweep_profile

GPU = load_profile("gpu-like")


def _trace(n: int, rate: float, isl: int, osl: int, start: float = 0.0) -> list[SimRequest]:
    return [SimRequest(id=i, arrival=start + i / rate, isl=isl, osl=osl) for i in range(n)]


class Scripted:
    """A scaler that plays given actions at given ticks (to drive the fleet's hooks directly)."""

    def __init__(self, script: dict[float, list[Action]]) -> None:
        self.script = script
        self.seen: list = []

    def step(self, obs, fleet, now):
        self.seen.append((now, [(w.id, w.role, w.state, w.standby) for w in fleet]))
        acts = list(self.script.get(now, []))
        return PlanDecision(now, obs, None, None, {}, {}, acts, {}, {}, [])


def test_standby_workers_take_no_traffic_until_activated_and_cost_worker_time():
    script = {10.0: [Action("start", Role.PREFILL, then="standby")]}
    scaler = Scripted(script)
    fleet = VirtualFleet(GPU, FleetSpec(1, 1), scaler=scaler, interval_s=10, start_s=5)
    reqs = _trace(200, 5.0, 1000, 20)
    fleet.run(reqs)
    standby_id = next(wid for wid, *_ in scaler.seen[1][1] if wid not in ("p0", "d1"))
    assert all(r.prefill_worker != standby_id for r in reqs)  # never routed to
    states = {s for _, views in scaler.seen[2:] for wid, _, s, _ in views if wid == standby_id}
    assert states == {"standby"}
    # activated: it serves after the wake-up time
    scaler2 = Scripted({10.0: [Action("start", Role.PREFILL, then="standby")]})
    fleet2 = VirtualFleet(GPU, FleetSpec(1, 1), scaler=scaler2, interval_s=10, start_s=5)
    fleet2.standby_wake_s = 2.0
    scaler2.script[20.0] = [Action("activate", Role.PREFILL, "p2")]
    # prompts one prefill worker cannot keep up with: the live Router's pair selection sends a request to
    # the lowest-id idle prefill worker, so a second one takes traffic only when the first is busy
    reqs2 = _trace(300, 5.0, 3000, 20)
    res = fleet2.run(reqs2)
    assert any(r.prefill_worker == "p2" and r.arrival >= 22.0 for r in reqs2)
    assert not any(r.prefill_worker == "p2" and r.arrival < 22.0 for r in reqs2)
    assert res.role_seconds["prefill"] > 2 * 0.9 * res.duration_s - 10  # p0 all along, p2 from t=10


def test_per_role_hardware_and_worker_seconds():
    slow = load_profile("gpu-like", per_running_seq_s=0.001, name="slow-decode")
    reqs = _trace(100, 5.0, 500, 100)
    fast = VirtualFleet(GPU, FleetSpec(1, 1)).run([SimRequest(r.id, r.arrival, r.isl, r.osl) for r in reqs])
    mixed = VirtualFleet(GPU, FleetSpec(1, 1), role_profiles={Role.DECODE: slow}).run(reqs)
    itl = lambda res: sum(r.itl for r in res.requests) / len(res.requests)  # noqa: E731
    assert itl(mixed) > 1.2 * itl(fast)
    assert mixed.role_seconds == pytest.approx({"prefill": mixed.duration_s, "decode": mixed.duration_s})


def test_the_load_mode_runs_between_intervals_in_virtual_time():
    perf = PerfModel.from_dict(sweep_profile(GPU))
    pl = Planner(perf, PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=12), interval_s=30,
                                       predictor="constant", start_s=20, fast_interval_s=2, fast_confirm_cold=2))
    reqs = _trace(40, 1.0, 3000, 20) + _trace(1200, 40.0, 3000, 20, start=40)
    for i, r in enumerate(reqs):
        r.id = i
    res = VirtualFleet(GPU, FleetSpec(1, 1), scaler=pl, interval_s=30, start_s=20).run(reqs)
    load = [d for d in res.decisions if d.mode == "load"]
    assert load and 40 < load[0].at < 60  # reacted within seconds of the burst, before the 60 s tick
    assert all(a.kind in ("start", "activate") for d in load for a in d.actions)


def test_early_stop_ends_a_replay_when_told():
    reqs = _trace(300, 20.0, 2000, 50)
    seen = []

    def stop(r):
        seen.append(r.id)
        return len(seen) >= 10
    res = VirtualFleet(GPU, FleetSpec(1, 1)).run(reqs, stop=stop)
    assert 10 <= len(seen) < 20  # the engine step that finished the 10th may have finished a few more
    assert res.summary(1.0, 0.05)["finished"] == len(seen) < 300
