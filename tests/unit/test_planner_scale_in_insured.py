"""``PlannerSettings.scale_in_insured``: a confirmed decline keeps giving back — after a step down, while every interval
stays below capacity, one more worker goes back the next interval (not after the confirmation and the cooldown again)
when the pool without it still holds what proportional insurance measured (``_insured``) and the hysteresis keep. Pure:
the planner's decisions on hand-made fleets (docs/benchmarks.md, Issue 14, plan15)."""

from __future__ import annotations

from adapters.base import Role
from orchestrator.config import PlannerConfig
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView
from orchestrator.planner.install import settings_from_config
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.solver import Limits, Targets
from tests.unit.test_planner_logic import perf

NEED_1 = 0.1  # req/s that the test profile sizes at 1 prefill worker (ISL 1000, TTFT 1 s)


def _fleet(p: int, d: int = 1) -> list[WorkerView]:
    return [WorkerView(f"p{i}", Role.PREFILL) for i in range(p)] + [WorkerView(f"d{i}", Role.DECODE) for i in range(d)]


def _obs(t: float, rate: float = NEED_1) -> Observation:
    return Observation(at=t, window_s=60, request_rate=rate, mean_isl=1000, mean_osl=50)


def _planner(on: bool, insured: float | None = 1.0, **kw) -> Planner:
    """One-minute intervals, a two-minute cooldown after a change (as ``dyad plan``'s two intervals), no warm standby.
    ``insured``: the prefill capacity proportional insurance stands for (its own measurement is tested in
    test_planner_insurance.py); None: the rise is not measured yet."""
    pl = Planner(perf(), PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=20), predictor="constant",
                                         correct_from_latency=False, interval_s=60.0, cooldown_s=120.0,
                                         scale_in_intervals=2, scale_in_insured=on, **kw))

    def insure(exact, now, reasons):  # noqa: ANN001 - the planner's own signature
        pl._insured = None if insured is None else {Role.PREFILL: insured, Role.DECODE: 1.0}

    pl._insure = insure  # type: ignore[method-assign]
    return pl


def _prefill_path(pl: Planner, start: int, steps: int, rate: float = NEED_1) -> list[int]:
    """Prefill counts the planner asks for over ``steps`` intervals from ``start`` serving workers, the fleet following."""
    p, out = start, []
    for k in range(1, steps + 1):
        d = pl.step(_obs(60.0 * k, rate), _fleet(p), 60.0 * k)
        p = d.desired["prefill"]
        out.append(p)
    return out


def test_a_confirmed_decline_gives_one_back_per_interval_where_the_insurance_allows():
    # 6 prefill workers at a need of 1: confirmed over two intervals, then one back per interval with the setting, one
    # per confirmation + cooldown (two intervals) without it
    assert _prefill_path(_planner(True), 6, 7) == [6, 5, 4, 3, 2, 1, 1]
    assert _prefill_path(_planner(False), 6, 7) == [6, 5, 5, 4, 4, 3, 3]


def test_not_below_what_the_measured_insurance_holds():
    # insurance measured at 3.5 workers: the pool gives back quickly down to 4, then only as the confirmation allows
    # (and the insurance is not a floor for the ordinary scale-in: that is the burst floor's job)
    assert _prefill_path(_planner(True, insured=3.5), 6, 7) == [6, 5, 4, 4, 3, 3, 2]


def test_not_before_the_rise_is_measured():
    assert _prefill_path(_planner(True, insured=None), 6, 7) == _prefill_path(_planner(False), 6, 7)


def test_an_interval_at_capacity_ends_the_decline():
    pl = _planner(True)
    assert _prefill_path(pl, 6, 2) == [6, 5]  # confirmed, one back
    assert pl._declining[Role.PREFILL]
    # the load comes back to what 5 workers or more need: the decline is over (and the next one is confirmed afresh)
    d = pl.step(_obs(180.0, 30.0), _fleet(5), 180.0)
    assert d.desired["prefill"] >= 5 and not pl._declining[Role.PREFILL]
    d = pl.step(_obs(240.0), _fleet(5), 240.0)
    assert d.desired["prefill"] == 5  # below again, not yet confirmed


def test_not_within_the_cooldown_after_a_growth():
    pl = _planner(True)
    _prefill_path(pl, 6, 2)
    pl._last_grow[Role.PREFILL] = 120.0  # as if the load mode had grown prefill at the last interval
    d = pl.step(_obs(180.0), _fleet(5), 180.0)
    assert d.desired["prefill"] == 5


def test_the_setting_from_the_config_file():
    assert PlannerSettings().scale_in_insured is True and PlannerConfig().scale_in_insured is True  # the default
    assert settings_from_config(PlannerConfig(scale_in_insured=False)).scale_in_insured is False
