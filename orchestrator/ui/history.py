"""The fleet page's last hour: the gateway's own metrics sampled every few seconds into a ring buffer.

No external service: every ``interval_s`` the sampler reads the cumulative counters and histograms of
the gateway's ``DyadMetrics`` (requests by status, refusals, TTFT and ITL histograms, predicted cached
vs routed prompt tokens) plus the fleet's healthy workers, and keeps them for ``span_s`` (an hour).
Each point compares the newest totals with those ``window_s`` earlier: request rate, 5xx ratio,
refusals per second, TTFT and ITL p50/p99 (interpolated inside histogram buckets, as Prometheus'
``histogram_quantile`` does), predicted prefix hit ratio, in flight and healthy workers.

``History`` is pure (totals and times in, points out); ``read_totals`` reads a metrics object and a
fleet; ``run_sampler`` is the loop the gateway runs. Memory is fixed: ``span_s / interval_s`` points.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

INTERVAL_S = 5.0
SPAN_S = 3600.0
WINDOW_S = 30.0  # each point summarises this much (a quantile over 5 s of a quiet fleet is noise)


@dataclass(frozen=True)
class Totals:
    """Cumulative values read at one moment (``mono``: monotonic seconds, ``wall``: epoch seconds)."""

    mono: float
    wall: float
    requests: float = 0.0
    errors: float = 0.0  # answered with status >= 500
    rejected: float = 0.0  # refused before dispatch (rate limit, admission, queue full)
    ttft: tuple[tuple[float, float], ...] = ()  # cumulative (upper bound, count), +inf last
    itl: tuple[tuple[float, float], ...] = ()
    predicted_cached: float = 0.0
    routed_prompt: float = 0.0
    inflight: float = 0.0
    healthy: int = 0
    workers: int = 0


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative ``(upper bound, count)`` buckets (ascending, +inf last), with linear
    interpolation inside the bucket, like Prometheus. None without observations."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # above the highest finite bucket: its bound is the best answer
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _delta_buckets(new: Sequence[tuple[float, float]], old: Sequence[tuple[float, float]]
                   ) -> list[tuple[float, float]]:
    if not old:
        return list(new)
    return [(b, max(0.0, c - oc)) for (b, c), (_, oc) in zip(new, old, strict=False)]


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def point(new: Totals, old: Totals | None) -> dict[str, Any]:
    """One chart point from two totals (``old`` None: the first sample, rates unknown)."""
    p: dict[str, Any] = {"t": new.wall, "inflight": new.inflight, "healthy": new.healthy, "workers": new.workers}
    if old is None or new.mono <= old.mono:
        p.update(req_rate=None, error_ratio=None, rejected_rate=None, ttft_p50=None, ttft_p99=None,
                 itl_p50=None, itl_p99=None, hit_ratio=None)
        return p
    dt = new.mono - old.mono
    n = max(0.0, new.requests - old.requests)
    ttft = _delta_buckets(new.ttft, old.ttft)
    itl = _delta_buckets(new.itl, old.itl)
    p.update(
        req_rate=n / dt,
        error_ratio=_ratio(max(0.0, new.errors - old.errors), n),
        rejected_rate=max(0.0, new.rejected - old.rejected) / dt,
        ttft_p50=histogram_quantile(0.5, ttft), ttft_p99=histogram_quantile(0.99, ttft),
        itl_p50=histogram_quantile(0.5, itl), itl_p99=histogram_quantile(0.99, itl),
        hit_ratio=_ratio(max(0.0, new.predicted_cached - old.predicted_cached),
                         max(0.0, new.routed_prompt - old.routed_prompt)),
    )
    return p


class History:
    """A ring buffer of totals and the points derived from them."""

    def __init__(self, interval_s: float = INTERVAL_S, span_s: float = SPAN_S, window_s: float = WINDOW_S) -> None:
        self.interval_s = interval_s
        self.span_s = span_s
        self.window = max(1, round(window_s / interval_s))  # samples between the two totals of a point
        size = max(2, math.ceil(span_s / interval_s) + 1)
        self._totals: deque[Totals] = deque(maxlen=self.window + 1)
        self._points: deque[dict[str, Any]] = deque(maxlen=size)

    def add(self, totals: Totals) -> dict[str, Any]:
        self._totals.append(totals)
        old = self._totals[0] if len(self._totals) > 1 else None
        p = point(totals, old)
        self._points.append(p)
        return p

    def points(self) -> list[dict[str, Any]]:
        return list(self._points)

    def latest(self) -> dict[str, Any] | None:
        return self._points[-1] if self._points else None

    def view(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "window_s": self.window * self.interval_s, "span_s": self.span_s,
                "points": self.points()}


# ----------------------------------------------------------------------------- reading the live metrics
def _samples(metric: Any, suffix: str = "") -> list[Any]:
    out = []
    for family in metric.collect():
        for s in family.samples:
            if s.name == family.name + suffix or (not suffix and s.name == family.name + "_total"):
                out.append(s)
    return out


def _counter_total(metric: Any, where: Any = None) -> float:
    return sum(s.value for s in _samples(metric) if where is None or where(s.labels))


def _histogram_buckets(metric: Any) -> tuple[tuple[float, float], ...]:
    per_bound: dict[float, float] = {}
    for s in _samples(metric, "_bucket"):
        bound = float(s.labels["le"])
        per_bound[bound] = per_bound.get(bound, 0.0) + s.value
    return tuple(sorted(per_bound.items()))


def _is_5xx(labels: dict[str, str]) -> bool:
    return labels.get("status", "").startswith("5")


def read_totals(metrics: Any, fleet: Any, mono: float, wall: float | None = None) -> Totals:
    workers = list(fleet.workers()) if fleet is not None else []
    healthy = sum(1 for w in workers if getattr(w, "health_ok", False)
                  and getattr(getattr(w, "state", None), "value", None) == "healthy")
    return Totals(
        mono=mono, wall=time.time() if wall is None else wall,
        requests=_counter_total(metrics.requests),
        errors=_counter_total(metrics.requests, _is_5xx),
        rejected=_counter_total(metrics.rejected),
        ttft=_histogram_buckets(metrics.ttft),
        itl=_histogram_buckets(metrics.itl),
        predicted_cached=_counter_total(metrics.predicted_cached_tokens),
        routed_prompt=_counter_total(metrics.routed_prompt_tokens),
        inflight=sum(s.value for s in _samples(metrics.inflight)),
        healthy=healthy, workers=len(workers),
    )


async def run_sampler(runtime: Any, history: History) -> None:
    """Sample ``runtime.metrics`` every ``history.interval_s`` until cancelled."""
    while True:
        try:
            history.add(read_totals(runtime.metrics, runtime.fleet, runtime.clock.now()))
        except Exception:  # noqa: BLE001 - the page's history must never take the gateway down
            pass
        await asyncio.sleep(history.interval_s)


def start_history(runtime: Any, interval_s: float = INTERVAL_S, span_s: float = SPAN_S,
            window_s: float = WINDOW_S) -> History:
    """Give a started gateway runtime its page history (``runtime.ui_history``) and sampling loop."""
    history = History(interval_s, span_s, window_s)
    runtime.ui_history = history
    runtime.add_task(run_sampler(runtime, history), "dyad-ui-history")
    return history
