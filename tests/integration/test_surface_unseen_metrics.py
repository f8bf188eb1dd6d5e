"""A worker whose ``/metrics`` answer is huge (adapters/base.py ``MAX_METRICS_BYTES``).

Found while checking the fleet page with "a worker with huge metrics": the scrape read the whole answer and
parsed it on the gateway's event loop — a 55-MB answer of matching series took ~17 s of parsing, every scrape
interval, during which the gateway answered nothing. Now an answer over 2 MiB is refused unread (a scrape
error, counted in ``dyad_worker_scrape_errors_total``); the worker keeps serving, its load unknown.
"""

from __future__ import annotations

import socket

import httpx

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from tests.integration.socket_engine import SocketEngine
from tests.integration.test_gateway import wait_until

SERIES = b'vllm:num_requests_running{model_name="tiny",replica="%d"} 1\n'
HUGE = b"".join(SERIES % i for i in range(60_000))  # ~3.3 MB


class HugeMetricsEngine(SocketEngine):
    """A test double (no real engine answers so): healthy, serving ``tiny``, its /metrics ~3.3 MB of series
    that would all count as running requests."""

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        if path.startswith("/metrics"):
            payload, kind = HUGE, b"text/plain"
        elif path.startswith("/v1/models"):
            payload, kind = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}', b"application/json"
        else:
            payload, kind = b'{"status":"ok"}', b"application/json"
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                     % (kind, len(payload), payload))
        return True


def test_a_huge_metrics_answer_is_a_scrape_error_not_parsed():
    engine = HugeMetricsEngine().start()
    cfg = load_config({"models": [{"name": "tiny"}],
                       "workers": [{"id": "huge", "url": engine.url, "engine": "vllm", "models": ["tiny"]}],
                       "health": {"interval_s": 0.5}, "scrape": {"interval_s": 0.2}}, environ={})
    try:
        with GatewayThread(cfg) as gw:
            def errors():
                return gw.runtime.metrics.registry.get_sample_value("dyad_worker_scrape_errors_total",
                                                                    {"worker": "huge"}) or 0.0
            assert wait_until(lambda: errors() >= 2, timeout=30), errors()
            worker = gw.runtime.fleet.get("huge")
            assert worker.load.running == 0  # never parsed (it would be 60 000)
            assert worker.health_ok
            assert httpx.get(f"{gw.url}/ui/api/state", timeout=10).json()["workers"][0]["running"] == 0
    finally:
        engine.stop()
