"""``PlannerSettings.burst_drain``: the interval's 5-s peak sized as a burst the prefill queue absorbs within the TTFT
target (``burst_drain_need``), not as a sustained rate; never below the forecast's sizing. Pure: the formula and the
planner's sizing on hand-made observations (docs/benchmarks.md, Issue 14, plan13)."""

from __future__ import annotations

import math

import pytest

from adapters.base import Role
from orchestrator.config import PlannerConfig
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView, burst_drain_need
from orchestrator.planner.metrics_source import PEAK_WINDOW_S, Observation
from orchestrator.planner.solver import Limits, Targets
from tests.unit.test_planner_logic import perf


def test_the_need_lets_the_last_request_of_the_burst_wait_exactly_the_slack():
    peak, service, ttft, window = 12.0, 0.4, 2.0, 5.0
    c = burst_drain_need(peak, service, ttft, window)
    backlog = (peak * service - c) * window  # worker-seconds of work left when the burst ends
    assert backlog / c + service == pytest.approx(ttft)
    # a longer slack or a shorter burst needs fewer workers; none without slack
    assert burst_drain_need(peak, service, 4.0, window) < c
    assert burst_drain_need(peak, service, ttft, 2.5) < c
    assert burst_drain_need(peak, 2.0, 2.0, window) == math.inf


def _obs(t: float, rate: float, peak: float) -> Observation:
    return Observation(at=t, window_s=30, request_rate=rate, mean_isl=1000, mean_osl=50, peak_rate=peak)


def _sized(drain: bool, rate: float, peak: float) -> tuple[int, float]:
    pl = Planner(perf(), PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=40), predictor="constant",
                                         correct_from_latency=False, burst_window_s=600, burst_drain=drain))
    d = pl.step(_obs(30, rate, peak), [WorkerView("p0", Role.PREFILL), WorkerView("d0", Role.DECODE)], 30)
    return d.sized["prefill"], d.sizing.prefill_exact


def test_a_burst_is_sized_for_draining_within_the_target_not_as_a_sustained_rate():
    sustained, exact_sustained = _sized(False, 4.0, 30.0)
    drained, exact_drained = _sized(True, 4.0, 30.0)
    service = perf().prefill_time(1000)
    assert exact_drained == pytest.approx(burst_drain_need(30.0, service, 1.0, PEAK_WINDOW_S))
    assert exact_drained < exact_sustained and drained < sustained


def test_never_below_the_sizing_for_the_forecast_rate():
    # a peak barely above a high mean rate: the fluid bound is below what the mean itself needs
    _, exact_mean_only = _sized(False, 20.0, 20.0)  # no burst: the mean's sizing
    _, exact_drained = _sized(True, 20.0, 21.0)
    assert exact_drained == pytest.approx(exact_mean_only) or exact_drained >= exact_mean_only


def test_off_by_default_and_from_the_config_file():
    assert PlannerSettings().burst_drain is False
    assert PlannerConfig().burst_drain is PlannerSettings().burst_drain
    assert PlannerConfig(burst_drain=True).burst_drain is True
