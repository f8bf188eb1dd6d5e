"""Warm standby, live: the local actuator keeps a started engine out of rotation and the planner
activates it before starting a cold one.

A real gateway (P/D routing) over one prefill and one decode ``dyad sim-engine`` (the simulator
stands in for engines; the slowed GPU-like profile of the live-loop test, so the peak needs a
second prefill worker). The planner keeps ``standby_prefill: 1``:

- the actuator starts a standby prefill engine; the registry holds it in ``standby``: it is
  health-checked (its probe passes) but the router never sends it a request (the engine's own
  request counter stays at 0 under traffic);
- when the load rises the planner ``activate``s it: it is in rotation in well under a second (a
  registry state change) and serves soon after; a cold engine is started to refill the pool;
- not one request fails.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.fleet.worker import WorkerState
from orchestrator.gateway.serve import GatewayThread
from tests.fixtures.planner_live import fire, sim_pd_setup
from tests.integration.test_planner_loop_live import ENGINE, MODEL, chat_body, one_stream

pytestmark = [pytest.mark.timeout(240)]


def requests_served(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


async def traffic(url: str, rate: float, until, max_s: float) -> tuple[int, list[str]]:
    problems: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def go() -> None:
            p = await one_stream(client, chat_body())
            if p is not None:
                problems.append(p)

        sent = await fire(go, lambda el: None if el >= max_s or until() else rate)
    return sent, problems


def test_standby_worker_is_held_out_then_activated(tmp_path: Path):
    setup = sim_pd_setup(tmp_path, ENGINE, MODEL)  # `dyad profile --sim <file>` + 1P/1D sim engines
    perf, cmd, static = setup.perf, setup.cmd, setup.static
    gw = None
    stop = threading.Event()
    try:
        config = load_config({
            "models": [{"name": MODEL}],
            "workers": [{"id": "p0", "url": static[0].url, "engine": "sim", "role": "prefill", "models": [MODEL]},
                        {"id": "d0", "url": static[1].url, "engine": "sim", "role": "decode", "models": [MODEL]}],
            "gateway": {"admin_token": "standby-admin"},
            "health": {"interval_s": 0.3},
            "scrape": {"interval_s": 0.5},
            "disagg": {"enabled": True, "min_prefill_tokens": 32},
            "planner": {
                "enabled": True, "interval_s": 1.5, "actuator": "local", "max_workers": 6, "profile": str(perf),
                "local_commands": {"prefill": cmd, "decode": cmd}, "local_engine": "sim", "local_models": [MODEL],
                "ttft_target_s": 0.5, "itl_target_s": 0.025, "predictor": "constant", "start_s": 5,
                "scale_in_intervals": 3, "correct_from_latency": False, "standby_prefill": 1,
            },
        }, environ={})
        gw = GatewayThread(config).start()
        fleet = gw.runtime.fleet
        states: dict[str, list[tuple[float, str]]] = {}  # worker id → (time, state) changes seen

        def watch() -> None:
            while not stop.is_set():
                now = time.monotonic()
                for w in fleet.workers():
                    seq = states.setdefault(w.id, [])
                    if not seq or seq[-1][1] != w.state.value:
                        seq.append((now, w.state.value))
                stop.wait(0.02)

        threading.Thread(target=watch, daemon=True).start()

        def standby_ready():
            return next((w for w in fleet.workers() if w.state is WorkerState.STANDBY and w.health_ok), None)

        # light traffic until the actuator has a standby prefill engine that passed its probe
        sent0, problems0 = asyncio.run(traffic(gw.url, 1.0, lambda: standby_ready() is not None, 40))
        sb = standby_ready()
        assert sb is not None, ("no standby worker", gw.runtime.planner.status()["standby"])
        assert sb.id.startswith("local-prefill") and sb.ready_at is not None
        # held out of rotation: more traffic, and the standby engine serves none of it
        sent1, problems1 = asyncio.run(traffic(gw.url, 1.0, lambda: False, 4))
        assert fleet.get(sb.id).state is WorkerState.STANDBY
        assert requests_served(sb.url) == 0 and requests_served(static[0].url) > 0
        status = httpx.get(f"{gw.url}/admin/planner", timeout=5,
                           headers={"Authorization": "Bearer standby-admin"}).json()
        assert status["standby"]["count"]["prefill"] == 1 and status["standby"]["wanted"]["prefill"] == 1
        assert "dyad_planner_standby_workers{role=\"prefill\"} 1.0" in httpx.get(f"{gw.url}/metrics").text

        # the peak: the planner activates the standby engine (before any cold start of that role)
        def activated() -> bool:
            return any(a["kind"] == "activate" for h in gw.runtime.planner.history for a in h["actions"])

        seen_at: list[float] = []
        served: list[float] = []  # by the activated engine, read every 0.5 s from its activation on: the planner
        # may give the engine back and stop it once the load it sees drops (a fresh-clone run read a closed port
        # at the end of the peak; another, on a machine loaded by other jobs, 6 s after the activation)
        read_at = [0.0]

        def activated_a_while_ago() -> bool:  # keep the peak on for 6 s after the activation
            now = time.monotonic()
            if not seen_at and activated():
                seen_at.append(now)
            if not seen_at:
                return False
            if now - read_at[0] >= 0.5:
                read_at[0] = now
                try:
                    served.append(requests_served(sb.url))
                except httpx.HTTPError:  # stopped: what it served was read before
                    return True
            return now - seen_at[0] > 6

        sent2, problems2 = asyncio.run(traffic(gw.url, 9.0, activated_a_while_ago, 60))
        stop.set()
        history = gw.runtime.planner.history
        act = next(h for h in history for a in h["actions"] if a["kind"] == "activate")
        assert act["actions"][[a["kind"] for a in act["actions"]].index("activate")]["worker_id"] == sb.id
        # warm before cold: no prefill engine was cold-started for rotation before the activation
        before = [h for h in history if h["at"] < act["at"]]
        assert not [a for h in before for a in h["actions"]
                    if a["kind"] == "start" and a["role"] == "prefill" and a["then"] != "standby"], before
        # in rotation within well under a second of the decision
        healthy_at = next(t for t, s in states[sb.id] if s == "healthy")
        lag = healthy_at - act["at"]
        assert lag < 1.0, (lag, states[sb.id])
        assert served and max(served) > 0, ("the activated standby engine never served", served, states[sb.id])
        problems = problems0 + problems1 + problems2
        assert problems == [], problems[:5]
        procs = gw.runtime.planner.actuator.local.processes
        cold = {w.id: round(w.ready_at - procs[w.id].started_at, 2) for w in fleet.workers()
                if w.id in procs and w.id != sb.id and w.ready_at is not None}
        print(f"standby {sb.id}: in rotation {lag * 1000:.0f} ms after the activating decision; "
              f"sent {sent0 + sent1 + sent2}; cold engines started meanwhile, start → ready (s): {cold}")
    finally:
        stop.set()
        if gw is not None:
            gw.stop()
        for e in static:
            e.stop()
