"""vLLM's dialect: ``/health``, ``/metrics`` with ``vllm:*`` names, ``/tokenize``.

Metric names moved between releases; every lookup below lists the current name first and the
older ones after it (checked against vLLM 0.32's ``v1/metrics/loggers.py`` and the deprecation
notes of earlier releases):

- KV usage: ``kv_cache_usage_perc`` (v1) ← ``gpu_cache_usage_perc`` (v0 and early v1)
- prefix cache: ``prefix_cache_{queries,hits}_total`` ← ``gpu_prefix_cache_{queries,hits}_total``
  (v1 ≤ 0.10); v0 only had a ``gpu_prefix_cache_hit_rate`` gauge
- ITL: ``inter_token_latency_seconds`` ← ``time_per_output_token_seconds``

Every series carries ``engine`` (data-parallel rank) and ``model_name`` labels. Counts, counters
and histograms are summed across ranks; KV usage is averaged (each rank has its own equally sized
cache, so the mean is the fraction of the whole).
"""

from __future__ import annotations

from typing import Any

import httpx

from adapters.base import EngineAdapter, EngineKind, LoadSnapshot
from adapters.engine_http import fetch_tokens, probe_ok
from adapters.prometheus_text import MetricSet
from adapters.tokenize_cache import TokenizeCache, content_key

P = "vllm:"

# The NIXL hand-off object (orchestrator/disagg/vllm_flow.py): the prefill step asks for it, the
# decode step carries the prefill's answer. It names the host and port the engine pulls KV from, so
# only Dyad may set it.
KV_TRANSFER_PARAMS = "kv_transfer_params"
INTERNAL_FIELDS = frozenset({KV_TRANSFER_PARAMS})
# vLLM copies ``vllm_xargs`` into the sampling params' ``extra_args``, which is where its engine reads
# ``kv_transfer_params`` from (the top-level field is moved there too): a client's
# ``vllm_xargs.kv_transfer_params`` reaches the KV connector as if it were Dyad's (a string there makes
# a P/D engine's scheduler fail on ``.get``).
INTERNAL_FIELD_CARRIERS = frozenset({"vllm_xargs"})

# Chat request fields that change the prompt vLLM renders (TokenizeChatRequest accepts them all).
CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)

# Extra series kept in LoadSnapshot.raw (summed across ranks) when the engine exports them.
_RAW_SUMS = {
    "external_prefix_cache_queries": ("vllm:external_prefix_cache_queries_total",),
    "external_prefix_cache_hits": ("vllm:external_prefix_cache_hits_total",),
    "num_requests_swapped": ("vllm:num_requests_swapped",),  # v0 only
    "nixl_num_failed_transfers": ("vllm:nixl_num_failed_transfers_total",),
    "prefill_time_seconds_sum": ("vllm:request_prefill_time_seconds_sum",),
    "prefill_time_seconds_count": ("vllm:request_prefill_time_seconds_count",),
    "decode_time_seconds_sum": ("vllm:request_decode_time_seconds_sum",),
    "decode_time_seconds_count": ("vllm:request_decode_time_seconds_count",),
}


def select_model(ms: MetricSet, model: str | None, label: str = "model_name") -> MetricSet:
    """Keep the series of one model: ``model`` if the page has it, else the first one it names.

    A name the page does not know (a served-name/alias mismatch) falls back to the first model
    rather than to an empty — falsely idle — snapshot. Series without the label are kept.
    """
    names = ms.label_values(label)
    if model not in names:
        if len(names) <= 1:
            return ms
        model = names[0]
    return ms.where(lambda labels: labels.get(label, model) == model)


def _int_label(labels: dict[str, str] | None, *keys: str) -> int | None:
    if not labels:
        return None
    for k in keys:
        v = labels.get(k)
        if v is None:
            continue
        try:
            return int(float(v))
        except ValueError:
            continue
    return None


def parse_vllm_metrics(text: str, now: float, model: str | None = None) -> LoadSnapshot:
    """A vLLM ``/metrics`` page (any release since 0.6) → ``LoadSnapshot``."""
    ms = select_model(MetricSet.parse(text, (P,)), model)
    snap = LoadSnapshot(scraped_at=now)
    snap.running = ms.sum(P + "num_requests_running") or 0.0
    snap.waiting = ms.sum(P + "num_requests_waiting") or 0.0
    snap.kv_usage = ms.mean(P + "kv_cache_usage_perc", P + "gpu_cache_usage_perc") or 0.0
    snap.prefix_cache_queries = ms.sum(P + "prefix_cache_queries_total", P + "gpu_prefix_cache_queries_total")
    snap.prefix_cache_hits = ms.sum(P + "prefix_cache_hits_total", P + "gpu_prefix_cache_hits_total")
    if snap.prefix_cache_queries is None:
        snap.prefix_cache_hit_rate = ms.mean(P + "gpu_prefix_cache_hit_rate")
    snap.prompt_tokens = ms.sum(P + "prompt_tokens_total")
    snap.generation_tokens = ms.sum(P + "generation_tokens_total")
    snap.prompt_tokens_by_source = ms.sum_by("source", P + "prompt_tokens_by_source_total")
    snap.requests_finished = ms.sum(P + "request_success_total")
    snap.preemptions = ms.sum(P + "num_preemptions_total")

    info = ms.samples(P + "cache_config_info")
    if info:
        snap.block_size = _int_label(info[0].labels, "block_size")
        blocks = [_int_label(s.labels, "num_gpu_blocks") for s in info]
        known = [b for b in blocks if b is not None]
        snap.num_blocks = sum(known) if known else None

    snap.ttft = ms.histogram(P + "time_to_first_token_seconds")
    snap.itl = ms.histogram(P + "inter_token_latency_seconds", P + "time_per_output_token_seconds")
    snap.e2e = ms.histogram(P + "e2e_request_latency_seconds")
    snap.queue_time = ms.histogram(P + "request_queue_time_seconds")
    snap.prompt_len = ms.histogram(P + "request_prompt_tokens")
    snap.generation_len = ms.histogram(P + "request_generation_tokens")

    for key, names in _RAW_SUMS.items():
        v = ms.sum(*names)
        if v is not None:
            snap.raw[key] = v
    return snap


class VllmAdapter(EngineAdapter):
    """vLLM's OpenAI server (also the project's simulator, which speaks the same dialect)."""

    kind = EngineKind.VLLM
    internal_fields = INTERNAL_FIELDS
    internal_field_carriers = INTERNAL_FIELD_CARRIERS
    scheduling_fields = frozenset({"priority"})  # (lower runs earlier; non-zero needs priority scheduling)

    def __init__(self, cache: TokenizeCache | None = None) -> None:
        self.cache = cache if cache is not None else TokenizeCache()

    async def health(self, client: httpx.AsyncClient, base_url: str, timeout: float) -> bool:
        return await probe_ok(client, f"{base_url}/health", timeout)

    def parse_metrics(self, text: str, now: float, model: str | None = None) -> LoadSnapshot:
        return parse_vllm_metrics(text, now, model)

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
        """Token ids as vLLM's completions (``prompt``) or chat (``messages``) endpoint computes them.

        Completions add the tokenizer's special tokens (BOS); chat renders the template with the
        generation prompt and adds no further special tokens — the same defaults the engine's
        own endpoints use — unless ``chat_options`` (the client's chat body) overrides a
        template field. A prompt that is already token ids is returned as is.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("tokenize needs exactly one of prompt or messages")
        if isinstance(prompt, list):
            return list(prompt)
        if prompt is not None:
            kind, content = "prompt", prompt
            body: dict[str, Any] = {"model": model, "prompt": prompt, "add_special_tokens": True}
        else:
            kind, content = "chat", messages
            options = {k: chat_options[k] for k in CHAT_TEMPLATE_FIELDS if chat_options and k in chat_options}
            if options.get("continue_final_message"):
                options.setdefault("add_generation_prompt", False)  # vLLM refuses both at once
            body = {"add_generation_prompt": True, "add_special_tokens": False, **options,
                    "model": model, "messages": messages}
            content = [messages, options] if options else messages
        return await fetch_tokens(client, f"{base_url}/tokenize", body, timeout, self.cache,
                                  content_key(model, kind, content))

    def shape_request(self, endpoint: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """vLLM takes the OpenAI body as is; the request id travels in the X-Request-Id header."""
        return body
