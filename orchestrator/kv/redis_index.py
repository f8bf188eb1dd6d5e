"""Prefix index in Redis, so router replicas share what the engines hold.

Key schema (``P`` = ``index.key_prefix``; one Redis node, no cluster; docs/prefix-index.md):

- ``P:idx:slots``     HASH   worker id → slot (a small integer; a cleared worker's slot is freed).
- ``P:idx:nslots``    STRING slots ever created (the next new slot).
- ``P:idx:free``      ZSET   freed slots (score = slot), the lowest reused first.
- ``P:idx:gen``       STRING bumped whenever the slot table changes.
- ``P:idx:epoch``     STRING random id written with the first slot (each write proposes a fresh
  one; SETNX keeps the first): a Redis that lost its data gets a new epoch, so replicas know
  their cached slot table is stale; with ``gen`` it tells a replica when to re-read the table.
- ``P:idx:b:<hash>``  STRING the block's holder mask: byte ``s`` = worker ``s``'s tier mask
  (1 device, 2 host, 4 disk), written with SETBIT/BITFIELD (``orchestrator/kv/masks.py``).
- ``P:idx:w:<slot>``  SET    block hashes held by the worker (clearing a worker touches only these).
- ``P:idx:lru``       ZSET   member ``<hash>|<slot>``, score = store sequence; lowest evicted first
  once its size passes ``index.max_blocks``.
- ``P:idx:seq``       STRING counter giving the LRU order.
- ``P:idx:approx``    ZSET   member ``<hash>|<slot>`` of approximate-mode entries (workers without KV
  events), score = expiry in Redis server ms; refreshed by any replica that routes there, dropped
  by any replica's expiry pass, so a replica that stops (or crashes) leaves nothing behind.

Hashes are unsigned 64-bit integers written as 16 hex digits. A lookup is ONE script call whose
arguments are the key prefix and the request's hashes packed as 8-byte big-endian integers; it
reads the block keys in order, stops at the first block nobody holds, and answers the epoch, the
slot count and the masks read, length-prefixed in one string (tiny to send and to parse). The walk
(AND of masks) runs here, client-side, in ``masks.walk``. Writes are one script call each
(store/remove/clear keep the mask, the worker's set and the LRU consistent).

Availability: every write is mirrored into a local ``MemoryPrefixIndex``. While Redis is unreachable
lookups are answered from that mirror (what this replica itself has learnt) and the routing goes on;
once Redis answers again the mirror is written back (``resync``), so a restarted, empty Redis is
refilled without waiting for engines to re-send their events. While down (unreachable, or refusing writes:
OOM under ``maxmemory``, a read-only replica), a background probe writes a small key
every ``retry_interval_s``, so an idle replica comes back too; ``dyad_index_mirror_only`` is 1 from
the first failure until Redis answers again (``SharedPrefixIndex.available``).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, OutOfMemoryError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.kv.index import DEFAULT_TIER_WEIGHTS, Tier
from orchestrator.kv.shared_index import SharedPrefixIndex
from orchestrator.router.types import Overlap

if TYPE_CHECKING:
    from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.kv.redis_index")

# A Redis that refuses writes (full under ``maxmemory`` with ``noeviction``: OOM; a replica: READONLY)
# is down for the index as much as an unreachable one: its entries would go stale (stores, removals and
# a restarted engine's clear lost) while lookups still read them. The mirror answers meanwhile, and the
# write-back once writes succeed again repairs what was missed (as after an outage).
REDIS_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, OutOfMemoryError, ReadOnlyError)

# Shared by the write scripts: the worker's slot (assigned on first store), bit offsets of a tier
# mask inside the worker's byte (SETBIT counts from the byte's most significant bit), and dropping
# a (worker, block) entry.
_COMMON = """
local p = ARGV[1]
local function slot_of(w, create)
  local s = redis.call('HGET', p .. ':idx:slots', w)
  if s or not create then return s end
  local free = redis.call('ZRANGE', p .. ':idx:free', 0, 0)
  if #free > 0 then
    s = free[1]
    redis.call('ZREM', p .. ':idx:free', s)
  else
    s = tostring(redis.call('INCR', p .. ':idx:nslots') - 1)
  end
  redis.call('HSET', p .. ':idx:slots', w, s)
  redis.call('INCR', p .. ':idx:gen')
  redis.call('SETNX', p .. ':idx:epoch', ARGV[#ARGV])
  return s
end
local function drop(h, s, lru_too)
  local bkey = p .. ':idx:b:' .. h
  redis.call('BITFIELD', bkey, 'SET', 'u8', '#' .. s, 0)
  if redis.call('BITCOUNT', bkey) == 0 then redis.call('DEL', bkey) end
  redis.call('SREM', p .. ':idx:w:' .. s, h)
  redis.call('ZREM', p .. ':idx:approx', h .. '|' .. s)
  if lru_too then redis.call('ZREM', p .. ':idx:lru', h .. '|' .. s) end
end
"""

# ARGV: prefix, worker, tier mask, cap, approximate TTL ms (0: not approximate), hashes..., epoch candidate
_STORE = _COMMON + """
local w, tier, cap, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local s = slot_of(w, true)
local offs = {}
for b = 0, 2 do
  if bit.band(tier, bit.lshift(1, b)) ~= 0 then offs[#offs + 1] = tonumber(s) * 8 + 7 - b end
end
local first, last = 6, #ARGV - 1
local approx_until = nil
if ttl > 0 then
  local t = redis.call('TIME')
  approx_until = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
end
local n_new = last - first + 1
local top = redis.call('INCRBY', p .. ':idx:seq', n_new)
local wkey = p .. ':idx:w:' .. s
local lru = p .. ':idx:lru'
for i = first, last do
  local h = ARGV[i]
  local bkey = p .. ':idx:b:' .. h
  for _, o in ipairs(offs) do redis.call('SETBIT', bkey, o, 1) end
  redis.call('SADD', wkey, h)
  redis.call('ZADD', lru, top - last + i, h .. '|' .. s)
  if approx_until then redis.call('ZADD', p .. ':idx:approx', approx_until, h .. '|' .. s) end
end
local n = redis.call('ZCARD', lru)
local evicted = 0
if n > cap then
  local victims = redis.call('ZPOPMIN', lru, n - cap)
  for j = 1, #victims, 2 do
    local member = victims[j]
    local sep = string.find(member, '|', 1, true)
    drop(string.sub(member, 1, sep - 1), string.sub(member, sep + 1), false)
    evicted = evicted + 1
  end
end
return {evicted, n - evicted}
"""

# ARGV: prefix, worker, tier mask (0 = every tier), hashes..., epoch candidate (unused)
_REMOVE = _COMMON + """
local w, tier = ARGV[2], tonumber(ARGV[3])
local s = slot_of(w, false)
if s then
  for i = 4, #ARGV - 1 do
    local h = ARGV[i]
    local bkey = p .. ':idx:b:' .. h
    local m = redis.call('BITFIELD', bkey, 'GET', 'u8', '#' .. s)[1]
    if m ~= 0 then
      local left = 0
      if tier ~= 0 then left = bit.band(m, bit.bnot(tier)) end
      if left ~= 0 then
        redis.call('BITFIELD', bkey, 'SET', 'u8', '#' .. s, left)
      else
        drop(h, s, true)
      end
    end
  end
end
return redis.call('ZCARD', p .. ':idx:lru')
"""

# ARGV: prefix, max entries, epoch candidate (unused).  Drops approximate entries past their
# shared expiry (Redis server time), whichever replica recorded or last refreshed them.
_EXPIRE = _COMMON + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', p .. ':idx:approx', '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
for _, member in ipairs(due) do
  local sep = string.find(member, '|', 1, true)
  drop(string.sub(member, 1, sep - 1), string.sub(member, sep + 1), true)
end
return #due
"""

# ARGV: prefix, worker, epoch candidate (unused)
_CLEAR = _COMMON + """
local s = slot_of(ARGV[2], false)
if not s then return 0 end
local members = redis.call('SMEMBERS', p .. ':idx:w:' .. s)
for i = 1, #members do drop(members[i], s, true) end
redis.call('DEL', p .. ':idx:w:' .. s)
-- Free the slot (none of its bits remain) so masks stay narrow as workers come and go.
redis.call('HDEL', p .. ':idx:slots', ARGV[2])
redis.call('ZADD', p .. ':idx:free', tonumber(s), s)
redis.call('INCR', p .. ':idx:gen')
return #members
"""

# ARGV: prefix, hashes packed as big-endian uint64.  → {epoch, gen, (uint16 length, mask)...}
_LOOKUP = """
local p = ARGV[1]
local bp = p .. ':idx:b:'
local packed = ARGV[2]
local parts = {}
for pos = 1, #packed, 8 do
  local hi, lo = struct.unpack('>I4I4', packed, pos)
  local v = redis.call('GET', bp .. string.format('%08x%08x', hi, lo))
  if not v then break end
  parts[#parts + 1] = struct.pack('>I2', #v) .. v
end
return {redis.call('GET', p .. ':idx:epoch') or '', redis.call('GET', p .. ':idx:gen') or '',
        table.concat(parts)}
"""


def hex_hashes(block_hashes: Sequence[int]) -> list[str]:
    """Block hashes as the index's Redis keys and members spell them."""
    return [f"{h:016x}" for h in block_hashes]


def unpack_masks(blob: bytes) -> list[int]:
    """The lookup script's ``(uint16 length, mask bytes)...`` string → holder masks."""
    out, pos, n = [], 0, len(blob)
    view = memoryview(blob)
    from_bytes = int.from_bytes
    while pos < n:
        size = (blob[pos] << 8) | blob[pos + 1]
        out.append(from_bytes(view[pos + 2:pos + 2 + size], "little"))
        pos += 2 + size
    return out


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


class RedisPrefixIndex(SharedPrefixIndex):
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
        super().__init__(key_prefix, max_blocks, metrics, clock, retry_interval_s)
        self._client = client or aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        self._store_s, self._remove_s, self._clear_s = LuaScript(_STORE), LuaScript(_REMOVE), LuaScript(_CLEAR)
        self._lookup_s, self._expire_s = LuaScript(_LOOKUP), LuaScript(_EXPIRE)
        # Remaining approximate TTL (s) of a (worker, block) this replica recorded, for resync.
        self.approximate_ttl_of: Callable[[str, int], float | None] | None = None
        self._meta_keys = [f"{key_prefix}:idx:epoch", f"{key_prefix}:idx:gen"]
        self._down_since: float | None = None
        self._next_try = 0.0
        self._resync_task: asyncio.Task[None] | None = None
        self._probe_task: asyncio.Task[None] | None = None
        # Workers cleared (engine restart, unhealthy, removed) while Redis could not be written: cleared
        # there too before the mirror is written back, or Redis would go on crediting their old blocks.
        self._cleared_while_down: dict[str, None] = {}

    @property
    def client(self) -> aioredis.Redis:
        return self._client

    # --- availability
    def _mark_down(self, err: BaseException) -> None:
        if self.available:
            log.warning("redis index unreachable (%s); routing from this replica's local index", err)
        self.available = False
        self._slot_view = (b"", b"")  # whatever Redis we reach next, re-read its slot table
        now = self._clock.now()
        self._down_since = self._down_since or now
        self._next_try = now + self._retry_interval_s
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        """While down, PING every ``retry_interval_s``: a replica that routes nothing also finds Redis
        back, resyncs and clears ``dyad_index_mirror_only`` (requests retry on their own as well)."""
        while not self.available:
            await asyncio.sleep(max(self._retry_interval_s, 0.05))
            if self.available:
                return
            try:
                # a write, not a PING: a full (OOM) or read-only Redis answers PING but refuses writes
                await self._client.set(f"{self.key_prefix}:idx:probe", b"1", px=10_000)
            except REDIS_DOWN_ERRORS as e:
                log.debug("redis index probe: still down (%s)", e)
                continue
            self._mark_up()

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
            result = await script(self._client, [*args, uuid.uuid4().hex])
        except REDIS_DOWN_ERRORS as e:
            self._mark_down(e)
            return None
        self._mark_up()
        return result

    async def resync(self) -> None:
        """Write the local mirror back into Redis (after Redis came back, possibly empty)."""
        try:
            exact: list[tuple[str, int, int]] = []
            approximate: list[tuple[str, int, float]] = []
            ttl_of = self.approximate_ttl_of
            for worker_id, h, mask in self.mirror.entries():
                left = ttl_of(worker_id, h) if ttl_of is not None else None
                if left is not None:
                    approximate.append((worker_id, h, left))
                else:
                    exact.append((worker_id, h, mask))
            for worker_id in list(self._cleared_while_down):
                await self._clear_s(self._client, [self.key_prefix, worker_id, uuid.uuid4().hex])
                self._cleared_while_down.pop(worker_id, None)
            for (worker_id, tier), hashes in self._mirror_by_tier(exact).items():
                for i in range(0, len(hashes), self.RESYNC_CHUNK):
                    await self._write_store(worker_id, hashes[i:i + self.RESYNC_CHUNK], tier)
            for worker_id, h, left in approximate:  # keep their remaining TTL
                await self._write_store(worker_id, [h], Tier.DEVICE, max(1, int(left * 1000)))
            self.resyncs += 1
        except REDIS_DOWN_ERRORS as e:
            self._mark_down(e)

    # --- writes
    async def _write_store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier, ttl_ms: int = 0) -> None:
        res = await self._store_s(self._client, [self.key_prefix, worker_id, int(tier), self.max_blocks, ttl_ms,
                                                 *hex_hashes(block_hashes), uuid.uuid4().hex])
        evicted, size = res  # type: ignore[misc]
        if evicted:
            self._count_evictions(int(evicted))
        if self._metrics is not None:
            self._metrics.index_blocks.labels(self.backend).set(int(size))

    async def store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE,
                    anchors: Sequence[int] | None = None) -> None:
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

    async def record_approximate(self, worker_id: str, block_hashes: Sequence[int], ttl_s: float) -> None:
        """Store device-tier entries that expire ``ttl_s`` after the last replica that records them
        (approximate mode); expiry is shared: any replica's ``expire_approximate`` drops them."""
        if not block_hashes:
            return
        self.mirror.store_now(worker_id, block_hashes, Tier.DEVICE)
        if not self._may_try():
            return
        try:
            await self._write_store(worker_id, block_hashes, Tier.DEVICE, max(1, int(ttl_s * 1000)))
        except REDIS_DOWN_ERRORS as e:
            self._mark_down(e)
            return
        self._mark_up()

    async def expire_approximate(self, limit: int = 10_000) -> int:
        """Drop approximate entries past their shared expiry; returns how many (0 while Redis is down)."""
        n = await self._run(self._expire_s, [self.key_prefix, limit])
        return int(n) if n is not None else 0  # type: ignore[call-overload]

    async def remove(self, worker_id: str, block_hashes: Sequence[int], tier: Tier | None = None) -> None:
        if not block_hashes:
            return
        self.mirror.remove_now(worker_id, block_hashes, tier)
        await self._run(self._remove_s, [self.key_prefix, worker_id, 0 if tier is None else int(tier),
                                         *hex_hashes(block_hashes)])

    async def clear_worker(self, worker_id: str) -> None:
        self.mirror.clear_worker_now(worker_id)
        if await self._run(self._clear_s, [self.key_prefix, worker_id]) is None:  # (not written: down)
            self._cleared_while_down[worker_id] = None
            while len(self._cleared_while_down) > 100_000:
                del self._cleared_while_down[next(iter(self._cleared_while_down))]

    # --- reads
    async def _load_slots(self) -> None:
        """Re-read the slot table (a slot was added by someone, or Redis lost its data)."""
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.mget(self._meta_keys)
            pipe.hgetall(f"{self.key_prefix}:idx:slots")
            (epoch, gen), table = await pipe.execute()
        self._set_slot_table(epoch, gen, table)

    async def overlaps(
        self,
        block_hashes: Sequence[int],
        tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
        workers: Sequence[str] | None = None,
    ) -> dict[str, Overlap]:
        if not block_hashes:
            return {}
        if not self._may_try():
            self.fallback_lookups += 1
            return self.mirror.overlaps_now(block_hashes, tier_weights, workers)
        packed = struct.pack(f">{len(block_hashes)}Q", *block_hashes)
        try:
            epoch, gen, blob = await self._lookup_s(self._client, [self.key_prefix, packed])  # type: ignore[misc]
            if (epoch, gen) != self._slot_view:
                await self._load_slots()
        except REDIS_DOWN_ERRORS as e:
            self._mark_down(e)
            self.fallback_lookups += 1
            return self.mirror.overlaps_now(block_hashes, tier_weights, workers)
        self._mark_up()
        return self._answer(unpack_masks(blob), tier_weights, workers)

    async def size(self) -> int:
        if not self._may_try():
            return await self.mirror.size()
        try:
            n = await self._client.zcard(f"{self.key_prefix}:idx:lru")
        except REDIS_DOWN_ERRORS as e:
            self._mark_down(e)
            return await self.mirror.size()
        self._mark_up()
        return int(n)

    async def worker_blocks(self, worker_id: str) -> int:
        slot = await self._client.hget(f"{self.key_prefix}:idx:slots", worker_id)
        if slot is None:
            return 0
        return int(await self._client.scard(f"{self.key_prefix}:idx:w:{int(slot)}"))

    async def close(self) -> None:
        for task in (self._resync_task, self._probe_task):
            if task is not None and not task.done():
                task.cancel()
        await self._client.aclose()
