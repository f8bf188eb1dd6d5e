"""Router replicas on one real redis-server share the prefix index and each other's in-flight load.

- ``test_two_gateway_processes_...``: two ``dyad serve`` processes over two simulated engines
  (in-process SimEngineThreads; simulated because the check needs a slow, exactly controllable
  decode): an index entry learnt by one is used by the other; a request in flight through one
  steers the other's choice; Redis killed and restarted under load → no failed request, routing
  goes on and the index is refilled.
- ``test_replicas_share_index_and_load_...``: two PrefixTrackers in this process, for what needs
  reaching inside: reservation contents (prefill tokens dropped at the first token), the lease of
  a replica that dies, the local fallback and resync."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis as sync_redis

from orchestrator.config import load_config
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.kv.tracker import build_prefix_tracker
from orchestrator.router.policies.kv_aware import KvAwarePolicy
from orchestrator.router.types import PeerLoad, RouteRequest
from orchestrator.sim.server import SimEngineThread
from tests.fixtures.redis import free_port, redis_server, unique_prefix  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.redis

SYSTEM = " ".join(f"rule{i}" for i in range(640))  # 640 sim tokens = 20 blocks of 32


def replica(url: str, prefix: str, approximate_ttl_s: float = 120.0):
    cfg = load_config({
        "models": [{"name": "m", "tokenizer": "sim", "block_size": 32}],
        "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{9000 + i}", "engine": "sim", "models": ["m"]}
                    for i in range(3)],
        "router": {"policy": "kv_aware", "seed": 1},
        "index": {"backend": "redis", "redis_url": url, "key_prefix": prefix,
                  "approximate_ttl_s": approximate_ttl_s},
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
    req = await tracker.annotate(req, body, "/v1/completions", cands)
    now = tracker.clock.now()
    d = policy.choose(req, cands, now)
    await tracker.on_routed(req, d, now)
    if tracker.shared_load is not None:
        await tracker.shared_load._written(rid)  # the reservation is written in the background
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
        req_b = await b.annotate(req_b, {"prompt": SYSTEM + " another question"}, "/v1/completions", fb.candidates("m"))
        assert req_b.overlaps[d_a.worker.id].blocks == 20
        # ...and sees A's in-flight request as load on that worker.
        assert req_b.peer_load[d_a.worker.id].inflight == 1  # type: ignore[attr-defined]
        assert req_b.peer_load[d_a.worker.id].prefill_tokens > 0  # type: ignore[attr-defined]
        # A's first token: the request stays in flight but its prompt is no longer queued work.
        await a.on_first_token(req_a, d_a, 0.0)
        req_b = await b.annotate(req_b, {"prompt": SYSTEM + " another question"}, "/v1/completions", fb.candidates("m"))
        assert req_b.peer_load[d_a.worker.id] == PeerLoad(inflight=1, prefill_tokens=0)
        await a.on_finished(req_a, d_a, True, 0.0)
        req_b = await b.annotate(req_b, {"prompt": SYSTEM + " another question"}, "/v1/completions", fb.candidates("m"))
        assert req_b.peer_load == {}  # type: ignore[attr-defined]
        # A replica that dies with requests in flight leaks nothing beyond its lease.
        await route(a, fa, pa, "a2", SYSTEM + " question two")
        await a.shared_load.stop(release=False)  # stops renewing: as if the process died
        req_b = await b.annotate(req_b, {"prompt": SYSTEM}, "/v1/completions", fb.candidates("m"))
        assert sum(p.inflight for p in req_b.peer_load.values()) == 1  # type: ignore[attr-defined]
        await asyncio.sleep(1.7)
        req_b = await b.annotate(req_b, {"prompt": SYSTEM}, "/v1/completions", fb.candidates("m"))
        assert req_b.peer_load == {}  # type: ignore[attr-defined]
        # Redis crashes and comes back empty: routing goes on from the local view, then resyncs.
        # (In approximate mode a replica's local view holds its own decisions; with KV events every
        # replica ingests every engine's events, so its local view is complete.)
        await route(b, fb, pb, "b1", SYSTEM + " before the outage")
        b.index._retry_interval_s = 0.0  # type: ignore[attr-defined]
        with redis_server.stopped():
            req, d = await route(b, fb, pb, "b2", SYSTEM + " during the outage")
            assert req.overlaps  # answered from B's local view
        req_b = await b.annotate(req_b, {"prompt": SYSTEM}, "/v1/completions", fb.candidates("m"))
        if b.index._resync_task is not None:  # type: ignore[attr-defined]
            await b.index._resync_task  # type: ignore[attr-defined]
        assert await a.index.size() > 0  # refilled from B's local view, visible to A
        req_a2 = RouteRequest(request_id="a3", model="m", prompt_tokens=0)
        req_a2 = await a.annotate(req_a2, {"prompt": SYSTEM}, "/v1/completions", fa.candidates("m"))
        assert max(o.blocks for o in req_a2.overlaps.values()) == 20
    finally:
        await a.stop()
        await b.stop()


async def test_approximate_entries_expire_on_a_shared_clock(redis_server):  # noqa: F811
    """Approximate mode (no KV events): an entry lives ttl after the last replica that used it —
    the replica that recorded it first does not delete it while another still uses it, and entries
    of a replica that stopped are dropped by the others.

    The moments are measured, not assumed: the probe runs once A's own TTL has passed, and counts only if it
    finished before B's refresh could have expired (on a starved machine fixed sleeps of 0.6 and 0.7 s around
    a 1-s TTL once probed after B's refresh had run out too); a scenario that missed its window is run again
    with a fresh prefix, and the test fails if none of three hit it."""
    ttl = 2.0
    for _ in range(3):
        prefix = unique_prefix("approx")
        a, fa, pa = replica(redis_server.url, prefix, approximate_ttl_s=ttl)
        b, fb, pb = replica(redis_server.url, prefix, approximate_ttl_s=ttl)
        await a.start()
        await b.start()
        try:
            req_a, d = await route(a, fa, pa, "a1", SYSTEM + " first")
            a_recorded = time.monotonic()  # A's entry expires (for A) by a_recorded + ttl
            await a.on_finished(req_a, d, True, 0.0)  # done: its in-flight load no longer repels B
            await asyncio.sleep(ttl / 2)
            b_refreshing = time.monotonic()  # B's refresh lands after this: it lives until past b_refreshing + ttl
            req_b, d_b = await route(b, fb, pb, "b1", SYSTEM + " second")  # B uses and refreshes it
            b_refreshed = time.monotonic()
            assert d_b.worker.id == d.worker.id and req_b.overlaps[d.worker.id].blocks == 20
            await asyncio.sleep(max(0.0, a_recorded + ttl + 0.1 - time.monotonic()))  # A's own TTL has passed
            probe = RouteRequest(request_id="p1", model="m", prompt_tokens=0)
            probe = await a.annotate(probe, {"prompt": SYSTEM}, "/v1/completions", fa.candidates("m"))
            if a.approx._pass is not None:
                await a.approx._pass
            if time.monotonic() >= b_refreshing + ttl:
                continue  # too slow to tell: B's refresh may have run out as well
            assert a.approx.remaining(d.worker.id, req_a.block_hashes[0]) in (None, 0.0)  # A's own record is over
            assert probe.overlaps[d.worker.id].blocks == 20  # still in Redis: B refreshed it
            await a.stop()  # A goes away; B's expiry pass cleans up after everyone
            await asyncio.sleep(max(0.0, b_refreshed + ttl + 0.1 - time.monotonic()))
            probe = await b.annotate(probe, {"prompt": SYSTEM}, "/v1/completions", fb.candidates("m"))
            if b.approx._pass is not None:
                await b.approx._pass
            probe = await b.annotate(probe, {"prompt": SYSTEM}, "/v1/completions", fb.candidates("m"))
            assert probe.overlaps == {}
            assert await b.index.size() == 0
            return
        finally:
            await a.stop()
            await b.stop()
    pytest.fail("three tries, and each probe came after B's refresh could have expired: the machine is too slow")


# --- two `dyad serve` processes ----------------------------------------------------------------------

class GatewayProcess:
    """``dyad serve --config`` as a child process on a free port (claimed machine-wide: orchestrator/ports.py);
    stopped by its own pid."""

    def __init__(self, config: dict, workdir: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / f"{name}.json"
        cfg.write_text(json.dumps({**config, "gateway": {"host": "127.0.0.1", "port": self.port}}))
        self.log = workdir / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(cfg)],
                                         cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gateway not ready: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def complete(url: str, prompt: str, max_tokens: int = 2) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens},
                   timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_two_gateway_processes_share_index_and_load_and_survive_redis_restart(redis_server, tmp_path):  # noqa: F811
    engines = [SimEngineThread(model="m", profile="cpu-tiny", seed=i, kv_events=False).start() for i in range(2)]
    prefix = unique_prefix("procs")
    base = {
        "models": [{"name": "m", "block_size": 32}],
        "workers": [{"id": f"e{i}", "url": e.url, "engine": "sim", "models": ["m"]} for i, e in enumerate(engines)],
        "router": {"policy": "kv_aware", "debug_headers": True},
        "index": {"backend": "redis", "redis_url": redis_server.url, "key_prefix": prefix},
        # No engine scrapes after the first: what one replica knows of the other's load must come
        # through Redis, not from the engines' own counters.
        "scrape": {"interval_s": 3600},
    }
    gateways = [GatewayProcess({**base, "router": {**base["router"], "seed": i}}, tmp_path, f"gw{i}") for i in range(2)]
    a, b = gateways
    try:
        for g in gateways:
            g.wait_ready()
        # 1. Shared index (approximate mode: the engines publish no events, so what a replica knows
        #    of a prefix is what some replica routed). A prefix routed by B is found by A.
        for t in range(3):
            system = words(f"sys{t}w", 320)  # 10 blocks
            first = complete(b.url, system + " first question")
            assert first.headers["x-dyad-predicted-cached-tokens"] == "0"
            second = complete(a.url, system + " second question")
            assert second.headers["x-dyad-worker"] == first.headers["x-dyad-worker"]
            assert int(second.headers["x-dyad-predicted-cached-tokens"]) == 320

        # 2. Shared in-flight load. A long request through A stays in flight on worker X; B, which
        #    has nothing of its own in flight and no fresh engine metrics, must see it and send
        #    fresh prompts to the other worker (a coin toss per request without the shared load).
        held: dict[str, str] = {}
        started = threading.Event()

        def long_request() -> None:
            body = {"model": "m", "prompt": words("long", 64), "max_tokens": 400, "stream": True}
            with httpx.stream("POST", f"{a.url}/v1/completions", json=body, timeout=120, trust_env=False) as r:
                held["worker"] = r.headers["x-dyad-worker"]
                started.set()
                for _ in r.iter_bytes():
                    pass

        t = threading.Thread(target=long_request)
        t.start()
        assert started.wait(30)
        time.sleep(0.2)  # A's reservation is written in the background
        choices = [complete(b.url, words(f"fresh{i}w", 64)).headers["x-dyad-worker"] for i in range(6)]
        assert held["worker"] not in choices, (held, choices)
        t.join(120)

        # 3. Redis killed -9 and restarted (empty) while both replicas serve: no request fails.
        errors: list[str] = []
        done = threading.Event()
        count = [0]

        def load(g: GatewayProcess, tag: str) -> None:
            i = 0
            while not done.is_set():
                try:
                    r = httpx.post(f"{g.url}/v1/completions", json={"model": "m", "prompt": words(f"{tag}{i % 5}w", 96)
                                   + f" n{i}", "max_tokens": 2}, timeout=30, trust_env=False)
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    errors.append(repr(e))
                count[0] += 1
                i += 1

        threads = [threading.Thread(target=load, args=(g, f"load{n}")) for n, g in enumerate(gateways)]
        for th in threads:
            th.start()
        time.sleep(1.0)
        before = count[0]
        redis_server.restart()
        time.sleep(3.0)
        done.set()
        for th in threads:
            th.join(60)
        assert not errors, errors[:5]
        assert count[0] - before >= 10  # requests kept flowing through the restart
        # Routing continues and resyncs: the restarted Redis holds the replicas' entries again and a
        # prefix routed by A after the restart is found by B.
        r = sync_redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 10
        while r.zcard(f"{prefix}:idx:lru") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.zcard(f"{prefix}:idx:lru") > 0
        system = words("after", 320)
        first = complete(a.url, system + " one")
        second = complete(b.url, system + " two")
        assert second.headers["x-dyad-worker"] == first.headers["x-dyad-worker"]
        assert int(second.headers["x-dyad-predicted-cached-tokens"]) == 320
    finally:
        for g in gateways:
            g.stop()
        for e in engines:
            e.stop()
