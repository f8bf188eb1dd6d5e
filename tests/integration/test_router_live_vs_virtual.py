"""One router, live and virtual: a small trace replayed through the live gateway over simulated engine
servers and through the virtual-time fleet gets the same routing decisions.

Live: a real gateway (``GatewayThread``: P/D pair selection on, KV events from the engines into its
prefix index, load scraped from the engines) in front of six ``dyad sim-engine`` servers
(``SimEngineThread``: 2 prefill, 4 decode, GPU-like profile; the simulator stands in for six GPU
engines), streamed completions sent on a schedule. Virtual: ``VirtualFleet`` with the same fleet,
profile, block size and P/D settings, replaying the same requests at the times the live run sent
them. Both runs route with the same ``Router`` and ``PdRoutingPolicy``; the virtual fleet only
supplies the state (engine loads, cached prefixes).

Comparable by construction, not by luck: every decision in the trace is decided by state both sides
hold exactly — which requests are still in flight (each request is either long-lived, in flight for the
whole trace, or short, over long before the next arrival), which prefixes each engine caches (the same
engine model on both sides), the prefill ledger (a 4,000-token prefill still running 0.1 s later). The trace exercises each branch of pair selection: a cached document pulling prefill to the
worker that holds it, a busy prefill worker pushing the next long prompt to the other one, local
prefill of short prompts on the decode worker, and decode placement by in-flight load.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from orchestrator.config import load_config
from orchestrator.gateway.serve import GatewayThread
from orchestrator.kv.word_tokenizer import SimTokenizer
from orchestrator.router.pd_selection import PdSelectionSettings
from orchestrator.sim.engine_model import chain_block_hashes
from orchestrator.sim.profiles import GPU_LIKE
from orchestrator.sim.server import SimEngineThread
from orchestrator.sim.virtual_time import FleetSpec, SimRequest, VirtualFleet

pytestmark = [pytest.mark.timeout(240)]

MODEL = "sim"
BLOCK = 16  # the GPU-like profile's block size, and the model's in the gateway
MIN_PREFILL = 100
IDS = ["p0", "p1", "d2", "d3", "d4", "d5"]  # VirtualFleet names workers by role and creation order


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


DOC_A, DOC_B = words("alpha", 320), words("beta", 320)
# (send offset in s, prompt, max_tokens). Every request is either long-lived (2,000 tokens: ~14 s of decode
# virtual, longer live, so in flight for the whole 10-s trace) or short (5 tokens or a small prompt: over
# in well under the 1 s to the next arrival), so at every arrival both sides agree on what is in flight
# however slow a loaded machine makes the live engines (slower only widens the margins it relies on).
LONG, SHORT = 2000, 5
TRACE = [
    (0.0, DOC_A + " " + words("qa", 20), LONG),    # split: nothing cached anywhere
    (1.0, DOC_B + " " + words("qb", 20), LONG),    # split; decode avoids the busy worker
    (2.0, DOC_A + " " + words("qc", 20), SHORT),   # prefill where alpha is cached; an idle decode worker
    (3.0, words("short", 30), SHORT),              # 30 uncached tokens < 100: local prefill on decode
    (4.0, DOC_B + " " + words("qd", 20), SHORT),   # beta cached on a busy decode worker only: split
    (6.0, words("long", 4000), SHORT),             # a long prefill keeps one prefill worker busy...
    (6.1, words("other", 4000), SHORT),            # ...so this one goes to the other (and another decoder)
    (7.5, DOC_A + " " + words("qe", 20), SHORT),   # the idle decode worker now holds alpha: local prefill
    (8.5, words("tiny", 10), SHORT),
    (9.5, DOC_B + " " + words("qf", 20), SHORT),   # ... and beta (from 4.0): local prefill
]


def virtual_requests(offsets: list[float]) -> list[SimRequest]:
    tok = SimTokenizer()
    out = []
    for i, ((_, prompt, max_tokens), at) in enumerate(zip(TRACE, offsets, strict=True)):
        ids = tok.encode(prompt)
        full = len(ids) // BLOCK * BLOCK
        out.append(SimRequest(id=i, arrival=at, isl=len(ids), osl=max_tokens,
                              blocks=tuple(chain_block_hashes(ids[:full], BLOCK)), block_tokens=BLOCK))
    return out


def run_virtual(offsets: list[float]) -> list[tuple[str | None, str]]:
    fleet = VirtualFleet(GPU_LIKE, FleetSpec(prefill=2, decode=4), policy="kv_aware", block_tokens=BLOCK,
                         pd_settings=PdSelectionSettings(min_prefill_tokens=MIN_PREFILL), model=MODEL)
    assert [sw.worker.id for sw in fleet.workers.values()] == IDS
    result = fleet.run(virtual_requests(offsets))
    assert all(r.finish is not None for r in result.requests)
    return [(pw, w) for _, w, pw, _ in sorted(fleet.route_log)]


async def send_all(url: str) -> tuple[list[float], list[str]]:
    problems: list[str] = []
    offsets: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one(prompt: str, max_tokens: int) -> None:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True, "temperature": 0}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            if r.status_code != 200 or not lines or lines[-1] != "data: [DONE]":
                problems.append(f"{r.status_code} {lines[-1:] if lines else None}")

        t0 = time.monotonic()
        tasks = []
        for at, prompt, max_tokens in TRACE:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            offsets.append(time.monotonic() - t0)
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
        await asyncio.gather(*tasks)
    return offsets, problems


def test_live_router_and_virtual_fleet_make_the_same_decisions():
    roles = ["prefill", "prefill", "decode", "decode", "decode", "decode"]
    engines = [SimEngineThread(model=MODEL, profile="gpu-like", seed=i, kv_events=True).start() for i in range(6)]
    gw = None
    try:
        config = load_config({
            "models": [{"name": MODEL, "block_size": BLOCK}],
            "workers": [{"id": wid, "url": e.url, "engine": "sim", "role": role, "models": [MODEL],
                         "kv_events": {"endpoint": e.kv_events_endpoint, "replay_endpoint": e.replay_endpoint}}
                        for wid, e, role in zip(IDS, engines, roles, strict=True)],
            "router": {"policy": "kv_aware"},
            "disagg": {"enabled": True, "min_prefill_tokens": MIN_PREFILL},
            "health": {"interval_s": 1.0},
            "scrape": {"interval_s": 0.1},
        }, environ={})
        gw = GatewayThread(config).start()
        offsets, problems = asyncio.run(send_all(gw.url))
        assert problems == []
        live_log = sorted(gw.runtime.router.recent_decisions, key=lambda d: d["time"])
        live = [(d["prefill_worker"], d["worker"]) for d in live_log]
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()
    virtual = run_virtual(offsets)
    assert len(live) == len(virtual) == len(TRACE)
    diff = [f"{i}: live {a} virtual {b}" for i, (a, b) in enumerate(zip(live, virtual, strict=True))]
    assert live == virtual, "\n".join(diff)
    # the trace really exercises the branches: both prefill workers, local prefill, several decode workers
    assert {pw for pw, _ in live} >= {"p0", "p1", None}
    assert len({w for _, w in live}) >= 2
