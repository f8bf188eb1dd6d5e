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

import contextlib
import threading
import time
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
        "scrape": {"interval_s": 0.1},
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
    """The leg is slow on a prefill worker that is busy meanwhile (a long generation sent to its engine
    directly: its scraped generated-token counter moves), so the prefill leg's own watchdog sees work and
    lets it run; the decode worker, idle because the request has not reached it, is not stalled either.
    (A prefill worker that does no work at all for the budget is stalled: test_request_path_failures.py.)"""
    with pd_pair(prefill_delay_s=0, decode_delay_s=0) as gw:
        p = gw.runtime.fleet.get("p")
        busy = threading.Thread(target=_generate_directly, args=(p.url, 8 * STALL_S + 30), daemon=True)
        busy.start()
        deadline = time.monotonic() + 30
        while not (p.load.generation_tokens or 0) > 0:  # (scraped: the engine is generating)
            assert time.monotonic() < deadline, "the prefill engine's generated tokens never showed in its scrape"
            time.sleep(0.05)
        httpx.post(f"{p.url}/sim/faults", json={"prefill_delay_s": 8 * STALL_S}, timeout=10).raise_for_status()
        r = completion(gw)
        assert r.status_code == 200, r.text
        assert r.headers["x-dyad-prefill-worker"] == "p" and r.headers["x-dyad-worker"] == "d"
        assert gw.runtime.metrics.registry.get_sample_value("dyad_pd_requests_total",
                                                            {"mode": "disaggregated"}) == 1


def _generate_directly(url: str, seconds: float) -> None:
    """A long streamed generation on an engine, not through the gateway, read for ``seconds`` at most."""
    body = {"model": MODEL, "prompt": "busy", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    ends = time.monotonic() + seconds
    with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", f"{url}/v1/completions", json=body,
                                                            timeout=seconds + 10) as r:
        for _ in r.iter_raw():
            if time.monotonic() > ends:
                break


def test_a_decode_worker_that_does_nothing_after_the_prefill_is_still_stalled():
    # The decode engine holds the request 120 s (a liveness bound, never waited out): the watchdog
    # pulls it one window or two after the prefill leg ended; no other worker can take it.
    with pd_pair(prefill_delay_s=0, decode_delay_s=120) as gw:
        r = completion(gw)
        assert r.status_code == 503, r.text
        assert "worker d did no work" in r.json()["error"]["message"] and "(stalled)" in r.json()["error"]["message"]
