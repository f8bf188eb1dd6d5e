"""``telemetry.children.child``: lock-free request-path children export exactly what prometheus_client would."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from orchestrator.telemetry.children import Cell, child


def _scrape(fast: bool) -> list[str]:
    r = CollectorRegistry()
    c = Counter("x_total", "x", ["m"], registry=r)
    h = Histogram("h", "h", ["m"], buckets=(0.1, 1, 5), registry=r)
    g = Gauge("g", "g", ["m"], registry=r)
    rnd = random.Random(7)
    for i in range(2000):
        v = rnd.choice([0.0, 0.05, 0.1, 0.1000001, 0.5, 1.0, 3, 5, 7, 1e9, rnd.random() * 10])
        label = "a" if i % 3 else "b"
        if fast:
            child(h, label).observe(v)
            child(c, label).inc(2)
            child(g, label).inc()
            child(g, label).dec(0.5)
        else:
            h.labels(label).observe(v)
            c.labels(label).inc(2)
            g.labels(label).inc()
            g.labels(label).dec(0.5)
    if fast:
        child(g, "c").set(3)
        h.labels("a").observe(0.2)  # the prometheus_client path still writes the same series
        c.labels("a").inc()
    else:
        g.labels("c").set(3)
        h.labels("a").observe(0.2)
        c.labels("a").inc()
    return [line for line in generate_latest(r).decode().splitlines() if "_created" not in line]


def test_fast_children_scrape_exactly_as_prometheus_client():
    assert _scrape(fast=True) == _scrape(fast=False)


def test_counter_refuses_a_negative_increment():
    c = Counter("y_total", "y", ["m"], registry=CollectorRegistry())
    with pytest.raises(ValueError):
        child(c, "m").inc(-1)
    assert c.labels("m")._value.get() == 0


def test_histogram_nan_goes_to_the_sum_only_like_prometheus_client():
    for fast in (True, False):
        h = Histogram("z", "z", ["m"], buckets=(1,), registry=CollectorRegistry())
        (child(h, "m") if fast else h.labels("m")).observe(float("nan"))
        assert [b.get() for b in h.labels("m")._buckets] == [0, 0]
        assert math.isnan(h.labels("m")._sum.get())


def test_values_already_counted_are_kept():
    c = Counter("w_total", "w", ["m"], registry=CollectorRegistry())
    c.labels("m").inc(5)
    child(c, "m").inc()
    assert isinstance(c.labels("m")._value, Cell) and c.labels("m")._value.get() == 6
