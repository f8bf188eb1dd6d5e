"""Dashboards name only metrics that exist: every metric in every panel query (and variable query)
is checked against a live scrape of a gateway in front of a simulated fleet, the simulated
engine's ``/metrics``, a real vLLM 0.32 scrape, the recording rules, and (for the GPU panels) a DCGM
exporter answer; then every query runs in a real Prometheus scraping that gateway, those engines and
the DCGM exporter answer served over HTTP.

The DCGM series cannot come from this machine (no GPU, no exporter): ``data/dcgm-exporter-sample.txt``
is written from the exporter's default counter set and label scheme, and says so. What it proves is
that the GPU panels' names, labels and arithmetic work on the exporter's format, not that a
particular exporter version still emits them."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
REAL_VLLM_SCRAPE = ROOT / "tests" / "unit" / "data" / "vllm-0.32-metrics.txt"  # a real vLLM 0.32 scrape
DCGM_SAMPLE = Path(__file__).resolve().parent / "data" / "dcgm-exporter-sample.txt"
GPU_PANELS = ("GPU utilization", "GPU power draw", "GPU memory used", "Fleet GPU power", "Mean GPU utilization",
              "Generated tokens per joule")

PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "increase", "irate", "deriv", "histogram_quantile", "topk",
    "bottomk", "abs", "clamp_max", "clamp_min", "vector", "scalar", "time", "label_values", "label_replace",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "absent", "delta", "avg_over_time", "max_over_time", "min_over_time", "sum_over_time",
}
# Dyad families that a short test run cannot put samples in, and why. Everything else a dashboard
# names must have samples in the live scrape.
NO_SAMPLES_IN_TEST_FLEET = {
    "dyad_upstream_errors_total": "needs an engine failing mid-request",
    "dyad_retries_total": "needs an engine failing before the first byte",
    "dyad_client_disconnects_total": "needs a client hanging up mid-stream",
    "dyad_worker_scrape_errors_total": "needs an engine whose /metrics fails",
    "dyad_role_changes_total": "needs a role change (admin API or planner)",
    "dyad_kv_event_gaps_total": "needs lost KV events",
    "dyad_index_evictions_total": "needs the index over its cap",
    "dyad_index_mirror_only": "needs a shared (redis / redis_cluster) index; the test fleet's is in memory",
    "dyad_index_mirror_since_timestamp_seconds": "needs a shared (redis / redis_cluster) index",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def _load_build():
    spec = importlib.util.spec_from_file_location("dashboards_build", DASHBOARDS / "build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def queries(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (or a Grafana ``label_values(metric, label)`` query)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", s)
    names = set(re.findall(r"(?<![\w.$])[a-zA-Z_:][\w:]*", s))
    return {n for n in names if n not in PROMQL_WORDS}


def _exposition_names(text: str) -> set[str]:
    """Series names as written (the client parser would add ``_total`` to the exporter's counters)."""
    return {re.split(r"[{\s]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def _recording_rules() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}


def _sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def _family(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_committed_json_is_what_build_py_writes():
    rendered = _load_build().render()
    assert sorted(rendered) == sorted(_dashboards())
    for name, text in rendered.items():
        assert (DASHBOARDS / name).read_text() == text, f"stale {name}: run python dashboards/build.py"


def test_dashboards_are_well_formed():
    uids = set()
    for name, d in _dashboards().items():
        assert d["uid"] not in uids
        uids.add(d["uid"])
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), name
        panels = [p for p in d["panels"] if p["type"] != "row"]
        assert len(panels) >= 10, name
        for p in panels:
            assert p["targets"] and p["title"], (name, p["id"])
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24, (name, p["title"])
        # No two panels overlap on the grid.
        cells = set()
        for p in d["panels"]:
            g = p["gridPos"]
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, (name, p["title"])
                    cells.add((x, y))


def test_metric_name_extraction():
    assert metric_names('histogram_quantile(0.99, sum by (le, model) (rate(dyad_request_ttft_seconds_bucket'
                        '{instance=~"$instance", model=~"$model"}[$__rate_interval])))') == \
        {"dyad_request_ttft_seconds_bucket"}
    assert metric_names("a_total / on (instance, worker) group_left (role) (b == 1) or vector(0)") == \
        {"a_total", "b"}
    assert metric_names("label_values(dyad_requests_total, instance)") == {"dyad_requests_total"}
    assert metric_names('sum(rate(vllm:prompt_tokens_by_source_total{source="x"}[1m]))') == \
        {"vllm:prompt_tokens_by_source_total"}


def test_recording_rules_used_by_dashboards_are_defined_on_dashboard_metrics():
    rules = _recording_rules()
    used = {n for d in _dashboards().values() for e in queries(d) for n in metric_names(e) if ":" in n
            and not n.startswith("vllm:")}
    assert used, "dashboards use recording rules"
    assert used <= set(rules), used - set(rules)


@pytest.fixture(scope="module")
def scrapes(live_fleet):
    gateway_text = httpx.get(f"{live_fleet.url}/metrics", timeout=10.0).text
    engine_text = httpx.get(f"{next(iter(live_fleet.engines.values())).url}/metrics", timeout=10.0).text
    return gateway_text, engine_text


def test_every_dashboard_metric_is_in_a_live_scrape(scrapes):
    gateway_text, engine_text = scrapes
    gateway_samples = _sample_names(gateway_text)
    gateway_families = set(re.findall(r"^# HELP (\S+)", gateway_text, re.M))
    engine_samples = _sample_names(engine_text)
    real_vllm = _sample_names(REAL_VLLM_SCRAPE.read_text())
    dcgm = _exposition_names(DCGM_SAMPLE.read_text())
    rules = _recording_rules()

    def check(name: str, problems: list[str], unsampled: set[str]) -> None:
        if name.startswith("vllm:"):
            if name not in engine_samples:
                problems.append(f"{name}: not in the simulated engine's /metrics")
            if name not in real_vllm:
                problems.append(f"{name}: not in the real vLLM 0.32 scrape")
        elif name.startswith("dyad_"):
            family = _family(name)
            if name in gateway_samples:
                return
            if family not in gateway_families and name not in gateway_families:
                problems.append(f"{name}: not exported by the gateway")
            elif family in NO_SAMPLES_IN_TEST_FLEET or name in NO_SAMPLES_IN_TEST_FLEET:
                unsampled.add(name)
            else:
                problems.append(f"{name}: exported but no samples after live traffic")
        elif name.startswith("DCGM_"):
            if name not in dcgm:
                problems.append(f"{name}: not in the DCGM exporter's answer ({DCGM_SAMPLE.name})")
        elif name in rules:
            for inner in metric_names(rules[name]):
                check(inner, problems, unsampled)
        else:
            problems.append(f"{name}: neither a Dyad, vLLM or DCGM metric nor a recording rule")

    problems: list[str] = []
    unsampled: set[str] = set()
    checked = set()
    for dash in _dashboards().values():
        for expr in queries(dash):
            for name in metric_names(expr):
                checked.add(name)
                check(name, problems, unsampled)
    assert not problems, "\n".join(sorted(set(problems)))
    assert len(checked) >= 40
    # The allow-list only excuses families a short run cannot exercise; it must not grow to cover
    # everything (at least the core request/latency/routing/worker families are sampled).
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED"} <= checked
    sampled = {n for n in checked if n in gateway_samples}
    for core in ("dyad_requests_total", "dyad_request_ttft_seconds_bucket", "dyad_routing_decisions_total", "dyad_worker_kv_usage_ratio", "dyad_worker_healthy",
                 "dyad_pd_requests_total", "dyad_worker_role"):
        assert core in sampled, core


@pytest.fixture(scope="module")
def dcgm_exporter():
    """The DCGM exporter's answer served over HTTP on a free loopback port, as the exporter serves it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = DCGM_SAMPLE.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


@pytest.mark.prometheus
def test_every_dashboard_query_runs_in_prometheus(live_fleet, prometheus_server, dcgm_exporter):
    prom = prometheus_server
    prom.set_targets([(f"{live_fleet.url}/metrics", {"job": "dyad-gateway"})]
                     + [(f"{e.url}/metrics", {"job": "engine"}) for e in live_fleet.engines.values()]
                     + [(dcgm_exporter, {"job": "dcgm-exporter"})])
    # rate() needs two samples in its window: wait until it has them.
    prom.wait_for('rate(dyad_requests_total{job="dyad-gateway"}[1m])')
    prom.wait_for('rate(vllm:prompt_tokens_total{job="engine"}[1m])')
    prom.wait_for('DCGM_FI_DEV_GPU_UTIL{job="dcgm-exporter"}')
    # Grafana variables as "All": the query text is what Grafana would send.
    subst = {"$__rate_interval": "1m", "$model": ".*", "$instance": ".*"}
    errors, empty = [], []
    for name, dash in _dashboards().items():
        for p in dash["panels"]:
            for t in p.get("targets", []):
                expr = t["expr"]
                for k, v in subst.items():
                    expr = expr.replace(k, v)
                try:
                    if not prom.query(expr):
                        empty.append(p["title"])
                except ValueError as e:
                    errors.append(f"{name} / {p['title']}: {e}\n  {expr}")
    assert not errors, "\n".join(errors)
    # Data, not just valid syntax, for the panels an operator looks at first.
    for title in ("Requests / s", "Requests by status", "Healthy workers", "In flight per worker (gateway count)",
                  "Decisions by policy and outcome", "Workers by role", "Tokens / s", *GPU_PANELS):
        assert title not in empty, f"{title!r} shows no data"
    # the GPU panels' arithmetic on the exporter's series: one line per GPU, memory as a ratio
    per_gpu = prom.query("sum by (Hostname, gpu) (DCGM_FI_DEV_FB_USED) / (sum by (Hostname, gpu) "
                         "(DCGM_FI_DEV_FB_USED) + sum by (Hostname, gpu) (DCGM_FI_DEV_FB_FREE))")
    assert len(per_gpu) == 4 and all(0.8 < float(r["value"][1]) < 1.0 for r in per_gpu)
    assert prom.query_value("sum(DCGM_FI_DEV_POWER_USAGE)") > 0
