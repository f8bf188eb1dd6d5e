"""Non-streamed traffic only, no Prometheus: the planner takes TTFT/ITL from the engines' own
histograms as the gateway's scrape loop reads them (``Worker.load``), plans with latency
correction on, and its local actuator starts the prefill worker the load needs.

A live gateway (P/D routing) over one prefill and one decode ``dyad sim-engine`` (the simulator
stands in for engines; it exports vLLM's ``vllm:time_to_first_token_seconds`` and
``vllm:inter_token_latency_seconds``, measured for every request as vLLM does). Before this, such a
fleet held on ``latency_missing`` for good: the gateway times first tokens on streams only.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.planner.metrics_source import EngineLatency, latency_from_engines, parse_gateway_metrics
from orchestrator.sim.profiles import load_profile
from orchestrator.sim.server import SimEngineThread
from orchestrator.sim.virtual_time import sweep_profile
from tests.fixtures.planner_live import open_loop

pytestmark = [pytest.mark.timeout(180)]

MODEL = "sim"
_ids = itertools.count()


def prefill_heavy() -> dict:
    n = next(_ids)
    return {"model": MODEL, "prompt": " ".join(f"w{n}x{i}" for i in range(1500)), "max_tokens": 4,
            "ignore_eos": True}


async def streamed(url: str, rate: float, seconds: float) -> list[str]:
    """Streamed completions (same prompts) for ``seconds``: what the gateway can time itself."""
    failures: list[str] = []
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async def one(body: dict) -> None:
            try:
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    lines = [x async for x in r.aiter_lines()]
                if r.status_code != 200 or "data: [DONE]" not in lines:
                    failures.append(f"{r.status_code} {lines[-2:]}")
            except httpx.HTTPError as e:
                failures.append(repr(e))

        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = asyncio.create_task(one(prefill_heavy()))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            await asyncio.sleep(1 / rate)
        if tasks:
            await asyncio.wait(tasks, timeout=60)
    return failures


async def drive(url: str, rate: float, until, max_s: float) -> tuple[int, list[str]]:
    return await open_loop(url, prefill_heavy, rate, until, max_s)  # not streamed


def test_non_streamed_fleet_plans_and_starts_a_worker(tmp_path: Path):
    profile = load_profile("gpu-like")
    perf = tmp_path / "profile.json"
    perf.write_text(json.dumps(sweep_profile(profile)))
    cmd = f"{sys.executable} -m orchestrator.cli sim-engine --port {{port}} --model {MODEL} --no-kv-events --seed 3"
    engines = [SimEngineThread(model=MODEL, profile=profile, seed=i, kv_events=False).start() for i in range(2)]
    gw = None
    try:
        config = load_config({
            "models": [{"name": MODEL}],
            "workers": [{"id": f"w{i}", "url": e.url, "engine": "sim", "role": role, "models": [MODEL]}
                        for i, (e, role) in enumerate(zip(engines, ["prefill", "decode"], strict=True))],
            "health": {"interval_s": 0.3},
            "scrape": {"interval_s": 0.5},
            "disagg": {"enabled": True, "min_prefill_tokens": 32},
            "planner": {
                "enabled": True, "interval_s": 1.5, "actuator": "local", "profile": str(perf),
                "local_commands": {"prefill": cmd, "decode": cmd}, "local_engine": "sim", "local_models": [MODEL],
                "ttft_target_s": 1.0, "itl_target_s": 0.05, "max_workers": 4, "predictor": "constant",
                "start_s": 3,
            },
        }, environ={})
        assert config.planner.correct_from_latency
        gw = GatewayThread(config).start()
        planner = gw.runtime.planner

        def started() -> bool:
            return any(w.id.startswith("local-prefill") for w in gw.runtime.fleet.workers())

        sent, failed = asyncio.run(drive(gw.url, rate=6, until=started, max_s=45))
        assert failed == [] and sent > 10
        rows = list(planner.timeline)
        assert any(r["latency_source"] == "engines" and r["ttft_mean_s"] for r in rows), rows[-3:]
        assert not any(r["latency_source"] == "gateway" for r in rows)  # nothing streamed: no gateway latency
        planned = [h for h in planner.history if (h["observation"] or {}).get("latency_source") == "engines"]
        assert planned and not any("latency_missing" in r for h in planned for r in h["reasons"])
        assert started(), ("the planner started no prefill worker", planner.held, rows[-3:])
        assert any(a["kind"] == "start" and a["role"] == "prefill" for h in planned for a in h["actions"])

        # How the estimate compares with what the gateway times on streams, over one window of
        # streamed traffic (printed for docs/benchmarks.md, not asserted)
        fleet = gw.runtime.fleet
        time.sleep(1.0)
        loads0 = {w.id: (w.role, w.load) for w in fleet.workers()}
        text0 = httpx.get(f"{gw.url}/metrics").text
        stream_failed = asyncio.run(streamed(gw.url, rate=3, seconds=8))
        time.sleep(1.5)  # the scrape loop reads every engine again
        text1 = httpx.get(f"{gw.url}/metrics").text
        assert stream_failed == []
        before, after = parse_gateway_metrics(text0, 0).histograms, parse_gateway_metrics(text1, 1).histograms
        gw_ttft = after["dyad_request_ttft_seconds"].minus(before["dyad_request_ttft_seconds"])
        step = after["dyad_pd_prefill_seconds"].minus(before["dyad_pd_prefill_seconds"])
        parts = []
        for w in fleet.workers():
            role, old = loads0.get(w.id, (None, None))
            if old is not None and old.ttft is not None and w.load.ttft is not None:
                parts.append(EngineLatency(role, w.load.ttft.minus(old.ttft), None))
        est, engines_only = latency_from_engines(parts, step), latency_from_engines(parts)
        print(f"streamed window ({gw_ttft.count:.0f} streams): gateway TTFT mean {gw_ttft.mean():.3f} s, "
              f"p90 {gw_ttft.quantile(0.9):.3f} s; estimate (gateway prefill step + decode engine) mean "
              f"{est['ttft_mean']:.3f} s, p90 {est['ttft_p90']:.3f} s; engines only mean "
              f"{engines_only['ttft_mean']:.3f} s, p90 {engines_only['ttft_p90']:.3f} s")
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()
