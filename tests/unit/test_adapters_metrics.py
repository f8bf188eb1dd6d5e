"""Metric parsing: the text-format reader and the vLLM/SGLang normalization into LoadSnapshot.

Inputs: a real vLLM 0.32 scrape (copied into
tests/unit/data so the suite does not depend on the shared folder), and hand-written scrapes in
the older vLLM names and in SGLang's names (SGLang cannot run here; the names come from its
metrics_collector.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from adapters import EngineKind, SglangAdapter, VllmAdapter, get_adapter
from adapters.prometheus_text import MetricSet, parse_samples

DATA = Path(__file__).parent / "data"
REAL_VLLM_032 = (DATA / "vllm-0.32-metrics.txt").read_text()


# --- text format -------------------------------------------------------------------------------


def test_parse_samples_handles_labels_escapes_special_values_and_junk():
    text = "\n".join(
        [
            "# HELP x A help line with {braces}",
            "# TYPE x gauge",
            'x{a="1",b="q\\"uo}te\\\\",c="line\\nbreak"} 2.5',
            "plain 7",
            'withts{a="z"} 3 1700000000000',
            "inf_metric +Inf",
            "neg_inf -Inf",
            "nan_metric NaN",
            "broken_line_without_value",
            'bad_value{a="1"} notanumber',
            "",
        ]
    )
    samples = {s.name: s for s in parse_samples(text)}
    assert samples["x"].labels == {"a": "1", "b": 'q"uo}te\\', "c": "line\nbreak"}
    assert samples["x"].value == 2.5
    assert samples["plain"].value == 7 and samples["plain"].labels == {}
    assert samples["withts"].value == 3
    assert samples["inf_metric"].value == math.inf
    assert samples["neg_inf"].value == -math.inf
    assert math.isnan(samples["nan_metric"].value)
    assert "broken_line_without_value" not in samples and "bad_value" not in samples


def test_prefix_filter_keeps_only_engine_series():
    names = {s.name for s in parse_samples(REAL_VLLM_032, ("vllm:",))}
    assert names and all(n.startswith("vllm:") for n in names)
    assert "process_cpu_seconds_total" not in names


def test_matches_prometheus_client_parser_on_real_scrape():
    """Our reader and the reference parser agree sample for sample on a real vLLM page."""
    from prometheus_client.parser import text_string_to_metric_families

    ref = {}
    for fam in text_string_to_metric_families(REAL_VLLM_032):
        for s in fam.samples:
            ref[(s.name, tuple(sorted(s.labels.items())))] = s.value
    ours = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_samples(REAL_VLLM_032)}
    assert ours.keys() == ref.keys()
    for k, v in ref.items():
        assert ours[k] == pytest.approx(v, nan_ok=True), k


def test_histogram_merges_ranks_and_interpolates():
    text = "\n".join(
        f'h_bucket{{engine="{e}",le="{le}"}} {c}'
        for e, counts in (("0", (1, 3, 4)), ("1", (0, 2, 2)))
        for le, c in zip(("0.1", "1.0", "+Inf"), counts, strict=True)
    )
    text += '\nh_sum{engine="0"} 2.0\nh_sum{engine="1"} 1.0\nh_count{engine="0"} 4\nh_count{engine="1"} 2\n'
    h = MetricSet.parse(text).histogram("h")
    assert h.buckets == [(0.1, 1.0), (1.0, 5.0), (math.inf, 6.0)]
    assert h.count == 6 and h.sum == 3.0
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.9 * (3 - 1) / 4)


# --- vLLM 0.32 (real scrape) -------------------------------------------------------------------


def test_vllm_real_scrape_normalizes_every_field():
    snap = VllmAdapter().parse_metrics(REAL_VLLM_032, now=12.5)
    assert snap.scraped_at == 12.5
    assert (snap.running, snap.waiting, snap.kv_usage) == (0.0, 0.0, 0.0)
    assert snap.prefix_cache_queries == 323 and snap.prefix_cache_hits == 160
    assert snap.cache_hit_ratio == pytest.approx(160 / 323)
    assert snap.prompt_tokens == 323 and snap.generation_tokens == 22
    assert snap.prompt_tokens_by_source == {"local_compute": 163, "local_cache_hit": 160, "external_kv_transfer": 0}
    assert snap.requests_finished == 6  # summed over finished_reason
    assert snap.preemptions == 0
    assert snap.block_size == 32 and snap.num_blocks == 65536
    assert snap.ttft.count == 6 and snap.ttft.sum == pytest.approx(0.0788230896)
    assert snap.itl.count == 16  # inter_token_latency_seconds
    assert snap.e2e.count == 6 and snap.queue_time.count == 6
    assert snap.prompt_len.sum == 323 and snap.generation_len.sum == 22
    assert 0.01 <= snap.ttft.quantile(0.5) <= 0.02  # 5 of 6 first tokens in (0.01, 0.02]
    assert snap.raw["prefill_time_seconds_count"] == 6


# Older vLLM (v0 / v1 <= 0.10) names, two data-parallel ranks, two models on one page.
OLD_VLLM = """
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="other"} 50.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
vllm:num_requests_swapped{engine="0",model_name="m"} 0.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.6
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:gpu_prefix_cache_queries_total{engine="1",model_name="m"} 300.0
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:gpu_prefix_cache_hits_total{engine="1",model_name="m"} 90.0
vllm:time_per_output_token_seconds_bucket{engine="0",le="0.01",model_name="m"} 5.0
vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 8.0
vllm:time_per_output_token_seconds_bucket{engine="1",le="0.01",model_name="m"} 1.0
vllm:time_per_output_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 2.0
vllm:time_per_output_token_seconds_sum{engine="0",model_name="m"} 0.5
vllm:time_per_output_token_seconds_sum{engine="1",model_name="m"} 0.1
vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 8.0
vllm:time_per_output_token_seconds_count{engine="1",model_name="m"} 2.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
"""

V0_HIT_RATE = """
vllm:num_requests_running{model_name="m"} 1.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.25
"""


def test_vllm_old_names_sum_ranks_average_kv_and_pick_model():
    snap = VllmAdapter().parse_metrics(OLD_VLLM, now=0.0, model="m")
    assert snap.running == 5 and snap.waiting == 5  # summed over engine ranks, model "other" excluded
    assert snap.kv_usage == pytest.approx(0.4)  # mean of the ranks' fractions
    assert snap.prefix_cache_queries == 400 and snap.prefix_cache_hits == 100
    assert snap.cache_hit_ratio == pytest.approx(0.25)
    assert snap.itl.count == 10 and snap.itl.buckets == [(0.01, 6.0), (math.inf, 10.0)]
    assert snap.block_size == 16 and snap.num_blocks == 2000
    assert snap.raw["num_requests_swapped"] == 0
    assert snap.prompt_tokens is None and snap.ttft is None  # absent, not zero


def test_vllm_without_model_takes_first_model_on_page():
    snap = VllmAdapter().parse_metrics(OLD_VLLM, now=0.0)
    assert snap.running == 5


def test_vllm_other_model_selected():
    snap = VllmAdapter().parse_metrics(OLD_VLLM, now=0.0, model="other")
    assert snap.running == 50 and snap.waiting == 0


def test_vllm_unknown_model_name_falls_back_to_the_page_model():
    snap = VllmAdapter().parse_metrics(REAL_VLLM_032, now=0.0, model="served-under-another-name")
    assert snap.prompt_tokens == 323  # not an empty, falsely idle snapshot


def test_vllm_v0_hit_rate_gauge():
    snap = VllmAdapter().parse_metrics(V0_HIT_RATE, now=0.0)
    assert snap.prefix_cache_queries is None
    assert snap.prefix_cache_hit_rate == 0.25 and snap.cache_hit_ratio == 0.25
    assert snap.kv_usage == 0.5


def test_vllm_empty_or_garbage_page_gives_empty_snapshot():
    for text in ("", "<html>not metrics</html>", "# only comments\n"):
        snap = VllmAdapter().parse_metrics(text, now=1.0)
        assert snap.running == 0 and snap.prefix_cache_queries is None and snap.ttft is None


# --- SGLang (hand-written from its metrics_collector.py) ----------------------------------------

SGLANG = """
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen",tp_rank="0",dp_rank="0"} 7.0
sglang:num_running_reqs{engine_type="unified",model_name="qwen",tp_rank="1",dp_rank="0"} 7.0
sglang:num_running_reqs{engine_type="unified",model_name="qwen",tp_rank="0",dp_rank="1"} 3.0
sglang:num_queue_reqs{model_name="qwen",tp_rank="0",dp_rank="0"} 2.0
sglang:num_queue_reqs{model_name="qwen",tp_rank="0",dp_rank="1"} 1.0
sglang:token_usage{model_name="qwen",tp_rank="0",dp_rank="0"} 0.3
sglang:token_usage{model_name="qwen",tp_rank="0",dp_rank="1"} 0.5
sglang:cache_hit_rate{model_name="qwen",tp_rank="0",dp_rank="0"} 0.4
sglang:cache_hit_rate{model_name="qwen",tp_rank="0",dp_rank="1"} 0.6
sglang:gen_throughput{model_name="qwen",tp_rank="0",dp_rank="0"} 120.5
sglang:num_decode_prealloc_queue_reqs{model_name="qwen",tp_rank="0",dp_rank="0"} 4.0
sglang:prompt_tokens_total{model_name="qwen"} 1000.0
sglang:generation_tokens_total{model_name="qwen"} 250.0
sglang:cached_tokens_total{model_name="qwen",cache_source="device"} 300.0
sglang:cached_tokens_total{model_name="qwen",cache_source="host"} 100.0
sglang:num_requests_total{model_name="qwen"} 20.0
sglang:cache_config_info{model_name="qwen",page_size="64",num_pages="500"} 1.0
sglang:time_to_first_token_seconds_bucket{model_name="qwen",le="0.1"} 15.0
sglang:time_to_first_token_seconds_bucket{model_name="qwen",le="+Inf"} 20.0
sglang:time_to_first_token_seconds_sum{model_name="qwen"} 3.0
sglang:time_to_first_token_seconds_count{model_name="qwen"} 20.0
sglang:inter_token_latency_seconds_bucket{model_name="qwen",le="0.02"} 200.0
sglang:inter_token_latency_seconds_bucket{model_name="qwen",le="+Inf"} 230.0
sglang:inter_token_latency_seconds_sum{model_name="qwen"} 4.0
sglang:inter_token_latency_seconds_count{model_name="qwen"} 230.0
sglang:e2e_request_latency_seconds_bucket{model_name="qwen",le="+Inf"} 20.0
sglang:e2e_request_latency_seconds_sum{model_name="qwen"} 30.0
sglang:e2e_request_latency_seconds_count{model_name="qwen"} 20.0
"""


def test_sglang_names_normalize():
    snap = SglangAdapter().parse_metrics(SGLANG, now=3.0)
    assert snap.running == 10  # dp ranks summed, tp_rank 1 duplicate ignored
    assert snap.waiting == 3
    assert snap.kv_usage == pytest.approx(0.4)
    assert snap.prefix_cache_queries == 1000 and snap.prefix_cache_hits == 400  # all cache sources
    assert snap.cache_hit_ratio == pytest.approx(0.4)
    assert snap.prefix_cache_hit_rate == pytest.approx(0.5)  # engine's own gauge, kept too
    assert snap.prompt_tokens == 1000 and snap.generation_tokens == 250
    assert snap.requests_finished == 20
    assert snap.block_size == 64 and snap.num_blocks == 500
    assert snap.ttft.count == 20 and snap.ttft.quantile(0.5) == pytest.approx(0.1 * 10 / 15)
    assert snap.itl.count == 230 and snap.e2e.mean() == pytest.approx(1.5)
    assert snap.raw["gen_throughput"] == 120.5 and snap.raw["num_decode_prealloc_queue_reqs"] == 4


def test_sglang_underscore_prefix_and_old_itl_name():
    text = SGLANG.replace("sglang:", "sglang_").replace("inter_token_latency", "time_per_output_token")
    snap = SglangAdapter().parse_metrics(text, now=0.0)
    assert snap.running == 10 and snap.itl.count == 230


def test_sglang_without_cached_counter_keeps_only_rate():
    text = "\n".join(line for line in SGLANG.splitlines() if "cached_tokens" not in line)
    snap = SglangAdapter().parse_metrics(text, now=0.0)
    assert snap.prefix_cache_queries is None and snap.cache_hit_ratio == pytest.approx(0.5)


def test_get_adapter_by_kind():
    assert isinstance(get_adapter(EngineKind.VLLM), VllmAdapter)
    assert get_adapter("sim") is get_adapter(EngineKind.VLLM)  # the simulator speaks vLLM's dialect
    assert isinstance(get_adapter("sglang"), SglangAdapter)
    assert get_adapter("sglang") is get_adapter(EngineKind.SGLANG)
    with pytest.raises(ValueError):
        get_adapter("tgi")
