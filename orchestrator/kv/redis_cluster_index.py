"""Prefix index on Redis Cluster (or Valkey cluster): the shared index scaled out over hash slots.

Key layout (``P`` = ``index.key_prefix``; the part in braces is the hash tag that picks the slot;
reasoning in docs/prefix-index.md):

- ``P:b:{P:<anchor>}:<hash>``  STRING the block's holder mask (byte ``s`` = worker ``s``'s tier mask,
  as in the single-node backend, ``orchestrator/kv/masks.py``). ``anchor`` is the hash of the first
  block of the block's *group*: ``index.GROUP_BLOCKS`` consecutive blocks of a prompt chain. Every
  holder of a block holds its anchor (hashes are chained), so the group is a property of the block,
  and one group lives in one slot: a lookup of n blocks is ceil(n / GROUP_BLOCKS) MGETs, sent in one
  cluster pipeline (one round trip per node, in parallel), whatever the fleet size.
- ``P:w:{P:w<slot>}``          ZSET  the worker's entries (member ``<anchor><hash>`` in hex, score =
  store time): clearing a worker reads only this; past ``max_blocks_per_worker`` the oldest are
  dropped (the engines' own removals normally keep it far below).
- ``P:meta:{P:meta}:*``        the slot table (``slots`` HASH worker → slot, ``nslots``, ``free``
  ZSET, ``gen``, ``epoch``), all in one slot, read only when ``gen``/``epoch`` change.

Writes are batched: a store or remove of n blocks is one script per touched group plus one on the
worker's key, all in one pipeline (non-transactional across slots: the index is a routing hint,
and a write that half-applies is repaired by the engine's next event or the resync). Scripts only
touch the keys they are given, as cluster mode requires.

Availability is the single-node backend's: every write is mirrored into a local
``MemoryPrefixIndex``; when a node is unreachable (killed, failing over: ``ClusterDownError``,
connection errors, ``TRYAGAIN``, or a call slower than ``call_timeout_s``), this replica switches to that mirror at
once: lookups are answered from it and writes go only to it, so no request waits on a dead node.
A background probe asks the cluster every ``retry_interval_s`` (redis-py re-reads the topology, so
a promoted replica is found); once ``cluster_state`` is ``ok`` and all 16,384 slots are served (a
primary that died without a replica, or whose replica refuses promotion, keeps this replica on its
mirror until the node is back; docs/operations.md, "Failover") the
mirror is written back (``resync``) and the cluster serves again. Replicas
and the planner point at the same cluster (any node is a seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from orchestrator.clock import SYSTEM_CLOCK, Clock
from orchestrator.kv.index import DEFAULT_TIER_WEIGHTS, Tier, chain_anchors
from orchestrator.kv.shared_index import SharedPrefixIndex
from orchestrator.redis_clients import cluster_client
from orchestrator.router.types import Overlap

if TYPE_CHECKING:
    from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.kv.redis_cluster")

# Errors that mean "part of the cluster is unreachable right now" (not a bug in a command).
CLUSTER_DOWN_ERRORS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)

# KEYS: block keys of one group.  ARGV: slot, tier mask.  Sets the worker's tier bits.
_STORE = """
local s, tier = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, #KEYS do
  for b = 0, 2 do
    if bit.band(tier, bit.lshift(1, b)) ~= 0 then redis.call('SETBIT', KEYS[i], s * 8 + 7 - b, 1) end
  end
end
return #KEYS
"""

# KEYS: block keys of one group.  ARGV: slot, tier mask (0 = all tiers).  Returns the 1-based
# indexes of the keys the worker no longer holds in any tier.
_REMOVE = """
local s, tier = tonumber(ARGV[1]), tonumber(ARGV[2])
local gone = {}
for i = 1, #KEYS do
  local m = redis.call('BITFIELD', KEYS[i], 'GET', 'u8', '#' .. s)[1]
  if m ~= 0 then
    local left = 0
    if tier ~= 0 then left = bit.band(m, bit.bnot(tier)) end
    redis.call('BITFIELD', KEYS[i], 'SET', 'u8', '#' .. s, left)
    if left == 0 then
      gone[#gone + 1] = i
      if redis.call('BITCOUNT', KEYS[i]) == 0 then redis.call('DEL', KEYS[i]) end
    end
  else
    gone[#gone + 1] = i
  end
end
return gone
"""

# KEYS: the worker's ZSET.  ARGV: cap, then (score, member) pairs.  Returns members dropped by the cap.
_TOUCH = """
for i = 2, #ARGV, 2 do redis.call('ZADD', KEYS[1], ARGV[i], ARGV[i + 1]) end
local n = redis.call('ZCARD', KEYS[1])
local cap = tonumber(ARGV[1])
if n <= cap then return {} end
local out = {}
local victims = redis.call('ZPOPMIN', KEYS[1], n - cap)
for j = 1, #victims, 2 do out[#out + 1] = victims[j] end
return out
"""

# KEYS: slots, nslots, free, gen, epoch (one slot).  ARGV: worker, epoch candidate.  → slot
_ASSIGN = """
local s = redis.call('HGET', KEYS[1], ARGV[1])
if s then return s end
local free = redis.call('ZRANGE', KEYS[3], 0, 0)
if #free > 0 then
  s = free[1]
  redis.call('ZREM', KEYS[3], s)
else
  s = tostring(redis.call('INCR', KEYS[2]) - 1)
end
redis.call('HSET', KEYS[1], ARGV[1], s)
redis.call('INCR', KEYS[4])
redis.call('SETNX', KEYS[5], ARGV[2])
return s
"""

# KEYS: slots, free, gen.  ARGV: worker.  Frees the worker's slot.
_FREE = """
local s = redis.call('HGET', KEYS[1], ARGV[1])
if not s then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], tonumber(s), s)
redis.call('INCR', KEYS[3])
return 1
"""


class _Scripts:
    """SHA1s of the scripts; a node that does not know one (a promoted replica, a restarted node)
    gets every script loaded again and the batch is retried once (all writes are idempotent)."""

    SOURCES = {"store": _STORE, "remove": _REMOVE, "touch": _TOUCH, "assign": _ASSIGN, "free": _FREE}

    def __init__(self) -> None:
        import hashlib
        self.sha = {k: hashlib.sha1(v.encode()).hexdigest() for k, v in self.SOURCES.items()}

    async def load(self, client: RedisCluster) -> None:
        for src in self.SOURCES.values():
            await client.script_load(src)  # redis-py sends SCRIPT LOAD to every primary


class RedisClusterPrefixIndex(SharedPrefixIndex):
    backend = "redis_cluster"
    MAX_BACKLOG = 100_000  # writes queued while a resync runs
    uses_anchors = True  # the tracker passes each block's group anchor to ``store``
    RESYNC_CHUNK = 2000
    RETRY_INTERVAL_S = 1.0  # between probes while on the mirror
    CALL_TIMEOUT_S = 0.5  # a routing-path call slower than this counts as down
    PROBE_CALL_TIMEOUTS = 4  # a probe's calls (CLUSTER INFO, slot table, topology re-read) get 4× longer

    @classmethod
    def return_bound_s(cls, retry_interval_s: float = RETRY_INTERVAL_S,
                       call_timeout_s: float = CALL_TIMEOUT_S) -> float:
        """How long after the cluster serves every slot again a replica on its mirror takes to start
        its resync, at most: a probe (sleep, then CLUSTER INFO and the slot table, each bounded) that
        still met the old topology re-reads it (bounded too), and the next probe succeeds."""
        probe = retry_interval_s + 3 * cls.PROBE_CALL_TIMEOUTS * call_timeout_s
        return 2 * probe

    def __init__(
        self,
        url: str = "redis://127.0.0.1:7000/0",
        key_prefix: str = "dyad",
        max_blocks: int = 1_000_000,
        metrics: DyadMetrics | None = None,
        *,
        client: RedisCluster | None = None,
        clock: Clock = SYSTEM_CLOCK,
        retry_interval_s: float = RETRY_INTERVAL_S,
        socket_timeout_s: float = CALL_TIMEOUT_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
        max_blocks_per_worker: int | None = None,
    ) -> None:
        super().__init__(key_prefix, max_blocks, metrics, clock, retry_interval_s)
        self.max_blocks_per_worker = max_blocks_per_worker or max_blocks
        self._client = client or cluster_client(url, socket_timeout_s)
        self._scripts = _Scripts()
        p = key_prefix
        self._meta = [f"{p}:meta:{{{p}:meta}}:{k}" for k in ("slots", "nslots", "free", "gen", "epoch")]
        # our hash → its group anchor, for blocks this replica wrote (resync and tier moves need it)
        self._anchor: OrderedDict[int, int] = OrderedDict()
        self._my_slots: dict[str, int] = {}  # slots this replica assigned or read, for writes
        self._call_timeout_s = call_timeout_s
        self._probe_task: asyncio.Task[None] | None = None
        self._backlog: list[Callable[[], Awaitable[Any]]] | None = None  # writes made during a resync
        self.errors = 0

    @property
    def client(self) -> RedisCluster:
        return self._client

    # --- keys
    def _bkey(self, anchor: int, h: int) -> str:
        return f"{self.key_prefix}:b:{{{self.key_prefix}:{anchor:016x}}}:{h:016x}"

    def _wkey(self, slot: int) -> str:
        return f"{self.key_prefix}:w:{{{self.key_prefix}:w{slot}}}"

    def _anchors_for(self, block_hashes: Sequence[int], anchors: Sequence[int] | None) -> list[int]:
        if anchors is not None and len(anchors) == len(block_hashes):
            return list(anchors)
        known = self._anchor
        if block_hashes and all(h in known for h in block_hashes):
            return [known[h] for h in block_hashes]
        return chain_anchors(block_hashes)  # a chain from position 0 (touches, approximate records)

    def _remember(self, block_hashes: Sequence[int], anchors: Sequence[int]) -> None:
        known = self._anchor
        for h, a in zip(block_hashes, anchors, strict=True):
            known[h] = a
            known.move_to_end(h)
        over = len(known) - 2 * self.max_blocks
        for _ in range(max(0, over)):
            known.popitem(last=False)

    # --- availability: a failed call switches this replica to its mirror at once; a background
    # probe (never a request) finds out when the whole cluster answers again, then resyncs.
    def _mark_down(self, err: BaseException) -> None:
        self.errors += 1
        if self.available:
            log.warning("redis cluster index unreachable (%s: %s); routing from this replica's local index",
                        type(err).__name__, err)
        self.available = False
        self._slot_view = (b"", b"")
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        while not self.available:
            await asyncio.sleep(self._retry_interval_s)
            try:
                # any node (the client's default node may be the one that died), on a fresh topology
                info = await asyncio.wait_for(self._client.cluster_info(target_nodes=RedisCluster.RANDOM),
                                              self._call_timeout_s * self.PROBE_CALL_TIMEOUTS)
                if not cluster_serves_all_slots(info):
                    continue  # e.g. a primary died without a replica: stay on the mirror until fixed
                await asyncio.wait_for(self._load_slots(), self._call_timeout_s * self.PROBE_CALL_TIMEOUTS)
            except CLUSTER_DOWN_ERRORS as e:
                log.debug("redis cluster probe: still down (%s)", e)
                with contextlib.suppress(*CLUSTER_DOWN_ERRORS):  # re-read the slots from any live node
                    await asyncio.wait_for(self._client.nodes_manager.initialize(),
                                           self._call_timeout_s * self.PROBE_CALL_TIMEOUTS)
                continue
            log.warning("redis cluster index reachable again; resyncing this replica's local index into it")
            # Lookups stay on the mirror until the cluster holds it again; writes made meanwhile
            # are queued and replayed once the resync is through.
            self._backlog = []
            try:
                await self._resync_all()
                self.available = True
                backlog, self._backlog = self._backlog, None
                for op in backlog or ():
                    await op()
            except CLUSTER_DOWN_ERRORS as e:
                self._backlog = None
                self.errors += 1
                log.debug("redis cluster probe: resync failed (%s)", e)
                self.available = False
                continue
            self.resyncs += 1
            log.warning("redis cluster index resynced (%d entries)", self.mirror.size_now())

    def _queue(self, op: Callable[[], Awaitable[Any]]) -> bool:
        """While a resync runs, queue a write for after it (bounded; beyond, the next outage's
        resync covers it). True when queued."""
        backlog = self._backlog
        if backlog is None or self.available:
            return False
        if len(backlog) < self.MAX_BACKLOG:
            backlog.append(op)
        return True

    async def _pipeline(self, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run commands in one cluster pipeline (grouped per node by redis-py); reload scripts and
        retry once when a node does not know them."""
        for attempt in (0, 1):
            pipe = self._client.pipeline()
            for call in calls:
                pipe.execute_command(*call)
            results = await pipe.execute(raise_on_error=False)
            if any(isinstance(r, NoScriptError) for r in results) and attempt == 0:
                await self._scripts.load(self._client)
                continue
            for r in results:
                if isinstance(r, Exception):
                    raise r
            return results
        raise AssertionError("unreachable")

    async def _guard(self, coro: Any) -> Any:
        """Run a cluster call within ``call_timeout_s``; None when the cluster is (treated as)
        unreachable: the caller then uses its mirror."""
        if not self.available:
            coro.close()
            return None
        try:
            return await asyncio.wait_for(coro, self._call_timeout_s)
        except CLUSTER_DOWN_ERRORS as e:
            self._mark_down(e)
            return None

    # --- slot table
    async def _slot(self, worker_id: str) -> int:
        slot = self._my_slots.get(worker_id)
        if slot is None:
            res = await self._pipeline([("EVALSHA", self._scripts.sha["assign"], 5, *self._meta, worker_id,
                                         uuid.uuid4().hex)])
            slot = self._my_slots[worker_id] = int(res[0])
        return slot

    async def _load_slots(self) -> None:
        epoch_gen, table = await self._pipeline([("MGET", self._meta[4], self._meta[3]),
                                                 ("HGETALL", self._meta[0])])
        self._set_slot_table(*epoch_gen, table)
        self._my_slots = dict(self._slot_of)

    # --- writes
    def _group(self, block_hashes: Sequence[int], anchors: Sequence[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for h, a in zip(block_hashes, anchors, strict=True):
            groups.setdefault(a, []).append(h)
        return groups

    async def _write_store(self, worker_id: str, block_hashes: Sequence[int], anchors: Sequence[int],
                           tier: Tier) -> None:
        slot = await self._slot(worker_id)
        sha = self._scripts.sha
        calls: list[tuple[Any, ...]] = []
        for a, hs in self._group(block_hashes, anchors).items():
            keys = [self._bkey(a, h) for h in hs]
            calls.append(("EVALSHA", sha["store"], len(keys), *keys, slot, int(tier)))
        score = f"{time.time():.6f}"
        touch: list[Any] = [self.max_blocks_per_worker]
        for h, a in zip(block_hashes, anchors, strict=True):
            touch += [score, f"{a:016x}{h:016x}"]
        calls.append(("EVALSHA", sha["touch"], 1, self._wkey(slot), *touch))
        results = await self._pipeline(calls)
        dropped = results[-1]
        if dropped:  # past the per-worker cap: the oldest entries leave the worker's set; clear their bits
            self._count_evictions(len(dropped))
            await self._drop_members(slot, dropped)

    async def _write_remove(self, slot: int, block_hashes: Sequence[int], anchors: Sequence[int], tier: int,
                            touch_worker: bool = True) -> None:
        sha = self._scripts.sha
        calls: list[tuple[Any, ...]] = []
        groups = list(self._group(block_hashes, anchors).items())
        for a, hs in groups:
            keys = [self._bkey(a, h) for h in hs]
            calls.append(("EVALSHA", sha["remove"], len(keys), *keys, slot, tier))
        results = await self._pipeline(calls)
        if not touch_worker:
            return
        members = []
        for (a, hs), gone in zip(groups, results, strict=True):
            members += [f"{a:016x}{hs[int(i) - 1]:016x}" for i in gone]
        if members:
            await self._pipeline([("ZREM", self._wkey(slot), *members)])

    async def _drop_members(self, slot: int, members: Sequence[bytes | str]) -> None:
        """Clear worker ``slot``'s bits (all tiers) from the blocks named by members of its set
        (``<anchor><hash>`` in hex) that have already left that set (cap eviction, clearing)."""
        pairs = [(int(m[:16], 16), int(m[16:], 16)) for m in (x.decode() if isinstance(x, bytes) else x
                                                               for x in members)]
        for i in range(0, len(pairs), self.RESYNC_CHUNK):
            chunk = pairs[i:i + self.RESYNC_CHUNK]
            await self._write_remove(slot, [h for _, h in chunk], [a for a, _ in chunk], 0, touch_worker=False)

    async def store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE,
                    anchors: Sequence[int] | None = None) -> None:
        if not block_hashes:
            return
        anchors = self._anchors_for(block_hashes, anchors)
        self._remember(block_hashes, anchors)
        self.mirror.store_now(worker_id, block_hashes, tier)
        if self._queue(lambda: self._write_store(worker_id, block_hashes, anchors, tier)):
            return
        await self._guard(self._write_store(worker_id, block_hashes, anchors, tier))

    async def remove(self, worker_id: str, block_hashes: Sequence[int], tier: Tier | None = None) -> None:
        if not block_hashes:
            return
        self.mirror.remove_now(worker_id, block_hashes, tier)
        known = self._anchor
        hs = [h for h in block_hashes if h in known]
        if not hs:
            return
        anchors = [known[h] for h in hs]
        mask = 0 if tier is None else int(tier)
        if self._queue(lambda: self._remove(worker_id, hs, anchors, mask)):
            return
        await self._guard(self._remove(worker_id, hs, anchors, mask))

    async def _remove(self, worker_id: str, hs: Sequence[int], anchors: Sequence[int], tier: int) -> None:
        slot = self._my_slots.get(worker_id)
        if slot is None:
            await self._load_slots()
            slot = self._my_slots.get(worker_id)
            if slot is None:
                return
        await self._write_remove(slot, hs, anchors, tier)

    async def clear_worker(self, worker_id: str) -> None:
        self.mirror.clear_worker_now(worker_id)
        if self._queue(lambda: self._clear(worker_id)):
            return
        await self._guard(self._clear(worker_id))

    async def _clear(self, worker_id: str) -> None:
        slot = self._my_slots.get(worker_id)
        if slot is None:
            await self._load_slots()
            slot = self._my_slots.get(worker_id)
            if slot is None:
                return
        wkey = self._wkey(slot)
        await self._drop_members(slot, (await self._pipeline([("ZRANGE", wkey, 0, -1)]))[0])
        await self._pipeline([("DEL", wkey),
                              ("EVALSHA", self._scripts.sha["free"], 3, self._meta[0], self._meta[2],
                               self._meta[3], worker_id)])
        self._my_slots.pop(worker_id, None)

    async def resync(self) -> None:
        """Write the local mirror back into the cluster (after a node came back or failed over)."""
        try:
            await self._resync_all()
            self.resyncs += 1
        except CLUSTER_DOWN_ERRORS as e:
            self._mark_down(e)

    async def _resync_all(self) -> None:
        for (worker_id, tier), hashes in self._mirror_by_tier().items():
            for i in range(0, len(hashes), self.RESYNC_CHUNK):
                chunk = hashes[i:i + self.RESYNC_CHUNK]
                await self._write_store(worker_id, chunk, self._anchors_for(chunk, None), tier)

    # --- reads
    async def overlaps(
        self,
        block_hashes: Sequence[int],
        tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
        workers: Sequence[str] | None = None,
    ) -> dict[str, Overlap]:
        if not block_hashes:
            return {}
        masks = await self._guard(self._read_masks(block_hashes))
        if masks is None:
            self.fallback_lookups += 1
            return self.mirror.overlaps_now(block_hashes, tier_weights, workers)
        return self._answer(masks, tier_weights, workers)

    async def _read_masks(self, block_hashes: Sequence[int]) -> list[int]:
        anchors = chain_anchors(block_hashes)
        calls: list[tuple[Any, ...]] = [("MGET", self._meta[4], self._meta[3])]
        groups = self._group(block_hashes, anchors)
        for a, hs in groups.items():
            calls.append(("MGET", *[self._bkey(a, h) for h in hs]))
        results = await self._pipeline(calls)
        epoch, gen = results[0]
        if (epoch or b"", gen or b"") != self._slot_view:
            await self._load_slots()
        masks: list[int] = []
        for vals in results[1:]:
            for v in vals:
                if v is None:
                    return masks
                masks.append(int.from_bytes(v, "little"))
        return masks

    async def size(self) -> int:
        """Entries held: the sum of the workers' sets (one ZCARD per worker; diagnostics)."""
        async def count() -> int:
            await self._load_slots()
            if not self._slot_of:
                return 0
            res = await self._pipeline([("ZCARD", self._wkey(s)) for s in self._slot_of.values()])
            return int(sum(res))
        n = await self._guard(count())
        return await self.mirror.size() if n is None else n

    async def worker_blocks(self, worker_id: str) -> int:
        await self._load_slots()
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return 0
        return int((await self._pipeline([("ZCARD", self._wkey(slot))]))[0])

    async def close(self) -> None:
        if self._probe_task is not None and not self._probe_task.done():
            self._probe_task.cancel()
        await self._client.aclose()


def cluster_serves_all_slots(info: object) -> bool:
    """``CLUSTER INFO`` (as redis-py parses it) says the cluster is up and every hash slot is served."""
    if not isinstance(info, dict):
        return False
    def text(v: object) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)
    state = text(info.get("cluster_state", ""))
    try:
        slots_ok = int(text(info.get("cluster_slots_ok", "0")))
    except ValueError:
        return False
    return state == "ok" and slots_ok == 16384
