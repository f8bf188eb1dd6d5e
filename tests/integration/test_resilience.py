"""Retry backoff and circuit breakers: the pure logic, then through a gateway.

The gateway tests run over Dyad's simulated engines (orchestrator/sim) because they need faults on
demand (``POST /sim/faults {"fail_next": N}`` makes an engine answer 500); the same paths against
real vLLM engines that are killed are in tests/integration/test_chaos_vllm.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.resilience import Backoff, BreakerState, CircuitBreakers
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread

# --- backoff ----------------------------------------------------------------------------------


def test_backoff_grows_exponentially_with_jitter_and_a_cap():
    b = Backoff(base_s=0.1, max_s=0.5)
    rng = random.Random(7)
    assert b.delay(0, rng) == 0.0
    for retry_no, ceiling in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (10, 0.5)):
        samples = [b.delay(retry_no, rng) for _ in range(200)]
        assert all(ceiling / 2 <= s <= ceiling for s in samples), retry_no
        assert max(samples) - min(samples) > ceiling / 4  # jittered, not a fixed delay


def test_backoff_zero_base_means_no_wait():
    assert Backoff(base_s=0.0).delay(3) == 0.0


# --- breakers ---------------------------------------------------------------------------------


def test_breaker_opens_after_threshold_half_opens_after_timeout_and_closes_after_successes():
    changes = []
    cb = CircuitBreakers(failure_threshold=3, open_s=10.0, success_threshold=2, half_open_probes=1,
                         on_change=lambda w, s: changes.append((w, s)))
    cb.record_failure("a", 0.0)
    cb.record_failure("a", 1.0)
    assert cb.blocked(1.0) == frozenset() and cb.state("a") is BreakerState.CLOSED
    cb.record_success("a", 1.5)  # a success resets the count: failures must be consecutive
    for t in (2.0, 2.1, 2.2):
        cb.record_failure("a", t)
    assert cb.state("a") is BreakerState.OPEN and cb.blocked(5.0) == {"a"}
    assert cb.blocked(12.1) == {"a"}  # opened at 2.2 (third consecutive failure)
    assert cb.blocked(12.2) == frozenset() and cb.state("a") is BreakerState.HALF_OPEN
    assert cb.dispatched("a") is True  # the one probe allowed
    assert cb.blocked(12.25) == {"a"}  # its probe slot is taken
    cb.probe_done("a")
    cb.record_success("a", 12.3)
    assert cb.state("a") is BreakerState.HALF_OPEN
    cb.dispatched("a")
    cb.probe_done("a")
    cb.record_success("a", 12.4)
    assert cb.state("a") is BreakerState.CLOSED and cb.blocked(12.5) == frozenset()
    assert changes == [("a", BreakerState.OPEN), ("a", BreakerState.HALF_OPEN), ("a", BreakerState.CLOSED)]


def test_failure_while_half_open_reopens_for_a_full_period():
    cb = CircuitBreakers(failure_threshold=1, open_s=5.0, success_threshold=1)
    cb.record_failure("a", 0.0)
    assert cb.blocked(5.0) == frozenset()  # half-open now
    cb.dispatched("a")
    cb.probe_done("a")
    cb.record_failure("a", 6.0)
    assert cb.state("a") is BreakerState.OPEN
    assert cb.blocked(10.9) == {"a"} and cb.blocked(11.0) == frozenset()


def test_threshold_zero_disables_breakers_and_forget_drops_state():
    off = CircuitBreakers(failure_threshold=0)
    for t in range(10):
        off.record_failure("a", float(t))
    assert off.blocked(10.0) == frozenset() and off.state("a") is BreakerState.CLOSED
    cb = CircuitBreakers(failure_threshold=1)
    cb.record_failure("a", 0.0)
    assert cb.snapshot() == {"a": "open"}
    cb.forget("a")
    assert cb.snapshot() == {} and cb.blocked(0.0) == frozenset()


# --- through the gateway (simulated engines: faults on demand) -------------------------------------


@pytest.fixture(scope="module")
def engines() -> Iterator[list[SimEngineThread]]:
    a = SimEngineThread(model="m", profile="zero", kv_events=False).start()
    b = SimEngineThread(model="m", profile="zero", kv_events=False).start()
    yield [a, b]
    a.stop()
    b.stop()


def _gateway(engines: list[SimEngineThread], **resilience) -> GatewayThread:
    config = load_config({
        "models": [{"name": "m"}],
        "workers": [{"id": n, "url": e.url, "engine": "sim", "models": ["m"]} for n, e in zip("ab", engines, strict=True)],
        "router": {"policy": "round_robin", "debug_headers": True},
        "health": {"interval_s": 30},
        "resilience": resilience,
    }, environ={})
    return GatewayThread(config)


def _faults(engine: SimEngineThread, **faults) -> None:
    httpx.post(f"{engine.url}/sim/faults", json=faults, timeout=5).raise_for_status()


def test_breaker_opens_on_5xx_and_the_router_skips_the_worker_then_it_recovers(engines):
    a, b = engines
    _faults(a, fail_next=1000)
    try:
        with _gateway(engines, breaker_failure_threshold=2, breaker_open_s=0.5, breaker_success_threshold=1,
                      backoff_base_s=0.0) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
            served = []
            for _ in range(8):
                r = c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text  # the 500s were retried on b
                served.append(r.headers["x-dyad-worker"])
            assert set(served) == {"b"}
            assert gw.runtime.breakers.state("a") is BreakerState.OPEN
            text = gw.runtime.metrics.render().decode()
            # exactly threshold attempts reached a before its breaker opened; none after
            assert 'dyad_upstream_errors_total{kind="http_500",worker="a"} 2.0' in text
            assert 'dyad_circuit_breaker_transitions_total{state="open",worker="a"} 1.0' in text
            _faults(a, fail_next=0)
            import time
            time.sleep(0.6)
            served = [c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                      .headers["x-dyad-worker"] for _ in range(4)]
            assert "a" in served  # the half-open probe succeeded and closed the breaker
            assert gw.runtime.breakers.state("a") is BreakerState.CLOSED
    finally:
        _faults(a, fail_next=0)


def test_retries_wait_a_backoff(engines):
    a, b = engines
    _faults(a, fail_next=1)
    _faults(b, fail_next=1)
    try:
        with _gateway(engines, backoff_base_s=0.2, backoff_max_s=0.2, breaker_failure_threshold=0) as gw:
            r = httpx.post(f"{gw.url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                           timeout=10)
            # attempt 1 on one engine (500), retry 1 after >= 0.1 s on the other (500), retry 2 after
            # >= 0.1 s back on... nothing: both were tried. The answer is the last engine error.
            assert r.status_code == 500
            assert r.elapsed.total_seconds() >= 0.1
            text = gw.runtime.metrics.render().decode()
            assert 'dyad_retries_total{model="m"} 1.0' in text
    finally:
        _faults(a, fail_next=0)
        _faults(b, fail_next=0)
