"""``PlannerSettings.standby_confirm``: a cold start into the warm standby pool only for the want that held over the
last ``scale_in_intervals`` intervals; parking a worker the serving pool gives back, and stopping idle extras, follow
the want now. Pure: the planner's decisions on hand-made fleets (docs/benchmarks.md, Issue 14, plan13)."""

from __future__ import annotations

from adapters.base import Role
from orchestrator.config import PlannerConfig
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.solver import Limits, Targets
from tests.unit.test_planner_logic import perf

NEED_1, NEED_2 = 0.1, 8.0  # req/s that the test profile sizes at 1 and 2 prefill workers (ISL 1000, TTFT 1 s)


def _fleet(p: int, d: int = 1, standby_p: int = 0) -> list[WorkerView]:
    return ([WorkerView(f"p{i}", Role.PREFILL) for i in range(p)] + [WorkerView(f"d{i}", Role.DECODE) for i in range(d)]
            + [WorkerView(f"sb{i}", Role.PREFILL, "standby") for i in range(standby_p)])


def _obs(t: float, rate: float) -> Observation:
    return Observation(at=t, window_s=60, request_rate=rate, mean_isl=1000, mean_osl=50)


def _planner(confirm: bool, calm: bool = True, **kw) -> Planner:
    """``calm``: as on a load whose rise is measured and that rose no further than it (``_rose_beyond_noise`` False);
    its own test below feeds the history instead."""
    pl = Planner(perf(), PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=20), predictor="constant",
                                         correct_from_latency=False, standby_prefill=1, standby_confirm=confirm, **kw))
    if calm:
        pl._rose_beyond_noise = lambda: False  # type: ignore[method-assign]
    return pl


def _standby_starts(d) -> int:
    return sum(1 for a in d.actions if a.kind == "start" and a.then == "standby")


def test_a_want_of_one_interval_starts_no_standby_worker_a_want_that_holds_does():
    for confirm in (False, True):
        pl = _planner(confirm)
        # 2 serving at a need of 1: hysteresis keeps the second, a spare worker, so the pool wants nothing
        d = pl.step(_obs(60, NEED_1), _fleet(2), 60)
        assert d.desired["prefill"] == 2 and _standby_starts(d) == 0
        # the need rises to 2: the spare is gone and the pool wants one worker
        d = pl.step(_obs(120, NEED_2), _fleet(2), 120)
        assert d.desired["prefill"] == 2
        assert _standby_starts(d) == (0 if confirm else 1)
        if confirm:  # the want held a second interval: now it is started
            d = pl.step(_obs(180, NEED_2), _fleet(2), 180)
            assert _standby_starts(d) == 1


def test_idle_extras_are_stopped_on_the_want_now():
    pl = _planner(True)
    pl.step(_obs(60, NEED_2), _fleet(2, standby_p=1), 60)  # at its need: the pool's one worker is wanted
    d = pl.step(_obs(120, NEED_1), _fleet(2, standby_p=1), 120)  # a spare again: the idle standby is not wanted
    assert ("stop", "sb0") in [(a.kind, a.worker_id) for a in d.actions]


def test_parking_a_worker_given_back_is_not_held_back():
    pl = _planner(True, scale_in_intervals=1)
    pl.step(_obs(60, NEED_1), _fleet(3), 60)  # 3 serving at a need of 1: one back, the other is the spare
    # the spare is the last one beyond the need: giving it back parks it, although the pool wanted nothing before
    d = pl.step(_obs(120, NEED_1), _fleet(2), 120)
    assert ("park", Role.PREFILL) in [(a.kind, a.role) for a in d.actions]


def test_the_first_interval_starts_the_pool_it_wants():
    d = _planner(True).step(_obs(60, NEED_1), _fleet(1), 60)
    assert _standby_starts(d) == 1  # nothing before it to confirm against: the start-up insurance is unchanged


def test_shared_pool_waits_for_the_want_to_hold_too():
    kw = dict(role_change_s=5.0, start_s=60.0, standby_decode=0)
    for confirm in (False, True):
        pl = _planner(confirm, **kw)
        assert pl.standby_pooled()
        pl.step(_obs(60, NEED_1), _fleet(2), 60)
        d = pl.step(_obs(120, NEED_2), _fleet(2), 120)
        assert _standby_starts(d) == (0 if confirm else 1)


def test_a_rise_beyond_the_measured_one_or_before_it_is_measured_counts_as_growth():
    pl = _planner(True, calm=False)
    fleet = _fleet(2)
    assert pl._insured is None and pl._rose_beyond_noise()  # nothing measured yet: a wobble cannot be told from a step
    t = 0.0
    for k in range(30):  # a noisy flat load, 0.10-0.12 req/s: the rise measured is about x1.2
        t += 60
        pl.step(_obs(t, 0.12 if k % 2 else 0.10), fleet, t)
    assert pl._insured is not None
    t += 60
    pl.step(_obs(t, 0.11), fleet, t)
    assert not pl._rose_beyond_noise()  # within the load's own variability
    t += 60
    pl.step(_obs(t, 0.5), fleet, t)
    assert pl._rose_beyond_noise()  # x4: a step, its want is started at once


def test_the_setting_from_the_config_file():
    assert PlannerSettings().standby_confirm is True and PlannerConfig().standby_confirm is True  # the default
    assert PlannerConfig(standby_confirm=False).standby_confirm is False


def test_a_want_that_comes_with_growth_is_started_at_once():
    pl = _planner(True)
    pl.step(_obs(60, NEED_1), _fleet(1, standby_p=1), 60)  # at its need, the pool's one worker wanted
    # the load rises and the interval grows prefill 1 -> 2 (the standby is woken): the pool, short again, is refilled
    d = pl.step(_obs(120, NEED_2), _fleet(1, standby_p=1), 120)
    assert ("activate", "sb0") in [(a.kind, a.worker_id) for a in d.actions]
    assert _standby_starts(d) == 1


def test_a_want_after_the_load_mode_drew_on_the_pool_is_started_at_once():
    pl = _planner(True, fast_interval_s=2.0)
    pl.step(_obs(60, NEED_1), _fleet(2), 60)  # a spare: the pool wants nothing
    fleet = _fleet(2, standby_p=1)
    fleet[0].inflight = 40  # a prefill queue beyond what two workers clear within the target: the load mode wakes sb0
    woke = pl.react(fleet, 62)
    assert woke is not None and ("activate", "sb0") in [(a.kind, a.worker_id) for a in woke.actions]
    # at the next interval 3 serve at a need of 3 (no growth, no spare): the pool was drawn on, so it is refilled at once
    d = pl.step(_obs(120, 16.0), _fleet(3), 120)
    assert d.desired["prefill"] == 3 and d.sized["prefill"] == 3
    assert _standby_starts(d) == 1
    # the same interval without the load mode's wake before it waits for the want to hold
    quiet = _planner(True, fast_interval_s=2.0)
    quiet.step(_obs(60, NEED_1), _fleet(3), 60)
    assert _standby_starts(quiet.step(_obs(120, 16.0), _fleet(3), 120)) == 0
