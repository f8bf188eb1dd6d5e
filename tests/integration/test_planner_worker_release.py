"""A worker the planner scales in is released, never stranded: a role move leaves it serving in its new
role (not draining), and a worker the actuator cannot stop (a configured engine under the local
actuator, any worker under role changes alone) is never drained to be stopped — a drained worker
whose stop then does nothing would stay out of service for good.

Real ``FleetRegistry`` and ``RoleManager``; no engines (the actuators' process handling is covered in
test_planner_actuators.py)."""

from __future__ import annotations

import asyncio
import subprocess
from types import SimpleNamespace

import pytest

from adapters.base import EngineKind, Role
from orchestrator.clock import VirtualClock
from orchestrator.config import load_config
from orchestrator.disagg.roles import RoleManager
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.planner.actuators import LocalProcess
from orchestrator.planner.core import Action, PlanDecision, Planner, PlannerSettings
from orchestrator.planner.install import actuator_from_config, stoppable_by
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.service import views_from_workers
from orchestrator.planner.solver import Limits, Targets
from orchestrator.telemetry.metrics import DyadMetrics
from tests.unit.test_planner_logic import PROFILE

LOCAL = {"prefill": "x {port}", "decode": "x {port}"}


def _cfg(**planner):
    return load_config({"planner": {"enabled": True, **planner}}, environ={}).planner


def _runtime(workers: list[Worker]) -> SimpleNamespace:
    fleet = FleetRegistry(workers)
    return SimpleNamespace(fleet=fleet, roles=RoleManager(fleet, VirtualClock()), metrics=DyadMetrics())


def _worker(wid: str, role: Role, inflight: int = 0) -> Worker:
    return Worker(id=wid, url="http://127.0.0.1:9", engine=EngineKind.SIM, role=role, models=["m"],
                  inflight=inflight)


def _decision(actions: list[Action]) -> PlanDecision:
    return PlanDecision(0.0, None, None, None, {}, {}, actions, {}, {}, [])


_PROCS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_stand_ins():
    yield
    for p in _PROCS:
        p.kill()
        p.wait()
    _PROCS.clear()


def _own(actuator, worker_id: str, role: Role) -> None:
    """Record ``worker_id`` as an engine the local actuator started: a live stand-in process (an
    exited one would be reaped by the actuator as a crashed engine)."""
    local = actuator.local if hasattr(actuator, "local") else actuator.fallback
    local = getattr(local, "local", local)  # the fallback is the draining wrapper around the local actuator
    proc = subprocess.Popen(["sleep", "60"])
    _PROCS.append(proc)
    local.processes[worker_id] = LocalProcess(worker_id, role, 9, proc)


async def test_role_move_through_the_local_actuator_leaves_the_worker_serving():
    # local actuator with role changes faster than a start: drains-for-a-move go to the RoleManager
    runtime = _runtime([_worker("p0", Role.PREFILL, inflight=1), _worker("d0", Role.DECODE)])
    act = actuator_from_config(_cfg(actuator="local", local_commands=LOCAL, role_change_s=1, start_s=30), runtime)
    done = await act.apply(_decision([Action("drain", Role.PREFILL, "p0", then="decode")]))
    assert done == ["p0 → decode"]
    p0 = runtime.fleet.get("p0")
    assert p0.state is WorkerState.HEALTHY and p0.target_role is Role.DECODE  # takes no new work meanwhile
    p0.inflight = 0  # its last prefill finished
    for _ in range(100):
        if p0.target_role is None:
            break
        await asyncio.sleep(0.01)
    assert p0.role is Role.DECODE and p0.target_role is None
    assert p0.state is WorkerState.HEALTHY and p0.accepting  # serving in its new role, not left draining
    # the planner's follow-up set_role for the same move is not a second change
    assert await act.apply(_decision([Action("set_role", Role.DECODE, "p0")])) == []
    await runtime.roles.close()


def test_stoppable_by_each_actuator():
    runtime = _runtime([_worker("cfg-0", Role.DECODE)])
    configured = runtime.fleet.get("cfg-0")
    local = actuator_from_config(_cfg(actuator="local", local_commands=LOCAL), runtime)
    mixed = actuator_from_config(_cfg(actuator="local", local_commands=LOCAL, role_change_s=1, start_s=30), runtime)
    for act in (local, mixed):
        can_stop = stoppable_by(act)
        assert not can_stop(configured)
        _own(act, "local-decode-1", Role.DECODE)
        assert can_stop(_worker("local-decode-1", Role.DECODE))
    assert not stoppable_by(actuator_from_config(_cfg(actuator="role_change"), runtime))(configured)
    assert stoppable_by(actuator_from_config(_cfg(), runtime)) is None  # recommend: shows every stop


async def test_planner_never_strands_a_configured_worker_under_the_local_actuator():
    # Two configured decoders (busy, so a scale-in would drain rather than stop) and one the actuator
    # started. Load falls: the planner gives back decoders — only ones it can stop.
    workers = [_worker("p0", Role.PREFILL), _worker("d-cfg-0", Role.DECODE, inflight=2),
               _worker("d-cfg-1", Role.DECODE, inflight=2), _worker("local-decode-1", Role.DECODE, inflight=3)]
    runtime = _runtime(workers)
    act = actuator_from_config(_cfg(actuator="local", local_commands=LOCAL), runtime)
    _own(act, "local-decode-1", Role.DECODE)
    can_stop = stoppable_by(act)
    planner = Planner(PerfModel.from_dict(PROFILE), PlannerSettings(
        targets=Targets(1.0, 0.05), limits=Limits(budget=8), predictor="constant", scale_in_intervals=1,
        scale_in_step=2, correct_from_latency=False))
    drained: list[str] = []
    for i in range(1, 5):
        obs = Observation(at=60.0 * i, window_s=60, request_rate=0.05, mean_isl=500, mean_osl=50)
        d = planner.step(obs, views_from_workers(runtime.fleet.workers(), can_stop), 60.0 * i)
        assert d.desired["decode"] == 1  # wants two decoders fewer
        drained += [a.worker_id for a in d.actions if a.kind in ("drain", "stop")]
        await act.apply(d)
    assert drained == ["local-decode-1"]  # the one it started; it will stop once idle
    assert runtime.fleet.get("local-decode-1").state is WorkerState.DRAINING
    for wid in ("d-cfg-0", "d-cfg-1"):
        assert runtime.fleet.get(wid).state is WorkerState.HEALTHY, wid  # still serving
    # Without the actuator's answer the same planner would drain a configured worker too.
    blind = Planner(PerfModel.from_dict(PROFILE), planner.settings)
    fresh = _runtime([_worker("p0", Role.PREFILL), _worker("d-cfg-0", Role.DECODE, inflight=2),
                      _worker("d-cfg-1", Role.DECODE, inflight=2), _worker("local-decode-1", Role.DECODE, inflight=3)])
    d = blind.step(Observation(at=60.0, window_s=60, request_rate=0.05, mean_isl=500, mean_osl=50),
                   views_from_workers(fresh.fleet.workers()), 60.0)
    assert {a.worker_id for a in d.actions if a.kind == "drain"} == {"d-cfg-0", "d-cfg-1"}
