"""The stall watchdog under P/D: a request waiting on its prefill leg does not make the idle decode
worker "stalled"; once the leg is over, a decode worker that does nothing still is.

Found with tests/integration/test_pd_roles.py on a loaded machine: a split request whose prefill
on one engine took long was pulled with "worker a did no work for 27.3 s (stalled)" — a was the
decode worker, idle because the request had not reached it yet — and, both workers tried, the
client got a 503 without a worker header. The engines here are Dyad's simulated engines (vLLM
dialect), whose ``prefill_delay_s`` fault holds a request before it reaches the engine's core: the
delay is a lower bound, so the assertions hold however slow the machine is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.server import SimEngineThread

MODEL = "m"
PROMPT = "Explain the plan: " + " ".join(f"step{i} then" for i in range(150))
STALL_S = 0.5  # the watchdog's window; the holds below are several times longer


@contextmanager
def pd_pair(prefill_delay_s: float, decode_delay_s: float) -> Iterator[GatewayThread]:
    p = SimEngineThread(model=MODEL, profile="cpu-tiny", kv_events=False, prefill_delay_s=prefill_delay_s).start()
    d = SimEngineThread(model=MODEL, profile="cpu-tiny", kv_events=False, prefill_delay_s=decode_delay_s).start()
    config = load_config({
        "models": [{"name": MODEL, "block_size": 32}],
        "workers": [{"id": "p", "url": p.url, "engine": "sim", "role": "prefill", "models": [MODEL]},
                    {"id": "d", "url": d.url, "engine": "sim", "role": "decode", "models": [MODEL]}],
        "router": {"policy": "least_load", "debug_headers": True},
        "health": {"interval_s": 30},
        # prefill_timeout_s is a liveness bound here: the prefill leg must end by itself
        "disagg": {"min_prefill_tokens": 32, "prefill_timeout_s": 120},
        "resilience": {"stall_timeout_s": STALL_S, "stall_prefill_tokens_per_s": 1e9},
    }, environ={})
    try:
        with GatewayThread(config) as gw:
            yield gw
    finally:
        p.stop()
        d.stop()


def completion(gw: GatewayThread) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})


def test_a_slow_prefill_leg_does_not_make_the_idle_decode_worker_stalled():
    with pd_pair(prefill_delay_s=8 * STALL_S, decode_delay_s=0) as gw:
        r = completion(gw)
        assert r.status_code == 200, r.text
        assert r.headers["x-dyad-prefill-worker"] == "p" and r.headers["x-dyad-worker"] == "d"
        assert gw.runtime.metrics.registry.get_sample_value("dyad_pd_requests_total",
                                                            {"mode": "disaggregated"}) == 1


def test_a_decode_worker_that_does_nothing_after_the_prefill_is_still_stalled():
    # The decode engine holds the request 120 s (a liveness bound, never waited out): the watchdog
    # pulls it one window or two after the prefill leg ended; no other worker can take it.
    with pd_pair(prefill_delay_s=0, decode_delay_s=120) as gw:
        r = completion(gw)
        assert r.status_code == 503, r.text
        assert "worker d did no work" in r.json()["error"]["message"] and "(stalled)" in r.json()["error"]["message"]
