"""Where the planner's inputs come from: one ``Observation`` per interval.

Demand, not throughput: the request rate is *arrivals* (``dyad_request_arrivals_total``, counted when a
request arrives, whether it is then served, queued or refused) and the mean ISL is arrived prompt
tokens over arrivals (``dyad_request_arrival_prompt_tokens_total``). Under overload the finished-request
rate is what the fleet manages, not what it is asked for; sizing from it under-provisions while the
queue grows and overshoots once the backlog clears. Finished requests give only what needs a finish:
the mean OSL (generated tokens) and latency (TTFT/ITL).

Latency has two sources. The gateway measures TTFT/ITL on the streams it relays (what clients see,
``dyad_request_ttft_seconds``); a non-streamed request has no first token the gateway can time.
When a window has no stream latency, the engines' own histograms (``vllm:`` / ``sglang:``
``time_to_first_token_seconds`` and ``inter_token_latency_seconds``, measured by the engine for every
request, streamed or not) stand in: from the gateway's scrape of each engine's ``/metrics``
(``Worker.load``) or from Prometheus when it scrapes the engines. ``Observation.latency_source``
says which one was used ("gateway", "engines" or None); ``latency_from_engines`` is the pure part.

Two sources, same output:
- ``PrometheusSource`` asks a Prometheus server (HTTP API, instant queries over ``dyad_*`` series
  the gateway exports); use it when Prometheus already scrapes the gateway.
- ``DirectSource`` scrapes the gateway's ``/metrics`` itself and differences two scrapes; the
  embedded default, no Prometheus needed.
``observation_from_scrapes`` (the arithmetic of ``DirectSource``) is pure and unit-tested.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from adapters.base import Histogram, LoadSnapshot, Role
from orchestrator.deadline import within


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
    latency_source: str | None = None  # where TTFT/ITL came from: "gateway" (streams), "engines" or None

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


PEAK_WINDOW_S = 5.0  # bursts are measured at this time scale (a few TTFT targets): what queues see


# ---------------------------------------------------------------- latency from the engines

@dataclass(frozen=True)
class EngineLatency:
    """One engine's latency histograms over one window (observations in the window only)."""

    role: Role
    ttft: Histogram | None
    itl: Histogram | None


def merge_histograms(hs: list[Histogram | None]) -> Histogram | None:
    """Sum histograms of the same series from several engines (buckets kept only when they agree)."""
    got = [h for h in hs if h is not None and h.count > 0]
    if not got:
        return None
    bounds = [b for b, _ in got[0].buckets]
    same = all([b for b, _ in h.buckets] == bounds for h in got)
    buckets = [(b, sum(h.buckets[i][1] for h in got)) for i, b in enumerate(bounds)] if same else []
    return Histogram(buckets, sum(h.sum for h in got), sum(h.count for h in got))


LATENCY_FIELDS = ("ttft_mean", "ttft_p90", "ttft_p99", "itl_mean", "itl_p90")


def latency_from_engines(parts: list[EngineLatency], prefill_step: Histogram | None = None) -> dict[str, float | None]:
    """The Observation's TTFT/ITL fields from the engines' own histograms (pure).

    Aggregated workers (role both) see a request from arrival to its first token: their TTFT is
    the request's, less the gateway's own time. In a P/D fleet a split request's first token comes
    after two steps: the prefill (queue + prefill) and the decode engine's first token (KV transfer
    + first step), so the two means (and p90s) are added — an upper estimate when some requests
    prefill locally on the decode worker. The prefill step is the gateway's own measurement
    (``prefill_step``: ``dyad_pd_prefill_seconds``, timed for every split request, streamed or not,
    including the HTTP round trip the engine cannot see) when it has one, else the prefill engines'
    TTFT. ITL comes from the workers that decode."""
    pre = merge_histograms([p.ttft for p in parts if p.role is Role.PREFILL])
    if prefill_step is not None and prefill_step.count > 0:
        pre = prefill_step
    first = merge_histograms([p.ttft for p in parts if p.role is not Role.PREFILL])
    itl = merge_histograms([p.itl for p in parts if p.role is not Role.PREFILL])

    def add(f: Callable[[Histogram], float | None]) -> float | None:
        vals = [f(h) for h in (pre, first) if h is not None]
        vals = [v for v in vals if v is not None]
        return sum(vals) if vals else None

    return {
        "ttft_mean": add(Histogram.mean), "ttft_p90": add(lambda h: h.quantile(0.9)),
        "ttft_p99": add(lambda h: h.quantile(0.99)),
        "itl_mean": itl.mean() if itl is not None else None,
        "itl_p90": itl.quantile(0.9) if itl is not None else None,
    }


def with_engine_latency(obs: Observation, engine: dict[str, float | None]) -> Observation:
    """``obs`` with the gateway's stream latency when it has any, else the engines' (pure)."""
    if obs.ttft_mean is not None or obs.itl_mean is not None:
        return replace(obs, latency_source="gateway")
    if engine.get("ttft_mean") is None and engine.get("itl_mean") is None:
        return replace(obs, latency_source=None)
    return replace(obs, latency_source="engines", **{k: engine.get(k) for k in LATENCY_FIELDS})


# Engine series (both dialects), read when the gateway has no stream latency for a window
ENGINE_TTFT = "(vllm|sglang):time_to_first_token_seconds"
ENGINE_ITL = "(vllm|sglang):inter_token_latency_seconds"


def _first(rows: list[dict[str, Any]]) -> float:
    """The value of a one-row vector result (0 when empty)."""
    return (_num(rows[0]["value"][1]) or 0.0) if rows else 0.0


def engine_latency_queries(window: str) -> dict[str, str]:
    """PromQL for the engines' histograms per scrape target (``instance``), over ``window``."""
    out = {}
    for key, name in (("ttft", ENGINE_TTFT), ("itl", ENGINE_ITL)):
        out[f"{key}_bucket"] = f'sum by (instance, le) (increase({{__name__=~"{name}_bucket"}}[{window}]))'
        out[f"{key}_sum"] = f'sum by (instance) (increase({{__name__=~"{name}_sum"}}[{window}]))'
        out[f"{key}_count"] = f'sum by (instance) (increase({{__name__=~"{name}_count"}}[{window}]))'
    return out


def instance_of(url: str) -> str:
    """A worker URL as Prometheus labels its scrape target (``host:port``)."""
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0]


def bucket_bound(row: dict[str, Any]) -> float:
    """A histogram bucket row's upper bound (its ``le`` label); ``ValueError`` naming it when it has none
    or one that is not a number (it was a bare KeyError/ValueError out of the observation)."""
    le = (row.get("metric") or {}).get("le")
    try:
        return float(le)
    except (TypeError, ValueError):
        raise ValueError(f"a histogram bucket row whose 'le' label is {str(le)[:40]!r}, not a bound") from None


def engine_parts_from_prometheus(results: dict[str, list[dict[str, Any]]],
                                 roles: dict[str, Role]) -> list[EngineLatency]:
    """Prometheus vector results (``engine_latency_queries``) → one ``EngineLatency`` per instance
    (pure). ``roles`` maps an instance to its worker's role; an instance the gateway does not know
    is not one of its workers and is left out."""
    hist: dict[tuple[str, str], dict[str, Any]] = {}
    for key, rows in results.items():
        series, _, part = key.partition("_")
        for row in rows:
            inst = (row.get("metric") or {}).get("instance", "")
            if inst not in roles:
                continue
            v = _num(row["value"][1]) or 0.0
            h = hist.setdefault((inst, series), {"buckets": {}, "sum": 0.0, "count": 0.0})
            if part == "bucket":
                h["buckets"][bucket_bound(row)] = v
            else:
                h[part] = v
    out: dict[str, dict[str, Histogram | None]] = {}
    for (inst, series), h in hist.items():
        out.setdefault(inst, {})[series] = Histogram(sorted(h["buckets"].items()), h["sum"], h["count"])
    return [EngineLatency(roles[i], d.get("ttft"), d.get("itl")) for i, d in out.items()]


# ---------------------------------------------------------------- Prometheus HTTP API

def model_selector(model: str | None) -> str:
    """``{model="..."}`` (``{}`` without a model); the name is a PromQL string (pasted as it was, a name
    with a double quote or a backslash broke every query, and the planner held)."""
    return "{" + ("model=" + json.dumps(model, ensure_ascii=False) if model else "") + "}"


def prometheus_queries(window: str, model: str | None = None) -> dict[str, str]:
    """The PromQL behind each Observation field (exposed so dashboards and docs can reuse them)."""
    sel = model_selector(model)

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


class PrometheusAnswerError(RuntimeError):
    """Prometheus (or something answering in its place: a proxy's error page) sent an answer of the
    wrong shape; the planner holds, and this names what came back."""

    def __init__(self, url: str, what: str) -> None:
        super().__init__(f"Prometheus at {url} answered {what}")


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
                 client: httpx.AsyncClient | None = None, timeout_s: float = 5.0,
                 engines: Callable[[], Iterable[tuple[Role, str]]] | None = None) -> None:
        self.url = url.rstrip("/")
        self.engines = engines  # (role, url) of the gateway's workers: engine latency when streams give none
        self.window_s = window_s
        self.model = model
        self._client = client
        self.timeout_s = timeout_s

    async def _vector(self, client: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
        r = await client.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=self.timeout_s)
        try:
            body = r.json()
        except ValueError:
            if r.is_error:  # not Prometheus's own refusal (a proxy's error page): the status says what there is
                raise PrometheusAnswerError(self.url, f"HTTP {r.status_code} to {expr!r} ({r.text[:60]!r})") from None
            raise PrometheusAnswerError(self.url, f"with something that is not JSON ({r.headers.get('content-type')}: "
                                                  f"{r.text[:60]!r})") from None
        if not isinstance(body, dict):
            raise PrometheusAnswerError(self.url, f"with JSON that is not a query result ({type(body).__name__})")
        if r.is_error or body.get("status") != "success":
            # Prometheus's own words (its query timeout: 503 errorType timeout; too many samples: 422): they
            # were lost behind httpx's "Server error '503 ...' for url '<the query, URL-encoded>'"
            why = f"{str(body.get('errorType') or '?')[:40]}: {str(body.get('error') or '')[:200]}"
            said = f"HTTP {r.status_code}" if r.is_error else "an error"
            raise PrometheusAnswerError(self.url, f"{said} ({why}) to {expr!r}")
        data = body.get("data")
        rows = data.get("result") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("resultType") not in (None, "vector") or not isinstance(rows, list) \
                or not all(isinstance(row, dict) and isinstance(row.get("metric", {}), dict)
                           and isinstance(row.get("value"), list) and len(row["value"]) == 2 for row in rows):
            kind = data.get("resultType") if isinstance(data, dict) else type(data).__name__
            raise PrometheusAnswerError(self.url, f"with a result that is not an instant vector ({kind})")
        return rows

    async def _query(self, client: httpx.AsyncClient, expr: str) -> float | None:
        """The one value ``expr`` has (None: no series). Each query aggregates to one series, so several
        are an answer to something else (a proxy merging Prometheus servers, a double): refused, not the
        first taken. NaN is returned as such (the caller tells 0/0 from a missing series); ±Inf too (no
        fleet produces one: the input gate holds on it, naming the field)."""
        result = await self._vector(client, expr)
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusAnswerError(self.url, f"{len(result)} series to {expr!r}, which aggregates to one")
        raw = result[0]["value"][1]
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise PrometheusAnswerError(self.url, f"a value that is not a number ({str(raw)[:40]!r}) to {expr!r}") \
                from None

    async def _engine_latency(self, client: httpx.AsyncClient, window: str) -> dict[str, float | None]:
        """The engines' TTFT/ITL over the window, per scrape target mapped to the worker's role."""
        roles = {instance_of(url): role for role, url in (self.engines() if self.engines else ())}
        if not roles:
            return {}
        queries = engine_latency_queries(window)
        step = {"bucket": f"sum by (le) (increase(dyad_pd_prefill_seconds_bucket[{window}]))",
                "sum": f"sum(increase(dyad_pd_prefill_seconds_sum[{window}]))",
                "count": f"sum(increase(dyad_pd_prefill_seconds_count[{window}]))"}
        answers = await asyncio.gather(*(self._vector(client, e) for e in [*queries.values(), *step.values()]))
        results = dict(zip([*queries, *(f"step_{k}" for k in step)], answers, strict=True))
        try:
            buckets = sorted((bucket_bound(r), _num(r["value"][1]) or 0.0) for r in results["step_bucket"])
            parts = engine_parts_from_prometheus({k: v for k, v in results.items() if not k.startswith("step_")},
                                                 roles)
        except ValueError as e:
            raise PrometheusAnswerError(self.url, str(e)) from None
        prefill_step = Histogram(buckets, _first(results["step_sum"]), _first(results["step_count"]))
        return latency_from_engines(parts, prefill_step)

    async def observe(self, now: float) -> Observation:
        """One observation, within ``2 × timeout_s`` in all (its two rounds of concurrent queries, the
        second only when no stream gave latency): httpx's timeout bounds each read, not the answer, and
        a Prometheus (or a proxy before it) that sends a byte now and then would hold the planner loop
        for good; past the deadline this raises ``TimeoutError`` and the loop holds."""
        return await within(2 * self.timeout_s, self._observe(now), f"Prometheus at {self.url}")

    async def _observe(self, now: float) -> Observation:
        client = self._client or httpx.AsyncClient()
        try:
            window = f"{max(1, int(round(self.window_s)))}s"
            queries = prometheus_queries(window, self.model)
            # concurrently: a hung Prometheus costs one timeout per interval, not one per field
            answers = await asyncio.gather(*(self._query(client, e) for e in queries.values()),
                                           return_exceptions=True)
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
            values = dict(zip(queries, answers, strict=True))
            rate = values.pop("request_rate")
            if rate is not None and math.isnan(rate):  # arrivals are counted: a NaN rate is no measurement
                raise PrometheusAnswerError(self.url, f"NaN to the arrival rate ({queries['request_rate']!r})")
            # a NaN elsewhere is 0/0 (a mean or quantile over a window in which nothing finished): not measured
            values = {k: None if v is not None and math.isnan(v) else v for k, v in values.items()}
            if rate is None:
                # two causes with two remedies: the series is absent, or the window holds fewer than two of
                # its samples (rate() needs two: a window shorter than two scrape intervals answers nothing)
                present = await self._query(
                    client, f"count(last_over_time(dyad_request_arrivals_total{model_selector(self.model)}[1h]))")
                if present:
                    raise NoPrometheusData(
                        f"Prometheus at {self.url}: dyad_request_arrivals_total is there, but the last {window} hold "
                        "fewer than two of its samples (rate() needs two): set planner.prometheus_window_s to at "
                        "least twice Prometheus's scrape interval; holding")
                raise NoPrometheusData(f"Prometheus at {self.url} has no dyad_request_arrivals_total samples over "
                                       f"the last {window} (just restarted, or not scraping the gateway); holding")
            obs = Observation(at=now, window_s=self.window_s, request_rate=rate, **values)
            engine: dict[str, float | None] = {}
            if obs.ttft_mean is None and obs.itl_mean is None and self.engines is not None:
                engine = await self._engine_latency(client, window)  # no streams this window
        finally:
            if self._client is None:
                await client.aclose()
        return with_engine_latency(obs, engine)


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
          "dyad_request_generation_tokens", "dyad_request_e2e_seconds", "dyad_pd_prefill_seconds")
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
                 timeout_s: float = 5.0, *, read: Callable[[], bytes | str] | None = None,
                 engines: Callable[[], Iterable[tuple[str, Role, LoadSnapshot]]] | None = None) -> None:
        if (metrics_url is None) == (read is None):
            raise ValueError("DirectSource needs exactly one of metrics_url and read")
        self.metrics_url = metrics_url
        self.read = read
        self._client = client
        self.timeout_s = timeout_s
        self._prev: Scrape | None = None
        # (worker id, role, last scraped load): the engines' histograms, read from the gateway's own
        # scrape of each engine's /metrics; used for latency when no stream gave any
        self.engines = engines
        self._engine_prev: dict[str, LoadSnapshot] = {}

    async def _text(self) -> str:
        if self.read is not None:
            text = self.read()
            return text.decode() if isinstance(text, bytes) else text
        assert self.metrics_url is not None
        client = self._client or httpx.AsyncClient()
        try:
            r = await within(self.timeout_s, client.get(self.metrics_url, timeout=self.timeout_s), self.metrics_url)
            r.raise_for_status()
            return r.text
        finally:
            if self._client is None:
                await client.aclose()

    async def observe(self, now: float) -> Observation:
        cur = parse_gateway_metrics(await self._text(), now)
        prev, self._prev = self._prev, cur
        parts = self._engine_window()
        if prev is None:
            return Observation(at=now, window_s=0.0, request_rate=None)
        if not cur.has_arrivals:
            # a gateway that does not export arrival counters: demand is not measured (never plan on 0)
            return Observation(at=now, window_s=cur.at - prev.at, request_rate=None)
        step = "dyad_pd_prefill_seconds"
        engine = latency_from_engines(parts, cur.histograms[step].minus(prev.histograms[step])) if parts else {}
        return with_engine_latency(observation_from_scrapes(prev, cur), engine)

    def _engine_window(self) -> list[EngineLatency]:
        """The engines' latency histograms since the last call (an engine seen for the first time only primes)."""
        if self.engines is None:
            return []
        parts = []
        seen: dict[str, LoadSnapshot] = {}
        for wid, role, load in self.engines():
            seen[wid] = load
            old = self._engine_prev.get(wid)
            if old is None:
                continue

            def delta(cur: Histogram | None, before: Histogram | None) -> Histogram | None:
                if cur is None:
                    return None
                return cur.minus(before) if before is not None else None

            parts.append(EngineLatency(role, delta(load.ttft, old.ttft), delta(load.itl, old.itl)))
        self._engine_prev = seen
        return parts
