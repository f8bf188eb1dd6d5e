"""The one interface every engine adapter implements, and the load snapshot they all produce.

An adapter knows one engine's wire dialect (vLLM, SGLang); the rest of Dyad only sees
``EngineAdapter`` and ``LoadSnapshot``. Parsing is pure (text in, snapshot out) so it is tested
without a network; the I/O methods take an ``httpx.AsyncClient`` owned by the caller.
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx
import orjson


class EngineKind(str, Enum):  # noqa: UP042 (str() stays "EngineKind.X" for existing callers)
    VLLM = "vllm"
    SGLANG = "sglang"
    SIM = "sim"  # the project's simulator; speaks vLLM's dialect (or SGLang's with dialect=sglang)


class Role(str, Enum):  # noqa: UP042
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


@dataclass
class Histogram:
    """A cumulative Prometheus histogram: ``buckets`` are (upper bound, cumulative count), sorted."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    sum: float = 0.0
    count: float = 0.0

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket, as PromQL's histogram_quantile does (``q`` in [0, 1]).

        An estimate from bucket counts, not a percentile of samples: for raw samples use
        ``orchestrator.stats.percentile``."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        bounds = [b for b, _ in self.buckets]
        counts = [c for _, c in self.buckets]
        i = bisect.bisect_left(counts, rank)
        if i >= len(bounds):
            return bounds[-2] if len(bounds) > 1 and math.isinf(bounds[-1]) else bounds[-1]
        upper = bounds[i]
        lower = bounds[i - 1] if i > 0 else 0.0
        below = counts[i - 1] if i > 0 else 0.0
        if math.isinf(upper):
            return lower
        in_bucket = counts[i] - below
        if in_bucket <= 0:
            return upper
        return lower + (upper - lower) * (rank - below) / in_bucket

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def minus(self, older: Histogram) -> Histogram:
        """The observations between two scrapes of the same series (counter reset → self). A reset is
        any part that went down (as Prometheus's ``rate`` reads one), not only the count: an engine
        restarted between the scrapes that served more since than before has a higher count, and the
        difference was garbage (negative buckets, a wrong mean)."""
        if (older.count > self.count or older.sum > self.sum or len(older.buckets) != len(self.buckets)
                or any(oc > c for (_, c), (_, oc) in zip(self.buckets, older.buckets, strict=True))):
            return self
        return Histogram(
            buckets=[(b, c - oc) for (b, c), (_, oc) in zip(self.buckets, older.buckets, strict=True)],
            sum=self.sum - older.sum,
            count=self.count - older.count,
        )


@dataclass
class LoadSnapshot:
    """One engine's load, normalized across engines and metric-name generations.

    Counters are cumulative as the engine reports them; gauges are current values. ``None`` means
    the engine did not report the series (not zero).
    """

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # fraction 0..1
    prefix_cache_queries: float | None = None  # tokens queried (counter)
    prefix_cache_hits: float | None = None  # tokens hit (counter)
    prefix_cache_hit_rate: float | None = None  # engines that export a rate instead (SGLang)
    prompt_tokens: float | None = None  # counter
    generation_tokens: float | None = None  # counter
    prompt_tokens_by_source: dict[str, float] = field(default_factory=dict)  # counter per source
    requests_finished: float | None = None  # counter
    preemptions: float | None = None  # counter
    block_size: int | None = None
    num_blocks: int | None = None
    ttft: Histogram | None = None
    itl: Histogram | None = None
    e2e: Histogram | None = None
    queue_time: Histogram | None = None
    prompt_len: Histogram | None = None
    generation_len: Histogram | None = None
    scraped_at: float = 0.0  # clock time of the scrape
    raw: dict[str, float] = field(default_factory=dict)  # extra engine-specific gauges

    @property
    def cache_hit_ratio(self) -> float | None:
        if self.prefix_cache_queries:
            return (self.prefix_cache_hits or 0.0) / self.prefix_cache_queries
        return self.prefix_cache_hit_rate


# An engine's /metrics answer longer than this is refused unread (a scrape error): parsing is CPU work on the
# gateway's event loop, ~0.3 s per MB of matching series, and the read was unbounded (a 55-MB answer stalled the
# loop 17 s every scrape). vLLM's and SGLang's are tens of KB.
MAX_METRICS_BYTES = 2 * 1024 * 1024
MAX_MODELS_BYTES = 1024 * 1024  # /v1/models: one card per model (and LoRA adapter), a few hundred bytes each


async def get_capped(client: httpx.AsyncClient, url: str, timeout: float, cap: int) -> bytes:
    """GET ``url``'s body, read as it arrives and refused past ``cap`` bytes; ``AdapterError`` for that, for a
    non-2xx answer (its status) and for no answer."""
    try:
        async with client.stream("GET", url, timeout=timeout) as r:
            if not r.is_success:
                raise AdapterError(f"{url}: HTTP {r.status_code}", status=r.status_code)
            chunks: list[bytes] = []
            size = 0
            async for chunk in r.aiter_bytes():
                size += len(chunk)
                if size > cap:
                    raise AdapterError(f"{url}: the answer is longer than {cap} bytes; not read further, not parsed")
                chunks.append(chunk)
    except httpx.HTTPError as e:
        raise AdapterError(f"{url}: {type(e).__name__}: {e}") from e
    return b"".join(chunks)


class AdapterError(Exception):
    """An engine call made by an adapter failed: unreachable, non-2xx status, or an unexpected body.

    ``status`` is the engine's HTTP status when it answered (``None`` when it did not).
    """

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class UnsupportedByEngine(AdapterError):
    """The engine's dialect has no way to do this (e.g. chat-template tokenization on SGLang)."""


class EngineAdapter(ABC):
    """One engine dialect. Stateless apart from caches; safe to share between workers of a kind."""

    kind: EngineKind
    # Body fields this dialect's Dyad code sets to steer an engine or a P/D hand-off. They are Dyad's
    # alone: a client body carrying one is refused with a 400 (``orchestrator.gateway.request``).
    internal_fields: frozenset[str] = frozenset()
    # Body fields whose members this engine merges into the place where it keeps an internal field, so an
    # internal field inside one of them acts as if set at the top level: refused there too.
    internal_field_carriers: frozenset[str] = frozenset()
    # Body fields that set this engine's scheduling order among the requests it holds (vLLM's and SGLang's
    # ``priority``). The order between clients is Dyad's (a key's priority class is its ceiling: admission.py),
    # so a client may send only the engine's default (absent, null or 0); anything else is refused with a 400.
    scheduling_fields: frozenset[str] = frozenset()

    @abstractmethod
    async def health(self, client: httpx.AsyncClient, base_url: str, timeout: float) -> bool:
        """True when the engine answers its health endpoint with success, False on another answer or no
        connection; ``TimeoutError`` when it took the probe but did not answer within ``timeout`` (busy, not
        gone: ``FleetRegistry.last_resort``)."""

    @abstractmethod
    def parse_metrics(self, text: str, now: float, model: str | None = None) -> LoadSnapshot:
        """Prometheus text exposition → LoadSnapshot (pure).

        ``model`` selects the series of one served model (label ``model_name``); ``None`` takes
        the first model the scrape mentions (an engine process serves one model).
        """

    async def scrape(
        self, client: httpx.AsyncClient, base_url: str, timeout: float, now: float, model: str | None = None
    ) -> LoadSnapshot:
        """GET ``/metrics`` and parse it; an unreachable engine, a non-2xx answer or one longer than
        ``MAX_METRICS_BYTES`` raises ``AdapterError``."""
        raw = await get_capped(client, f"{base_url}/metrics", timeout, MAX_METRICS_BYTES)
        return self.parse_metrics(raw.decode("utf-8", "replace"), now, model)

    @abstractmethod
    async def tokenize(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        model: str,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        timeout: float = 5.0,
        chat_options: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids exactly as the engine would compute them for this prompt / chat.

        ``chat_options`` is the client's chat request body (or any dict): the adapter picks the
        fields that change the rendered prompt (``add_generation_prompt``, ``tools``, ...).
        """

    def shape_request(self, endpoint: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """Engine-specific changes to a client body before it is forwarded (default: none)."""
        return body

    async def list_models(self, client: httpx.AsyncClient, base_url: str, timeout: float) -> list[str]:
        return list(await self.model_cards(client, base_url, timeout))

    async def model_cards(self, client: httpx.AsyncClient, base_url: str, timeout: float) -> dict[str, int | None]:
        """The engine's models (``/v1/models``), each with its context length (``max_model_len``, which
        vLLM and SGLang report on each model card) or None when the engine does not say."""
        raw = await get_capped(client, f"{base_url}/v1/models", timeout, MAX_MODELS_BYTES)
        cards: dict[str, int | None] = {}
        for m in orjson.loads(raw).get("data", []):
            if isinstance(m, dict) and isinstance(m.get("id"), str):
                n = m.get("max_model_len")
                cards[m["id"]] = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
        return cards
