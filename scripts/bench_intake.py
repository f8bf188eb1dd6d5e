#!/usr/bin/env python3
"""In-process cost of the gateway intake pipeline per request (authenticate + admit + wrapped response).

    .venv/bin/python scripts/bench_intake.py
"""
import asyncio
import time

from starlette.requests import Request

from orchestrator.config import load_config
from orchestrator.gateway.admission import Intake
from orchestrator.gateway.auth import hash_key
from orchestrator.gateway.runtime import GatewayRuntime
from orchestrator.router.types import RouteRequest


async def bench(cfg, label, n=20000):
    workers = [{"url": f"http://127.0.0.1:{9000 + i}", "models": ["m"]} for i in range(4)]  # never contacted
    rt = GatewayRuntime(load_config(cfg | {"workers": workers}, environ={}))
    for w in rt.fleet.workers():  # as if the health loop had passed them
        rt.fleet.record_health(w, True, 0.0)
    assert len(rt.router.candidates("m")) == 4
    intake = Intake(rt)
    req = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                   "headers": [(b"authorization", b"Bearer key-a")]})
    async def inner(scope, receive, send): pass
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            who = intake.authenticate(req)
            who.check_model("m")
            rr = RouteRequest(request_id="r", model="m", prompt_tokens=100, max_tokens=10)
            slot = await intake.admit(who, rr, req.headers)
            await intake.wrap(inner, "m", "r", slot)(None, None, None)
        best.append((time.perf_counter() - t) / n * 1e6)
    print(f"{label}: {min(best):.1f} us per request (best of 3 x {n})")
    await rt.http.aclose()

async def main():
    await bench({}, "open gateway, no limits")
    keys = {"auth": {"keys": [{"name": f"k{i}", "sha256": hash_key(f"key-{'a' if i == 0 else i}")} for i in range(10)]}}
    await bench(keys, "10 hashed keys, no limits")
    await bench(keys | {"limits": {"default_rpm": 10**9, "default_tpm": 10**12, "max_inflight_per_worker": 10**6,
                                   "ttft_slo_s": 5, "prefill_tokens_per_s": 1e9}},
                "10 keys + local rpm/tpm buckets + queue gate + TTFT check")
asyncio.run(main())
