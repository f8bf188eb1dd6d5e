"""The local actuator's lifecycle as the planner sees it (no processes: the actuator's book of started
engines is filled by hand): engines it is still starting count as starting, not absent (or the planner
starts them twice); a stop first takes the worker out of rotation and waits for what the router sent
it after the planner saw it idle."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from adapters.base import Role
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.fleet.worker import Worker, WorkerState
from orchestrator.planner.actuators import LocalProcess, LocalProcessActuator
from orchestrator.planner.core import Action, PlanDecision
from orchestrator.planner.install import _DrainingLocal, starting_by
from orchestrator.planner.service import views_from_workers


def _local_with(*ids: str) -> LocalProcessActuator:
    local = LocalProcessActuator({Role.PREFILL: "true"})
    for wid in ids:
        local.processes[wid] = LocalProcess(wid, Role.PREFILL, 1, proc=None)  # type: ignore[arg-type]
    return local


def test_engines_being_started_count_as_starting_until_first_healthy():
    local = _local_with("local-prefill-1")
    actuator = _DrainingLocal(local, SimpleNamespace(fleet=FleetRegistry()))
    starting = starting_by(actuator)
    assert starting is not None
    new = Worker("local-prefill-1", "http://x", role=Role.PREFILL, state=WorkerState.UNHEALTHY)
    configured = Worker("p0", "http://y", role=Role.PREFILL, state=WorkerState.UNHEALTHY)
    views = {v.id: v.state for v in views_from_workers([new, configured], starting=starting)}
    assert views == {"local-prefill-1": "starting", "p0": "unhealthy"}
    new.health_ok, new.state = True, WorkerState.HEALTHY
    assert views_from_workers([new], starting=starting)[0].state == "healthy"
    new.health_ok, new.state = False, WorkerState.UNHEALTHY  # up once, then fell over: not starting
    assert views_from_workers([new], starting=starting)[0].state == "unhealthy"


async def test_a_stop_drains_first_and_waits_for_what_was_routed_since():
    fleet = FleetRegistry([Worker("local-prefill-1", "http://x", role=Role.PREFILL, health_ok=True)])
    w = fleet.get("local-prefill-1")
    w.inflight = 1  # the router chose it after the planner saw it idle
    local = _local_with("local-prefill-1")
    order: list[str] = []

    async def stop(worker_id: str) -> bool:
        order.append(f"stop with state {fleet.get(worker_id).state.value} inflight {fleet.get(worker_id).inflight}")
        local.processes.pop(worker_id)
        return True

    local.stop = stop  # type: ignore[method-assign]
    actuator = _DrainingLocal(local, SimpleNamespace(fleet=fleet))
    decision = PlanDecision(at=0.0, observation=None, forecast=None, sizing=None, desired={}, current={},
                            actions=[Action("stop", Role.PREFILL, "local-prefill-1")], correction={},
                            predictors={}, reasons=[])

    done = await actuator.apply(decision)  # returns at once: the planner loop does not wait
    assert fleet.get("local-prefill-1").state is WorkerState.DRAINING  # out of rotation
    assert done == ["stopping local-prefill-1 once its 1 request(s) finish"] and order == []
    await asyncio.sleep(0.2)
    assert order == []  # still serving what it was sent
    w.inflight = 0
    for _ in range(50):
        if order:
            break
        await asyncio.sleep(0.02)
    assert order == ["stop with state draining inflight 0"]


async def test_an_idle_worker_is_drained_then_stopped_at_once():
    fleet = FleetRegistry([Worker("local-prefill-1", "http://x", role=Role.PREFILL, health_ok=True)])
    local = _local_with("local-prefill-1")
    seen: list[str] = []

    async def stop(worker_id: str) -> bool:
        seen.append(fleet.get(worker_id).state.value)
        local.processes.pop(worker_id)
        return True

    local.stop = stop  # type: ignore[method-assign]
    decision = PlanDecision(at=0.0, observation=None, forecast=None, sizing=None, desired={}, current={},
                            actions=[Action("stop", Role.PREFILL, "local-prefill-1")], correction={},
                            predictors={}, reasons=[])
    done = await _DrainingLocal(local, SimpleNamespace(fleet=fleet)).apply(decision)
    assert done == ["stopped local-prefill-1"] and seen == ["draining"]
