"""Redis clients for the state gateway replicas share (the response-owner map, the rate-limit buckets):
made from the URL an operator writes, and closed without a fuss.

One node: redis-py's own URL grammar, ``redis://[user:password@]host:port/db`` or ``rediss://...`` for
TLS, with the TLS settings in the query (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs``, ``ssl_check_hostname``), as the prefix index reads it.

Redis Cluster (``index.backend: redis_cluster``): the same grammar with a comma-separated list of seed
nodes, ``rediss://h1:p1,h2:p2?ssl_ca_certs=/etc/dyad/redis-ca.pem``. The scheme, credentials and query
apply to every node of the cluster, the ones the client learns from ``CLUSTER SLOTS`` too (a TLS cluster
announces its TLS ports there, ``tls-cluster yes``).

``OffPathClient``: a single-node client whose connections are opened in the background, never by a request
(a request's bound is too short for a TCP + TLS handshake on a loaded gateway or to a far Redis).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    import redis.asyncio as aioredis

DEFAULT_PORT = 6379

log = logging.getLogger("dyad.redis")


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


# --- connections opened off the request path ------------------------------------------------------------------

CONNECT_TIMEOUT_S = 5.0  # opening a connection (TCP, TLS handshake, AUTH): its own budget, never a request's


class ColdConnection(Exception):
    """A call found no open connection to Redis. Opening one (TCP, a TLS handshake, AUTH) has its own budget
    (``CONNECT_TIMEOUT_S``) and is done in the background (``OffPathClient.warm``); the caller decides without
    Redis this once, and does not count Redis as down. (Not a redis-py ``ConnectionError``: its retry policy must
    not retry it.)"""


class _OffPath:
    """For redis-py's connection classes: a connection opens only when ``OffPathClient`` opens it (``may_open``);
    a call that would open one (a fresh pooled connection, or one redis-py reconnects after an error) raises
    ``ColdConnection`` instead. (A flag on the connection, not on the call's context: a request's coroutine may be
    resumed in another task's context, native/lane.py.)"""

    may_open = False

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self.is_connected and not self.may_open:  # type: ignore[attr-defined]
            raise ColdConnection("no open connection to Redis")
        await super().connect_check_health(check_health, retry_socket_connect)  # type: ignore[misc]


_OFF_PATH_CLASSES: dict[type, type] = {}


def _off_path_class(base: type) -> type:
    cls = _OFF_PATH_CLASSES.get(base)
    if cls is None:
        cls = _OFF_PATH_CLASSES[base] = type(f"OffPath{base.__name__}", (_OffPath, base), {})
    return cls


class OffPathClient:
    """A single-node asyncio Redis client whose connections are opened only off the request path.

    A call's own bound (``call_timeout_s``, the socket's read/write timeout) covered the connection's opening
    too, TLS handshake included: on a loaded gateway, or to a far Redis, a handshake that always outlasts a
    request's bound never completes, and the caller decides without Redis for good. Here a call (``call``) uses
    only open pooled connections; finding none, it raises ``ColdConnection`` at once and a background task opens
    one with ``connect_timeout_s`` (one at a time; after a failed opening, not again for ``retry_s``). The pool so
    grows to the calls' concurrency off the path. ``connect`` opens the first at start."""

    def __init__(self, url: str, *, call_timeout_s: float, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 retry_s: float = 1.0, name: str = "Redis", **options: Any) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.connection import Connection, ConnectionPool, parse_url

        url_options = parse_url(url)  # (the URL's scheme picks the class: rediss:// is TLS)
        url_options["connection_class"] = _off_path_class(url_options.get("connection_class", Connection))
        self.pool = ConnectionPool(**{"socket_timeout": call_timeout_s, "socket_connect_timeout": connect_timeout_s,
                                      **options, **url_options})
        self.redis = aioredis.Redis(connection_pool=self.pool)
        self.connect_timeout_s = connect_timeout_s
        self.retry_s = retry_s
        self.name = name
        self._warming: asyncio.Task[None] | None = None
        self._again = False  # a call found no connection while one was being opened: open another after it
        self._retry_at = 0.0
        self._failing = False  # the last opening failed (logged once, and once more when one succeeds)
        self.opened = 0  # connections opened off the path (tests, logs)

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)`` on an open connection, or ``ColdConnection`` at once (and one is opened
        in the background)."""
        try:
            return await fn(*args, **kwargs)
        except ColdConnection:
            self.warm()
            raise

    def warm(self) -> None:
        """Open one more connection in the background (unless one is being opened, or the last try failed less
        than ``retry_s`` ago)."""
        loop = asyncio.get_running_loop()
        if self._warming is not None and not self._warming.done():
            self._again = True
            return
        if loop.time() < self._retry_at:
            return
        self._warming = loop.create_task(self._open(), name=f"dyad-redis-connect-{self.name}")

    async def _open_one(self) -> None:
        """Open a pooled connection (an idle closed one, or a new one) and give it back to the pool, open."""
        conn = self.pool.get_available_connection()  # (in use now: no call takes it meanwhile)
        conn.may_open = True
        try:
            await asyncio.wait_for(conn.connect(), self.connect_timeout_s)
        finally:
            conn.may_open = False
            await self.pool.release(conn)
        self.opened += 1

    async def _open(self) -> None:
        while True:
            self._again = False
            try:
                await self._open_one()
            except Exception as e:  # noqa: BLE001 - reported; the callers decide without Redis meanwhile
                self._retry_at = asyncio.get_running_loop().time() + self.retry_s
                if not self._failing:
                    log.warning("%s: could not open a connection to Redis (%s: %s); deciding without it, trying "
                                "again every %g s", self.name, type(e).__name__, e, self.retry_s)
                self._failing = True
                return
            if self._failing:
                log.warning("%s: Redis connection open again", self.name)
                self._failing = False
            if not self._again:
                return

    async def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
        """Open a first connection before any request needs one (awaited at start). Best effort: False (logged)
        when Redis did not answer; the first calls then start the background opening."""
        try:
            await asyncio.wait_for(self._open_one(), timeout_s)
            return True
        except Exception as e:  # noqa: BLE001 - best effort
            log.warning("%s: Redis did not answer at start (%s: %s)", self.name, type(e).__name__, e)
            return False

    async def opening(self) -> None:
        """Wait for the connection being opened in the background, if any (tests; a clean shutdown)."""
        task = self._warming
        if task is not None and not task.done():
            await asyncio.wait({task})

    async def aclose(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
        await close_quietly(self.redis)
