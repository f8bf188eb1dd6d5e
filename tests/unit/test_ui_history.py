"""The fleet page's history: quantiles from histogram buckets, rates and ratios between samples, a
fixed-size ring buffer, read from a real DyadMetrics registry (no server)."""

from __future__ import annotations

import math

import pytest

from orchestrator.telemetry.metrics import DyadMetrics
from orchestrator.ui.history import History, Totals, histogram_quantile, read_totals


class Fleet:
    def __init__(self, workers=()):
        self._w = list(workers)

    def workers(self):
        return self._w


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 10.0), (0.5, 60.0), (1.0, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (50 - 10) / 50)
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 39 / 40)
    assert histogram_quantile(0.99, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (math.inf, 5.0)]) == 0.1  # beyond the last finite bound


def test_points_from_a_live_metrics_registry():
    m = DyadMetrics()
    h = History(interval_s=5, span_s=60, window_s=10)  # a point spans 2 samples
    fleet = Fleet()
    h.add(read_totals(m, fleet, mono=0.0, wall=1000.0))
    first = h.latest()
    assert first["req_rate"] is None and first["t"] == 1000.0
    for i in range(90):
        m.requests.labels("tiny", "chat", "200").inc()
        m.ttft.labels("tiny").observe(0.2 if i < 45 else 0.6)
        m.itl.labels("tiny").observe(0.02)
    for _ in range(10):
        m.requests.labels("tiny", "chat", "503").inc()
    m.rejected.labels("rate_limited").inc(5)
    m.predicted_cached_tokens.labels("tiny").inc(300)
    m.routed_prompt_tokens.labels("tiny").inc(1000)
    m.inflight.labels("tiny").set(7)
    h.add(read_totals(m, fleet, mono=5.0, wall=1005.0))
    p = h.latest()
    assert p["req_rate"] == pytest.approx(100 / 5)
    assert p["error_ratio"] == pytest.approx(0.1)
    assert p["rejected_rate"] == pytest.approx(1.0)
    assert p["hit_ratio"] == pytest.approx(0.3)
    assert p["inflight"] == 7
    assert 0.15 < p["ttft_p50"] <= 0.3 and 0.5 < p["ttft_p99"] <= 0.75
    assert 0.015 < p["itl_p99"] <= 0.02
    # quiet from now on: once the window has passed, rates drop to 0 and quantiles to unknown
    h.add(read_totals(m, fleet, mono=10.0, wall=1010.0))
    assert h.latest()["req_rate"] == pytest.approx(100 / 10)  # window: totals 2 samples back
    h.add(read_totals(m, fleet, mono=15.0, wall=1015.0))
    q = h.latest()
    assert q["req_rate"] == 0 and q["ttft_p99"] is None and q["error_ratio"] is None and q["hit_ratio"] is None


def test_ring_buffer_keeps_one_span_of_points():
    h = History(interval_s=5, span_s=60, window_s=5)
    for i in range(100):
        h.add(Totals(mono=i * 5.0, wall=i * 5.0, requests=i * 10.0))
    pts = h.points()
    assert len(pts) == 13  # 60 s / 5 s + 1
    assert pts[-1]["t"] == 495.0 and pts[0]["t"] == 435.0
    assert all(p["req_rate"] == pytest.approx(2.0) for p in pts)
    assert h.view()["window_s"] == 5


def test_counter_reset_never_gives_negative_rates():
    h = History(interval_s=1, span_s=10, window_s=1)
    h.add(Totals(mono=0.0, wall=0.0, requests=100.0, errors=10.0))
    h.add(Totals(mono=1.0, wall=1.0, requests=5.0, errors=0.0))  # a restarted process
    p = h.latest()
    assert p["req_rate"] == 0 and p["error_ratio"] is None
