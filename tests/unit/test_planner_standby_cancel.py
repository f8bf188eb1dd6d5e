"""``PlannerSettings.standby_cancel``: a worker still starting into the warm standby pool that the pool no longer wants is
stopped at once (forced past the actuators' "still starting" guard), before the ready ones, instead of finishing its
start-up and being stopped as an idle extra once ready. Pure: the planner's decisions on hand-made fleets
(docs/benchmarks.md, Issue 14, plan15)."""

from __future__ import annotations

from adapters.base import Role
from orchestrator.config import PlannerConfig
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView
from orchestrator.planner.install import settings_from_config
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.solver import Limits, Targets
from tests.unit.test_planner_logic import perf

NEED_1, NEED_2 = 0.1, 8.0  # req/s that the test profile sizes at 1 and 2 prefill workers (ISL 1000, TTFT 1 s)


def _fleet(p: int, d: int = 1, ready: int = 0, starting: int = 0, role: Role = Role.PREFILL) -> list[WorkerView]:
    """``p`` prefill and ``d`` decode workers serving; ``ready`` warm standby workers and ``starting`` ones still starting
    into the pool, parked in ``role``."""
    return ([WorkerView(f"p{i}", Role.PREFILL) for i in range(p)] + [WorkerView(f"d{i}", Role.DECODE) for i in range(d)]
            + [WorkerView(f"sb{i}", role, "standby") for i in range(ready)]
            + [WorkerView(f"new{i}", role, "starting", standby=True) for i in range(starting)])


def _obs(t: float, rate: float) -> Observation:
    return Observation(at=t, window_s=60, request_rate=rate, mean_isl=1000, mean_osl=50)


def _planner(cancel: bool, **kw) -> Planner:
    kw.setdefault("standby_shared", False)
    return Planner(perf(), PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=20), predictor="constant",
                                           correct_from_latency=False, standby_prefill=1, standby_confirm=False,
                                           standby_cancel=cancel, **kw))


def _stops(d) -> list[tuple[str | None, bool]]:
    return [(a.worker_id, a.force) for a in d.actions if a.kind == "stop"]


def test_a_start_the_pool_no_longer_wants_is_stopped_at_once():
    for cancel in (False, True):
        pl = _planner(cancel)
        # 2 serving at a need of 1: hysteresis keeps the second, a spare worker, so the pool wants nothing; the worker
        # still starting into it (started when the spare was not there) is not wanted
        d = pl.step(_obs(60, NEED_1), _fleet(2, starting=1), 60)
        assert pl.standby_wanted()["prefill"] == 0
        # without the setting it finishes its start-up (and is stopped once ready, as an idle extra); with it, now,
        # forced past the actuators' "still starting" guard
        assert _stops(d) == ([("new0", True)] if cancel else [])


def test_a_starting_worker_goes_before_a_ready_one():
    for cancel in (False, True):
        pl = _planner(cancel)
        # at its need: the pool wants one worker and holds two, one ready and one still starting
        d = pl.step(_obs(60, NEED_2), _fleet(2, ready=1, starting=1), 60)
        assert pl.standby_wanted()["prefill"] == 1
        # the ready one serves in seconds; from now on both cost the same: the starting one is stopped
        assert _stops(d) == ([("new0", True)] if cancel else [("sb0", False)])


def test_a_start_the_pool_still_wants_is_kept():
    pl = _planner(True)
    d = pl.step(_obs(60, NEED_2), _fleet(2, starting=1), 60)  # at its need: the pool wants the worker it is starting
    assert pl.standby_wanted()["prefill"] == 1 and _stops(d) == []


def test_the_shared_pool_cancels_a_start_too():
    kw = dict(role_change_s=5.0, start_s=60.0, standby_decode=0, standby_shared=True)
    for cancel in (False, True):
        pl = _planner(cancel, **kw)
        assert pl.standby_pooled()
        d = pl.step(_obs(60, NEED_1), _fleet(2, starting=1, role=Role.DECODE), 60)
        assert pl.standby_wanted()["shared"] == 0
        assert _stops(d) == ([("new0", True)] if cancel else [])


def test_the_setting_from_the_config_file():
    assert PlannerSettings().standby_cancel is False and PlannerConfig().standby_cancel is False
    cfg = PlannerConfig(standby_cancel=True)
    assert cfg.standby_cancel is True
    assert settings_from_config(cfg).standby_cancel is True
