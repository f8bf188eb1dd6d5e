"""SGLang's dialect: ``/health`` (or ``/health_generate``), ``sglang:*`` metrics, ``/tokenize``.

SGLang cannot run on this machine (its PyPI build needs CUDA), so this adapter is built from
SGLang's documented wire protocol and its ``observability/metrics_collector.py`` and
``entrypoints/openai/protocol.py``, and tested against hand-written scrapes and the project's
simulator speaking this dialect — not against a real SGLang.

Metric facts used here:
- gauges ``num_running_reqs``, ``num_queue_reqs``, ``token_usage`` (KV pool usage 0..1),
  ``cache_hit_rate``, ``gen_throughput``, P/D queues (``num_prefill_*_queue_reqs``,
  ``num_decode_*_queue_reqs``), ``cache_config_info`` (``page_size``, ``num_pages``);
- counters ``prompt_tokens_total``, ``generation_tokens_total``, ``cached_tokens_total`` (newer
  releases split it by a ``cache_source`` label), ``num_requests_total``;
- histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds`` (older:
  ``time_per_output_token_seconds``), ``e2e_request_latency_seconds``, ``queue_time_seconds``,
  ``prompt_tokens_histogram``, ``generation_tokens_histogram``.
- The separator is ``sglang:``; some releases and wrappers export ``sglang_`` instead — both are
  read. Tensor-parallel ranks report the same scheduler state, so only ``tp_rank`` 0 (or series
  without the label) is counted; data-parallel ranks are summed.

``cached_tokens_total / prompt_tokens_total`` are exactly the prefix-cache hits/queries vLLM
reports, so they fill the same ``LoadSnapshot`` fields.
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx

from adapters.base import EngineAdapter, EngineKind, LoadSnapshot, UnsupportedByEngine
from adapters.engine_http import fetch_tokens, probe_ok
from adapters.prometheus_text import MetricSet, Sample, parse_samples
from adapters.tokenize_cache import TokenizeCache, content_key
from adapters.vllm import select_model

P = "sglang:"

# Fields Dyad sets on SGLang bodies: the dual-dispatch bootstrap (orchestrator/disagg/sglang_flow.py:
# which prefill server a decode server pulls KV from, and the pair's room) and the request id
# (``shape_request``; SGLang aborts and de-duplicates by it: the client's X-Request-Id with a random
# suffix). Only Dyad may set them.
BOOTSTRAP_HOST = "bootstrap_host"
BOOTSTRAP_PORT = "bootstrap_port"
BOOTSTRAP_ROOM = "bootstrap_room"
RID = "rid"
INTERNAL_FIELDS = frozenset({BOOTSTRAP_HOST, BOOTSTRAP_PORT, BOOTSTRAP_ROOM, RID})

_RAW_SUMS = {
    "gen_throughput": "gen_throughput",
    "num_used_tokens": "num_used_tokens",
    "num_grammar_queue_reqs": "num_grammar_queue_reqs",
    "num_prefill_bootstrap_queue_reqs": "num_prefill_bootstrap_queue_reqs",
    "num_prefill_prealloc_queue_reqs": "num_prefill_prealloc_queue_reqs",
    "num_prefill_inflight_queue_reqs": "num_prefill_inflight_queue_reqs",
    "num_decode_prealloc_queue_reqs": "num_decode_prealloc_queue_reqs",
    "num_decode_transfer_queue_reqs": "num_decode_transfer_queue_reqs",
    "num_retracted_reqs": "num_retracted_reqs",
}


def _canonical(samples: list[Sample]) -> list[Sample]:
    """Rename ``sglang_x`` to ``sglang:x`` so both exports read the same."""
    for s in samples:
        if s.name.startswith("sglang_"):
            s.name = P + s.name[len("sglang_") :]
    return samples


def parse_sglang_metrics(text: str, now: float, model: str | None = None) -> LoadSnapshot:
    """An SGLang ``/metrics`` page (``--enable-metrics``) → ``LoadSnapshot``."""
    ms = MetricSet(_canonical(parse_samples(text, ("sglang:", "sglang_"))))
    ms = ms.where(lambda labels: labels.get("tp_rank", "0") == "0")
    ms = select_model(ms, model)
    snap = LoadSnapshot(scraped_at=now)
    snap.running = ms.sum(P + "num_running_reqs") or 0.0
    snap.waiting = ms.sum(P + "num_queue_reqs") or 0.0
    snap.kv_usage = ms.mean(P + "token_usage") or 0.0
    snap.prompt_tokens = ms.sum(P + "prompt_tokens_total")
    snap.generation_tokens = ms.sum(P + "generation_tokens_total")
    cached = ms.sum(P + "cached_tokens_total")
    if cached is not None and snap.prompt_tokens is not None:
        snap.prefix_cache_queries = snap.prompt_tokens
        snap.prefix_cache_hits = cached
    snap.prefix_cache_hit_rate = ms.mean(P + "cache_hit_rate")
    snap.requests_finished = ms.sum(P + "num_requests_total")
    info = ms.info_labels(P + "cache_config_info")
    if info:
        for key, attr in (("page_size", "block_size"), ("num_pages", "num_blocks")):
            try:
                setattr(snap, attr, int(float(info[key])))
            except (KeyError, ValueError):
                pass
    snap.ttft = ms.histogram(P + "time_to_first_token_seconds")
    snap.itl = ms.histogram(P + "inter_token_latency_seconds", P + "time_per_output_token_seconds")
    snap.e2e = ms.histogram(P + "e2e_request_latency_seconds")
    snap.queue_time = ms.histogram(P + "queue_time_seconds")
    snap.prompt_len = ms.histogram(P + "prompt_tokens_histogram")
    snap.generation_len = ms.histogram(P + "generation_tokens_histogram")
    for key, name in _RAW_SUMS.items():
        v = ms.sum(P + name)
        if v is not None:
            snap.raw[key] = v
    return snap


class SglangAdapter(EngineAdapter):
    """SGLang's HTTP server (``python -m sglang.launch_server``)."""

    kind = EngineKind.SGLANG
    internal_fields = INTERNAL_FIELDS
    scheduling_fields = frozenset({"priority"})  # (lower runs earlier; non-zero needs priority scheduling)

    def __init__(self, cache: TokenizeCache | None = None, deep_health: bool = False) -> None:
        """``deep_health`` probes ``/health_generate`` (runs a one-token generation) instead of ``/health``."""
        self.cache = cache if cache is not None else TokenizeCache()
        self.deep_health = deep_health

    async def health(self, client: httpx.AsyncClient, base_url: str, timeout: float) -> bool:
        path = "/health_generate" if self.deep_health else "/health"
        return await probe_ok(client, base_url + path, timeout)

    def parse_metrics(self, text: str, now: float, model: str | None = None) -> LoadSnapshot:
        return parse_sglang_metrics(text, now, model)

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
        """Token ids of a completions prompt via SGLang's ``/tokenize``.

        SGLang's ``/tokenize`` takes text only (no chat template), so chats raise
        ``UnsupportedByEngine``; a router then tokenizes locally or routes without prefix overlap.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("tokenize needs exactly one of prompt or messages")
        if messages is not None:
            raise UnsupportedByEngine(
                "SGLang's /tokenize does not apply the chat template; tokenize chats with a local tokenizer"
            )
        if isinstance(prompt, list):
            return list(prompt)
        body = {"model": model, "prompt": prompt, "add_special_tokens": True}
        return await fetch_tokens(client, f"{base_url}/tokenize", body, timeout, self.cache,
                                  content_key(model, "prompt", prompt), batch_answer=True)

    def shape_request(self, endpoint: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """SGLang reads the request id from the body field ``rid`` (not from X-Request-Id) and keys the
        request by it (it de-duplicates and aborts by it).

        ``request_id`` may be the client's X-Request-Id (or a gateway id the client has seen and can
        guess), so the rid is Dyad's own: that id plus a random suffix (the id stays its prefix, for
        logs), fresh for every request sent. Set only for one-prompt requests: a batch of prompts would
        need one id per prompt. A client ``rid`` never gets here (it is an internal field, refused at
        intake).
        """
        prompt = body.get("prompt")
        is_batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        if is_batch:
            return body
        shaped = dict(body)
        shaped[RID] = f"{request_id}-{secrets.token_hex(8)}"
        return shaped
