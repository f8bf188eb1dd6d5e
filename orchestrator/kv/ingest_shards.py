"""Which gateway replica writes which engine's KV events into the shared index (``index.ingest_shard``).

Without it every replica subscribes to every engine and writes every event: correct (the writes are
idempotent) but N replicas multiply the index's write load N times — the first thing that breaks
with tens of replicas (docs/operations.md, "Index capacity"). With it, replicas register in Redis
(``P:{P:load}:replicas``, a ZSET of replica id → expiry in Redis server ms, renewed every
``interval_s``, gone ``ttl_s`` after a replica stops renewing) and each engine is ingested by one
replica: the one with the highest ``hash(replica, worker)`` among the live ones (rendezvous
hashing: when a replica joins or leaves, only the engines it gains or loses move). A replica that
gains an engine subscribes with a full replay of the engine's buffer, so the hand-over loses
nothing the engine still buffers. While Redis cannot be reached a replica ingests every engine
(safe: writes are idempotent and its local mirror stays complete).

``owner`` is pure; ``IngestShards.members`` is the one Redis call (one script on one key, so it
runs unchanged on a Redis Cluster).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence

from orchestrator.kv.redis_index import LuaScript

# KEYS: the replicas ZSET.  ARGV: own id, ttl ms.  → live replica ids (after renewing our own entry)
_MEMBERS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 4)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


def _weight(replica: str, worker: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{replica}|{worker}".encode(), digest_size=8).digest(), "big")


def owner(worker_id: str, replicas: Sequence[str]) -> str | None:
    """The replica that ingests ``worker_id``'s events (None when there are no replicas)."""
    return max(replicas, key=lambda r: (_weight(r, worker_id), r), default=None)


class IngestShards:
    def __init__(self, client: object, key_prefix: str, replica_id: str, *, interval_s: float = 2.0,
                 ttl_s: float = 6.0, down_errors: tuple[type[BaseException], ...] = (OSError,),
                 call_timeout_s: float = 0.5) -> None:
        self.client = client
        self.key = f"{key_prefix}:{{{key_prefix}:load}}:replicas"
        self.replica_id = replica_id
        self.interval_s = interval_s
        self.ttl_ms = int(ttl_s * 1000)
        self.down_errors = (*down_errors, asyncio.TimeoutError)
        self.call_timeout_s = call_timeout_s
        self._members_s = LuaScript(_MEMBERS)
        self.replicas: list[str] | None = None  # last known live replicas; None = unknown (ingest all)

    async def members(self) -> list[str] | None:
        """Renew this replica's registration and return the live replicas (None: Redis unreachable)."""
        try:
            raw = await asyncio.wait_for(
                self._members_s.call_keys(self.client, [self.key], [self.replica_id, self.ttl_ms]),  # type: ignore[arg-type]
                self.call_timeout_s)
        except self.down_errors:
            self.replicas = None
            return None
        self.replicas = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in raw)  # type: ignore[union-attr]
        return self.replicas

    def owns(self, worker_id: str) -> bool:
        """Whether this replica ingests ``worker_id`` (every worker while the replica set is unknown)."""
        if not self.replicas:
            return True
        return owner(worker_id, self.replicas) == self.replica_id

    async def leave(self) -> None:
        """Deregister at once (a clean stop hands this replica's engines over without waiting the TTL)."""
        try:
            await asyncio.wait_for(self.client.zrem(self.key, self.replica_id), self.call_timeout_s)  # type: ignore[attr-defined]
        except self.down_errors:
            pass
