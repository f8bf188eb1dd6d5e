"""Planner decision logic: predictors, performance model, solver, hysteresis/draining (pure, no network)."""

from __future__ import annotations

import math

import pytest

from adapters.base import Role
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.perf_model import PerfModel, ProfileError
from orchestrator.planner.predictors import (
    AutoPredictor,
    ConstantPredictor,
    EwmaPredictor,
    HoltWintersPredictor,
    LinearTrendPredictor,
    LoadForecast,
    make_predictor,
)
from orchestrator.planner.solver import Limits, Targets, solve

PROFILE = {
    "source": "test",
    "kv_capacity_tokens": 200_000,
    # 10k tokens/s prefill with a fixed 20 ms overhead
    "prefill": [{"isl": n, "ttft_s": 0.02 + n / 10_000} for n in (128, 1024, 4096, 16384)],
    # ITL grows with concurrency and context
    "decode": [{"concurrency": c, "context": ctx, "itl_s": 0.01 + 0.0005 * c * (ctx / 1024)}
               for ctx in (1024, 8192) for c in (1, 8, 32, 128)],
}


def perf() -> PerfModel:
    return PerfModel.from_dict(PROFILE)


# ---------------------------------------------------------------- predictors

def test_constant_and_ewma():
    c, e = ConstantPredictor(), EwmaPredictor(0.5)
    assert c.predict() is None and e.predict() is None
    for v in (10, 20):
        c.observe(v)
        e.observe(v)
    assert c.predict() == 20
    assert e.predict() == 15


def test_linear_trend_extrapolates_a_ramp():
    p = LinearTrendPredictor(window=4)
    for v in (10, 20, 30, 40):
        p.observe(v)
    assert p.predict() == pytest.approx(50)


def test_holt_winters_learns_a_season():
    season = [10, 50, 90, 50]
    hw = HoltWintersPredictor(season=4, alpha=0.3, beta=0.05, gamma=0.5)
    for _ in range(6):
        for v in season:
            hw.observe(v)
    # the next value is position 0 of the season: 10, and the predictor must know it is low
    assert hw.predict() == pytest.approx(10, abs=8)
    hw.observe(10)
    assert hw.predict() == pytest.approx(50, abs=8)


def test_auto_picks_by_backtest_error():
    ramp = AutoPredictor()
    for v in range(0, 200, 10):
        ramp.observe(v)
    assert ramp.chosen.name in ("linear", "holt_winters")
    flat = AutoPredictor()
    for v in [100, 100, 100, 100, 100, 100]:
        flat.observe(v)
    assert flat.chosen.name == "constant"  # ties go to the first
    assert flat.errors()["constant"] == 0


def test_make_predictor_rejects_unknown():
    with pytest.raises(ValueError, match="unknown predictor 'arima'"):
        make_predictor("arima")


# ---------------------------------------------------------------- performance model

def test_profile_interpolates_and_extrapolates():
    m = perf()
    assert m.prefill_time(1024) == pytest.approx(0.02 + 0.1024)
    assert m.prefill_time(2048) == pytest.approx(0.02 + 0.2048)
    assert m.prefill_time(32768) == pytest.approx(0.02 + 3.2768)  # beyond the sweep
    assert m.decode_itl(8, 1024) == pytest.approx(0.014)
    mid = m.decode_itl(8, 4608)  # halfway between contexts 1024 and 8192
    assert m.decode_itl(8, 1024) < mid < m.decode_itl(8, 8192)


def test_max_decode_concurrency_respects_itl_and_kv():
    m = perf()
    # itl(c, 1024) = 0.01 + 0.0005c <= 0.05  → c <= 80
    assert m.max_decode_concurrency(0.05, 1024) == 80
    # at context 8192: 0.01 + 0.004c <= 0.05 → c <= 10 (KV would allow 24)
    assert m.max_decode_concurrency(0.05, 8192) == 10
    assert m.max_decode_concurrency(0.2, 50_000) == 4  # KV-bound: 200k / 50k (ITL would allow 7)
    assert m.max_decode_concurrency(0.005, 1024) == 0  # even one stream misses the target


def test_bad_profile_names_the_field():
    with pytest.raises(ProfileError, match=r"profile.prefill.0"):
        PerfModel.from_dict({"prefill": [{"isl": "x"}], "decode": [{"concurrency": 1, "context": 1, "itl_s": 1}]})
    with pytest.raises(ProfileError, match="profile.decode"):
        PerfModel.from_dict({"prefill": [{"isl": 1, "ttft_s": 1}]})


def test_profile_round_trips():
    m = perf()
    again = PerfModel.from_dict(m.to_dict())
    assert again.prefill_time(3000) == m.prefill_time(3000)
    assert again.decode_itl(20, 3000) == m.decode_itl(20, 3000)


# ---------------------------------------------------------------- solver

def test_solver_scales_with_load_and_credits_prefix_hits():
    m, t, lim = perf(), Targets(ttft_s=1.0, itl_s=0.05), Limits(budget=100)
    low = solve(LoadForecast(2, 4096, 200), m, t, lim)
    high = solve(LoadForecast(8, 4096, 200), m, t, lim)
    assert high.prefill_exact == pytest.approx(4 * low.prefill_exact)
    assert high.decode_exact == pytest.approx(4 * low.decode_exact)
    cached = solve(LoadForecast(8, 4096, 200), m, t, lim, prefix_hit_ratio=0.75)
    assert cached.prefill < high.prefill
    assert cached.decode == high.decode
    # 8 req/s * 4096 tok = 32.8k tok/s of prefill at ~10k tok/s per worker → at least 4 workers
    assert high.prefill >= 4


def test_solver_input_output_mix_moves_the_split():
    m, t, lim = perf(), Targets(1.0, 0.05), Limits(budget=100)
    prefill_heavy = solve(LoadForecast(4, 8000, 20), m, t, lim)
    decode_heavy = solve(LoadForecast(4, 500, 1000), m, t, lim)
    assert prefill_heavy.prefill > prefill_heavy.decode
    assert decode_heavy.decode > decode_heavy.prefill


def test_solver_fits_budget_and_minimums():
    m = perf()
    s = solve(LoadForecast(100, 8000, 500), m, Targets(1.0, 0.05), Limits(budget=6, min_decode=2))
    assert s.over_budget and s.prefill + s.decode == 6 and s.decode >= 2
    with pytest.raises(ValueError, match="budget"):
        Limits(budget=1, min_prefill=1, min_decode=1)


def test_solver_reports_unreachable_targets():
    s = solve(LoadForecast(1, 16384, 10), perf(), Targets(ttft_s=0.5, itl_s=0.05), Limits(budget=10))
    assert "ttft" in s.infeasible and s.prefill >= 1


# ---------------------------------------------------------------- planner core

def _fleet(p: int, d: int, inflight: int = 0) -> list[WorkerView]:
    return ([WorkerView(f"p{i}", Role.PREFILL, inflight=inflight) for i in range(p)]
            + [WorkerView(f"d{i}", Role.DECODE, inflight=inflight) for i in range(d)])


def _obs(t: float, rate: float, isl: float, osl: float) -> Observation:
    return Observation(at=t, window_s=60, request_rate=rate, mean_isl=isl, mean_osl=osl)


def test_planner_scales_out_at_once_and_in_only_after_hysteresis_and_drain():
    pl = Planner(perf(), PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=20),
                                         predictor="constant", correct_from_latency=False))
    fleet = _fleet(1, 1)
    d = pl.step(_obs(60, 8, 4096, 200), fleet, 60)
    starts = [a for a in d.actions if a.kind == "start"]
    assert len(starts) == d.desired["prefill"] + d.desired["decode"] - 2 > 0
    big = _fleet(d.desired["prefill"], d.desired["decode"], inflight=3)
    # load drops: first interval holds (hysteresis), second drains, nothing is stopped while busy
    d1 = pl.step(_obs(120, 1, 4096, 200), big, 120)
    assert not [a for a in d1.actions if a.kind in ("drain", "stop")]
    d2 = pl.step(_obs(180, 1, 4096, 200), big, 180)
    drains = [a for a in d2.actions if a.kind == "drain"]
    assert drains and all(a.then == "stop" for a in drains)
    assert not [a for a in d2.actions if a.kind == "stop"]
    # the drained workers go idle: now they are stopped, and only they
    drained = {a.worker_id for a in drains}
    for w in big:
        if w.id in drained:
            w.state, w.inflight = "draining", 0
    d3 = pl.step(_obs(240, 1, 4096, 200), big, 240)
    assert {a.worker_id for a in d3.actions if a.kind == "stop"} == drained


def test_planner_prefers_role_change_when_faster():
    settings = PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=6), predictor="constant",
                               scale_in_intervals=1, role_change_s=2.0, start_s=60.0, correct_from_latency=False)
    pl = Planner(perf(), settings)
    fleet = _fleet(1, 5)
    d = pl.step(_obs(60, 3, 8000, 20), fleet, 60)  # prefill-heavy: needs more prefill, decode idle
    kinds = [a.kind for a in d.actions]
    assert "set_role" in kinds and "start" not in kinds
    moved = [a for a in d.actions if a.kind == "set_role"]
    assert all(a.role is Role.PREFILL for a in moved)
    assert d.desired["prefill"] + d.desired["decode"] <= 6


def test_planner_corrects_from_observed_latency():
    pl = Planner(perf(), PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=50), predictor="constant"))
    fleet = _fleet(4, 4)
    base = pl.step(_obs(60, 2, 2048, 100), fleet, 60)
    obs = _obs(120, 2, 2048, 100)
    m = perf()
    obs.ttft_mean = 3 * m.expected_ttft(2, 2048, 4, tail=1.0)  # the fleet is 3x slower than profiled
    later = pl.step(obs, fleet, 120)
    assert pl.correction.ttft > 1.5
    assert later.sizing.prefill_exact > base.sizing.prefill_exact
    assert math.isfinite(later.correction["ttft"])


def test_burst_floor_holds_while_warming_up_then_keeps_the_peak_prefill_only():
    settings = PlannerSettings(targets=Targets(1.0, 0.05), limits=Limits(budget=40), predictor="constant",
                               scale_in_intervals=1, scale_in_margin=0.0, burst_window_s=300,
                               correct_from_latency=False)
    pl = Planner(perf(), settings)
    # warming up: light load, but no whole window seen yet → no scale-in of the 6+6 we started with
    d = pl.step(_obs(60, 0.5, 4096, 200), _fleet(6, 6), 60)
    assert d.desired == {"prefill": 6, "decode": 6} and not d.actions
    assert any("warming up" in r for r in d.reasons)
    # a burst at t=400 (past the warm-up), then quiet: prefill keeps the burst's sizing, decode shrinks
    burst = pl.step(_obs(400, 8, 4096, 200), _fleet(6, 6), 400)
    fleet = _fleet(burst.desired["prefill"], burst.desired["decode"])
    quiet = pl.step(_obs(460, 0.5, 4096, 200), fleet, 460)
    assert quiet.desired["prefill"] == burst.desired["prefill"] >= 4
    assert quiet.desired["decode"] < burst.desired["decode"]
    # the burst leaves the window: prefill may shrink now
    later = pl.step(_obs(760, 0.5, 4096, 200), fleet, 760)
    assert later.desired["prefill"] < burst.desired["prefill"]
