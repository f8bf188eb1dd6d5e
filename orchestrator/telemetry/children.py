"""A metric's labelled child for the request path: looked up once per label values, updated with plain
float operations.

``prometheus_client`` spends four Python calls and a lock per counter increment (``inc`` →
``_raise_if_not_observable`` → ``_is_observable`` → ``MutexValue.inc``) and twice that per histogram
observation; the gateway makes ~20 such updates per request (docs/benchmarks.md, issue 13, "fewer frames
per request"). ``child`` returns a small object whose ``inc``/``dec``/``set``/``observe`` is one call
that adds to a plain float, and that float is the very value the labelled ``prometheus_client`` child
exports: the value objects of that child are replaced by ``Cell``s, which keep ``MutexValue``'s
interface (``inc``/``set``/``get``/exemplars). So the series, names, types, labels and the scrape are
those of the ``prometheus_client`` metric, and code that still goes through ``metric.labels(...)`` updates
the same numbers.

Thread model: no lock. Request metrics are updated on the gateway's event-loop thread only (a scrape
from another thread reads a float: always a value that was current at some moment). A metric updated
concurrently from several threads must not be used through ``child``.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.values import MutexValue


class Cell:
    """A float without a lock, in place of ``prometheus_client.values.MutexValue``."""

    __slots__ = ("v", "_exemplar")

    def __init__(self, value: float = 0.0) -> None:
        self.v = value
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self.v += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.v = value

    def get(self) -> float:
        return self.v

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get_exemplar(self) -> Any:
        return self._exemplar


def _cell_of(value: Any) -> Cell:
    if isinstance(value, Cell):
        return value
    cell = Cell(value.get())
    cell.set_exemplar(value.get_exemplar())
    return cell


class CounterChild:
    __slots__ = ("_cell", "metric")

    def __init__(self, metric: Any) -> None:
        self.metric = metric  # the prometheus_client child (labelled)
        self._cell = metric._value = _cell_of(metric._value)

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._cell.v += amount


class GaugeChild:
    __slots__ = ("_cell", "metric")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._cell = metric._value = _cell_of(metric._value)

    def inc(self, amount: float = 1) -> None:
        self._cell.v += amount

    def dec(self, amount: float = 1) -> None:
        self._cell.v -= amount

    def set(self, value: float) -> None:
        self._cell.v = float(value)


class HistogramChild:
    __slots__ = ("_sum", "_buckets", "_bounds", "metric")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._sum = metric._sum = _cell_of(metric._sum)
        self._buckets = metric._buckets = [_cell_of(b) for b in metric._buckets]
        self._bounds = tuple(metric._upper_bounds)  # ascending, the last is +Inf

    def observe(self, amount: float) -> None:
        """As ``Histogram.observe``: the sum, and the first bucket whose bound is >= amount."""
        self._sum.v += amount
        i = bisect_left(self._bounds, amount)
        if i < len(self._buckets):  # (NaN: bisect says 0, prometheus_client counts it in no bucket)
            if amount != amount:
                return
            self._buckets[i].v += 1


def _fast(found: Any) -> Any:
    value = getattr(found, "_sum", None) if isinstance(found, Histogram) else getattr(found, "_value", None)
    if not isinstance(value, (MutexValue, Cell)):  # (prometheus_client's multiprocess mode: left as it is)
        return found
    if isinstance(found, Counter):
        return CounterChild(found)
    if isinstance(found, Gauge) and found._multiprocess_mode == "all":
        return GaugeChild(found)
    if isinstance(found, Histogram):
        return HistogramChild(found)
    return found  # (another type: the prometheus_client child itself)


def child(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)`` for the request path, remembered on the metric (``labels`` takes a lock and
    rebuilds the label tuple on every call) and updated lock-free (module docstring). For metrics whose
    label values are bounded (model names, endpoints, statuses, policies, index backends) and never
    removed."""
    try:
        cache = metric._dyad_children
    except AttributeError:
        cache = metric._dyad_children = {}
    found = cache.get(values)
    if found is None:
        found = cache[values] = _fast(metric.labels(*values))
    return found


class RequestChildren:
    """The request metrics of one (model, endpoint label) as ``child``ren: one look-up per request
    instead of one per update."""

    __slots__ = ("inflight", "arrivals", "arrival_prompt_tokens", "ttft", "itl", "e2e", "prompt_tokens",
                 "generation_tokens", "_requests", "_counter", "_model", "_label")

    def __init__(self, metrics: Any, model: str, label: str) -> None:
        self.inflight = child(metrics.inflight, model)
        self.arrivals = child(metrics.arrivals, model)
        self.arrival_prompt_tokens = child(metrics.arrival_prompt_tokens, model)
        self.ttft = child(metrics.ttft, model)
        self.itl = child(metrics.itl, model)
        self.e2e = child(metrics.e2e, model, label)
        self.prompt_tokens = child(metrics.prompt_tokens, model)
        self.generation_tokens = child(metrics.generation_tokens, model)
        self._counter = metrics.requests
        self._model = model
        self._label = label
        self._requests: dict[str, Any] = {}

    def requests(self, status: str) -> Any:
        """``dyad_requests_total{model, endpoint, status}``."""
        found = self._requests.get(status)
        if found is None:
            found = self._requests[status] = child(self._counter, self._model, self._label, status)
        return found


def request_children(metrics: Any, model: str, label: str) -> RequestChildren:
    """The ``RequestChildren`` of (model, label), remembered on ``metrics`` (a ``DyadMetrics``)."""
    try:
        cache = metrics._dyad_request_children
    except AttributeError:
        cache = metrics._dyad_request_children = {}
    found = cache.get((model, label))
    if found is None:
        found = cache[(model, label)] = RequestChildren(metrics, model, label)
    return found
