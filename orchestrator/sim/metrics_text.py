"""Prometheus text exposition of a simulated engine, under vLLM's or SGLang's real metric names.

Rendered by hand from the core's counters (no prometheus_client registry per engine): it is fast,
and the names, types and labels are exactly the ones the engines export (vLLM 0.32:
tests/unit/data/vllm-0.32-metrics.txt; SGLang: docs/engines.md §6).
"""

from __future__ import annotations

import math

from orchestrator.sim.engine_model import EngineModel, Hist


def _labels(base: dict[str, str], extra: dict[str, str] | None = None) -> str:
    d = dict(base)
    if extra:
        d.update(extra)
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(d.items())) + "}"


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def meta(self, name: str, typ: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {typ}")

    def sample(self, name: str, labels: str, value: float) -> None:
        self.lines.append(f"{name}{labels} {_num(value)}")

    def gauge(self, name: str, help_text: str, labels: dict[str, str], value: float) -> None:
        self.meta(name, "gauge", help_text)
        self.sample(name, _labels(labels), value)

    def counter(self, name: str, help_text: str, series: list[tuple[dict[str, str], float]]) -> None:
        self.meta(name, "counter", help_text)
        for labels, v in series:
            self.sample(f"{name}_total", _labels(labels), v)

    def histogram(self, name: str, help_text: str, labels: dict[str, str], h: Hist) -> None:
        self.meta(name, "histogram", help_text)
        for bound, cum in h.cumulative():
            self.sample(f"{name}_bucket", _labels(labels, {"le": _num(bound)}), cum)
        self.sample(f"{name}_count", _labels(labels), h.count)
        self.sample(f"{name}_sum", _labels(labels), h.sum)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render_vllm(m: EngineModel, model_name: str, engine: str = "0") -> str:
    st = m.stats
    p = m.profile
    lb = {"engine": engine, "model_name": model_name}
    w = _Writer()
    w.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lb, m.num_running)
    w.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lb, m.num_waiting)
    w.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lb, m.kv_usage)
    w.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
              [(lb, st.prefix_cache_queries)])
    w.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
              [(lb, st.prefix_cache_hits)])
    if p.host_kv_tokens:  # vLLM exports these when a KV connector (here: CPU offloading) is configured
        w.counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                  "cross-instance cache sharing, in terms of number of queried tokens.", [(lb, st.host_cache_queries)])
        w.counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                  "cross-instance cache sharing, in terms of number of cached tokens.", [(lb, st.host_cache_hits)])
    w.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", [(lb, st.num_preemptions)])
    w.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [(lb, st.prompt_tokens)])
    w.counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
              [({**lb, "source": s}, v) for s, v in st.prompt_tokens_by_source.items()])
    w.counter("vllm:generation_tokens", "Number of generation tokens processed.", [(lb, st.generation_tokens)])
    w.counter("vllm:request_success", "Count of successfully processed requests.",
              [({**lb, "finished_reason": r}, v) for r, v in st.request_success.items()])
    w.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", lb, st.prompt_len)
    w.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", lb, st.generation_len)
    w.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", lb, st.ttft)
    w.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", lb, st.itl)
    w.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lb, st.e2e)
    w.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", lb,
                st.queue_time)
    w.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", lb,
                st.prefill_time)
    w.histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", lb,
                st.decode_time)
    info = {
        "block_size": str(p.block_size), "num_gpu_blocks": str(p.num_gpu_blocks), "enable_prefix_caching": "True",
        "cache_dtype": "auto", "prefix_caching_hash_algo": "sim", "num_cpu_blocks": "None", "engine": engine,
        "model_name": model_name,
    }
    w.gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", info, 1.0)
    return w.text()


def render_sglang(m: EngineModel, model_name: str, mode: str = "null", gen_throughput: float = 0.0) -> str:
    st = m.stats
    p = m.profile
    lb = {"model_name": model_name, "engine_type": "unified" if mode == "null" else mode, "tp_rank": "0", "pp_rank": "0"}
    w = _Writer()
    w.gauge("sglang:num_running_reqs", "The number of running requests.", lb, m.num_running)
    w.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", lb, m.num_waiting)
    w.gauge("sglang:token_usage", "The token usage.", lb, m.kv_usage)
    hit = st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0
    w.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", lb, hit)
    w.gauge("sglang:gen_throughput", "The generation throughput (token/s).", lb, gen_throughput)
    w.gauge("sglang:num_prefill_prealloc_queue_reqs", "The number of requests in the prefill prealloc queue.", lb,
            0.0)
    w.gauge("sglang:num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.", lb,
            m.num_waiting if mode == "decode" else 0.0)
    w.gauge("sglang:max_total_num_tokens", "Maximum total number of tokens", lb, p.cache_tokens)
    w.counter("sglang:prompt_tokens", "Number of prefill tokens processed.", [(lb, st.prompt_tokens)])
    w.counter("sglang:generation_tokens", "Number of generation tokens processed.", [(lb, st.generation_tokens)])
    w.counter("sglang:cached_tokens", "Number of cached prompt tokens.", [(lb, st.prefix_cache_hits)])
    w.counter("sglang:num_requests", "Number of requests processed.", [(lb, sum(st.request_success.values()))])
    w.histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", lb, st.ttft)
    w.histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", lb, st.itl)
    w.histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", lb,
                st.e2e)
    w.gauge("sglang:cache_config_info", "Information of the cache config",
            {**lb, "page_size": str(p.block_size), "num_pages": str(p.num_gpu_blocks)}, 1.0)
    return w.text()
