"""The SLO planner reading from a REAL Prometheus and moving workers between roles.

A real Prometheus (``tests/fixtures/prometheus.py``) scrapes a live gateway (``GatewayThread``) in
front of four simulated engines (``SimEngineThread``; the simulator stands in for four engines this
2-core machine cannot run at once). The gateway's planner runs with ``PrometheusSource`` and the
role-change actuator (a fixed fleet re-split between the prefill and decode pools). Traffic first
is prefill-heavy (long prompts, two output tokens), then decode-heavy (short prompts, long outputs):
the planner must move workers to prefill, then back to decode, with no failed request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from adapters.base import Role
from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.sim.profiles import load_profile
from orchestrator.sim.server import SimEngineThread
from orchestrator.sim.virtual_time import sweep_profile
from tests.fixtures.planner_live import open_loop
from tests.fixtures.prometheus import prometheus_server  # noqa: F401

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(180)]

MODEL = "sim"
ADMIN = {"Authorization": "Bearer planner-admin"}
_ids = itertools.count()


def roles(gw: GatewayThread) -> Counter[str]:
    return Counter((w.target_role or w.role).value for w in gw.runtime.fleet.workers())


def peak_seen(url: str) -> bool:
    """The planner has an observation whose 5-s peak arrival rate (PromQL max_over_time subquery) is known."""
    status = httpx.get(f"{url}/admin/planner", headers=ADMIN, timeout=5).json()
    return any(((h["observation"] or {}).get("peak_rate") or 0) > 0 for h in status["history"])


async def drive(url: str, make_body: Callable[[], dict], rate: float, until: Callable[[], bool],
                max_s: float) -> tuple[int, list[str]]:
    """Open-loop traffic at ``rate`` req/s until ``until()`` (checked after min 2 s) or ``max_s``."""
    return await open_loop(url, make_body, rate, until, max_s)


def prefill_heavy() -> dict:
    n = next(_ids)
    words = " ".join(f"w{n}x{i}" for i in range(1500))  # unique from the first token: no prefix hits
    return {"model": MODEL, "prompt": words, "max_tokens": 2, "ignore_eos": True}


def decode_heavy() -> dict:
    n = next(_ids)
    return {"model": MODEL, "prompt": f"q{n} tell me a long story", "max_tokens": 300, "ignore_eos": True}


def test_planner_on_prometheus_moves_workers_with_the_mix(prometheus_server, tmp_path: Path):  # noqa: F811
    profile = load_profile("gpu-like")
    perf = tmp_path / "profile.json"
    perf.write_text(json.dumps(sweep_profile(profile)))  # what `dyad profile --sim gpu-like` writes
    engines = [SimEngineThread(model=MODEL, profile=profile, seed=i, kv_events=False).start() for i in range(4)]
    gw = None
    try:
        start_roles = ["prefill", "decode", "decode", "decode"]
        config = load_config({
            "models": [{"name": MODEL}],
            "workers": [{"id": f"w{i}", "url": e.url, "engine": "sim", "role": role, "models": [MODEL]}
                        for i, (e, role) in enumerate(zip(engines, start_roles, strict=True))],
            "gateway": {"admin_token": ADMIN["Authorization"].split()[1]},
            "health": {"interval_s": 0.5},
            "scrape": {"interval_s": 0.5},
            "planner": {
                "enabled": True, "interval_s": 1.5, "prometheus_url": prometheus_server.url,
                "prometheus_window_s": 4, "actuator": "role_change", "profile": str(perf),
                "ttft_target_s": 1.0, "itl_target_s": 0.05, "max_workers": 4, "predictor": "constant",
                "scale_in_intervals": 1, "scale_in_margin": 0.0, "correct_from_latency": False,
            },
        }, environ={})
        gw = GatewayThread(config).start()
        prometheus_server.set_targets([f"{gw.url}/metrics"])
        assert roles(gw) == {"prefill": 1, "decode": 3}

        # Phase 1: long prompts, two output tokens → the planner grows the prefill pool.
        # Keep the traffic up until the pool grew AND the planner has seen the burst subquery answer (it
        # needs a few scrapes of history; stopping at the first role change raced it).
        sent1, fail1 = asyncio.run(drive(gw.url, prefill_heavy, rate=6, max_s=30,
                                         until=lambda: roles(gw)["prefill"] >= 3 and peak_seen(gw.url)))
        after1 = roles(gw)
        # Prometheus really was the source: the planner's last observation carries its rates
        status = httpx.get(f"{gw.url}/admin/planner", headers=ADMIN, timeout=5).json()
        assert status["actuator"] == "role_change" and status["last_error"] is None, status["last_error"]
        obs = [h["observation"] for h in status["history"] if h["observation"] and (h["observation"]["request_rate"] or 0) > 0]
        assert obs and max(o["mean_isl"] or 0 for o in obs) > 1000
        assert any((o["peak_rate"] or 0) > 0 for o in obs)  # the burst subquery (max_over_time) answers too
        assert after1["prefill"] >= 3 and after1["decode"] >= 1, (after1, status["last"])

        # Phase 2: short prompts, long outputs → workers go back to the decode pool.
        sent2, fail2 = asyncio.run(drive(gw.url, decode_heavy, rate=6, max_s=25,
                                         until=lambda: roles(gw)["decode"] >= 3))
        after2 = roles(gw)
        status = httpx.get(f"{gw.url}/admin/planner", headers=ADMIN, timeout=5).json()
        assert after2["decode"] >= 3 and after2["prefill"] >= 1, (after2, status["last"])

        assert fail1 == [] and fail2 == [], (fail1[:3], fail2[:3])
        assert sent1 > 10 and sent2 > 10
        moves = gw.runtime.roles.history
        assert any(c.to_role is Role.PREFILL for c in moves) and any(c.to_role is Role.DECODE for c in moves)
        # every answer the gateway gave was a 200 (Prometheus's view of the gateway's counter)
        bad = prometheus_server.query_value('sum(dyad_requests_total{status!="200"})')
        assert not bad, bad
        assert sum(after2.values()) == 4  # a fixed fleet: moved, never started or stopped
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()


def test_non_streamed_traffic_plans_on_the_engines_latency(prometheus_server, tmp_path: Path):  # noqa: F811
    """Only non-streamed requests: the gateway times no first token, so its TTFT/ITL series stay
    empty. With Prometheus scraping the engines too, the planner takes TTFT/ITL from the engines'
    ``vllm:time_to_first_token_seconds`` / ``vllm:inter_token_latency_seconds`` (simulated engines
    export vLLM's names) and plans, latency correction on, instead of holding on latency_missing;
    the timeline names the source."""
    profile = load_profile("gpu-like")
    perf = tmp_path / "profile.json"
    perf.write_text(json.dumps(sweep_profile(profile)))
    engines = [SimEngineThread(model=MODEL, profile=profile, seed=i, kv_events=False).start() for i in range(2)]
    gw = None
    try:
        config = load_config({
            "models": [{"name": MODEL}],
            "workers": [{"id": f"w{i}", "url": e.url, "engine": "sim", "role": role, "models": [MODEL]}
                        for i, (e, role) in enumerate(zip(engines, ["prefill", "decode"], strict=True))],
            "gateway": {"admin_token": ADMIN["Authorization"].split()[1]},
            "health": {"interval_s": 0.5},
            "scrape": {"interval_s": 0.5},
            "disagg": {"enabled": True, "min_prefill_tokens": 32},
            "planner": {
                "enabled": True, "interval_s": 1.5, "prometheus_url": prometheus_server.url,
                "prometheus_window_s": 4, "actuator": "recommend", "profile": str(perf),
                "ttft_target_s": 1.0, "itl_target_s": 0.05, "max_workers": 6, "predictor": "constant",
            },
        }, environ={})
        assert config.planner.correct_from_latency  # the default: latency is a required input
        gw = GatewayThread(config).start()
        prometheus_server.set_targets([f"{gw.url}/metrics"] + [f"{e.url}/metrics" for e in engines])

        def planned_on_engines() -> bool:  # and asked for more prefill: stop there (nothing adds capacity)
            status = httpx.get(f"{gw.url}/admin/planner", headers=ADMIN, timeout=5).json()
            return any((h["observation"] or {}).get("latency_source") == "engines"
                       and h["desired"].get("prefill", 0) > h["current"].get("prefill", 0) for h in status["history"])

        # 6 req/s of long prompts need a second prefill engine; recommend-only adds none, so the traffic
        # stops as soon as the planner asked for it (the engines queue meanwhile; no request may fail)
        sent, failed = asyncio.run(drive(gw.url, prefill_heavy, rate=6, max_s=40, until=planned_on_engines))
        status = httpx.get(f"{gw.url}/admin/planner", headers=ADMIN, timeout=5).json()
        assert failed == [], failed[:3]
        assert sent > 5, sent
        rows = [r for r in status["timeline"] if r.get("latency_source") == "engines"]
        assert rows, ("the planner never took latency from the engines", status["held"], status["timeline"][-3:])
        # the gateway really had no latency of its own: nothing was streamed
        assert not prometheus_server.query_value("sum(dyad_request_ttft_seconds_count)")
        # it planned (no latency hold) and acted: long prompts at 6 req/s need more than one prefill worker
        planned = [h for h in status["history"] if (h["observation"] or {}).get("latency_source") == "engines"]
        assert planned and not any("latency_missing" in r for h in planned for r in h["reasons"])
        assert any(h["desired"].get("prefill", 0) > h["current"].get("prefill", 0) for h in planned), \
            [(h["desired"], h["current"]) for h in planned]
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()
