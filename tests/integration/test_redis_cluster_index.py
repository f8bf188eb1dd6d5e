"""The prefix index on a REAL Redis Cluster on loopback (``redis-server --cluster-enabled yes`` nodes
joined by ``redis-cli --cluster create``; tests/fixtures/redis_cluster.py).

- ``test_cluster_index_...``: two index instances (two router replicas) on a 3-primary cluster share
  entries per tier; a lookup reads ceil(n / GROUP_BLOCKS) hash slots; removals per tier, clearing a
  worker and the per-worker cap work across slots; the same answers as the in-memory index.
- ``test_primary_without_replica_...``: a primary of a cluster without replicas is killed: lookups
  and writes go to the mirror at once (its slots are not served), nothing fails; when the node comes
  back empty, the probe sees every slot served again and the resync refills it.
- ``test_gateway_survives_primary_kill_...``: a real gateway (``dyad serve``) over two simulated
  engines (the sim server in-process: KV events on, vLLM's wire format) with ``index.backend:
  redis_cluster`` on 3 primaries + 3 replicas, and a second, read-only replica (``ingest_events:
  false``) that finds what the first learnt; under routing load one primary is killed -9; its
  replica is promoted within the bound Redis' failover algorithm gives for the node timeout
  (``RedisCluster.failover_bound_s``); no request fails; the gateway's index returns to the cluster
  within ``RedisClusterPrefixIndex.return_bound_s`` after that; a new prefix it learns is then found
  in the cluster by the read-only replica.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from redis.cluster import key_slot

from orchestrator.kv.index import GROUP_BLOCKS, Tier
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.kv.redis_cluster_index import RedisClusterPrefixIndex
from orchestrator.sim.server import SimEngineThread
from tests.fixtures.redis import unique_prefix
from tests.fixtures.redis_cluster import RedisCluster
from tests.integration.test_redis_replicas import GatewayProcess, complete, words

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def cluster():
    with RedisCluster(primaries=3, replicas=0) as c:
        yield c


def chain(tag: int, n: int) -> list[int]:
    return [(tag << 32) + i + 1 for i in range(n)]


async def test_cluster_index_shares_entries_per_tier_and_touches_few_slots(cluster):
    prefix = unique_prefix("clu")
    # the 0.5 s production call bound guards routing latency; this shared machine can be slower (a call
    # past it would switch the index to its mirror, which is not what this test is about)
    a = RedisClusterPrefixIndex(cluster.url, prefix, max_blocks=10_000, max_blocks_per_worker=100,
                                call_timeout_s=5.0)
    b = RedisClusterPrefixIndex(cluster.url, prefix, max_blocks=10_000, call_timeout_s=5.0)
    mem = MemoryPrefixIndex()
    try:
        c1 = chain(1, 40)
        c2 = c1[:20] + chain(2, 10)  # shares 20 blocks with c1
        for idx in (a, mem):
            await idx.store("w0", c1)
            await idx.store("w1", c2[:25])
            await idx.store("w1", c2[25:], anchors=[c2[16]] * 5)  # a later piece of the chain
        for q in (c1, c2, c1[:5], chain(9, 3)):
            assert await b.overlaps(q) == await mem.overlaps(q)
        assert (await b.overlaps(c1))["w0"].blocks == 40 and (await b.overlaps(c2))["w1"].blocks == 30
        # the keys one lookup reads: ceil(40 / GROUP_BLOCKS) group slots (+1 for the slot-table version)
        groups = {key_slot(b._bkey(a_, h).encode()) for h, a_ in zip(c1, b._anchors_for(c1, None), strict=True)}
        assert len(groups) <= -(-40 // GROUP_BLOCKS)
        # tiers: an offload adds HOST; a GPU eviction leaves it credited at the host weight
        await a.store("w0", c1[30:], Tier.HOST)
        await a.remove("w0", c1[30:], Tier.DEVICE)
        ov = (await b.overlaps(c1, {"device": 1.0, "host": 0.5}))["w0"]
        assert ov.blocks == 40 and ov.weighted_blocks == pytest.approx(30 + 0.5 * 10)
        await a.remove("w0", c1[35:], Tier.HOST)
        assert (await b.overlaps(c1))["w0"].blocks == 35
        assert await b.worker_blocks("w0") == 35
        # the per-worker cap drops the oldest entries, in every slot they live in
        await a.store("w2", chain(3, 120))
        assert await b.worker_blocks("w2") == 100
        assert "w2" not in await b.overlaps(chain(3, 120))  # its chain's head was dropped first
        # clearing a worker removes its entries everywhere and frees its slot
        await a.clear_worker("w0")
        assert "w0" not in await b.overlaps(c1) and (await b.overlaps(c2))["w1"].blocks == 30
        assert await b.worker_blocks("w0") == 0
        assert a.available and b.available and a.fallback_lookups == 0
    finally:
        await a.close()
        await b.close()


def test_gateway_survives_primary_kill_and_index_recovers(tmp_path):
    with RedisCluster(primaries=3, replicas=1, node_timeout_ms=1000) as cl:  # replicas synced (see fixture)
        engines = [SimEngineThread(model="m", profile="cpu-tiny", seed=i, kv_events=True).start() for i in range(2)]
        prefix = unique_prefix("fo")
        config = {
            "models": [{"name": "m", "block_size": 32}],
            "workers": [{"id": f"e{i}", "url": e.url, "engine": "sim", "models": ["m"],
                         "kv_events": {"endpoint": e.kv_events_endpoint, "replay_endpoint": e.replay_endpoint}}
                        for i, e in enumerate(engines)],
            "router": {"policy": "kv_aware", "debug_headers": True, "seed": 1},
            "index": {"backend": "redis_cluster", "redis_url": cl.url, "key_prefix": prefix},
        }
        gw = GatewayProcess(config, tmp_path, "gw")
        # a second replica that only reads the shared index (index.ingest_events: false)
        reader = GatewayProcess({**config, "index": {**config["index"], "ingest_events": False}}, tmp_path, "reader")
        threads: list[threading.Thread] = []
        done = threading.Event()
        try:
            gw.wait_ready()
            reader.wait_ready()
            # KV events reach the cluster index: a prefix served once is found again, also by the
            # replica that never subscribed to the engines
            system = words("sys", 320)
            first = complete(gw.url, system + " one")
            time.sleep(0.5)
            second = complete(gw.url, system + " two")
            assert second.headers["x-dyad-worker"] == first.headers["x-dyad-worker"]
            assert int(second.headers["x-dyad-predicted-cached-tokens"]) >= 288
            third = complete(reader.url, system + " three")
            assert third.headers["x-dyad-worker"] == first.headers["x-dyad-worker"]
            assert int(third.headers["x-dyad-predicted-cached-tokens"]) >= 288

            errors: list[str] = []
            count = [0]

            def load(tag: str) -> None:
                i = 0
                while not done.is_set():
                    try:
                        r = httpx.post(f"{gw.url}/v1/completions",
                                       json={"model": "m", "prompt": words(f"{tag}{i % 7}w", 96) + f" n{i}",
                                             "max_tokens": 2}, timeout=30, trust_env=False)
                        if r.status_code != 200:
                            errors.append(f"{r.status_code} {r.text[:200]}")
                    except httpx.HTTPError as e:
                        errors.append(repr(e))
                    count[0] += 1
                    i += 1

            threads = [threading.Thread(target=load, args=(f"l{n}",)) for n in range(2)]
            for th in threads:
                th.start()
            time.sleep(1.5)
            before = count[0]
            victim = next(p for p, r in cl.role_of().items() if r == "master")
            killed_at = time.monotonic()
            cl.kill(victim)
            # Redis replaces the primary: in every running node's view every slot is owned by a running
            # primary again, within the bound Redis' failover algorithm gives for this node timeout.
            failover_s = cl.wait_serving(cl.failover_bound_s())
            promoted = [p for p in cl.running() if "Failover election won" in cl.log(p)]
            assert len(promoted) == 1, cl.describe()
            # The gateway, routing all along, noticed the dead node, served from its mirror, and returns
            # to the cluster (resync) within the index's own bound once the cluster serves again.
            bound = RedisClusterPrefixIndex.return_bound_s()
            deadline = time.monotonic() + bound
            while "redis cluster index resynced" not in gw.log.read_text():
                assert time.monotonic() < deadline, (
                    f"the gateway's index did not return to the cluster within {bound:.1f} s of the failover"
                    f"\n{gw.log.read_text()[-3000:]}\n{cl.describe()}")
                time.sleep(0.2)
            resynced_s = time.monotonic() - killed_at
            done.set()
            for th in threads:
                th.join(60)
            assert not errors, errors[:5]
            assert count[0] - before >= 10  # requests kept flowing through the failover and the resync
            log = gw.log.read_text()
            assert "redis cluster index unreachable" in log and "reachable again" in log, log[-3000:]
            print(f"failover: cluster serving again {failover_s:.1f} s after the kill (bound "
                  f"{cl.failover_bound_s():.1f} s); gateway resynced {resynced_s:.1f} s after the kill; "
                  f"{count[0] - before} requests meanwhile, 0 failed")

            # The index recovered for real: a new prefix, learnt by the gateway from KV events, is in the
            # cluster, where the read-only replica (which never saw it) finds it. Either replica may be on
            # its mirror again meanwhile (its first call met the old topology, or a call ran past its
            # 0.5-s bound on a loaded machine: CI run 48 saw the reader go down twice): each comes back
            # within the same bound, the gateway writing what it learnt on its way back (the resync), so
            # the two returns, one after the other, bound the wait.
            system = words("after", 320)
            a = complete(gw.url, system + " q")
            deadline = time.monotonic() + 2 * bound
            while True:
                time.sleep(0.3)
                b = complete(reader.url, system + f" r{time.monotonic()}")
                if (b.headers["x-dyad-worker"] == a.headers["x-dyad-worker"]
                        and int(b.headers["x-dyad-predicted-cached-tokens"]) >= 288):
                    break
                assert time.monotonic() < deadline, (
                    f"the read-only replica did not find the new prefix in the cluster within {2 * bound:.1f} s"
                    f"\n--- reader:\n{reader.log.read_text()[-3000:]}\n--- gateway:\n{gw.log.read_text()[-3000:]}"
                    f"\n{cl.describe()}")

            async def held() -> tuple[int, int]:  # a fresh client on the live nodes: what the cluster holds
                live = "redis://" + ",".join(f"127.0.0.1:{p}" for p in cl.running())
                probe = RedisClusterPrefixIndex(live, prefix, call_timeout_s=10.0, socket_timeout_s=5.0)
                try:
                    return await probe.size(), probe.fallback_lookups + probe.errors
                finally:
                    await probe.close()
            size, failures = asyncio.run(held())
            assert size > 0 and failures == 0, (size, failures)
        finally:
            done.set()
            for th in threads:
                th.join(60)
            gw.stop()
            reader.stop()
            for e in engines:
                e.stop()


async def test_replicas_share_in_flight_load_on_the_cluster(cluster):
    """Two router replicas (in-process trackers) on the cluster: a request one has in flight shows in
    the other's peer load (the load keys share one hash tag, so the multi-key scripts run there)."""
    from orchestrator.config import load_config
    from orchestrator.fleet.registry import FleetRegistry
    from orchestrator.kv.tracker import build_prefix_tracker
    from orchestrator.router.types import RouteDecision, RouteRequest

    prefix = unique_prefix("load")

    def replica():
        cfg = load_config({
            "models": [{"name": "m", "tokenizer": "sim", "block_size": 32}],
            "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{9000 + i}", "engine": "sim", "models": ["m"]}
                        for i in range(2)],
            "router": {"policy": "kv_aware", "seed": 1},
            "index": {"backend": "redis_cluster", "redis_url": cluster.url, "key_prefix": prefix},
        }, environ={})
        fleet = FleetRegistry.from_config(cfg)
        for w in fleet.workers():
            fleet.record_health(w, True, 0.0)
        return build_prefix_tracker(cfg, fleet), fleet

    a, fa = replica()
    b, fb = replica()
    for t in (a, b):  # the 0.5 s production bound guards routing latency; this shared machine can be slower
        t.shared_load.call_timeout_s = 5.0
        t.index._call_timeout_s = 5.0
    await a.start()
    await b.start()
    try:
        assert a.shared_load is not None and a.shared_load.route_key is not None
        req = RouteRequest(request_id="r1", model="m", prompt_tokens=640, block_size=32)
        body = {"model": "m", "prompt": " ".join(f"x{i}" for i in range(640))}
        req = await a.annotate(req, body, "/v1/completions", fa.candidates("m"))
        d = RouteDecision(worker=fa.get("w1"), policy="kv_aware", reason="")
        await a.on_routed(req, d, 0.0)
        await a.shared_load._written("r1")
        peers = await b.shared_load.peer_loads(["w0", "w1"])
        assert "w0" not in peers and peers["w1"].inflight == 1 and peers["w1"].prefill_tokens == 640
        assert await a.shared_load.peer_loads(["w0", "w1"]) == {}  # its own load is not a peer's
        await a.shared_load.release("r1")
        assert await b.shared_load.peer_loads(["w0", "w1"]) == {}
        # the approximate entry recorded by A (no KV events here) is in the cluster index for B
        req2 = RouteRequest(request_id="r2", model="m", prompt_tokens=0)
        req2 = await b.annotate(req2, body, "/v1/completions", fb.candidates("m"))
        assert req2.overlaps["w1"].blocks == 20
    finally:
        await a.stop()
        await b.stop()


async def test_primary_without_replica_dies_and_comes_back_empty_then_is_resynced():
    with RedisCluster(primaries=3, replicas=0, node_timeout_ms=1000) as cl:
        prefix = unique_prefix("norep")
        idx = RedisClusterPrefixIndex(cl.url, prefix, retry_interval_s=0.3, call_timeout_s=2.0)
        try:
            chains = [chain(t, 40) for t in range(1, 30)]  # 29 × 3 groups: every node holds some
            for t, c in enumerate(chains):
                await idx.store(f"w{t % 3}", c)
            assert idx.available
            victim = cl.ports[0]
            cl.kill(victim)
            answers = [await idx.overlaps(c) for c in chains]  # from the cluster, or the mirror once it fails
            assert all(a[f"w{t % 3}"].blocks == 40 for t, a in enumerate(answers))
            assert not idx.available and idx.fallback_lookups > 0
            await idx.store("w9", chain(99, 20))  # written to the mirror (or the cluster, if up)
            # once the node is marked failed, a third of the slots are not served: the probe keeps
            # the replica on its mirror (an early probe may try before that; its resync fails)
            await asyncio.sleep(3.0)
            for _ in range(10):
                assert not idx.available
                for t, c in enumerate(chains):
                    assert (await idx.overlaps(c))[f"w{t % 3}"].blocks == 40
                await asyncio.sleep(0.15)
            cl.restart(victim)
            deadline = time.monotonic() + 30
            while not (idx.available and idx.resyncs >= 1):
                assert time.monotonic() < deadline, "index did not return to the cluster"
                await asyncio.sleep(0.2)
            # a fresh replica (empty mirror) reads everything, including what the dead node held
            fresh = RedisClusterPrefixIndex(cl.url, prefix, call_timeout_s=5.0)
            try:
                for t, c in enumerate(chains):
                    assert (await fresh.overlaps(c))[f"w{t % 3}"].blocks == 40, t
                assert (await fresh.overlaps(chain(99, 20)))["w9"].blocks == 20
                assert fresh.fallback_lookups == 0
            finally:
                await fresh.close()
        finally:
            await idx.close()


async def test_replicas_split_event_ingestion_and_take_over_a_stopped_one(cluster):
    """``index.ingest_shard``: three replicas split 12 event-fed engines (each engine followed by
    exactly one); when one stops, the others take its engines over."""
    from orchestrator.config import load_config
    from orchestrator.fleet.registry import FleetRegistry
    from orchestrator.kv.ingest_shards import owner
    from orchestrator.kv.tracker import build_prefix_tracker

    prefix = unique_prefix("shard")
    workers = [{"id": f"w{i}", "url": f"http://127.0.0.1:{9000 + i}", "engine": "sim", "models": ["m"],
                "kv_events": {"endpoint": f"tcp://127.0.0.1:{20000 + i}"}} for i in range(12)]

    def replica():
        cfg = load_config({
            "models": [{"name": "m", "tokenizer": "sim", "block_size": 32}], "workers": workers,
            "router": {"policy": "kv_aware"},
            "index": {"backend": "redis_cluster", "redis_url": cluster.url, "key_prefix": prefix,
                      "ingest_shard": True},
        }, environ={})
        fleet = FleetRegistry.from_config(cfg)
        for w in fleet.workers():
            fleet.record_health(w, True, 0.0)
        t = build_prefix_tracker(cfg, fleet)
        t.shards.interval_s = 0.2
        return t

    reps = [replica() for _ in range(3)]
    for r in reps:
        await r.start()
    try:
        ids = [r.shards.replica_id for r in reps]
        # membership is eventually consistent (each replica registers from its own loop): rebalance until
        # every replica knows the full replica set
        deadline = time.monotonic() + 15
        while True:
            for r in reps:
                await r.rebalance()
            if all(sorted(r.shards.replicas) == sorted(ids) for r in reps):
                break
            assert time.monotonic() < deadline, [sorted(r.shards.replicas) for r in reps]
            await asyncio.sleep(0.2)
        owned = [set(r.subscribers) for r in reps]
        assert set().union(*owned) == {f"w{i}" for i in range(12)}
        assert sum(len(o) for o in owned) == 12  # each engine followed once
        for r, o in zip(reps, owned, strict=True):
            assert o == {f"w{i}" for i in range(12) if owner(f"w{i}", ids) == r.shards.replica_id}
        await reps[2].stop()  # leaves the replica set at once
        deadline = time.monotonic() + 10
        while set(reps[0].subscribers) | set(reps[1].subscribers) != {f"w{i}" for i in range(12)}:
            assert time.monotonic() < deadline, "engines of the stopped replica were not taken over"
            await asyncio.sleep(0.1)
        assert not set(reps[0].subscribers) & set(reps[1].subscribers)
    finally:
        for r in reps[:2]:
            await r.stop()
