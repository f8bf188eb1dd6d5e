"""Prefix index in Redis, so router replicas share what the engines hold.

Key schema (``P`` = ``index.key_prefix``; one Redis node, no cluster; docs/prefix-index.md):

- ``P:idx:b:<hash>``  HASH  worker id → tier mask (1 device, 2 host, 4 disk). Block → holders.
- ``P:idx:w:<worker>`` SET  block hashes held by the worker (clearing a worker touches only these).
- ``P:idx:lru``       ZSET  member ``<hash>|<worker>``, score = store sequence; lowest evicted first
  once its size passes ``index.max_blocks``.
- ``P:idx:seq``       STRING counter giving the LRU order.

Hashes are unsigned 64-bit integers written in decimal. Every operation is one Lua script call
(one round trip); the overlap walk runs server-side and stops as soon as no worker still matches.

Availability: every write is mirrored into a local ``MemoryPrefixIndex``. While Redis is unreachable
lookups are answered from that mirror (what this replica itself has learnt) and the routing goes on;
once Redis answers again the mirror is written back (``resync``), so a restarted, empty Redis is
refilled without waiting for engines to re-send their events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.kv.index import DEFAULT_TIER_WEIGHTS, PrefixIndex, Tier
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.router.types import Overlap

if TYPE_CHECKING:
    from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.kv.redis_index")

REDIS_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)

_STORE = """
local p, w, tier, cap = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local n_new = #ARGV - 4
local top = redis.call('INCRBY', p .. ':idx:seq', n_new)
local wkey = p .. ':idx:w:' .. w
local lru = p .. ':idx:lru'
for i = 5, #ARGV do
  local h = ARGV[i]
  local bkey = p .. ':idx:b:' .. h
  local m = tonumber(redis.call('HGET', bkey, w) or '0')
  redis.call('HSET', bkey, w, bit.bor(m, tier))
  redis.call('SADD', wkey, h)
  redis.call('ZADD', lru, top - n_new + i - 4, h .. '|' .. w)
end
local n = redis.call('ZCARD', lru)
local evicted = 0
if n > cap then
  local victims = redis.call('ZPOPMIN', lru, n - cap)
  for j = 1, #victims, 2 do
    local member = victims[j]
    local sep = string.find(member, '|', 1, true)
    local h = string.sub(member, 1, sep - 1)
    local vw = string.sub(member, sep + 1)
    redis.call('HDEL', p .. ':idx:b:' .. h, vw)
    redis.call('SREM', p .. ':idx:w:' .. vw, h)
    evicted = evicted + 1
  end
end
return {evicted, n - evicted}
"""

_REMOVE = """
local p, w, tier = ARGV[1], ARGV[2], tonumber(ARGV[3])
local wkey = p .. ':idx:w:' .. w
local lru = p .. ':idx:lru'
for i = 4, #ARGV do
  local h = ARGV[i]
  local bkey = p .. ':idx:b:' .. h
  local m = redis.call('HGET', bkey, w)
  if m then
    local left = 0
    if tier ~= 0 then left = bit.band(tonumber(m), bit.bnot(tier)) end
    if left ~= 0 then
      redis.call('HSET', bkey, w, left)
    else
      redis.call('HDEL', bkey, w)
      redis.call('SREM', wkey, h)
      redis.call('ZREM', lru, h .. '|' .. w)
    end
  end
end
return redis.call('ZCARD', lru)
"""

_CLEAR = """
local p, w = ARGV[1], ARGV[2]
local wkey = p .. ':idx:w:' .. w
local lru = p .. ':idx:lru'
local members = redis.call('SMEMBERS', wkey)
for i = 1, #members do
  local h = members[i]
  redis.call('HDEL', p .. ':idx:b:' .. h, w)
  redis.call('ZREM', lru, h .. '|' .. w)
end
redis.call('DEL', wkey)
return #members
"""

# ARGV: prefix, n_allowed (-1 = any worker), allowed ids..., w_device, w_host, w_disk, hashes...
_OVERLAPS = """
local p = ARGV[1]
local nf = tonumber(ARGV[2])
local allowed = nil
local o = 3
if nf >= 0 then
  allowed = {}
  for i = 1, nf do allowed[ARGV[2 + i]] = true end
  o = 3 + nf
end
local wd, wh, wk = tonumber(ARGV[o]), tonumber(ARGV[o + 1]), tonumber(ARGV[o + 2])
local function credit(m)
  local c = 0
  if bit.band(m, 1) ~= 0 then c = wd end
  if bit.band(m, 2) ~= 0 and wh > c then c = wh end
  if bit.band(m, 4) ~= 0 and wk > c then c = wk end
  return c
end
local blocks, weighted, order, active = {}, {}, {}, nil
for i = o + 3, #ARGV do
  local bkey = p .. ':idx:b:' .. ARGV[i]
  if active == nil then
    local flat = redis.call('HGETALL', bkey)
    active = {}
    for j = 1, #flat, 2 do
      local w = flat[j]
      if allowed == nil or allowed[w] then
        active[#active + 1] = w
        order[#order + 1] = w
        blocks[w] = 1
        weighted[w] = credit(tonumber(flat[j + 1]))
      end
    end
  else
    local vals = redis.call('HMGET', bkey, unpack(active))
    local still = {}
    for j = 1, #active do
      local m = vals[j]
      if m then
        local w = active[j]
        still[#still + 1] = w
        blocks[w] = blocks[w] + 1
        weighted[w] = weighted[w] + credit(tonumber(m))
      end
    end
    active = still
  end
  if #active == 0 then break end
end
local out = {}
for _, w in ipairs(order) do
  out[#out + 1] = w
  out[#out + 1] = blocks[w]
  out[#out + 1] = tostring(weighted[w])
end
return out
"""


class LuaScript:
    """A Lua script called by SHA, reloaded transparently after a Redis restart (SCRIPT cache lost)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha: str | None = None

    async def __call__(self, client: aioredis.Redis, args: Sequence[object]) -> object:
        try:
            return await self._call(client, args)
        except REDIS_DOWN_ERRORS:
            # A pooled connection may have died with a previous server (restart): one fresh try.
            return await self._call(client, args)

    async def call_keys(self, client: aioredis.Redis, keys: Sequence[str], args: Sequence[object]) -> object:
        """Call with declared KEYS (scripts that touch only keys they are given)."""
        try:
            return await self._call(client, args, keys)
        except REDIS_DOWN_ERRORS:
            return await self._call(client, args, keys)

    async def _call(self, client: aioredis.Redis, args: Sequence[object], keys: Sequence[str] = ()) -> object:
        if self.sha is None:
            self.sha = await client.script_load(self.source)
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.sha = await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


class RedisPrefixIndex(PrefixIndex):
    backend = "redis"
    RESYNC_CHUNK = 2000

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "dyad",
        max_blocks: int = 1_000_000,
        metrics: DyadMetrics | None = None,
        *,
        client: aioredis.Redis | None = None,
        clock: Clock = SYSTEM_CLOCK,
        retry_interval_s: float = 1.0,
        socket_timeout_s: float = 0.5,
    ) -> None:
        self.key_prefix = key_prefix
        self.max_blocks = max_blocks
        self._metrics = metrics
        self._clock = clock
        self._client = client or aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        self.mirror = MemoryPrefixIndex(max_blocks=max_blocks)  # this replica's own view; fallback
        self._store_s, self._remove_s = LuaScript(_STORE), LuaScript(_REMOVE)
        self._clear_s, self._overlaps_s = LuaScript(_CLEAR), LuaScript(_OVERLAPS)
        self.available = True
        self._down_since: float | None = None
        self._next_try = 0.0
        self._retry_interval_s = retry_interval_s
        self._resync_task: asyncio.Task[None] | None = None
        self.evictions = 0
        self.fallback_lookups = 0
        self.resyncs = 0

    @property
    def client(self) -> aioredis.Redis:
        return self._client

    # --- availability
    def _mark_down(self, err: BaseException) -> None:
        if self.available:
            log.warning("redis index unreachable (%s); routing from this replica's local index", err)
        self.available = False
        now = self._clock.now()
        self._down_since = self._down_since or now
        self._next_try = now + self._retry_interval_s

    def _may_try(self) -> bool:
        return self.available or self._clock.now() >= self._next_try

    def _mark_up(self) -> None:
        if not self.available:
            log.warning("redis index reachable again; resyncing this replica's local index into it")
            self.available = True
            self._down_since = None
            if self._resync_task is None or self._resync_task.done():
                self._resync_task = asyncio.get_running_loop().create_task(self.resync())

    async def _run(self, script: LuaScript, args: Sequence[object]) -> object | None:
        if not self._may_try():
            return None
        try:
            result = await script(self._client, args)
        except REDIS_DOWN_ERRORS as e:
            self._mark_down(e)
            return None
        self._mark_up()
        return result

    async def resync(self) -> None:
        """Write the local mirror back into Redis (after Redis came back, possibly empty)."""
        try:
            by_worker: dict[str, list[tuple[int, int]]] = {}
            for (worker_id, h) in list(self.mirror._lru):
                mask = self.mirror._blocks.get(h, {}).get(worker_id)
                if mask:
                    by_worker.setdefault(worker_id, []).append((h, mask))
            for worker_id, entries in by_worker.items():
                for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
                    hashes = [h for h, m in entries if m & tier]
                    for i in range(0, len(hashes), self.RESYNC_CHUNK):
                        await self._write_store(worker_id, hashes[i:i + self.RESYNC_CHUNK], tier)
            self.resyncs += 1
        except REDIS_DOWN_ERRORS as e:
            self._mark_down(e)

    # --- writes
    async def _write_store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier) -> None:
        res = await self._store_s(self._client, [self.key_prefix, worker_id, int(tier), self.max_blocks,
                                                 *block_hashes])
        evicted, size = res  # type: ignore[misc]
        if evicted:
            self.evictions += int(evicted)
            if self._metrics is not None:
                self._metrics.index_evictions.labels(self.backend).inc(int(evicted))
        if self._metrics is not None:
            self._metrics.index_blocks.labels(self.backend).set(int(size))

    async def store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
        if not block_hashes:
            return
        self.mirror.store_now(worker_id, block_hashes, tier)
        if not self._may_try():
            return
        try:
            await self._write_store(worker_id, block_hashes, tier)
        except REDIS_DOWN_ERRORS as e:
            self._mark_down(e)
            return
        self._mark_up()

    async def remove(self, worker_id: str, block_hashes: Sequence[int], tier: Tier | None = None) -> None:
        if not block_hashes:
            return
        self.mirror.remove_now(worker_id, block_hashes, tier)
        await self._run(self._remove_s, [self.key_prefix, worker_id, 0 if tier is None else int(tier),
                                         *block_hashes])

    async def clear_worker(self, worker_id: str) -> None:
        self.mirror.clear_worker_now(worker_id)
        await self._run(self._clear_s, [self.key_prefix, worker_id])

    # --- reads
    async def overlaps(
        self,
        block_hashes: Sequence[int],
        tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
        workers: Sequence[str] | None = None,
    ) -> dict[str, Overlap]:
        if not block_hashes:
            return {}
        args: list[object] = [self.key_prefix]
        if workers is None:
            args.append(-1)
        else:
            args.append(len(workers))
            args.extend(workers)
        args += [tier_weights.get("device", 0.0), tier_weights.get("host", 0.0), tier_weights.get("disk", 0.0)]
        args += block_hashes
        flat = await self._run(self._overlaps_s, args)
        if flat is None:
            self.fallback_lookups += 1
            return self.mirror.overlaps_now(block_hashes, tier_weights, workers)
        out: dict[str, Overlap] = {}
        items = list(flat)  # type: ignore[call-overload]
        for i in range(0, len(items), 3):
            w = items[i].decode() if isinstance(items[i], bytes) else str(items[i])
            weighted = items[i + 2].decode() if isinstance(items[i + 2], bytes) else str(items[i + 2])
            out[w] = Overlap(blocks=int(items[i + 1]), weighted_blocks=float(weighted))
        return out

    async def size(self) -> int:
        if not self._may_try():
            return len(self.mirror._lru)
        try:
            n = await self._client.zcard(f"{self.key_prefix}:idx:lru")
        except REDIS_DOWN_ERRORS as e:
            self._mark_down(e)
            return len(self.mirror._lru)
        self._mark_up()
        return int(n)

    async def worker_blocks(self, worker_id: str) -> int:
        return int(await self._client.scard(f"{self.key_prefix}:idx:w:{worker_id}"))

    async def close(self) -> None:
        if self._resync_task is not None and not self._resync_task.done():
            self._resync_task.cancel()
        await self._client.aclose()
