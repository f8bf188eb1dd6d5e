"""Source of the Grafana dashboards: ``python dashboards/build.py`` writes ``dashboards/*.json``.

The JSON files are committed (import them into Grafana, or mount them with a dashboard
provisioner); this file is what a person edits. ``tests/ops/test_dashboards.py`` fails when the
committed JSON differs from what this script writes, and checks every metric name in every query
against a live scrape of a gateway and a simulated engine.

Queries use only metrics declared in ``orchestrator/telemetry/metrics.py``, the recording rules
in ``deploy/prometheus/rules.yml``, vLLM's ``vllm:*`` series and NVIDIA's DCGM exporter's
``DCGM_FI_*`` series (GPU utilization, power, memory; its default counter set). Variables: ``$datasource``,
``$model`` (gateway-side panels), ``$instance`` (gateway replica).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
GW = 'instance=~"$instance"'  # every dyad_* selector carries this (gateway replicas)
GWM = f'{GW}, model=~"$model"'


@dataclass
class Panel:
    title: str
    queries: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | bargauge | table
    width: int = 12
    height: int = 8
    description: str = ""
    max: float | None = None
    thresholds: list[tuple[float | None, str]] = field(default_factory=lambda: [(None, "green")])
    stack: bool = False


@dataclass
class Row:
    title: str
    panels: list[Panel]


def q(expr: str, legend: str = "") -> tuple[str, str]:
    return (expr, legend)


def quantiles(metric: str, by: str, sel: str, legend_prefix: str = "") -> list[tuple[str, str]]:
    """p50 and p99 of a histogram, summed over everything but ``by``."""
    by_clause = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return [q(f"histogram_quantile({p}, sum by ({by_clause}) (rate({metric}_bucket{{{sel}}}[$__rate_interval])))",
              f"{legend_prefix}{legend}p{int(p * 100)}") for p in (0.5, 0.99)]


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    targets = [{"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": chr(65 + i),
                "range": True, "instant": p.kind in ("bargauge", "table")}
               for i, (expr, legend) in enumerate(p.queries)]
    defaults: dict[str, Any] = {
        "unit": p.unit,
        "thresholds": {"mode": "absolute",
                       "steps": [{"color": c, "value": v} for v, c in p.thresholds]},
        "color": {"mode": "thresholds" if p.kind in ("stat", "bargauge") else "palette-classic"},
    }
    if p.max is not None:
        defaults["max"] = p.max
        defaults["min"] = 0
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if p.stack else 0,
                              "showPoints": "never", "spanNulls": True,
                              "stacking": {"mode": "normal" if p.stack else "none", "group": "A"}}
    options: dict[str, Any] = {"tooltip": {"mode": "multi", "sort": "desc"},
                               "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
    if p.kind == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto"}
    elif p.kind == "bargauge":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True}
    elif p.kind == "table":
        options = {"showHeader": True}
    return {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": DS,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "targets": targets, "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
    }


def dashboard(uid: str, title: str, description: str, rows: list[Row], *, model_var: bool = True) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in rows:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for p in row.panels:
            if x + p.width > 24:
                x, y, row_h = 0, y + row_h, 0
            panels.append(_panel_json(p, pid, x, y))
            pid, x, row_h = pid + 1, x + p.width, max(row_h, p.height)
        y += row_h
    variables: list[dict[str, Any]] = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "options": []},
        {"name": "instance", "label": "Gateway", "type": "query", "datasource": DS,
         "query": {"query": "label_values(dyad_requests_total, instance)", "refId": "instance"},
         "definition": "label_values(dyad_requests_total, instance)",
         "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2, "options": [],
         "sort": 1, "hide": 0},
    ]
    if model_var:
        variables.append(
            {"name": "model", "label": "Model", "type": "query", "datasource": DS,
             "query": {"query": "label_values(dyad_request_e2e_seconds_count, model)", "refId": "model"},
             "definition": "label_values(dyad_request_e2e_seconds_count, model)",
             "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2, "options": [],
             "sort": 1, "hide": 0})
    return {
        "uid": uid, "title": title, "description": description, "tags": ["dyad"], "editable": True,
        "schemaVersion": 39, "version": 1, "timezone": "browser", "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "graphTooltip": 1,
        "templating": {"list": variables}, "annotations": {"list": []}, "links": [],
        "panels": panels,
    }


# --- the three dashboards ----------------------------------------------------------------------

def fleet_overview() -> dict[str, Any]:
    slo = [(None, "green"), (0.5, "red")]
    return dashboard("dyad-fleet", "Dyad / Fleet overview",
                     "Is the service healthy, fast and within SLO? Gateway-side view first, engines below.", [
        Row("Service", [
            Panel("Requests / s", [q(f"sum(rate(dyad_requests_total{{{GWM}}}[$__rate_interval]))")],
                  "reqps", "stat", 6, 4),
            Panel("5xx ratio", [q(f'sum(rate(dyad_requests_total{{{GWM}, status=~"5.."}}[$__rate_interval])) '
                                  f"/ sum(rate(dyad_requests_total{{{GWM}}}[$__rate_interval]))")],
                  "percentunit", "stat", 6, 4, thresholds=[(None, "green"), (0.01, "orange"), (0.05, "red")]),
            Panel("Healthy workers", [q(f"sum(dyad_worker_healthy{{{GW}}})", "healthy"),
                                      q(f"count(dyad_worker_healthy{{{GW}}})", "registered")],
                  "short", "stat", 6, 4, description="Workers passing health checks, of those registered."),
            Panel("In flight", [q(f"sum(dyad_requests_inflight{{{GWM}}})")], "short", "stat", 6, 4),
            Panel("Requests by status", [q(f"sum by (status) (rate(dyad_requests_total{{{GWM}}}[$__rate_interval]))",
                                           "{{status}}")], "reqps", stack=True, width=8),
            Panel("Time to first token (gateway)", quantiles("dyad_request_ttft_seconds", "", GWM), "s", width=8,
                  thresholds=slo, description="Measured at the gateway, so it includes routing and queueing."),
            Panel("Inter-token latency (gateway)", quantiles("dyad_request_itl_seconds", "", GWM), "s", width=8),
            Panel("End-to-end latency by endpoint", quantiles("dyad_request_e2e_seconds", "endpoint", GWM), "s",
                  width=8),
            Panel("TTFT p99 vs SLO (recording rule)", [q('dyad:request_ttft_seconds:p99_5m{model=~"$model"}',
                                                         "{{model}}")], "s", width=8, thresholds=slo),
            Panel("Prompt / generated tokens per request (p50)",
                  [q(f"histogram_quantile(0.5, sum by (le) (rate(dyad_request_prompt_tokens_bucket{{{GWM}}}"
                     "[$__rate_interval])))", "prompt"),
                   q(f"histogram_quantile(0.5, sum by (le) (rate(dyad_request_generation_tokens_bucket{{{GWM}}}"
                     "[$__rate_interval])))", "generated")], "short", width=8),
        ]),
        Row("Failures", [
            Panel("Upstream errors by worker and kind",
                  [q(f"sum by (worker, kind) (rate(dyad_upstream_errors_total{{{GW}}}[$__rate_interval]))",
                     "{{worker}} {{kind}}")], "ops", width=6),
            Panel("Retries and client disconnects",
                  [q(f"sum(rate(dyad_retries_total{{{GWM}}}[$__rate_interval]))", "retried"),
                   q(f"sum(rate(dyad_client_disconnects_total{{{GWM}}}[$__rate_interval]))", "client gone")],
                  "ops", width=6),
            Panel("Refused before dispatch",
                  [q(f"sum by (reason) (rate(dyad_rejected_requests_total{{{GW}}}[$__rate_interval]))",
                     "{{reason}}")], "ops", width=6),
            Panel("Engine metric scrape errors",
                  [q(f"sum by (worker) (rate(dyad_worker_scrape_errors_total{{{GW}}}[$__rate_interval]))",
                     "{{worker}}")], "ops", width=6),
        ]),
        Row("Workers", [
            Panel("Health (1 = passing)", [q(f"max by (worker) (dyad_worker_healthy{{{GW}}})", "{{worker}}")],
                  "short", "bargauge", 6, 8, max=1, thresholds=[(None, "red"), (1, "green")]),
            Panel("In flight per worker (gateway count)",
                  [q(f"sum by (worker) (dyad_worker_inflight_requests{{{GW}}})", "{{worker}}")], width=9),
            Panel("Engine queue: running / waiting",
                  [q(f"max by (worker) (dyad_worker_running_requests{{{GW}}})", "{{worker}} running"),
                   q(f"max by (worker) (dyad_worker_waiting_requests{{{GW}}})", "{{worker}} waiting")], width=9),
            Panel("KV cache usage", [q(f"max by (worker) (dyad_worker_kv_usage_ratio{{{GW}}})", "{{worker}}")],
                  "percentunit", "bargauge", 12, 8, max=1,
                  thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")]),
            Panel("Worker state", [q(f"sum by (state) (max by (worker, state) (dyad_worker_state{{{GW}}}))",
                                     "{{state}}")], stack=True, width=12),
        ]),
        Row("Engines (vLLM's own metrics)", [
            Panel("Engine TTFT p99", [q("histogram_quantile(0.99, sum by (le, instance) "
                                        "(rate(vllm:time_to_first_token_seconds_bucket[$__rate_interval])))",
                                        "{{instance}}")], "s", width=8),
            Panel("Engine queue time p99", [q("histogram_quantile(0.99, sum by (le, instance) "
                                              "(rate(vllm:request_queue_time_seconds_bucket[$__rate_interval])))",
                                              "{{instance}}")], "s", width=8),
            Panel("Tokens / s", [q("sum(rate(vllm:prompt_tokens_total[$__rate_interval]))", "prompt"),
                                 q("sum(rate(vllm:generation_tokens_total[$__rate_interval]))", "generated")],
                  "short", width=8),
            Panel("Running / waiting at engines",
                  [q("sum by (instance) (vllm:num_requests_running)", "{{instance}} running"),
                   q("sum by (instance) (vllm:num_requests_waiting)", "{{instance}} waiting")], width=12),
            Panel("Preemptions / s", [q("sum by (instance) (rate(vllm:num_preemptions_total[$__rate_interval]))",
                                        "{{instance}}")], "ops", width=12),
        ]),
        Row("GPUs (DCGM exporter)", gpu_panels()),
    ])


GPU = "Hostname, gpu"  # DCGM exporter labels naming one GPU (pod labels get renamed by some scrape setups)


def gpu_panels() -> list[Panel]:
    """NVIDIA's DCGM exporter (a DaemonSet on the GPU nodes, scraped by the same Prometheus): is the
    hardware busy, how much power does it draw, how full is its memory, and what does a token cost."""
    per_gpu = "{{Hostname}} gpu {{gpu}}"
    return [
        Panel("GPU utilization", [q(f"avg by ({GPU}) (DCGM_FI_DEV_GPU_UTIL)", per_gpu)], "percent", width=8,
              max=100, description="Share of time a kernel ran on the GPU (DCGM_FI_DEV_GPU_UTIL). Prefill GPUs "
                                   "near 100 % and decode GPUs far below is the usual P/D shape."),
        Panel("GPU power draw", [q(f"sum by ({GPU}) (DCGM_FI_DEV_POWER_USAGE)", per_gpu)], "watt", width=8),
        Panel("GPU memory used", [q(f"sum by ({GPU}) (DCGM_FI_DEV_FB_USED) / (sum by ({GPU}) (DCGM_FI_DEV_FB_USED) "
                                    f"+ sum by ({GPU}) (DCGM_FI_DEV_FB_FREE))", per_gpu)],
              "percentunit", width=8, max=1, thresholds=[(None, "green"), (0.95, "orange")],
              description="Framebuffer used / (used + free). vLLM reserves most of it for the KV cache at "
                          "start, so high is normal; KV usage per worker is in the Workers row."),
        Panel("Fleet GPU power", [q("sum(DCGM_FI_DEV_POWER_USAGE)")], "watt", "stat", 6, 4),
        Panel("Mean GPU utilization", [q("avg(DCGM_FI_DEV_GPU_UTIL)")], "percent", "stat", 6, 4, max=100,
              thresholds=[(None, "orange"), (30, "green")]),
        Panel("Generated tokens per joule",
              [q("sum(rate(vllm:generation_tokens_total[$__rate_interval])) / sum(DCGM_FI_DEV_POWER_USAGE)",
                 "tokens / J")], "short", "stat", 12, 4,
              description="Engines' generated tokens per second over the GPUs' power draw in watts."),
    ]


def routing_and_cache() -> dict[str, Any]:
    return dashboard("dyad-routing", "Dyad / Routing and cache",
                     "Where traffic goes and why: routing decisions, predicted vs actual prefix-cache hits, "
                     "the prefix index and the KV event streams that feed it.", [
        Row("Routing", [
            Panel("Decisions by policy and outcome",
                  [q(f"sum by (policy, outcome) (rate(dyad_routing_decisions_total{{{GW}}}[$__rate_interval]))",
                     "{{policy}} {{outcome}}")], "ops", width=8),
            Panel("Routing time (tokenize + index + policy)",
                  quantiles("dyad_routing_decision_seconds", "policy", GW), "s", width=8),
            Panel("Load spread: in flight per worker",
                  [q(f"sum by (worker) (dyad_worker_inflight_requests{{{GW}}})", "{{worker}}")], stack=True,
                  width=8),
        ]),
        Row("Prefix cache: predicted vs actual", [
            Panel("Predicted hit ratio (router)",
                  [q(f"sum(rate(dyad_predicted_cached_tokens_total{{{GWM}}}[$__rate_interval])) / "
                     f"sum(rate(dyad_routed_prompt_tokens_total{{{GWM}}}[$__rate_interval]))", "predicted"),
                   q("sum(rate(vllm:prefix_cache_hits_total[$__rate_interval])) / "
                     "sum(rate(vllm:prefix_cache_queries_total[$__rate_interval]))", "actual (engines)")],
                  "percentunit", width=8, max=1,
                  description="Share of prompt tokens the router expected to hit a prefix cache, against "
                              "what the engines report. A gap means the index is stale or blind."),
            Panel("Cached tokens / s: predicted vs engine-reported",
                  [q(f"sum(rate(dyad_predicted_cached_tokens_total{{{GWM}}}[$__rate_interval]))", "predicted"),
                   q(f"sum(rate(dyad_worker_prefix_cache_hit_tokens{{{GW}}}[$__rate_interval]))",
                     "engines (via gateway scrape)")], "short", width=8),
            Panel("Engine prefix-cache hit ratio per worker",
                  [q(f"max by (worker) (dyad_worker_prefix_cache_hit_ratio{{{GW}}})", "{{worker}}")],
                  "percentunit", "bargauge", 8, 8, max=1,
                  thresholds=[(None, "red"), (0.3, "orange"), (0.6, "green")]),
            Panel("Predicted hit ratio, 5 min (recording rule)",
                  [q('dyad:predicted_cache_hit_ratio:rate5m{model=~"$model"}', "{{model}}")], "percentunit",
                  width=12, max=1),
            Panel("Prompt tokens by source (engines)",
                  [q("sum by (source) (rate(vllm:prompt_tokens_by_source_total[$__rate_interval]))", "{{source}}")],
                  "short", stack=True, width=12),
        ]),
        Row("Prefix index and KV events", [
            Panel("Index entries vs cap",
                  [q(f"sum by (backend) (dyad_index_blocks{{{GW}}})", "{{backend}} entries"),
                   q(f"max by (backend) (dyad_index_capacity_blocks{{{GW}}})", "{{backend}} cap")], width=8),
            Panel("Index evictions / s",
                  [q(f"sum by (backend) (rate(dyad_index_evictions_total{{{GW}}}[$__rate_interval]))",
                     "{{backend}}")], "ops", width=8),
            Panel("Index lookup time", quantiles("dyad_index_lookup_seconds", "backend", GW), "s", width=8),
            Panel("KV events / s by type",
                  [q(f"sum by (type) (rate(dyad_kv_events_total{{{GW}}}[$__rate_interval]))", "{{type}}")],
                  "ops", stack=True, width=8),
            Panel("KV event lag per worker", [q(f"max by (worker) (dyad_kv_event_lag_seconds{{{GW}}})",
                                                "{{worker}}")], "s", width=8,
                  thresholds=[(None, "green"), (5, "red")]),
            Panel("KV event sequence gaps (1 h)",
                  [q(f"sum by (worker) (increase(dyad_kv_event_gaps_total{{{GW}}}[1h]))", "{{worker}}")],
                  "short", "bargauge", 8, 8, thresholds=[(None, "green"), (1, "red")]),
            Panel("Replicas on local index mirror",
                  [q(f"max by (instance, backend) (dyad_index_mirror_only{{{GW}}})", "{{instance}} {{backend}}")],
                  "short", width=12, max=1, thresholds=[(None, "green"), (1, "red")],
                  description="1 while a gateway replica routes from its own mirror because the shared index "
                              "(redis / redis_cluster) does not answer; alert DyadIndexOnLocalMirror after 5 min. "
                              "docs/operations.md, Failover."),
            Panel("Time on local index mirror",
                  [q(f"max by (instance, backend) ((time() - dyad_index_mirror_since_timestamp_seconds{{{GW}}}) "
                     f"and (dyad_index_mirror_since_timestamp_seconds{{{GW}}} > 0))", "{{instance}} {{backend}}")],
                  "s", width=12, thresholds=[(None, "green"), (300, "red")],
                  description="How long each replica has been on its mirror (empty when none is). A failover "
                              "takes seconds; minutes mean a node with no promoted replica, or Redis gone."),
        ]),
    ])


def pd_and_planner() -> dict[str, Any]:
    return dashboard("dyad-pd-planner", "Dyad / Prefill-decode and planner",
                     "Disaggregated serving (prefill pool, decode pool, KV transfer) and what the SLO "
                     "planner predicts and decides.", [
        Row("Prefill / decode", [
            Panel("Requests by P/D mode",
                  [q(f"sum by (mode) (rate(dyad_pd_requests_total{{{GW}}}[$__rate_interval]))", "{{mode}}")],
                  "reqps", stack=True, width=8,
                  description="disaggregated: prefilled on a prefill worker; local: short prompt prefilled on "
                              "the decode worker; fallback: prefill step failed, decode recomputed."),
            Panel("Prefill step time (gateway)", quantiles("dyad_pd_prefill_seconds", "", GW), "s", width=8),
            Panel("KV tokens received over the connector",
                  [q('sum by (instance) (rate(vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
                     "[$__rate_interval]))", "{{instance}}")], "short", width=8),
            Panel("Workers by role", [q(f"sum by (role) (max by (worker, role) (dyad_worker_role{{{GW}}}))",
                                        "{{role}}")], stack=True, width=8),
            Panel("Role changes", [q(f"sum by (from_role, to_role) (increase(dyad_role_changes_total{{{GW}}}[1h]))",
                                     "{{from_role}} → {{to_role}}")], "short", "bargauge", 8, 8),
            Panel("KV usage: prefill vs decode workers",
                  [q(f"avg by (role) (dyad_worker_kv_usage_ratio{{{GW}}} * on (instance, worker) group_left (role) "
                     f"(dyad_worker_role{{{GW}}} == 1))", "{{role}}")], "percentunit", width=8, max=1),
        ]),
        Row("Planner", [
            Panel("Desired vs current workers",
                  [q(f"max by (role) (dyad_planner_desired_workers{{{GW}}})", "{{role}} desired"),
                   q(f"sum by (role) (max by (worker, role) (dyad_worker_role{{{GW}}}))", "{{role}} current"),
                   q(f"max(dyad_planner_max_workers{{{GW}}})", "budget")], width=12),
            Panel("Planner predictions for the next interval",
                  [q(f"max by (quantity) (dyad_planner_predicted{{{GW}}})", "{{quantity}}")], width=12),
            Panel("Planner decisions", [q(f"sum by (action) (increase(dyad_planner_decisions_total{{{GW}}}[1h]))",
                                          "{{action}}")], "short", "bargauge", 8, 8),
            Panel("TTFT / ITL p99 vs SLO (recording rules)",
                  [q("max(dyad:request_ttft_seconds:p99_5m)", "TTFT p99"),
                   q("max(dyad:request_itl_seconds:p99_5m)", "ITL p99")], "s", width=16,
                  thresholds=[(None, "green"), (0.5, "red")]),
        ]),
    ], model_var=False)


DASHBOARDS = {
    "fleet-overview.json": fleet_overview,
    "routing-and-cache.json": routing_and_cache,
    "pd-and-planner.json": pd_and_planner,
}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n" for name, build in DASHBOARDS.items()}


if __name__ == "__main__":
    for name, text in render().items():
        (HERE / name).write_text(text)
        print(f"wrote {HERE / name}")
