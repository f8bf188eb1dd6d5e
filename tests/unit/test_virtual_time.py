"""The virtual-time simulator: engine arithmetic, event-loop conservation, planner-driven scaling."""

from __future__ import annotations

import dataclasses

import pytest

from adapters.base import Role
from orchestrator.planner.baselines import QueueAutoscaler
from orchestrator.planner.core import Planner, PlannerSettings
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.solver import Limits, Targets
from orchestrator.sim.engine_model import SimRequest as ModelRequest
from orchestrator.sim.profiles import load_profile
from orchestrator.sim.virtual_time import FleetSpec, ModelEngine, SimRequest, VirtualFleet, sweep_profile

GPU = load_profile("gpu-like")


def _run(engine: ModelEngine, until: float = 1e9) -> list:
    out = []
    while engine.next_event_time() <= until:
        out += engine.advance(engine.next_event_time())
    return out


def test_lone_prefill_costs_what_the_profile_says():
    e = ModelEngine(GPU, Role.BOTH)
    r = SimRequest(id=0, arrival=0.0, isl=10_000, osl=1)
    e.submit_prefill(r, 0.0)
    _run(e)
    assert r.first_token == pytest.approx(GPU.request_overhead_s + GPU.prefill_seconds(10_000))
    assert r.finish == r.first_token


def _stepwise(arrivals: list[tuple[float, SimRequest]]) -> None:
    """The same requests on a bare EngineModel advanced one step at a time (its own event times)."""
    m = ModelEngine(GPU, Role.DECODE).model
    by_id = {}
    pending = sorted(arrivals, key=lambda x: x[0])
    while pending or m.next_event_time() is not None:
        t_next = m.next_event_time()
        if pending and (t_next is None or pending[0][0] <= t_next):
            t, r = pending.pop(0)
            by_id[str(r.id)] = r
            m.submit(ModelRequest(str(r.id), range(r.isl), r.osl, remote_prefill=True, block_hashes=()), t)
            continue
        for o in m.advance(t_next):
            r = by_id[o.request_id]
            if r.first_token is None:
                r.first_token = o.times[0]
            if o.finished:
                r.finish = o.times[-1]


def test_coalesced_decode_runs_equal_step_by_step():
    """The fleet wakes an engine only at the end of a planned decode run; a newcomer mid-run must
    still join at the next step boundary, exactly as when the core is stepped token by token."""
    def scenario() -> list[tuple[float, SimRequest]]:
        a = [SimRequest(id=i, arrival=0.0, isl=1000, osl=300) for i in range(4)]
        late = SimRequest(id=9, arrival=0.5123, isl=100, osl=40)
        return [(0.0, r) for r in a] + [(late.arrival, late)]

    ref = scenario()
    _stepwise(ref)
    got = scenario()
    e = ModelEngine(GPU, Role.DECODE)
    wakeups = 0
    for t, r in got:
        _run(e, until=t)
        e.submit_decode(r, t)
    while e.next_event_time() < float("inf"):
        e.advance(e.next_event_time())
        wakeups += 1
    for (_, want), (_, have) in zip(ref, got, strict=True):
        assert have.first_token == pytest.approx(want.first_token)
        assert have.finish == pytest.approx(want.finish)
    assert got[-1][1].finish < got[0][1].finish
    assert wakeups < 20  # runs, not 300 tokens


def test_prefix_cache_hits_skip_prefill_work():
    e = ModelEngine(GPU, Role.PREFILL, block_tokens=512)
    first = SimRequest(id=0, arrival=0.0, isl=8 * 512, osl=10, blocks=tuple(range(8)))
    e.submit_prefill(first, 0.0)
    events = _run(e)
    assert [k for k, *_ in events] == ["prefilled"]
    again = SimRequest(id=1, arrival=1.0, isl=8 * 512, osl=10, blocks=tuple(range(8)))
    e.submit_prefill(again, 1.0)
    _run(e)
    assert again.cached == 8 * 512 - 1  # at least one token is always computed
    assert e.cache.match(range(8), touch=False) == 8
    assert e.idle


def _trace(n: int, rate: float, isl: int, osl: int, start: float = 0.0) -> list[SimRequest]:
    return [SimRequest(id=i, arrival=start + i / rate, isl=isl, osl=osl) for i in range(n)]


@pytest.mark.parametrize("spec", [FleetSpec(2, 2), FleetSpec(aggregated=3)])
def test_every_request_finishes_once_with_sane_latencies(spec):
    reqs = _trace(300, 20.0, 2000, 50)
    res = VirtualFleet(GPU, spec, policy="round_robin").run(reqs)
    assert all(r.finish is not None and r.first_token is not None for r in reqs)
    assert all(r.arrival < r.first_token <= r.finish for r in reqs)
    s = res.summary(ttft_s=1.0, itl_s=0.05)
    assert s["finished"] == 300
    assert s["worker_hours"] == pytest.approx(res.duration_s * sum(dataclasses.astuple(spec)) / 3600)


def test_overload_shows_up_as_missed_slo():
    light = VirtualFleet(GPU, FleetSpec(1, 1)).run(_trace(200, 1.0, 4000, 20)).summary(1.0, 0.05)
    heavy = VirtualFleet(GPU, FleetSpec(1, 1)).run(_trace(200, 10.0, 4000, 20)).summary(1.0, 0.05)
    assert light["slo_attainment"] == 1.0
    assert heavy["slo_attainment"] < 0.5  # 40k prompt tokens/s against one ~12k tok/s prefill worker


def _planner(budget: int = 12, itl: float = 0.05, **kw) -> Planner:
    perf = PerfModel.from_dict(sweep_profile(GPU))
    settings = PlannerSettings(targets=Targets(1.0, itl), limits=Limits(budget=budget), interval_s=10,
                               predictor="constant", start_s=20, **kw)
    return Planner(perf, settings)


def test_planner_scales_a_simulated_fleet_up_and_back_down():
    # 60 s quiet, 120 s at 8x the load, 120 s quiet again
    reqs = _trace(60, 1.0, 3000, 50) + _trace(960, 8.0, 3000, 50, start=60) + _trace(120, 1.0, 3000, 50, start=180)
    for i, r in enumerate(reqs):
        r.id = i
    fleet = VirtualFleet(GPU, FleetSpec(1, 1), scaler=_planner(), interval_s=10, start_s=20)
    res = fleet.run(reqs)
    peak = max(p + d for _, p, d, _ in res.timeline)
    assert peak >= 4
    assert res.timeline[-1][1] + res.timeline[-1][2] < peak  # gave workers back after the burst
    assert res.summary(1.0, 0.05)["finished"] == len(reqs)


def test_planner_moves_workers_between_roles_when_the_mix_shifts():
    # first prefill-heavy (long prompts, 2 output tokens), then decode-heavy (short prompts, long outputs)
    a = _trace(400, 4.0, 6000, 2)
    b = _trace(1600, 16.0, 200, 1000, start=100)
    reqs = a + b
    for i, r in enumerate(reqs):
        r.id = i
    pl = _planner(budget=6, itl=0.02, role_change_s=2.0, scale_in_intervals=1)
    fleet = VirtualFleet(GPU, FleetSpec(3, 3), scaler=pl, interval_s=10, start_s=60, role_change_s=2.0)
    res = fleet.run(reqs)
    kinds = [a.kind for d in res.decisions for a in d.actions]
    assert "set_role" in kinds
    early = [(p, d) for t, p, d, _ in res.timeline if 30 <= t <= 90]
    late = [(p, d) for t, p, d, _ in res.timeline if t >= 160]
    assert max(p for p, _ in early) > min(p for p, _ in late)
    assert max(d for _, d in late) > min(d for _, d in early)


def test_queue_autoscaler_baseline_runs_behind_the_same_interface():
    reqs = _trace(600, 8.0, 3000, 50)
    res = VirtualFleet(GPU, FleetSpec(1, 1), scaler=QueueAutoscaler(Limits(budget=10), stabilization_s=30),
                       interval_s=10, start_s=20).run(reqs)
    assert max(p + d for _, p, d, _ in res.timeline) > 2
    assert res.summary(1.0, 0.05)["finished"] == 600
