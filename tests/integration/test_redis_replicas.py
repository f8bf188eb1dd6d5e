"""Two router replicas (two PrefixTrackers, each with its own Redis client and local view) on one real
redis-server: they share the prefix index and each other's in-flight load; reservations of a
replica that dies expire; Redis restarted → routing continues and the index is refilled.

Both replicas live in this process (the two-`dyad serve`-process version waits for the gateway's
serve command to take an index config in tests; see the kv report)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.config import load_config
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.kv.tracker import build_prefix_tracker
from orchestrator.router.policies.kv_aware import KvAwarePolicy
from orchestrator.router.types import RouteRequest
from tests.fixtures.redis import redis_server, unique_prefix  # noqa: F401

pytestmark = pytest.mark.redis

SYSTEM = " ".join(f"rule{i}" for i in range(640))  # 640 sim tokens = 20 blocks of 32


def replica(url: str, prefix: str):
    cfg = load_config({
        "models": [{"name": "m", "tokenizer": "sim", "block_size": 32}],
        "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{9000 + i}", "engine": "sim", "models": ["m"]}
                    for i in range(3)],
        "router": {"policy": "kv_aware", "seed": 1},
        "index": {"backend": "redis", "redis_url": url, "key_prefix": prefix},
    }, environ={})
    fleet = FleetRegistry.from_config(cfg)
    for w in fleet.workers():
        fleet.record_health(w, True, 0.0)
    tracker = build_prefix_tracker(cfg, fleet)
    return tracker, fleet, KvAwarePolicy(cfg.router.kv_aware, seed=1)


async def route(tracker, fleet, policy, rid: str, text: str):
    req = RouteRequest(request_id=rid, model="m", prompt_tokens=0)
    body = {"model": "m", "prompt": text}
    cands = fleet.candidates("m")
    await tracker.annotate(req, body, "/v1/completions", cands)
    now = tracker.clock.now()
    d = policy.choose(req, cands, now)
    await tracker.on_routed(req, d, now)
    return req, d


async def test_replicas_share_index_and_load_and_survive_redis_restart(redis_server):  # noqa: F811
    prefix = unique_prefix("rep")
    a, fa, pa = replica(redis_server.url, prefix)
    b, fb, pb = replica(redis_server.url, prefix)
    a.shared_load.ttl_ms = 1500  # short lease so the crash case runs fast
    await a.start()
    await b.start()
    try:
        # Replica A routes a prompt; replica B, which never saw it, finds it in the shared index.
        req_a, d_a = await route(a, fa, pa, "a1", SYSTEM + " question one")
        req_b = RouteRequest(request_id="b1", model="m", prompt_tokens=0)
        await b.annotate(req_b, {"prompt": SYSTEM + " another question"}, "/v1/completions", fb.candidates("m"))
        assert req_b.overlaps[d_a.worker.id].blocks == 20
        # ...and sees A's in-flight request as load on that worker.
        assert req_b.peer_load[d_a.worker.id].inflight == 1  # type: ignore[attr-defined]
        assert req_b.peer_load[d_a.worker.id].prefill_tokens > 0  # type: ignore[attr-defined]
        await a.on_finished(req_a, d_a, True, 0.0)
        await b.annotate(req_b, {"prompt": SYSTEM + " another question"}, "/v1/completions", fb.candidates("m"))
        assert req_b.peer_load == {}  # type: ignore[attr-defined]
        # A replica that dies with requests in flight leaks nothing beyond its lease.
        await route(a, fa, pa, "a2", SYSTEM + " question two")
        await a.shared_load.stop(release=False)  # stops renewing: as if the process died
        await b.annotate(req_b, {"prompt": SYSTEM}, "/v1/completions", fb.candidates("m"))
        assert sum(p.inflight for p in req_b.peer_load.values()) == 1  # type: ignore[attr-defined]
        await asyncio.sleep(1.7)
        await b.annotate(req_b, {"prompt": SYSTEM}, "/v1/completions", fb.candidates("m"))
        assert req_b.peer_load == {}  # type: ignore[attr-defined]
        # Redis crashes and comes back empty: routing goes on from the local view, then resyncs.
        # (In approximate mode a replica's local view holds its own decisions; with KV events every
        # replica ingests every engine's events, so its local view is complete.)
        await route(b, fb, pb, "b1", SYSTEM + " before the outage")
        b.index._retry_interval_s = 0.0  # type: ignore[attr-defined]
        with redis_server.stopped():
            req, d = await route(b, fb, pb, "b2", SYSTEM + " during the outage")
            assert req.overlaps  # answered from B's local view
        await b.annotate(req_b, {"prompt": SYSTEM}, "/v1/completions", fb.candidates("m"))
        if b.index._resync_task is not None:  # type: ignore[attr-defined]
            await b.index._resync_task  # type: ignore[attr-defined]
        assert await a.index.size() > 0  # refilled from B's local view, visible to A
        req_a2 = RouteRequest(request_id="a3", model="m", prompt_tokens=0)
        await a.annotate(req_a2, {"prompt": SYSTEM}, "/v1/completions", fa.candidates("m"))
        assert max(o.blocks for o in req_a2.overlaps.values()) == 20
    finally:
        await a.stop()
        await b.stop()
