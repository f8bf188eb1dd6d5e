"""Redis URLs for the gateway's shared state (orchestrator/redis_clients.py): a cluster's seed list with
TLS and credentials (pure parsing; the live TLS cluster is tests/integration/test_response_owners_tls.py),
and which buckets a request without a token cost draws from (orchestrator/gateway/limits.py)."""

from __future__ import annotations

import pytest

from orchestrator.gateway.auth import ClientIdentity
from orchestrator.gateway.limits import limits_for
from orchestrator.redis_clients import cluster_options


def test_a_rediss_seed_list_gives_every_seed_and_tls_for_every_node():
    seeds, options = cluster_options("rediss://dyad:s3cret@10.0.0.1:7000,10.0.0.2:7001,redis-c/0"
                                     "?ssl_ca_certs=/etc/dyad/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/c.key")
    assert seeds == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("redis-c", 6379)]
    assert options == {"ssl": True, "ssl_ca_certs": "/etc/dyad/ca.pem", "ssl_certfile": "/c.pem",
                       "ssl_keyfile": "/c.key", "username": "dyad", "password": "s3cret"}


def test_a_plain_seed_list_has_no_tls_and_ipv6_seeds_keep_their_port():
    assert cluster_options("redis://127.0.0.1:7000,[::1]:7001,[::1]") == (
        [("127.0.0.1", 7000), ("::1", 7001), ("::1", 6379)], {})


def test_a_url_that_is_not_redis_is_refused_naming_its_scheme_not_its_password():
    with pytest.raises(ValueError, match="not http://") as e:
        cluster_options("http://user:hunter2@x:1")
    assert "hunter2" not in str(e.value)


def test_a_request_without_token_cost_draws_on_the_requests_bucket_only():
    who = ClientIdentity("k", rpm=10, tpm=1000)
    assert [(lim.dimension, lim.cost) for lim in limits_for(who, None)] == [("requests", 1.0)]
    assert [(lim.dimension, lim.cost) for lim in limits_for(who, 40)] == [("requests", 1.0), ("tokens", 40.0)]
