"""Redis clients for the state gateway replicas share (the response-owner map, the rate-limit buckets):
made from the URL an operator writes, and closed without a fuss.

One node: redis-py's own URL grammar, ``redis://[user:password@]host:port/db`` or ``rediss://...`` for
TLS, with the TLS settings in the query (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs``, ``ssl_check_hostname``), as the prefix index reads it.

Redis Cluster (``index.backend: redis_cluster``): the same grammar with a comma-separated list of seed
nodes, ``rediss://h1:p1,h2:p2?ssl_ca_certs=/etc/dyad/redis-ca.pem``. The scheme, credentials and query
apply to every node of the cluster, the ones the client learns from ``CLUSTER SLOTS`` too (a TLS cluster
announces its TLS ports there, ``tls-cluster yes``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    import redis.asyncio as aioredis

DEFAULT_PORT = 6379


def cluster_options(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The seed nodes of a cluster URL and the connection options (TLS, credentials) for every node.

    Pure (no connection): ``("127.0.0.1", 7000), ...`` and e.g. ``{"ssl": True, "ssl_ca_certs": ...}``."""
    from redis.asyncio.connection import SSLConnection, parse_url  # redis-py only where Redis is configured

    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        # (the URL itself is not repeated: it may carry a password, and this message reaches the log)
        raise ValueError(f"a Redis Cluster URL starts with redis:// or rediss://, not {parts.scheme or '(none)'}://")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or host.count("[") != host.count("]"):  # no port ("host", "[::1]"): the whole part is the host
            host, port = part.strip(), ""
        seeds.append((host.strip("[]") or "127.0.0.1", int(port or DEFAULT_PORT)))
    # redis-py parses one node's URL: give it the first seed with the same scheme, credentials and query.
    first = hosts.split(",")[0].strip() or "127.0.0.1"
    options = parse_url(urlunsplit((parts.scheme, f"{userinfo}@{first}" if userinfo else first, "", parts.query, "")))
    for key in ("host", "port", "db"):  # a cluster has only database 0
        options.pop(key, None)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    return seeds, options


def cluster_client(url: str, socket_timeout_s: float = 0.5) -> aioredis.RedisCluster:
    """An asyncio Redis Cluster client for ``cluster_options(url)``; socket waits bounded by
    ``socket_timeout_s``; a node without a live owner takes only its own slots down."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode

    seeds, options = cluster_options(url)
    return aioredis.RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds], socket_timeout=socket_timeout_s,
                                 socket_connect_timeout=socket_timeout_s, require_full_coverage=False, **options)


async def close_quietly(client: Any) -> None:
    """Close a client that may be talking to a dead server (nothing to report: it is being dropped)."""
    if client is None:
        return
    try:
        await client.aclose()
    except Exception:  # noqa: BLE001 - closing a dead connection
        pass
