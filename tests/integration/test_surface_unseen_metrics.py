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


BIG = 40 * 1024 * 1024  # more than loopback's socket buffers hold: a sender that is not read from blocks


class HugeAnswersEngine(SocketEngine):
    """A test double: /health answers 200 with a 40-MB body, /v1/models ~3 MB of model cards. Records whether
    each long answer was sent whole (read by the gateway) or cut (the gateway stopped reading and closed)."""

    def __init__(self) -> None:
        super().__init__()
        self.health_sent: list[bool] = []
        self.models = b'{"object":"list","data":[' + b",".join(
            b'{"id":"model-%d","object":"model"}' % i for i in range(100_000)) + b"]}"

    def respond(self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes) -> bool:
        if path.startswith("/health"):
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % BIG)
            try:
                for _ in range(BIG // 65536):
                    conn.sendall(b"x" * 65536)
            except OSError:
                self.health_sent.append(False)
                return False
            self.health_sent.append(True)
            return True
        payload = self.models if path.startswith("/v1/models") else b"{}"
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(payload), payload))
        except OSError:
            return False
        return True


def test_a_huge_health_or_models_answer_is_not_read_whole():
    engine = HugeAnswersEngine().start()
    cfg = load_config({"models": [{"name": "tiny"}],
                       "workers": [{"id": "big", "url": engine.url, "engine": "vllm"}],  # (models: from the engine)
                       "health": {"interval_s": 0.5, "timeout_s": 10}}, environ={})
    try:
        with GatewayThread(cfg) as gw:
            worker = gw.runtime.fleet.get("big")
            assert wait_until(lambda: worker.last_error is not None and "longer than" in worker.last_error,
                              timeout=30), worker.last_error
            assert not worker.health_ok and worker.models == []  # the 3-MB model list was refused, not learnt
            assert wait_until(lambda: len(engine.health_sent) >= 2, timeout=30)
            assert not any(engine.health_sent), "a 40-MB health answer was read whole"
    finally:
        engine.stop()
