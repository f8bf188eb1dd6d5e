"""The load mode's look-ahead (``PlannerSettings.fast_lookahead``, ``project_ahead``): warm standby is woken for
where the load will be when a worker woken at the next look would serve, from the growth over that same span;
cold starts stay on the load now (pure decision logic, virtual ``now``)."""

from __future__ import annotations

import math
from collections import deque

import pytest

from adapters.base import Role
from orchestrator.planner.core import Planner, PlannerSettings, WorkerView, project_ahead
from orchestrator.planner.metrics_source import Observation
from orchestrator.planner.perf_model import PerfModel
from orchestrator.planner.solver import Limits, Targets

PROFILE = {
    "source": "test",
    "kv_capacity_tokens": 200_000,
    "prefill": [{"isl": n, "ttft_s": 0.02 + n / 10_000} for n in (128, 1024, 4096, 16384)],
    # ITL grows with the batch, as on a CPU engine: a doubling of the streams breaks the ITL target
    "decode": [{"concurrency": c, "context": ctx, "itl_s": 0.01 + 0.002 * c * (ctx / 1024)}
               for ctx in (1024, 8192) for c in (1, 8, 32, 128)],
}

P, D = Role.PREFILL, Role.DECODE


def test_project_ahead_extrapolates_the_growth_over_the_span_it_was_measured_on():
    looks: deque = deque()
    assert project_ahead(looks, 0.0, {P: 0.0, D: 10.0}, 7.0) == {P: 0.0, D: 10.0}  # first look: nothing to go on
    assert project_ahead(looks, 2.0, {P: 0.0, D: 14.0}, 7.0)[D] == pytest.approx(14 + 4 * 7 / 2)
    assert project_ahead(looks, 4.0, {P: 0.0, D: 16.0}, 7.0)[D] == pytest.approx(16 + 6 * 7 / 4)  # from t=0
    # a falling load is not extrapolated down; a flat one stays where it is
    assert project_ahead(looks, 6.0, {P: 3.0, D: 8.0}, 7.0) == {P: 3.0 + 3 * 7 / 6, D: 8.0}
    # looks older than the lead are forgotten: at t=10 the growth is measured from t=4 (16 -> 20)
    assert project_ahead(looks, 10.0, {P: 3.0, D: 20.0}, 7.0)[D] == pytest.approx(20 + 4 * 7 / 6)
    assert [t for t, _ in looks] == [4.0, 6.0, 10.0]


def _fleet(p: int, d: int, streams: float, standby_decode: int = 0) -> list[WorkerView]:
    fleet = [WorkerView(f"p{i}", P) for i in range(p)]
    fleet += [WorkerView(f"d{i}", D, inflight=int(streams // d) + (1 if i < streams % d else 0)) for i in range(d)]
    fleet += [WorkerView(f"sd{i}", D, "standby") for i in range(standby_decode)]
    return fleet


def _planner(lookahead: bool) -> Planner:
    pl = Planner(PerfModel.from_dict(PROFILE),
                 PlannerSettings(targets=Targets(1.0, 0.08), limits=Limits(budget=20), predictor="constant",
                                 correct_from_latency=False, fast_interval_s=2, standby_wake_s=5, start_s=35,
                                 fast_confirm_cold=3, fast_lookahead=lookahead))
    pl.step(Observation(at=60, window_s=60, request_rate=2, mean_isl=400, mean_osl=100), _fleet(1, 2, 0), 60)
    return pl


def test_rising_decode_streams_wake_the_standby_before_they_cross_what_the_pool_holds():
    assert PlannerSettings().fast_lookahead  # the default
    pl = _planner(True)
    assert pl._forecast is not None
    per = pl._decode_per_worker(pl._forecast)
    hold = math.floor(2 * per / (1 + pl.settings.decode_headroom))  # streams 2 workers hold with headroom
    # streams climb by a fifth of what 2 workers hold every look: still within it at the third look
    step = hold / 5
    seen = []
    for k, t in enumerate((62, 64, 66)):
        streams = step * (k + 1)
        assert math.ceil(streams * (1 + pl.settings.decode_headroom) / per - 1e-9) <= 2  # the load now fits
        seen.append(pl.react(_fleet(1, 2, streams, standby_decode=1), t))
    woken = [d for d in seen if d is not None]
    assert woken and [(a.kind, a.worker_id) for a in woken[0].actions] == [("activate", "sd0")]
    assert any("rising to" in r for r in woken[0].reasons)
    # without the look-ahead the same looks wake nothing: the load now is within what 2 workers hold
    plain = _planner(False)
    for k, t in enumerate((62, 64, 66)):
        assert plain.react(_fleet(1, 2, step * (k + 1), standby_decode=1), t) is None


def test_a_projected_rise_alone_starts_no_cold_worker():
    pl = _planner(True)
    assert pl._forecast is not None
    per = pl._decode_per_worker(pl._forecast)
    hold = math.floor(2 * per / (1 + pl.settings.decode_headroom))
    # no standby to wake: the projection says 3 workers, the load now fits in 2, for many looks
    streams = [hold * f for f in (0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95)]
    for t, s in zip(range(62, 62 + 2 * len(streams), 2), streams, strict=True):
        d = pl.react(_fleet(1, 2, s), t)
        assert d is None or not [a for a in d.actions if a.kind == "start"]


def test_the_prefill_queue_is_not_extrapolated():
    # a prefill queue rising on 2 workers, each look within what they clear: no prefill standby is woken
    pl = Planner(PerfModel.from_dict(PROFILE),
                 PlannerSettings(targets=Targets(1.0, 0.08), limits=Limits(budget=20), predictor="constant",
                                 correct_from_latency=False, fast_interval_s=2, standby_wake_s=5, start_s=35))
    pl.step(Observation(at=60, window_s=60, request_rate=2, mean_isl=4096, mean_osl=100), _fleet(2, 1, 0), 60)
    for t, q in ((62, 0), (64, 1), (66, 2)):  # per worker: 1 request (of ~0.43 s) within half the 1-s TTFT
        fleet = _fleet(2, 1, 0) + [WorkerView("sp0", P, "standby")]
        for w in fleet[:2]:
            w.inflight = 1 if q >= 1 and w.id == "p0" else (1 if q >= 2 else 0)
        assert pl.react(fleet, t) is None


def test_the_setting_comes_from_the_config_file():
    from orchestrator.config import PlannerConfig
    from orchestrator.planner.install import settings_from_config
    assert settings_from_config(PlannerConfig()).fast_lookahead is True
    assert settings_from_config(PlannerConfig(fast_lookahead=False)).fast_lookahead is False
