"""Where the planner's inputs come from: one ``Observation`` per interval.

Demand, not throughput: the request rate is *arrivals* (``dyad_request_arrivals_total``, counted when a
request arrives, whether it is then served, queued or refused) and the mean ISL is arrived prompt
tokens over arrivals (``dyad_request_arrival_prompt_tokens_total``). Under overload the finished-request
rate is what the fleet manages, not what it is asked for; sizing from it under-provisions while the
queue grows and overshoots once the backlog clears. Finished requests give only what needs a finish:
the mean OSL (generated tokens) and latency (TTFT/ITL).

Two sources, same output:
- ``PrometheusSource`` asks a Prometheus server (HTTP API, instant queries over ``dyad_*`` series
  the gateway exports); use it when Prometheus already scrapes the gateway.
- ``DirectSource`` scrapes the gateway's ``/metrics`` itself and differences two scrapes; the
  embedded default, no Prometheus needed.
``observation_from_scrapes`` (the arithmetic of ``DirectSource``) is pure and unit-tested.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from adapters.base import Histogram


@dataclass
class Observation:
    """What the fleet did over the last ``window_s`` seconds (None = not measured)."""

    at: float
    window_s: float
    request_rate: float | None = 0.0  # arriving requests per second (None = not measured)
    peak_rate: float | None = None  # highest arrival rate over PEAK_WINDOW_S sub-windows: how bursty
    finished_rate: float | None = None  # finished requests per second (throughput; not used for sizing)
    mean_isl: float | None = None
    mean_osl: float | None = None
    ttft_mean: float | None = None
    ttft_p90: float | None = None
    ttft_p99: float | None = None
    itl_mean: float | None = None
    itl_p90: float | None = None
    queue_len: float | None = None  # requests waiting in engines, fleet-wide
    running: float | None = None
    kv_usage: float | None = None  # mean over workers, 0..1
    prefix_hit_ratio: float | None = None  # cached / prompt tokens, 0..1

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


PEAK_WINDOW_S = 5.0  # bursts are measured at this time scale (a few TTFT targets): what queues see


# ---------------------------------------------------------------- Prometheus HTTP API

def prometheus_queries(window: str, model: str | None = None) -> dict[str, str]:
    """The PromQL behind each Observation field (exposed so dashboards and docs can reuse them)."""
    m = f'model="{model}"' if model else ""
    sel = "{" + m + "}"

    def mean(h: str) -> str:
        return f"sum(rate({h}_sum{sel}[{window}])) / sum(rate({h}_count{sel}[{window}]))"

    def q(h: str, p: float) -> str:
        return f"histogram_quantile({p}, sum by (le) (rate({h}_bucket{sel}[{window}])))"

    return {
        "request_rate": f"sum(rate(dyad_request_arrivals_total{sel}[{window}]))",
        "peak_rate": (f"max_over_time(sum(rate(dyad_request_arrivals_total{sel}[{PEAK_WINDOW_S:g}s]))"
                      f"[{window}:1s])"),
        "finished_rate": f"sum(rate(dyad_request_e2e_seconds_count{sel}[{window}]))",
        "mean_isl": (f"sum(rate(dyad_request_arrival_prompt_tokens_total{sel}[{window}])) / "
                     f"sum(rate(dyad_request_arrivals_total{sel}[{window}]))"),
        "mean_osl": mean("dyad_request_generation_tokens"),
        "ttft_mean": mean("dyad_request_ttft_seconds"),
        "ttft_p90": q("dyad_request_ttft_seconds", 0.9),
        "ttft_p99": q("dyad_request_ttft_seconds", 0.99),
        "itl_mean": mean("dyad_request_itl_seconds"),
        "itl_p90": q("dyad_request_itl_seconds", 0.9),
        "queue_len": "sum(dyad_worker_waiting_requests)",
        "running": "sum(dyad_worker_running_requests)",
        "kv_usage": "avg(dyad_worker_kv_usage_ratio)",
        "prefix_hit_ratio": (f"sum(rate(dyad_predicted_cached_tokens_total{sel}[{window}])) / "
                             f"sum(rate(dyad_routed_prompt_tokens_total{sel}[{window}]))"),
    }


class NoPrometheusData(RuntimeError):
    """Prometheus answered but has no recent request series from the gateway: nothing to plan on."""


class PrometheusSource:
    """Instant queries against ``{url}/api/v1/query``; one query per field, missing series → None.

    ``observe`` raises when Prometheus cannot be asked (down, timing out, erroring) and also when it
    has no request rate over the window (``NoPrometheusData``: just restarted, lost its data, or not
    scraping the gateway): an empty answer there means "not measured", and planning on it as zero
    load would scale the fleet in. The planner loop then keeps its last decision until data is back.
    """

    def __init__(self, url: str, window_s: float = 60.0, model: str | None = None,
                 client: httpx.AsyncClient | None = None, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.window_s = window_s
        self.model = model
        self._client = client
        self.timeout_s = timeout_s

    async def _query(self, client: httpx.AsyncClient, expr: str) -> float | None:
        r = await client.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=self.timeout_s)
        r.raise_for_status()
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query failed: {body.get('error')}")
        result = body["data"]["result"]
        if not result:
            return None
        return _num(result[0]["value"][1])

    async def observe(self, now: float) -> Observation:
        client = self._client or httpx.AsyncClient()
        try:
            window = f"{max(1, int(round(self.window_s)))}s"
            queries = prometheus_queries(window, self.model)
            # concurrently: a hung Prometheus costs one timeout per interval, not one per field
            answers = await asyncio.gather(*(self._query(client, e) for e in queries.values()),
                                           return_exceptions=True)
        finally:
            if self._client is None:
                await client.aclose()
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        values = dict(zip(queries, answers, strict=True))
        rate = values.pop("request_rate")
        if rate is None:
            raise NoPrometheusData(f"Prometheus at {self.url} has no dyad_request_arrivals_total samples over "
                                   f"the last {window} (just restarted, or not scraping the gateway); holding")
        return Observation(at=now, window_s=self.window_s, request_rate=rate, **values)


# ---------------------------------------------------------------- direct scrape of the gateway

@dataclass
class Scrape:
    """The gateway series the planner needs, summed over labels, at one instant."""

    at: float
    histograms: dict[str, Histogram]
    counters: dict[str, float]
    gauges: dict[str, list[float]]
    has_arrivals: bool = True  # the arrival counter family was exported (its absence: rate unknown)


_HISTS = ("dyad_request_ttft_seconds", "dyad_request_itl_seconds", "dyad_request_prompt_tokens",
          "dyad_request_generation_tokens", "dyad_request_e2e_seconds")
_COUNTERS = ("dyad_predicted_cached_tokens_total", "dyad_routed_prompt_tokens_total",
             "dyad_request_arrivals_total", "dyad_request_arrival_prompt_tokens_total")
_GAUGES = ("dyad_worker_waiting_requests", "dyad_worker_running_requests", "dyad_worker_kv_usage_ratio")


def parse_gateway_metrics(text: str, at: float) -> Scrape:
    """Prometheus text → summed histograms/counters and per-series gauges (pure)."""
    buckets: dict[str, dict[float, float]] = {h: {} for h in _HISTS}
    sums = dict.fromkeys(_HISTS, 0.0)
    counts = dict.fromkeys(_HISTS, 0.0)
    counters = dict.fromkeys(_COUNTERS, 0.0)
    gauges: dict[str, list[float]] = {g: [] for g in _GAUGES}
    has_arrivals = False
    for fam in text_string_to_metric_families(text):
        if fam.name == "dyad_request_arrivals":
            has_arrivals = True
        for s in fam.samples:
            name = s.name
            if name.endswith("_bucket") and name[:-7] in buckets:
                le = float(s.labels["le"])
                b = buckets[name[:-7]]
                b[le] = b.get(le, 0.0) + s.value
            elif name.endswith("_sum") and name[:-4] in sums:
                sums[name[:-4]] += s.value
            elif name.endswith("_count") and name[:-6] in counts:
                counts[name[:-6]] += s.value
            elif name in counters:
                counters[name] += s.value
            elif name in gauges:
                gauges[name].append(s.value)
    hists = {h: Histogram(sorted(buckets[h].items()), sums[h], counts[h]) for h in _HISTS}
    return Scrape(at=at, histograms=hists, counters=counters, gauges=gauges, has_arrivals=has_arrivals)


def observation_from_scrapes(prev: Scrape, cur: Scrape) -> Observation:
    """What happened between two scrapes (pure). Counter resets count as a fresh start."""
    window = max(1e-9, cur.at - prev.at)
    h = {k: cur.histograms[k].minus(prev.histograms[k]) for k in cur.histograms}
    finished = h["dyad_request_e2e_seconds"].count

    def delta(name: str) -> float:
        d = cur.counters[name] - prev.counters[name]
        return d if d >= 0 else cur.counters[name]

    routed = delta("dyad_routed_prompt_tokens_total")
    arrived = delta("dyad_request_arrivals_total")
    arrived_tokens = delta("dyad_request_arrival_prompt_tokens_total")
    g = cur.gauges
    return Observation(
        at=cur.at, window_s=window, request_rate=arrived / window, finished_rate=finished / window,
        mean_isl=arrived_tokens / arrived if arrived > 0 else None,
        mean_osl=h["dyad_request_generation_tokens"].mean(),
        ttft_mean=h["dyad_request_ttft_seconds"].mean(), ttft_p90=h["dyad_request_ttft_seconds"].quantile(0.9),
        ttft_p99=h["dyad_request_ttft_seconds"].quantile(0.99),
        itl_mean=h["dyad_request_itl_seconds"].mean(), itl_p90=h["dyad_request_itl_seconds"].quantile(0.9),
        queue_len=sum(g["dyad_worker_waiting_requests"]) if g["dyad_worker_waiting_requests"] else None,
        running=sum(g["dyad_worker_running_requests"]) if g["dyad_worker_running_requests"] else None,
        kv_usage=(sum(g["dyad_worker_kv_usage_ratio"]) / len(g["dyad_worker_kv_usage_ratio"])
                  if g["dyad_worker_kv_usage_ratio"] else None),
        prefix_hit_ratio=(delta("dyad_predicted_cached_tokens_total") / routed) if routed > 0 else None,
    )


class DirectSource:
    """Scrapes the gateway's metrics each interval; the first call only primes (``window_s`` 0,
    rate not measured).

    Give ``metrics_url`` (``{gateway}/metrics`` over HTTP) or ``read`` (a callable returning the
    exposition text: what the gateway itself uses, no round trip through its own port).
    """

    def __init__(self, metrics_url: str | None = None, client: httpx.AsyncClient | None = None,
                 timeout_s: float = 5.0, *, read: Callable[[], bytes | str] | None = None) -> None:
        if (metrics_url is None) == (read is None):
            raise ValueError("DirectSource needs exactly one of metrics_url and read")
        self.metrics_url = metrics_url
        self.read = read
        self._client = client
        self.timeout_s = timeout_s
        self._prev: Scrape | None = None

    async def _text(self) -> str:
        if self.read is not None:
            text = self.read()
            return text.decode() if isinstance(text, bytes) else text
        assert self.metrics_url is not None
        client = self._client or httpx.AsyncClient()
        try:
            r = await client.get(self.metrics_url, timeout=self.timeout_s)
            r.raise_for_status()
            return r.text
        finally:
            if self._client is None:
                await client.aclose()

    async def observe(self, now: float) -> Observation:
        cur = parse_gateway_metrics(await self._text(), now)
        prev, self._prev = self._prev, cur
        if prev is None:
            return Observation(at=now, window_s=0.0, request_rate=None)
        if not cur.has_arrivals:
            # a gateway that does not export arrival counters: demand is not measured (never plan on 0)
            return Observation(at=now, window_s=cur.at - prev.at, request_rate=None)
        return observation_from_scrapes(prev, cur)
