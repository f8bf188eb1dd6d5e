"""``SharedPrefixIndex.available``: the one switch both shared backends flip, and what it exports.

Pure: the Redis clients below are built but never used (redis-py connects on the first command), and
the clock is virtual. The real outage and return are in tests/integration/test_index_mirror_gauge.py.
"""

from __future__ import annotations

import time

from orchestrator.clock import VirtualClock
from orchestrator.kv.redis_cluster_index import RedisClusterPrefixIndex
from orchestrator.kv.redis_index import RedisPrefixIndex
from orchestrator.telemetry.metrics import DyadMetrics


def _gauges(m: DyadMetrics, backend: str) -> tuple[float | None, float | None]:
    return (m.registry.get_sample_value("dyad_index_mirror_only", {"backend": backend}),
            m.registry.get_sample_value("dyad_index_mirror_since_timestamp_seconds", {"backend": backend}))


def test_switching_to_the_mirror_and_back_sets_the_gauges_and_mirror_since():
    for cls, backend in ((RedisPrefixIndex, "redis"), (RedisClusterPrefixIndex, "redis_cluster")):
        m, clock = DyadMetrics(), VirtualClock(100.0)
        idx = cls("redis://127.0.0.1:1/0", "p", 10, m, clock=clock)
        assert idx.available and idx.mirror_since is None and _gauges(m, backend) == (0.0, 0.0)
        before = time.time()
        idx.available = False
        only, since = _gauges(m, backend)
        assert only == 1.0 and before <= since <= time.time() and idx.mirror_since == 100.0
        clock.advance(30)
        idx.available = False  # still down: the start of the outage does not move
        assert _gauges(m, backend) == (1.0, since) and idx.mirror_since == 100.0
        idx.available = True
        assert _gauges(m, backend) == (0.0, 0.0) and idx.mirror_since is None
        idx.available = False  # a second outage starts its own clock
        assert idx.mirror_since == 130.0


def test_an_index_without_metrics_still_tracks_mirror_since():
    idx = RedisPrefixIndex("redis://127.0.0.1:1/0", "p", 10, None, clock=VirtualClock(5.0))
    idx.available = False
    assert idx.mirror_since == 5.0


def test_response_owner_map_is_shared_on_both_redis_backends_with_a_hash_tag_on_the_cluster():
    from redis.cluster import key_slot

    from orchestrator.config import load_config
    from orchestrator.gateway.responses_api import _key, build_owners

    def owners(index: dict):
        return build_owners(load_config({"models": [{"name": "m"}], "index": index}, environ={}))

    assert owners({"backend": "memory"}).shared is None
    single = owners({"backend": "redis", "redis_url": "redis://127.0.0.1:1/0", "key_prefix": "p"}).shared
    assert single is not None and not single.cluster
    cluster = owners({"backend": "redis_cluster", "redis_url": "redis://127.0.0.1:1,127.0.0.1:2",
                      "key_prefix": "p"}).shared
    assert cluster is not None and cluster.cluster
    k = _key("resp_abc")
    assert single._name(k) == f"p:resp:{k.hex()}"
    name = cluster._name(k)
    assert name == f"p:resp:{{{k.hex()}}}" and key_slot(name.encode()) == key_slot(k.hex().encode())
    assert "resp_abc" not in name  # a digest, never the client's id
