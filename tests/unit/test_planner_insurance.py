"""Proportional insurance (``PlannerSettings.insurance = "proportional"``): the burst floor and the warm
standby pool sized from the rise the load itself showed within a re-start horizon. Pure: the planner's
decisions on hand-made fleets and observations, with a virtual ``now``.
"""

from __future__ import annotations

import pytest

from adapters.base import Role
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView, horizon_rise
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.solver import Limits, Targets
from tests.unit.test_planner_logic import perf

INTERVAL = 30.0


def _planner(insurance: str) -> Planner:
    # start 60 s + interval 30 s: a re-start horizon of 90 s = 3 intervals
    return Planner(perf(), PlannerSettings(
        targets=Targets(1.0, 0.05), limits=Limits(budget=40), interval_s=INTERVAL, predictor="constant",
        correct_from_latency=False, start_s=60.0, burst_window_s=600.0, standby_prefill=1, standby_decode=1,
        insurance=insurance))


def _fleet(p: int, d: int, standby_p: int = 0, standby_d: int = 0) -> list[WorkerView]:
    return ([WorkerView(f"p{i}", Role.PREFILL) for i in range(p)] + [WorkerView(f"d{i}", Role.DECODE) for i in range(d)]
            + [WorkerView(f"sp{i}", Role.PREFILL, "standby") for i in range(standby_p)]
            + [WorkerView(f"sd{i}", Role.DECODE, "standby") for i in range(standby_d)])


def _obs(k: int, rate: float, peak: float) -> Observation:
    return Observation(at=k * INTERVAL, window_s=INTERVAL, request_rate=rate, mean_isl=1000, mean_osl=50,
                       peak_rate=peak)


def dp_status(pl: Planner) -> tuple[dict[str, int], bool]:
    """What ``/admin/planner`` shows of the standby pool and the insurance."""
    return pl.standby_wanted(), pl.insurance_status()["rise_known"]


def _stops(decision) -> set[str]:
    return {a.worker_id for a in decision.actions if a.kind == "stop"}


# ---------------------------------------------------------------- the measured rise

def test_horizon_rise_is_the_rise_beyond_what_the_horizon_before_held():
    assert horizon_rise([5.0] * 12, 3, 20, 0.9) == 1.0  # flat: nothing to insure
    assert horizon_rise([5.0] * 5, 3, 20, 0.9) == 1.0  # no complete window yet (needs 2 x 3 intervals)
    # a sustained climb 1 -> 2 -> 4 -> 8: within 3 intervals the load rose 8x above the 3 before
    climb = [1.0, 1.0, 1.0, 2.0, 4.0, 8.0]
    assert horizon_rise(climb, 3, 20, 1.0) == pytest.approx(8.0)
    # per-interval steps would say 2x: the horizon's rise is what a worker started too late misses
    assert horizon_rise(climb, 1, 20, 1.0) == pytest.approx(2.0)
    # a fall is not a rise
    assert horizon_rise([8.0, 8.0, 8.0, 4.0, 2.0, 1.0, 1.0], 3, 20, 1.0) == 1.0
    # memory: an old rise is forgotten
    old_step = [1.0, 1.0, 1.0, 3.0, 3.0, 3.0] + [3.0] * 30
    assert horizon_rise(old_step, 3, 40, 1.0) == pytest.approx(3.0)
    assert horizon_rise(old_step, 3, 20, 1.0) == 1.0


def test_the_rise_is_known_only_after_enough_windows_for_its_quantile():
    pl = _planner("proportional")
    # 2 x 3 intervals for the first complete window, then 1 / (1 - 0.9) = 10 windows in all
    for k in range(1, 16):
        assert not pl.rise_known()
        pl.step(_obs(k, 1.0, 1.2), _fleet(1, 1, 1, 1), k * INTERVAL)
    assert pl.rise_known()


# ---------------------------------------------------------------- what it releases, and what it keeps

def test_a_calm_load_releases_the_warm_standby_that_the_serving_pools_slack_covers():
    fixed, prop = _planner("fixed"), _planner("proportional")
    for k in range(1, 21):
        df = fixed.step(_obs(k, 1.0, 1.2), _fleet(1, 1, 1, 1), k * INTERVAL)
        dp = prop.step(_obs(k, 1.0, 1.2), _fleet(1, 1, 1, 1), k * INTERVAL)
    # 1.2 req/s needs a fraction of one prefill worker, and the load never rose: one worker is the insurance
    assert df.desired == dp.desired == {"prefill": 1, "decode": 1}
    assert not _stops(df)  # fixed: the 1 + 1 warm standby stays
    assert _stops(dp) == {"sp0", "sd0"}  # proportional: both idle standby workers are stopped
    assert dp_status(prop) == ({"prefill": 0, "decode": 0}, True)
    assert dp_status(fixed) == ({"prefill": 1, "decode": 1}, False)
    assert any(r.startswith("insurance:") for r in dp.reasons)


def test_a_load_that_rose_within_a_horizon_keeps_its_warm_standby():
    prop = _planner("proportional")
    # a load that steps 1 -> 6 req/s and back every 6 intervals: a 5x rise within one horizon, seen repeatedly
    for k in range(1, 25):
        high = (k // 3) % 2 == 1
        rate = 6.0 if high else 1.0
        d = prop.step(_obs(k, rate, rate * 1.2), _fleet(1, 1, 1, 1), k * INTERVAL)
    assert prop.rise_known()
    assert prop.horizon_rises()[Role.PREFILL] > 4.0
    assert "sp0" not in _stops(d)  # the prefill standby is insurance the measured rise asks for


def test_on_a_decline_the_burst_floor_keeps_only_the_horizons_peak():
    fixed, prop = _planner("fixed"), _planner("proportional")
    rates = [12.0] * 6 + [12.0 - 0.5 * i for i in range(1, 21)]  # flat, then a slow decline to 2 req/s
    fleet = _fleet(6, 2)
    for k, rate in enumerate(rates, start=1):
        df = fixed.step(_obs(k, rate, rate), fleet, k * INTERVAL)
        dp = prop.step(_obs(k, rate, rate), fleet, k * INTERVAL)
    # fixed: the 600 s floor holds the sizing of 20 intervals ago; proportional: the last 90 s times a rise of 1
    assert prop.horizon_rises()[Role.PREFILL] == 1.0
    assert dp.floored["prefill"] < df.floored["prefill"]


def test_insurance_setting_comes_from_the_config_file():
    from orchestrator.config import PlannerConfig
    from orchestrator.planner.install import settings_from_config as planner_settings

    assert planner_settings(PlannerConfig(insurance="proportional")).insurance == "proportional"
    assert planner_settings(PlannerConfig()).insurance == PlannerSettings().insurance
