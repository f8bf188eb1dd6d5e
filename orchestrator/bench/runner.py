"""Replay a trace against any OpenAI-compatible endpoint and measure what a client sees.

Works the same against Dyad, another router (vllm-router, sglang-router) or an engine directly: it
only speaks ``/v1/chat/completions`` or ``/v1/completions`` with streaming, and (optionally) reads the
engines' own ``/metrics`` before and after the run, so the prefix-cache hit ratio it reports is the
engines' real one, not a router's belief.

Pacing: open loop at the trace's arrival times divided by ``speed``; or a fixed rate (evenly spaced);
or a fixed number of requests in flight (closed loop). Open loop never waits for earlier requests, so
a slow server shows up as growing latency, not as a slower sender; ``max_send_lag_s`` in the summary
tells whether the client itself kept up.

Per request: TTFT (send → first content chunk), ITL (gaps between content chunks), end-to-end
latency, output tokens (from ``usage`` when the server sends it), and errors — HTTP status, an
``error`` event inside the stream, or a stream that ends without ``[DONE]`` (a truncated body).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from adapters.prometheus_text import MetricSet
from orchestrator.bench.progress import DEFAULT_INTERVAL_S, Progress
from orchestrator.bench.traces import TraceRequest
from orchestrator.stats import percentile  # also imported from here by the scripts

# ------------------------------------------------------------------------------------------- results


@dataclass
class RequestResult:
    index: int
    scheduled_s: float  # when the request was due, seconds from the run's start
    sent_s: float  # when it was actually sent
    input_len: int  # trace's prompt length (tokens)
    max_tokens: int
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage
    worker: str | None = None  # x-dyad-worker response header, when the gateway adds it

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (the per-request ITL used for SLOs)."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class EngineCounters:
    """Cumulative counters read from one engine's /metrics (None: the engine does not export it)."""

    url: str
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    requests: float | None = None
    external_hits: float | None = None  # vllm:external_prefix_cache_hits (a host/offload tier's reloads)
    error: str | None = None

    def minus(self, before: EngineCounters) -> dict[str, Any]:
        def d(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a - b

        q, h = d(self.prefix_queries, before.prefix_queries), d(self.prefix_hits, before.prefix_hits)
        return {
            "url": self.url,
            "requests": d(self.requests, before.requests),
            "prompt_tokens": d(self.prompt_tokens, before.prompt_tokens),
            "generation_tokens": d(self.generation_tokens, before.generation_tokens),
            "prefix_queries": q,
            "prefix_hits": h,
            "uncached_prompt_tokens": None if q is None or h is None else q - h,
            "hit_ratio": (h / q) if q and h is not None else None,
            "external_hits": d(self.external_hits, before.external_hits),
            "error": self.error or before.error,
        }


def parse_engine_counters(url: str, text: str) -> EngineCounters:
    """vLLM (and the simulator's) counter names; SGLang's token counters where it has them."""
    ms = MetricSet.parse(text, prefixes=("vllm:", "sglang:"))
    return EngineCounters(
        url=url,
        prefix_queries=ms.sum("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        prefix_hits=ms.sum("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        prompt_tokens=ms.sum("vllm:prompt_tokens_total", "sglang:prompt_tokens_total"),
        generation_tokens=ms.sum("vllm:generation_tokens_total", "sglang:generation_tokens_total"),
        requests=ms.sum("vllm:request_success_total", "sglang:num_requests_total"),
        external_hits=ms.sum("vllm:external_prefix_cache_hits_total"),
    )


async def read_engine_counters(client: httpx.AsyncClient, urls: Sequence[str]) -> list[EngineCounters]:
    async def one(url: str) -> EngineCounters:
        try:
            r = await client.get(f"{url.rstrip('/')}/metrics", timeout=10.0)
            r.raise_for_status()
            return parse_engine_counters(url, r.text)
        except (httpx.HTTPError, ValueError) as e:
            return EngineCounters(url=url, error=f"{type(e).__name__}: {e}")

    return list(await asyncio.gather(*(one(u) for u in urls)))


# ------------------------------------------------------------------------------------------- statistics


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "mean": (sum(values) / len(values)) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def summarize_results(results: Sequence[RequestResult], duration_s: float, *, slo_ttft_s: float | None = None,
                      slo_itl_s: float | None = None, engines: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Client-side latency distributions, throughput, SLO goodput and engine-side cache/load numbers.

    Goodput counts requests that succeeded and met every SLO given (TTFT; per-request mean ITL),
    divided by the run's duration."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    out_tokens = sum(r.output_tokens for r in ok)

    def meets(r: RequestResult) -> bool:
        if slo_ttft_s is not None and (r.ttft_s is None or r.ttft_s > slo_ttft_s):
            return False
        tp = r.tpot_s
        return not (slo_itl_s is not None and tp is not None and tp > slo_itl_s)

    met = sum(1 for r in ok if meets(r))
    errors = Counter((r.error or "error").split(":", 1)[0][:80] for r in results if not r.ok)
    workers = Counter(r.worker for r in ok if r.worker)
    summary: dict[str, Any] = {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "error_kinds": dict(errors.most_common(10)),
        "duration_s": duration_s,
        "request_rate": len(ok) / duration_s if duration_s > 0 else None,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration_s if duration_s > 0 else None,
        "ttft_s": _dist(ttft),
        "itl_s": _dist(itl),
        "tpot_s": _dist(tpot),
        "e2e_s": _dist(e2e),
        "max_send_lag_s": max((r.sent_s - r.scheduled_s for r in results), default=0.0),
        "slo": {"ttft_s": slo_ttft_s, "itl_s": slo_itl_s, "met": met,
                "goodput_rps": met / duration_s if duration_s > 0 else None,
                "attainment": met / len(results) if results else None},
        "requests_per_worker": dict(sorted(workers.items())),
    }
    if engines:
        q = [e["prefix_queries"] for e in engines if e.get("prefix_queries") is not None]
        h = [e["prefix_hits"] for e in engines if e.get("prefix_hits") is not None]
        loads = [e["uncached_prompt_tokens"] for e in engines if e.get("uncached_prompt_tokens") is not None]
        mean_load = sum(loads) / len(loads) if loads else 0.0
        summary["cache"] = {
            "prefix_queries": sum(q) if q else None,
            "prefix_hits": sum(h) if h else None,
            "hit_ratio": (sum(h) / sum(q)) if q and h and sum(q) > 0 else None,
        }
        ext = [e["external_hits"] for e in engines if e.get("external_hits") is not None]
        if ext and q and h and sum(q) > 0:  # engines with a host/offload tier: reloads are not recomputed either
            summary["cache"]["external_hits"] = sum(ext)
            summary["cache"]["hit_ratio_with_external"] = (sum(h) + sum(ext)) / sum(q)
        summary["prefill_load"] = {
            "per_engine": loads,
            "max": max(loads) if loads else None,
            "mean": mean_load if loads else None,
            "max_over_mean": (max(loads) / mean_load) if loads and mean_load > 0 else None,
        }
        summary["engines"] = list(engines)
    return summary


# ------------------------------------------------------------------------------------------- sending


def build_body(req: TraceRequest, model: str, api: str, *, stream: bool = True, ignore_eos: bool = True,
               temperature: float = 0.0) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for one trace request. ``api='auto'`` uses chat when the trace has messages."""
    use_chat = api == "chat" or (api == "auto" and req.messages is not None)
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": temperature,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang extension: generate exactly max_tokens
    if use_chat:
        body["messages"] = req.render_messages()
        return "/v1/chat/completions", body
    body["prompt"] = req.render_prompt()
    return "/v1/completions", body


def _chunk_text(chunk: dict[str, Any]) -> str:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content") or delta.get("reasoning_content")
            if text:
                return text
        text = choice.get("text")
        if text:
            return text
    return ""


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message") or payload["error"])
    return str(payload)[:300]


async def send_request(client: httpx.AsyncClient, base_url: str, path: str, body: dict[str, Any],
                       result: RequestResult, headers: dict[str, str] | None = None) -> RequestResult:
    """Send one request and fill ``result`` (timings relative to the moment of sending)."""
    t0 = time.perf_counter()
    last = t0
    try:
        if not body.get("stream"):
            r = await client.post(base_url + path, json=body, headers=headers)
            result.status = r.status_code
            result.worker = r.headers.get("x-dyad-worker")
            data = r.json() if r.content else {}
            if r.status_code != 200:
                result.error = f"http {r.status_code}: {_error_text(data)}"
                return result
            result.e2e_s = result.ttft_s = time.perf_counter() - t0
            usage = data.get("usage") or {}
            result.output_tokens = int(usage.get("completion_tokens") or 0)
            result.prompt_tokens = usage.get("prompt_tokens")
            result.ok = True
            return result
        async with client.stream("POST", base_url + path, json=body, headers=headers) as r:
            result.status = r.status_code
            result.worker = r.headers.get("x-dyad-worker")
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    result.error = f"http {r.status_code}: {_error_text(json.loads(raw))}"
                except ValueError:
                    result.error = f"http {r.status_code}: {raw[:200]!r}"
                return result
            chunks = 0
            done = False
            usage: dict[str, Any] | None = None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    result.error = f"bad sse chunk: {data[:120]}"
                    return result
                if "error" in chunk and not chunk.get("choices"):
                    result.error = f"stream error: {_error_text(chunk)}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if _chunk_text(chunk):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft_s = now - t0
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1
            result.e2e_s = time.perf_counter() - t0
            if not done:
                result.error = "truncated stream: ended without [DONE]"
                return result
            result.output_tokens = int((usage or {}).get("completion_tokens") or chunks)
            result.prompt_tokens = (usage or {}).get("prompt_tokens")
            if result.ttft_s is None:  # no content at all (e.g. max_tokens hit at once): first byte = end
                result.ttft_s = result.e2e_s
            result.ok = True
            return result
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        result.e2e_s = time.perf_counter() - t0
        return result


# ------------------------------------------------------------------------------------------- progress


# ``Progress`` (orchestrator/bench/progress.py): a bar on a terminal, periodic plain lines otherwise.


# ------------------------------------------------------------------------------------------- the run


@dataclass
class BenchOptions:
    url: str
    model: str
    speed: float = 1.0  # open loop: arrival_s / speed
    rate: float | None = None  # fixed rate (requests/s), evenly spaced
    concurrency: int | None = None  # closed loop: this many in flight
    api: str = "auto"  # chat | completions | auto
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    engines: list[str] = field(default_factory=list)
    timeout_s: float = 600.0
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    progress: bool | None = None  # None: a bar on a terminal, else plain lines; True: a bar; False: none
    progress_interval_s: float = DEFAULT_INTERVAL_S  # plain lines (not a terminal): one every this many seconds


@dataclass
class BenchResult:
    options: BenchOptions
    results: list[RequestResult]
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        opts = asdict(self.options)
        opts.pop("api_key", None)
        return {"options": opts, "summary": self.summary,
                "requests": [asdict(r) | {"tpot_s": r.tpot_s} for r in self.results]}


def schedule(requests: Sequence[TraceRequest], opts: BenchOptions) -> list[float]:
    """Send offsets (seconds from the start) for open-loop or fixed-rate pacing."""
    if opts.rate is not None:
        if opts.rate <= 0:
            raise ValueError("rate must be > 0")
        return [i / opts.rate for i in range(len(requests))]
    if opts.speed <= 0:
        raise ValueError("speed must be > 0")
    t0 = requests[0].arrival_s if requests else 0.0
    return [(r.arrival_s - t0) / opts.speed for r in requests]


def base_url(url: str) -> str:
    """Accept ``http://h:p``, ``http://h:p/`` or ``http://h:p/v1``."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def run_bench(requests: Sequence[TraceRequest], opts: BenchOptions) -> BenchResult:
    """Replay ``requests`` against ``opts.url``; returns per-request results and the summary."""
    url = base_url(opts.url)
    headers = dict(opts.headers)
    if opts.api_key:
        headers["authorization"] = f"Bearer {opts.api_key}"
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=1024)
    # Generous connect timeout: under overload a router may accept late, which is latency, not failure.
    timeout = httpx.Timeout(opts.timeout_s, connect=min(opts.timeout_s, 60.0))
    progress = Progress(len(requests), label="dyad bench", unit="requests done",
                        mode=None if opts.progress is None else ("bar" if opts.progress else "off"),
                        interval_s=opts.progress_interval_s)

    async def ticker() -> None:  # a line is due even while no request completes (a stall says so)
        while True:
            await asyncio.sleep(min(1.0, opts.progress_interval_s))
            progress.tick()

    ticking = asyncio.create_task(ticker()) if progress.mode == "lines" else None
    results: list[RequestResult] = []
    try:
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            before = await read_engine_counters(client, opts.engines) if opts.engines else []
            # Render every body before the clock starts: synthesizing a long prompt costs ms of CPU that
            # would otherwise delay the send (and, on a loaded machine, put the client behind schedule).
            bodies = [build_body(req, opts.model, opts.api, stream=opts.stream, ignore_eos=opts.ignore_eos,
                                 temperature=opts.temperature) for req in requests]
            start = time.perf_counter()

            async def one(req: TraceRequest, due: float, built: tuple[str, dict[str, Any]]) -> None:
                path, body = built
                res = RequestResult(index=req.index, scheduled_s=due, sent_s=time.perf_counter() - start,
                                    input_len=req.input_len, max_tokens=req.output_len)
                await send_request(client, url, path, body, res, headers or None)
                results.append(res)
                progress.update(res)

            if opts.concurrency is not None:
                if opts.concurrency < 1:
                    raise ValueError("concurrency must be >= 1")
                queue: asyncio.Queue[tuple[TraceRequest, tuple[str, dict[str, Any]]]] = asyncio.Queue()
                for item in zip(requests, bodies, strict=True):
                    queue.put_nowait(item)

                async def worker() -> None:
                    while not queue.empty():
                        req, built = queue.get_nowait()
                        await one(req, time.perf_counter() - start, built)

                await asyncio.gather(*(worker() for _ in range(opts.concurrency)))
            else:
                tasks = []
                for req, due, built in zip(requests, schedule(requests, opts), bodies, strict=True):
                    delay = start + due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(one(req, due, built)))
                await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
            after = await read_engine_counters(client, opts.engines) if opts.engines else []
    finally:
        if ticking is not None:
            ticking.cancel()
    progress.close()
    results.sort(key=lambda r: r.index)
    engines = [a.minus(b) for a, b in zip(after, before, strict=True)]
    summary = summarize_results(results, duration, slo_ttft_s=opts.slo_ttft_s, slo_itl_s=opts.slo_itl_s,
                                engines=engines)
    return BenchResult(opts, results, summary)


# ------------------------------------------------------------------------------------------- reports


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def format_table(summary: dict[str, Any], title: str | None = None) -> str:
    """The human-readable report."""
    lines = []
    if title:
        lines.append(title)
    s = summary
    rate = s.get("request_rate")
    otps = s.get("output_tok_s")
    lines.append(f"requests {s['requests']}  ok {s['ok']}  errors {s['errors']}  duration {s['duration_s']:.1f} s  "
                 f"throughput {rate or 0:.2f} req/s, {otps or 0:.1f} output tok/s")
    if s.get("error_kinds"):
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in s["error_kinds"].items()))
    lines.append(f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end")):
        d = s[key]
        lines.append(f"{label:<14}" + "".join(f"{_ms(d[k]):>10}" for k in ("mean", "p50", "p90", "p99", "max")))
    slo = s["slo"]
    if slo["ttft_s"] is not None or slo["itl_s"] is not None:
        lines.append(f"SLO (TTFT <= {_ms(slo['ttft_s'])} ms, ITL <= {_ms(slo['itl_s'])} ms): {slo['met']} met, "
                     f"goodput {slo['goodput_rps'] or 0:.2f} req/s, attainment {100 * (slo['attainment'] or 0):.1f}%")
    cache = s.get("cache")
    if cache:
        hr = cache["hit_ratio"]
        lines.append(f"engine prefix cache: {cache['prefix_hits'] or 0:.0f} / {cache['prefix_queries'] or 0:.0f} "
                     f"tokens hit = {'-' if hr is None else f'{100 * hr:.1f}%'}")
        if cache.get("hit_ratio_with_external") is not None:
            lines.append(f"  + reloaded from the host/offload tier: {cache['external_hits']:.0f} tokens; "
                         f"not recomputed = {100 * cache['hit_ratio_with_external']:.1f}%")
        pl = s["prefill_load"]
        if pl["max_over_mean"] is not None:
            lines.append(f"prefill load (uncached prompt tokens per engine): max {pl['max']:.0f}, "
                         f"mean {pl['mean']:.0f}, max/mean {pl['max_over_mean']:.2f}")
        for e in s["engines"]:
            hr = e["hit_ratio"]
            lines.append(f"  {e['url']:<28} requests {e['requests'] or 0:>6.0f}  prompt tok {e['prompt_tokens'] or 0:>9.0f}"
                         f"  hit {'-' if hr is None else f'{100 * hr:5.1f}%'}" + (f"  ({e['error']})" if e["error"] else ""))
    if s.get("requests_per_worker"):
        lines.append("requests per worker (x-dyad-worker): "
                     + ", ".join(f"{k} {v}" for k, v in s["requests_per_worker"].items()))
    if s.get("max_send_lag_s", 0) > 0.05:
        lines.append(f"note: the client fell behind the schedule by up to {s['max_send_lag_s']:.2f} s")
    return "\n".join(lines)


def plot_results(result: BenchResult, path: str) -> None:
    """Write ``bench_figure(result)`` as a PNG."""
    from orchestrator.bench import plots

    plots.save(bench_figure(result), path)


def bench_figure(result: BenchResult) -> Any:
    """Six panels (orchestrator/bench/plots.py): TTFT and per-request ITL over the run against their
    SLO lines, their distributions, requests in flight (integer ticks) and completed per second."""
    from orchestrator.bench import plots

    plt = plots.require_pyplot()
    opts = result.options
    ok = [r for r in result.results if r.ok]
    bad = [r for r in result.results if not r.ok]
    fig, ax = plt.subplots(3, 2, figsize=(12, 11))
    timed = [r for r in ok if r.ttft_s is not None]
    plots.latency_over_time(ax[0][0], [r.sent_s + r.ttft_s for r in timed], [r.ttft_s for r in timed],
                            title="Time to first token over the run", what="TTFT", slo_s=opts.slo_ttft_s,
                            xlabel="time of first token since start (s)")
    if bad:
        ax[0][0].scatter([r.sent_s for r in bad], [0] * len(bad), s=14, marker="x", c="red",
                         label=f"failed ({len(bad)})")
        ax[0][0].legend(fontsize=8, loc="upper left")
    tpot = [r for r in ok if r.tpot_s is not None]
    plots.latency_over_time(ax[0][1], [r.sent_s + (r.e2e_s or 0) for r in tpot], [r.tpot_s for r in tpot],
                            title="Inter-token latency over the run (mean per request)", what="ITL",
                            slo_s=opts.slo_itl_s, xlabel="time of last token since start (s)")
    plots.cdf(ax[1][0], [r.ttft_s for r in timed], title="TTFT distribution", what="TTFT",
              slo_s=opts.slo_ttft_s)
    plots.cdf(ax[1][1], [g for r in ok for g in r.itl_s], title="Inter-token latency distribution (every gap)",
              what="ITL", slo_s=opts.slo_itl_s)
    # requests in flight and completions per second, from the requests' own send / end times
    edges = sorted([(r.sent_s, 1) for r in result.results]
                   + [(r.sent_s + (r.e2e_s or 0.0), -1) for r in result.results])
    xs, ys, level = [0.0], [0], 0
    for t, d in edges:
        xs.append(t)
        ys.append(level)
        level += d
        xs.append(t)
        ys.append(level)
    ax[2][0].plot(xs, ys, color="#7b4fd6")
    plots.style(ax[2][0], "Requests in flight", "time since start (s)", "requests")
    plots.integer_ticks(ax[2][0])
    ends = [r.sent_s + (r.e2e_s or 0.0) for r in ok]
    duration = max(ends + [result.summary.get("duration_s") or 0.0, 1e-9])
    width = max(1.0, duration / 40)
    bins = [width * i for i in range(int(duration / width) + 2)]
    ax[2][1].hist(ends, bins=bins, weights=[1 / width] * len(ends), color="#1f9d55", alpha=0.8, label="answered")
    if bad:
        ax[2][1].hist([r.sent_s for r in bad], bins=bins, weights=[1 / width] * len(bad), color="#d64545",
                      alpha=0.8, label="failed")
    plots.style(ax[2][1], f"Completed requests ({width:.0f} s bins)", "time since start (s)", "requests / s")
    ax[2][1].legend(fontsize=8)
    s = result.summary
    slo = s.get("slo") or {}
    good = (f", goodput {slo['goodput_rps']:.2f} req/s within the SLOs"
            if (slo.get("ttft_s") or slo.get("itl_s")) and slo.get("goodput_rps") is not None else "")
    fig.suptitle(f"dyad bench against {opts.url} ({opts.model}): {len(ok)}/{len(result.results)} "
                 f"answered in {s.get('duration_s', 0):.0f} s{good}", fontsize=12)
    return fig
