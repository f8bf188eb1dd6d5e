"""Audit lines for the planner: when it changes the fleet (any actuator but recommend-only) each
step with actions leaves one line naming the planner, the actions and how they ended."""

from __future__ import annotations

import io
import json
import logging

import pytest

from adapters.base import Role
from orchestrator.clock import VirtualClock
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.service import PlannerService
from orchestrator.planner.solver import Limits
from orchestrator.telemetry.logging import configure_logging
from tests.unit.test_planner_logic import PROFILE


class NoLoad:
    async def observe(self, now):
        return Observation(at=now, window_s=1.0)


class Actuator:
    """Stands in for an actuator that starts engines (the local and Kubernetes ones are tested with
    real processes and a fake API server elsewhere); here only what the service logs matters."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail

    async def apply(self, decision):
        if self.fail:
            raise RuntimeError("API server said no")
        return [f"started {a.role.value}" for a in decision.actions]


@pytest.fixture
def lines():
    buf = io.StringIO()
    root = logging.getLogger()
    old_level, old_handlers = root.level, list(root.handlers)
    handler = configure_logging(json=True, level="ERROR", stream=buf)  # audit lines survive a quiet level
    yield lambda: [json.loads(x) for x in buf.getvalue().splitlines() if json.loads(x).get("audit")]
    root.removeHandler(handler)
    root.setLevel(old_level)
    assert root.handlers == old_handlers


def service(actuator) -> PlannerService:
    # one decode worker under a floor of two: the planner's first step starts one
    settings = PlannerSettings(limits=Limits(budget=4, min_prefill=1, min_decode=2), predictor="constant")
    fleet = [WorkerView("p0", Role.PREFILL), WorkerView("d0", Role.DECODE)]
    return PlannerService(Planner(PerfModel.from_dict(PROFILE), settings), NoLoad(), actuator,
                          fleet=lambda: fleet, clock=VirtualClock())


async def test_planner_actions_are_audited(lines):
    decision = await service(Actuator("local")).run_once()
    assert [a.kind for a in decision.actions] == ["start"]
    (line,) = lines()
    assert (line["action"], line["actor"], line["result"], line["actuator"]) == ("planner.apply", "planner", "ok", "local")
    assert line["actions"] == ["start decode"] and line["applied"] == ["started decode"]


async def test_failed_planner_actions_are_audited_and_still_raise(lines):
    with pytest.raises(RuntimeError):
        await service(Actuator("kubernetes", fail=True)).run_once()
    (line,) = lines()
    assert line["result"] == "error" and "API server said no" in line["error"] and line["actions"] == ["start decode"]


async def test_recommend_only_is_not_an_action(lines):
    await service(Actuator("recommend")).run_once()
    assert lines() == []
