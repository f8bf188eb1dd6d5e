"""The ``/v1/responses`` owner map (which engine holds a response id, responses_api.SharedOwners) shared
between two real gateway replicas through Redis over TLS (``rediss://``): a real redis-server on a
TLS-only port (one-way and mutual TLS, tests/fixtures/redis_tls.py) and a real three-node Redis
Cluster that speaks only TLS, bus included (tests/fixtures/redis_cluster_tls.py), certificates from a
throwaway CA (tests/fixtures/pki.py). The engines are the project's simulator (``dyad sim-engine``: it
stores responses as vLLM does); what is tested is the gateway's Redis client."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis as sync_redis

from orchestrator.gateway import responses_api
from orchestrator.gateway.responses_api import _key
from tests.fixtures.pki import make_pki
from tests.fixtures.redis import unique_prefix
from tests.fixtures.redis_cluster_tls import TlsRedisCluster
from tests.fixtures.redis_tls import TlsRedisServer
from tests.integration.test_responses_api import created_here_found_there, engines, two_replicas  # noqa: F401

pytestmark = pytest.mark.redis


@pytest.fixture
def _time_for_a_handshake(monkeypatch):
    """On a Redis Cluster a call's bound still covers the TLS handshake of a connection it opens (on one node
    the connections are opened off the request path, with their own budget: redis_clients.OffPathClient): on a
    loaded machine a handshake can outlast the owner map's 0.5-s bound (CI run 13), and the map then decides
    locally for a while. What is tested is sharing over TLS: the in-process replicas here get 5 s (the bounds'
    behaviour is tested in test_responses_api)."""
    monkeypatch.setattr(responses_api, "REDIS_TIMEOUT_S", 5.0)
    monkeypatch.setattr(responses_api, "CLUSTER_CALL_TIMEOUT_S", 10.0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("owners-pki"))


def assert_no_fallback(caplog) -> None:
    """Every replica reached Redis: nothing was decided from a local map alone. A replica whose first look at
    Redis, at start, timed out (a TLS handshake on a loaded machine: CI, once) tries again on first use and
    decides nothing from its local map meanwhile: that message alone is no fallback."""
    said = [m for r in caplog.records if "response owners" in (m := r.getMessage())
            and "did not answer at start" not in m]
    assert not said, said


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_replicas_share_response_ids_through_a_tls_redis(engines, tmp_path, pki, mutual, caplog):  # noqa: F811
    with TlsRedisServer(pki, auth_clients=mutual) as server:
        prefix = unique_prefix("tls-owners")
        with two_replicas(engines, tmp_path, {"backend": "redis", "redis_url": server.url,
                                              "key_prefix": prefix}) as (a, b):
            rid, nid = created_here_found_there(a, b)
        client = sync_redis.Redis.from_url(server.url)  # an independent client, over TLS
        try:
            keys = set(client.keys(f"{prefix}:resp:*"))
        finally:
            client.close()
        assert keys == {f"{prefix}:resp:{_key(i).hex()}".encode() for i in (rid, nid)}
    assert_no_fallback(caplog)


@pytest.mark.usefixtures("_time_for_a_handshake")
def test_replicas_share_response_ids_through_a_tls_redis_cluster(engines, tmp_path, pki, caplog):  # noqa: F811
    """``index.backend: redis_cluster`` with ``rediss://seed,seed,...?ssl_ca_certs=...``: the seeds, the
    nodes the client learns from the cluster, all over TLS; each id one hash-tagged key."""
    with TlsRedisCluster(pki, primaries=3) as cl:
        prefix = unique_prefix("tls-cowners")
        with two_replicas(engines, tmp_path, {"backend": "redis_cluster", "redis_url": cl.url,
                                              "key_prefix": prefix}) as (a, b):
            rid, nid = created_here_found_there(a, b)
        keys = set()
        for port in cl.ports:
            node = sync_redis.Redis(port=port, ssl=True, ssl_ca_certs=str(pki / "ca.pem"))
            try:
                keys |= set(node.keys(f"{prefix}:resp:*"))
            finally:
                node.close()
        assert keys == {f"{prefix}:resp:{{{_key(i).hex()}}}".encode() for i in (rid, nid)}
    assert_no_fallback(caplog)


async def test_prefix_index_on_a_tls_redis_cluster(pki):
    """The prefix index (``index.backend: redis_cluster``, kv_aware) takes the same ``rediss://`` seed
    list: it used to parse the query string as a port and stop the gateway at start-up. Two index
    replicas share entries through the TLS-only cluster, and neither falls back to its mirror."""
    from orchestrator.kv.redis_cluster_index import RedisClusterPrefixIndex

    with TlsRedisCluster(pki, primaries=3) as cl:
        prefix = unique_prefix("tls-idx")
        a = RedisClusterPrefixIndex(cl.url, prefix, call_timeout_s=5.0, socket_timeout_s=5.0)
        b = RedisClusterPrefixIndex(cl.url, prefix, call_timeout_s=5.0, socket_timeout_s=5.0)
        try:
            blocks = [(7 << 32) + i + 1 for i in range(40)]
            await a.store("w0", blocks)
            assert (await b.overlaps(blocks))["w0"].blocks == 40
            assert (await b.overlaps(blocks[:5]))["w0"].blocks == 5
            assert a.available and b.available
            assert a.fallback_lookups + a.errors + b.fallback_lookups + b.errors == 0
        finally:
            await a.close()
            await b.close()
