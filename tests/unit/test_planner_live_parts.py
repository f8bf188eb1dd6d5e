"""The live side of the planner loop, pure parts (no sockets, no processes):

- warm standby in the registry: probed, never a routing candidate, ``activate`` puts it in rotation
  with no I/O, ``park`` takes it out; the local actuator's wrapper drains before it parks;
- the churn guard: a worker still starting, or in rotation for less than the minimum serve time
  (derived from the interval), is not stopped unless the action forces it;
- latency from the engines' own histograms when the gateway's streams give none.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from adapters.base import Histogram, LoadSnapshot, Role
from orchestrator.clock import VirtualClock
from orchestrator.config import PlannerConfig
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.planner.actuators import LocalProcess, LocalProcessActuator, keep_reason
from orchestrator.planner.core import Action, PlanDecision
from orchestrator.planner.inputs import LATENCY_MISSING, InputGate
from orchestrator.planner.install import _DrainingLocal, min_serve_s
from orchestrator.planner.metrics_source import (
    DirectSource,
    EngineLatency,
    Observation,
    engine_parts_from_prometheus,
    instance_of,
    latency_from_engines,
    with_engine_latency,
)
from orchestrator.planner.service import views_from_workers

BOUNDS = [0.1, 0.5, 1.0, float("inf")]


def hist(counts: list[float], total: float) -> Histogram:
    """Cumulative histogram over BOUNDS from per-bucket counts."""
    cum, run = [], 0.0
    for b, c in zip(BOUNDS, counts, strict=True):
        run += c
        cum.append((b, run))
    return Histogram(cum, total, run)


def decision(*actions: Action) -> PlanDecision:
    return PlanDecision(at=0.0, observation=None, forecast=None, sizing=None, desired={}, current={},
                        actions=list(actions), correction={}, predictors={}, reasons=[])


# ------------------------------------------------------------------ standby in the registry

def test_a_standby_worker_is_probed_but_never_a_candidate_until_activated():
    fleet = FleetRegistry([Worker("s", "http://s", role=Role.DECODE, models=["m"], state=WorkerState.STANDBY)])
    w = fleet.get("s")
    fleet.record_health(w, True, now=5.0)
    assert w.health_ok is True and w.ready_at == 5.0
    assert w.state is WorkerState.STANDBY  # a passing probe does not put it in rotation
    assert fleet.candidates("m") == [] and not w.accepting
    fleet.activate("s")
    assert w.state is WorkerState.HEALTHY and fleet.candidates("m") == [w]
    fleet.park("s")
    assert w.state is WorkerState.STANDBY and fleet.candidates("m") == []
    for t in range(fleet.health.failure_threshold):  # a failing standby stays standby (health kept apart)
        fleet.record_health(w, False, now=6.0 + t)
    assert w.state is WorkerState.STANDBY and w.health_ok is False
    fleet.activate("s")
    assert w.state is WorkerState.UNHEALTHY  # not routed before its probe passes again


def test_standby_workers_as_the_planner_sees_them():
    ready = Worker("a", "http://a", role=Role.PREFILL, state=WorkerState.STANDBY, health_ok=True)
    coming = Worker("b", "http://b", role=Role.PREFILL, state=WorkerState.STANDBY)
    views = {v.id: v for v in views_from_workers([ready, coming])}
    assert views["a"].state == "standby" and not views["a"].standby
    assert views["b"].state == "starting" and views["b"].standby  # bound for the pool, not for rotation


async def test_the_local_wrapper_activates_at_once_and_parks_after_draining():
    clock = VirtualClock(100.0)
    fleet = FleetRegistry([Worker("local-decode-1", "http://x", role=Role.DECODE, models=["m"],
                                  state=WorkerState.STANDBY, health_ok=True),
                           Worker("local-decode-2", "http://y", role=Role.DECODE, models=["m"], health_ok=True)])
    local = LocalProcessActuator({Role.DECODE: "true"}, clock=clock)
    for wid in ("local-decode-1", "local-decode-2"):
        local.processes[wid] = LocalProcess(wid, Role.DECODE, 1, proc=None)  # type: ignore[arg-type]
    act = _DrainingLocal(local, SimpleNamespace(fleet=fleet))
    done = await act.apply(decision(Action("activate", Role.DECODE, "local-decode-1")))
    assert fleet.get("local-decode-1").state is WorkerState.HEALTHY, done
    busy = fleet.get("local-decode-2")
    busy.inflight = 2
    done = await act.apply(decision(Action("park", Role.DECODE, "local-decode-2")))
    assert busy.state is WorkerState.DRAINING and done == ["parking local-decode-2 once its 2 request(s) finish"]
    busy.inflight = 0
    for _ in range(50):
        if busy.state is WorkerState.STANDBY:
            break
        await asyncio.sleep(0.02)
    assert busy.state is WorkerState.STANDBY and "local-decode-2" in local.processes  # process kept


# ------------------------------------------------------------------ churn guard

def test_keep_reason():
    kw = {"min_serve_s": 4.0, "start_timeout_s": 30.0}
    assert "still starting" in keep_reason(10.0, started_at=5.0, ready_at=None, alive=True, **kw)
    assert keep_reason(40.0, started_at=5.0, ready_at=None, alive=True, **kw) is None  # a hung start
    assert keep_reason(10.0, started_at=5.0, ready_at=None, alive=False, **kw) is None  # died
    assert "in rotation for 0.3 s" in keep_reason(10.3, started_at=5.0, ready_at=10.0, alive=True, **kw)
    assert keep_reason(14.0, started_at=5.0, ready_at=10.0, alive=True, **kw) is None


def test_min_serve_time_derives_from_the_interval():
    assert min_serve_s(PlannerConfig(interval_s=2, scale_in_intervals=2)) == 4
    assert min_serve_s(PlannerConfig(interval_s=60, scale_in_intervals=3)) == 180


async def test_a_just_ready_worker_is_kept_unless_forced():
    clock = VirtualClock(100.0)
    fleet = FleetRegistry([Worker("local-prefill-1", "http://x", role=Role.PREFILL, models=["m"])])
    w = fleet.get("local-prefill-1")
    fleet.record_health(w, True, now=99.7)  # ready 0.3 s ago
    local = LocalProcessActuator({Role.PREFILL: "true"}, clock=clock)
    local.processes[w.id] = LocalProcess(w.id, Role.PREFILL, 1, proc=None, started_at=90.0)  # type: ignore[arg-type]
    stopped: list[str] = []

    async def stop(worker_id: str) -> bool:
        stopped.append(worker_id)
        local.processes.pop(worker_id)
        return True

    local.stop = stop  # type: ignore[method-assign]
    act = _DrainingLocal(local, SimpleNamespace(fleet=fleet), min_serve_s=4.0, start_timeout_s=30.0)
    done = await act.apply(decision(Action("stop", Role.PREFILL, w.id)))
    assert stopped == [] and w.state is WorkerState.HEALTHY and done[0].startswith("kept local-prefill-1")
    done = await act.apply(decision(Action("drain", Role.PREFILL, w.id, "stop")))
    assert w.state is WorkerState.HEALTHY and done[0].startswith("kept")  # not drained to be stopped either
    forced = Action("stop", Role.PREFILL, w.id)
    forced.force = True  # type: ignore[attr-defined]  # the planner may say so explicitly
    await act.apply(decision(forced))
    assert stopped == [w.id]


async def test_a_worker_is_stopped_once_it_served_long_enough():
    clock = VirtualClock(100.0)
    fleet = FleetRegistry([Worker("local-prefill-1", "http://x", role=Role.PREFILL, models=["m"])])
    w = fleet.get("local-prefill-1")
    fleet.record_health(w, True, now=95.0)
    local = LocalProcessActuator({Role.PREFILL: "true"}, clock=clock)
    local.processes[w.id] = LocalProcess(w.id, Role.PREFILL, 1, proc=None, started_at=90.0)  # type: ignore[arg-type]
    stopped: list[str] = []

    async def stop(worker_id: str) -> bool:
        stopped.append(worker_id)
        return True

    local.stop = stop  # type: ignore[method-assign]
    act = _DrainingLocal(local, SimpleNamespace(fleet=fleet), min_serve_s=4.0, start_timeout_s=30.0)
    await act.apply(decision(Action("stop", Role.PREFILL, w.id)))
    assert stopped == [w.id]


# ------------------------------------------------------------------ latency from the engines

def test_engine_latency_adds_the_two_stages_of_a_split_request():
    parts = [EngineLatency(Role.PREFILL, hist([4, 0, 0, 0], 0.2), None),  # prefill TTFT mean 0.05
             EngineLatency(Role.DECODE, hist([2, 0, 0, 0], 0.06), hist([10, 0, 0, 0], 0.2))]  # 0.03; ITL 0.02
    got = latency_from_engines(parts)
    assert abs(got["ttft_mean"] - 0.08) < 1e-9 and abs(got["itl_mean"] - 0.02) < 1e-9
    assert got["ttft_p90"] is not None and got["itl_p90"] is not None


def test_engine_latency_of_an_aggregated_fleet_merges_its_workers():
    parts = [EngineLatency(Role.BOTH, hist([0, 2, 0, 0], 0.6), hist([4, 0, 0, 0], 0.08)),
             EngineLatency(Role.BOTH, hist([0, 0, 2, 0], 1.4), None)]
    got = latency_from_engines(parts)
    assert abs(got["ttft_mean"] - 0.5) < 1e-9 and abs(got["itl_mean"] - 0.02) < 1e-9
    assert latency_from_engines([]) == dict.fromkeys(("ttft_mean", "ttft_p90", "ttft_p99", "itl_mean", "itl_p90"))


def test_gateway_latency_wins_and_the_source_is_named():
    obs = Observation(at=1, window_s=1, request_rate=2, ttft_mean=0.3)
    engine = {"ttft_mean": 0.1, "itl_mean": 0.01}
    assert with_engine_latency(obs, engine).latency_source == "gateway"
    assert with_engine_latency(obs, engine).ttft_mean == 0.3
    bare = Observation(at=1, window_s=1, request_rate=2)
    got = with_engine_latency(bare, engine)
    assert got.latency_source == "engines" and got.ttft_mean == 0.1 and got.itl_mean == 0.01
    assert with_engine_latency(bare, {}).latency_source is None


def test_prometheus_rows_map_to_roles_by_instance():
    assert instance_of("http://127.0.0.1:8001/") == "127.0.0.1:8001"
    rows = {
        "ttft_bucket": [{"metric": {"instance": "h:1", "le": str(b)}, "value": [0, str(c)]}
                        for b, c in zip(BOUNDS, [2, 2, 2, 2], strict=True)]
        + [{"metric": {"instance": "other:9", "le": "+Inf"}, "value": [0, "5"]}],
        "ttft_sum": [{"metric": {"instance": "h:1"}, "value": [0, "0.1"]}],
        "ttft_count": [{"metric": {"instance": "h:1"}, "value": [0, "2"]}],
    }
    parts = engine_parts_from_prometheus(rows, {"h:1": Role.BOTH})
    assert len(parts) == 1 and parts[0].role is Role.BOTH and parts[0].itl is None
    assert parts[0].ttft.count == 2 and abs(parts[0].ttft.mean() - 0.05) < 1e-9


GATEWAY_TEXT = """# TYPE dyad_request_arrivals counter
dyad_request_arrivals_total{{model="m"}} {n}
# TYPE dyad_request_arrival_prompt_tokens counter
dyad_request_arrival_prompt_tokens_total{{model="m"}} {tok}
# TYPE dyad_request_generation_tokens histogram
dyad_request_generation_tokens_bucket{{model="m",le="+Inf"}} {n}
dyad_request_generation_tokens_sum{{model="m"}} {gen}
dyad_request_generation_tokens_count{{model="m"}} {n}
"""


async def test_direct_source_takes_engine_latency_when_no_stream_gave_any():
    """Non-streamed traffic only: the gateway's TTFT/ITL series are empty; the engines' histograms
    (as the gateway's scrape loop stores them in Worker.load) give the interval's latency, and the
    input gate plans on it instead of holding on latency_missing."""
    state = {"n": 0}
    loads = {"w": LoadSnapshot(ttft=hist([0, 0, 0, 0], 0.0), itl=hist([0, 0, 0, 0], 0.0))}

    def read() -> str:
        n = state["n"]
        return GATEWAY_TEXT.format(n=n, tok=100 * n, gen=20 * n)

    src = DirectSource(read=read, engines=lambda: [("w", Role.BOTH, loads["w"])])
    gate = InputGate(max_age_s=10)
    first = await src.observe(0.0)
    assert first.request_rate is None  # primes
    state["n"] = 4
    loads["w"] = LoadSnapshot(ttft=hist([0, 4, 0, 0], 1.2), itl=hist([76, 0, 0, 0], 1.52))
    obs = await src.observe(2.0)
    assert obs.latency_source == "engines" and abs(obs.ttft_mean - 0.3) < 1e-9 and abs(obs.itl_mean - 0.02) < 1e-9
    assert isinstance(gate.check(obs, 2.0), Observation)

    no_engines = DirectSource(read=read)
    state["n"] = 0
    await no_engines.observe(0.0)
    state["n"] = 4
    held = InputGate(max_age_s=10).check(await no_engines.observe(2.0), 2.0)
    assert getattr(held, "reason", None) == LATENCY_MISSING and "engines" in held.detail


def test_the_planner_sees_a_young_worker_as_not_stoppable():
    """The planner is told which workers the actuator would refuse to stop, so it picks another."""
    from orchestrator.planner.install import stoppable_by

    clock = VirtualClock(100.0)
    fleet = FleetRegistry([Worker("local-prefill-1", "http://x", role=Role.PREFILL, models=["m"]),
                           Worker("local-prefill-2", "http://y", role=Role.PREFILL, models=["m"])])
    fleet.record_health(fleet.get("local-prefill-1"), True, now=99.0)  # ready 1 s ago
    fleet.record_health(fleet.get("local-prefill-2"), True, now=50.0)  # ready 50 s ago
    local = LocalProcessActuator({Role.PREFILL: "true"}, clock=clock)
    for wid in ("local-prefill-1", "local-prefill-2"):
        local.processes[wid] = LocalProcess(wid, Role.PREFILL, 1, proc=None, started_at=40.0)  # type: ignore[arg-type]
    act = _DrainingLocal(local, SimpleNamespace(fleet=fleet), min_serve_s=4.0, start_timeout_s=30.0)
    views = {v.id: v.stoppable for v in views_from_workers(fleet.workers(), stoppable_by(act))}
    assert views == {"local-prefill-1": False, "local-prefill-2": True}
    clock.advance(4.0)
    assert all(v.stoppable for v in views_from_workers(fleet.workers(), stoppable_by(act)))


def test_pod_keep_reason_reads_the_pods_own_timestamps():
    from orchestrator.planner.actuators import pod_keep_reason

    def pod(created: str, ready: str | None) -> dict:
        cond = {"type": "Ready", "status": "True" if ready else "False"}
        if ready:
            cond["lastTransitionTime"] = ready
        return {"metadata": {"name": "p", "creationTimestamp": created}, "status": {"conditions": [cond]}}

    t0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z
    assert "still starting" in pod_keep_reason(pod("2027-01-15T08:00:00Z", None), t0 + 5, 4.0, 30.0)
    assert pod_keep_reason(pod("2027-01-15T08:00:00Z", None), t0 + 31, 4.0, 30.0) is None
    assert "in rotation for 2.0 s" in pod_keep_reason(pod("2027-01-15T08:00:00Z", "2027-01-15T08:00:10Z"),
                                                      t0 + 12, 4.0, 30.0)
    assert pod_keep_reason(pod("2027-01-15T08:00:00Z", "2027-01-15T08:00:10Z"), t0 + 14, 4.0, 30.0) is None
    assert pod_keep_reason(pod("2027-01-15T08:00:00Z", None), t0 + 5, 0.0, 0.0) is None  # no guard


def test_the_gateways_prefill_step_replaces_the_prefill_engines_ttft():
    """In P/D the prefill step the gateway timed (HTTP round trip included) is used when it has one."""
    parts = [EngineLatency(Role.PREFILL, hist([4, 0, 0, 0], 0.2), None),  # engine: 0.05
             EngineLatency(Role.DECODE, hist([2, 0, 0, 0], 0.06), hist([10, 0, 0, 0], 0.2))]  # 0.03
    step = hist([0, 4, 0, 0], 1.2)  # the gateway: 0.3 per prefill step
    assert abs(latency_from_engines(parts, step)["ttft_mean"] - 0.33) < 1e-9
    assert abs(latency_from_engines(parts, hist([0, 0, 0, 0], 0.0))["ttft_mean"] - 0.08) < 1e-9  # none: engines


async def test_an_engine_whose_process_exited_is_reaped():
    class Exited:  # a process handle whose process is gone (no real process in the unit tier)
        returncode = 1
        pid = 2 ** 22 + 1  # above any pid_max: no such process (group) to signal

        def poll(self) -> int:
            return 1

        def terminate(self) -> None:
            pass

        def wait(self, timeout: float | None = None) -> int:
            return 1

    fleet = FleetRegistry([Worker("local-decode-1", "http://x", role=Role.DECODE, models=["m"],
                                  state=WorkerState.STANDBY)])
    local = LocalProcessActuator({Role.DECODE: "true"}, on_stopped=lambda p: fleet.remove(p.worker_id))
    local.processes["local-decode-1"] = LocalProcess("local-decode-1", Role.DECODE, 1, proc=Exited())  # type: ignore[arg-type]
    act = _DrainingLocal(local, SimpleNamespace(fleet=fleet))
    done = await act.apply(decision())
    assert done == ["reaped local-decode-1: its process exited with 1"]
    assert fleet.get("local-decode-1") is None and local.processes == {}


async def test_a_shared_standby_is_woken_into_the_other_role_live():
    """``standby_shared``'s cross-role wake through the live actuators: the role change (the gateway's
    RoleManager, no restart) then ``activate``: the parked decode engine serves prefill, nothing else moves."""
    from orchestrator.disagg.roles import RoleManager
    from orchestrator.planner.actuators import RoleChangeActuator

    clock = VirtualClock(100.0)
    fleet = FleetRegistry([Worker("local-decode-1", "http://x", role=Role.DECODE, models=["m"],
                                  state=WorkerState.STANDBY, health_ok=True),
                           Worker("local-decode-2", "http://y", role=Role.DECODE, models=["m"], health_ok=True),
                           Worker("local-prefill-1", "http://z", role=Role.PREFILL, models=["m"], health_ok=True)])
    local = LocalProcessActuator({Role.DECODE: "true", Role.PREFILL: "true"}, clock=clock)
    local.processes["local-decode-1"] = LocalProcess("local-decode-1", Role.DECODE, 1, proc=None)  # type: ignore[arg-type]
    roles = RoleManager(fleet, clock)
    act = RoleChangeActuator(lambda wid, role: roles.request(wid, role), drain=fleet.drain,
                             fallback=_DrainingLocal(local, SimpleNamespace(fleet=fleet)))
    done = await act.apply(decision(Action("set_role", Role.PREFILL, "local-decode-1"),
                                    Action("activate", Role.PREFILL, "local-decode-1")))
    w = fleet.get("local-decode-1")
    for _ in range(50):
        if w.role is Role.PREFILL:
            break
        await asyncio.sleep(0.02)
    assert w.role is Role.PREFILL and w.target_role is None, done
    assert w.state is WorkerState.HEALTHY and w in fleet.candidates("m")
    assert fleet.get("local-decode-2").role is Role.DECODE  # the serving decode worker is untouched
    await roles.close()


async def test_an_engine_restarted_between_two_scrapes_gives_its_new_histogram_not_a_difference():
    """An engine restarted mid-interval (its counters start again) that served more requests since than
    before: the reset was noticed only when the count went down, so the window's histogram was the new
    one minus the old one — negative buckets and a wrong mean (here 0.725 s for requests that took
    0.5 s). A bucket or sum that went down is a reset too (as Prometheus's rate() reads any decrease)."""
    state = {"n": 0}
    before = hist([10, 0, 0, 0], 0.5)  # ten requests of 0.05 s
    after = hist([0, 0, 30, 0], 15.0)  # restarted, then thirty of 0.5 s
    loads = {"w": LoadSnapshot(ttft=before, itl=hist([0, 0, 0, 0], 0.0))}
    src = DirectSource(read=lambda: GATEWAY_TEXT.format(n=state["n"], tok=100 * state["n"], gen=state["n"]),
                       engines=lambda: [("w", Role.BOTH, loads["w"])])
    await src.observe(0.0)
    state["n"] = 30
    loads["w"] = LoadSnapshot(ttft=after, itl=hist([0, 0, 0, 0], 0.0))
    obs = await src.observe(30.0)
    assert obs.latency_source == "engines" and abs(obs.ttft_mean - 0.5) < 1e-9, obs.ttft_mean
    assert after.minus(before) == after
    assert hist([0, 0, 30, 0], 15.0).minus(hist([0, 0, 10, 0], 5.0)) == hist([0, 0, 20, 0], 10.0)  # no reset
