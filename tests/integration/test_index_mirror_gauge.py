"""``dyad_index_mirror_only`` / ``dyad_index_mirror_since_timestamp_seconds``: how long a gateway
replica has been routing from its local mirror because the shared index is unreachable.

Real servers only: a real ``redis-server`` (tests/fixtures/redis.py) stopped and started again, and a
real 3-node Redis Cluster without replicas (tests/fixtures/redis_cluster.py) whose node is killed and
restarted. The gauge must go to 1 when the store fails, stay there while it is down, and return to 0
only once the store answers again and the mirror has been written back: with no request in between
(an idle replica must not page its operator forever).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.kv.redis_cluster_index import RedisClusterPrefixIndex
from orchestrator.kv.redis_index import RedisPrefixIndex
from orchestrator.telemetry.metrics import DyadMetrics
from tests.fixtures.redis import redis_server, unique_prefix  # noqa: F401
from tests.fixtures.redis_cluster import RedisCluster

pytestmark = pytest.mark.redis


def gauges(metrics: DyadMetrics, backend: str) -> tuple[float | None, float | None]:
    r = metrics.registry
    return (r.get_sample_value("dyad_index_mirror_only", {"backend": backend}),
            r.get_sample_value("dyad_index_mirror_since_timestamp_seconds", {"backend": backend}))


def chain(tag: int, n: int) -> list[int]:
    return [(tag << 32) + i + 1 for i in range(n)]


async def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_redis_down_sets_mirror_gauge_and_an_idle_replica_clears_it_after_resync(redis_server):  # noqa: F811
    metrics = DyadMetrics()
    idx = RedisPrefixIndex(redis_server.url, key_prefix=unique_prefix("mirror"), metrics=metrics,
                           retry_interval_s=0.2)
    other = RedisPrefixIndex(redis_server.url, key_prefix=idx.key_prefix)
    try:
        assert gauges(metrics, "redis") == (0.0, 0.0)  # the series exist from the start, at 0
        await idx.store("a", chain(1, 8))
        assert idx.available and idx.mirror_since is None
        with redis_server.stopped():
            before = time.time()
            await idx.store("b", chain(2, 6))  # fails: kept in the mirror only
            only, since = gauges(metrics, "redis")
            assert only == 1.0 and not idx.available and idx.mirror_since is not None
            assert before - 1 <= since <= time.time() + 1  # wall time of the switch
            await asyncio.sleep(0.6)  # several probes fail while it is down: still on the mirror, same start
            assert (await idx.overlaps(chain(2, 6)))["b"].blocks == 6
            assert gauges(metrics, "redis") == (1.0, since)
        # Redis is back, empty. No request from here on: the background probe finds it.
        await wait_for(lambda: idx.available and idx.resyncs >= 1, 10, "the idle replica never came back")
        if idx._resync_task is not None:
            await idx._resync_task
        assert gauges(metrics, "redis") == (0.0, 0.0) and idx.mirror_since is None
        ov = await other.overlaps(chain(2, 6))  # the resync wrote the mirror back into the new Redis
        assert ov["b"].blocks == 6
        assert (await other.overlaps(chain(1, 8)))["a"].blocks == 8
    finally:
        await idx.close()
        await other.close()


async def test_cluster_node_down_sets_mirror_gauge_until_it_returns_and_resync_is_through():
    with RedisCluster(primaries=3, replicas=0, node_timeout_ms=1000) as cl:
        metrics = DyadMetrics()
        idx = RedisClusterPrefixIndex(cl.url, unique_prefix("cmirror"), metrics=metrics, retry_interval_s=0.3,
                                      call_timeout_s=2.0)
        try:
            chains = [chain(t, 40) for t in range(1, 30)]  # 29 × 3 groups: every node holds some
            for t, c in enumerate(chains):
                await idx.store(f"w{t % 3}", c)
            assert idx.available and gauges(metrics, "redis_cluster") == (0.0, 0.0)
            victim = cl.ports[0]
            cl.kill(victim)
            for c in chains:  # some of these touch the dead node's slots
                await idx.overlaps(c)
            only, since = gauges(metrics, "redis_cluster")
            assert only == 1.0 and since and since > 0 and not idx.available
            # a primary without a replica: its slots stay unserved, the replica stays on its mirror
            await asyncio.sleep(3.0)
            assert gauges(metrics, "redis_cluster") == (1.0, since)
            cl.restart(victim)
            await wait_for(lambda: idx.available and idx.resyncs >= 1, 30, "index did not return to the cluster")
            assert gauges(metrics, "redis_cluster") == (0.0, 0.0)
        finally:
            await idx.close()
