"""Every Dyad metric, declared once.

Conventions: ``dyad_`` prefix, base units (seconds, tokens, ratios 0..1), ``_total`` on counters,
bounded label sets (model, endpoint, status class, policy, worker id, role). One ``DyadMetrics``
per gateway with its own registry, so several gateways (tests, the simulator) can live in one
process. The README lists these metrics; the dashboards test checks every query against a live scrape.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               1.0, 2.0)
TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05)


class DyadMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # --- requests, measured at the gateway
        self.requests = Counter("dyad_requests_total", "Requests answered by the gateway",
                                ["model", "endpoint", "status"], registry=r)
        self.ttft = Histogram("dyad_request_ttft_seconds", "Time to first token seen by the client",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dyad_request_itl_seconds", "Inter-token latency seen by the client (streaming)",
                             ["model"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("dyad_request_e2e_seconds", "End-to-end request latency",
                             ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Histogram("dyad_request_prompt_tokens", "Prompt length of finished requests",
                                       ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("dyad_request_generation_tokens",
                                           "Generated tokens of finished requests",
                                           ["model"], buckets=TOKEN_BUCKETS, registry=r)
        # Demand, counted when a request arrives (after its model is known), whatever happens to it later
        # (queued, refused, failed): the planner sizes the fleet for what arrives, not for what finished.
        self.arrivals = Counter("dyad_request_arrivals_total",
                                "Requests that arrived for a model (served, queued, refused or failed)",
                                ["model"], registry=r)
        self.arrival_prompt_tokens = Counter("dyad_request_arrival_prompt_tokens_total",
                                             "Prompt tokens of arrived requests (counted or estimated at arrival)",
                                             ["model"], registry=r)
        self.inflight = Gauge("dyad_requests_inflight", "Requests being served by the gateway", ["model"],
                              registry=r)
        self.upstream_errors = Counter("dyad_upstream_errors_total", "Failed attempts towards engines",
                                       ["worker", "kind"], registry=r)
        self.retries = Counter("dyad_retries_total", "Requests retried on another worker", ["model"], registry=r)
        self.stream_failovers = Counter("dyad_stream_failovers_total",
                                        "Streams whose worker failed mid-stream, by outcome (continued on "
                                        "another worker, restarted there before its first token, completed, "
                                        "ended with an error event)",
                                        ["outcome"], registry=r)
        self.breaker_transitions = Counter("dyad_circuit_breaker_transitions_total",
                                           "Circuit breaker state changes per worker", ["worker", "state"],
                                           registry=r)
        self.client_disconnects = Counter("dyad_client_disconnects_total",
                                          "Client went away; upstream request cancelled", ["model"], registry=r)
        self.native_plane_requests = Counter(
            "dyad_native_plane_requests_total",
            "OpenAI-route requests under gateway.data_plane: native, by how they were carried: native (by the "
            "compiled plane), handed_over (to the Python gateway behind it: prefill/decode pairs, https "
            "engines, tracing on), parked (their handler waited: admission queue, Redis, a tokenizer), "
            "continued (a broken stream continued by the Python relay)", ["way"], registry=r)
        # --- routing
        self.routing_decisions = Counter("dyad_routing_decisions_total", "Routing decisions",
                                         ["policy", "outcome"], registry=r)
        self.routing_decision_seconds = Histogram("dyad_routing_decision_seconds",
                                                  "Time to route one request (tokenize + index + policy)",
                                                  ["policy"], buckets=DECISION_BUCKETS, registry=r)
        self.predicted_cached_tokens = Counter("dyad_predicted_cached_tokens_total",
                                               "Prompt tokens the router expected to hit the prefix cache",
                                               ["model"], registry=r)
        self.routed_prompt_tokens = Counter("dyad_routed_prompt_tokens_total",
                                            "Prompt tokens of routed requests", ["model"], registry=r)
        # --- workers
        self.worker_inflight = Gauge("dyad_worker_inflight_requests", "Requests in flight per worker",
                                     ["worker"], registry=r)
        self.worker_healthy = Gauge("dyad_worker_healthy", "1 when the worker passes health checks",
                                    ["worker"], registry=r)
        self.worker_role = Gauge("dyad_worker_role", "1 for the worker's current role", ["worker", "role"],
                                 registry=r)
        self.worker_state = Gauge("dyad_worker_state", "1 for the worker's current state", ["worker", "state"],
                                  registry=r)
        self.worker_running = Gauge("dyad_worker_running_requests", "Engine-reported running requests",
                                    ["worker"], registry=r)
        self.worker_waiting = Gauge("dyad_worker_waiting_requests", "Engine-reported queued requests",
                                    ["worker"], registry=r)
        self.worker_kv_usage = Gauge("dyad_worker_kv_usage_ratio", "Engine-reported KV cache usage (0..1)",
                                     ["worker"], registry=r)
        self.worker_cache_hit_ratio = Gauge("dyad_worker_prefix_cache_hit_ratio",
                                            "Engine-reported prefix cache hit ratio (0..1)", ["worker"], registry=r)
        self.worker_actual_cached_tokens = Gauge("dyad_worker_prefix_cache_hit_tokens",
                                                 "Engine-reported prefix cache hit tokens (cumulative)",
                                                 ["worker"], registry=r)
        self.scrape_errors = Counter("dyad_worker_scrape_errors_total", "Failed metric scrapes", ["worker"],
                                     registry=r)
        # --- discovery (orchestrator/fleet/discovery)
        self.discovery_changes = Counter("dyad_discovery_changes_total",
                                         "Registry changes made by a discovery source (add, withdraw, remove, drain, "
                                         "undrain, set_role, ...)", ["source", "change"], registry=r)
        self.discovery_errors = Counter("dyad_discovery_errors_total",
                                        "Failed reads of a discovery source (API list/watch errors, unreadable or "
                                        "invalid workers file); the last good worker list stays", ["source"],
                                        registry=r)
        self.discovery_unused_pods = Gauge("dyad_discovery_unused_pods",
                                           "Pods the Kubernetes selectors match that are not workers, by reason "
                                           "(not_ready, no_ip, no_port, unknown_role, unmappable); which and why: "
                                           "GET /admin/discovery", ["reason"], registry=r)
        # --- prefix index
        self.index_blocks = Gauge("dyad_index_blocks", "(worker, block) entries in the prefix index",
                                  ["backend"], registry=r)
        self.index_evictions = Counter("dyad_index_evictions_total", "Entries evicted by the index cap",
                                       ["backend"], registry=r)
        self.kv_events = Counter("dyad_kv_events_total", "KV cache events ingested", ["worker", "type"],
                                 registry=r)
        self.kv_event_gaps = Counter("dyad_kv_event_gaps_total", "Sequence gaps detected in KV event streams",
                                     ["worker"], registry=r)
        self.kv_event_lag = Gauge("dyad_kv_event_lag_seconds", "Age of the newest KV event batch at ingestion",
                                  ["worker"], registry=r)
        self.index_capacity = Gauge("dyad_index_capacity_blocks",
                                    "Cap on (worker, block) entries in the prefix index (index.max_blocks)",
                                    ["backend"], registry=r)
        self.index_lookup_seconds = Histogram("dyad_index_lookup_seconds", "Prefix index overlap lookup time",
                                              ["backend"], buckets=DECISION_BUCKETS, registry=r)
        self.head_first = Counter("dyad_head_first_total",
                                  "Long new prompts routed on the tokens of their head (docs/prefix-index.md); "
                                  "outcome: whole (tokenized whole after the send), dropped (the tokenizer's "
                                  "queue was full: only the head recorded), head (workers with KV events: not "
                                  "needed)", ["outcome"], registry=r)
        self.index_mirror_only = Gauge("dyad_index_mirror_only",
                                       "1 while this replica answers prefix lookups from its local mirror because "
                                       "the shared index (redis / redis_cluster) is unreachable or resyncing",
                                       ["backend"], registry=r)
        self.index_mirror_since = Gauge("dyad_index_mirror_since_timestamp_seconds",
                                        "Unix time this replica switched to its local mirror (0 while on the "
                                        "shared index)", ["backend"], registry=r)
        # --- prefill/decode
        self.pd_requests = Counter("dyad_pd_requests_total",
                                   "Requests by P/D mode (disaggregated, local prefill, fallback)",
                                   ["mode"], registry=r)
        self.kv_transfer_seconds = Histogram("dyad_pd_prefill_seconds", "Prefill step time in P/D flows",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.role_changes = Counter("dyad_role_changes_total", "Worker role changes", ["from_role", "to_role"],
                                    registry=r)
        # --- planner
        self.planner_predicted = Gauge("dyad_planner_predicted", "Planner's prediction for the next interval",
                                       ["quantity"], registry=r)
        self.planner_desired_workers = Gauge("dyad_planner_desired_workers", "Workers the planner wants",
                                             ["role"], registry=r)
        self.planner_standby_workers = Gauge("dyad_planner_standby_workers",
                                             "Warm standby workers per role (started, held out of rotation)",
                                             ["role"], registry=r)
        self.planner_max_workers = Gauge("dyad_planner_max_workers", "The planner's worker budget (planner.max_workers)",
                                         registry=r)
        self.planner_decisions = Counter("dyad_planner_decisions_total", "Planner decisions", ["action"],
                                         registry=r)
        self.planner_held = Counter("dyad_planner_held_total",
                                    "Planner intervals that held the current sizes because an input was missing, "
                                    "stale or invalid (reason: source_unavailable, rate_missing, isl_missing, "
                                    "osl_missing, latency_missing, invalid_input)", ["reason"], registry=r)
        # --- overload / admission
        self.rejected = Counter("dyad_rejected_requests_total", "Requests refused before dispatch",
                                ["reason"], registry=r)
        self.queue_depth = Gauge("dyad_admission_queue_depth", "Requests waiting for a dispatch slot",
                                 ["priority"], registry=r)
        self.queue_wait = Histogram("dyad_admission_queue_wait_seconds",
                                    "Time admitted requests waited for a dispatch slot", ["priority"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.predicted_ttft = Histogram("dyad_admission_predicted_ttft_seconds",
                                        "Predicted time to first token on the best candidate worker",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.rate_limit_fallbacks = Counter("dyad_rate_limit_local_fallbacks_total",
                                            "Rate-limit decisions taken on local buckets because Redis was "
                                            "unreachable", registry=r)

    def forget_worker(self, worker_id: str) -> int:
        """Drop every series labelled with this worker (a worker that left the registry), returning how
        many. Worker ids come from discovery (pod names, workers-file entries): without this, each
        pod a rollout replaced left its error, breaker and KV-event series behind for the life of the
        process, so the scrape grew with every rollout. A worker that comes back starts from zero (a
        counter reset, which rate() handles)."""
        return self._forget(lambda wid: wid == worker_id)

    def forget_absent_workers(self, present: set[str]) -> int:
        """``forget_worker`` for every worker not in ``present`` (run at scrape time: a try or a scrape
        that ends after its worker was removed counts once more and would bring the series back)."""
        return self._forget(lambda wid: wid not in present)

    def _forget(self, gone: Callable[[str], bool]) -> int:
        dropped = 0
        for metric in vars(self).values():
            names = getattr(metric, "_labelnames", ())
            if "worker" not in names:
                continue
            i = names.index("worker")
            with metric._lock:
                keys = [k for k in metric._metrics if gone(k[i])]
            for k in keys:
                try:
                    metric.remove(*k)
                except KeyError:  # removed concurrently
                    continue
                dropped += 1
        return dropped

    def render(self) -> bytes:
        return generate_latest(self.registry)
