"""In-flight load shared between gateway replicas through Redis, as leased reservations.

Each replica reserves, per dispatched request, a member ``<replica>|<request>|<prefill tokens>`` in
``P:load:<worker>`` (a ZSET scored by expiry in Redis-server milliseconds). Reservations expire
after ``ttl_s`` unless the replica that made them keeps renewing them (every ``ttl_s / 3``), so a
crashed replica leaks nothing beyond one TTL. When a request's first token arrives its prefill is
over: the reservation is swapped for one with 0 prefill tokens (it still counts as in flight), and
when it finishes the reservation is released. Swap and release commute: a release that reaches Redis
first removes both members, and the swap only re-adds when the original member is still there.

``peer_loads`` answers, in one round trip, how many requests and queued prefill tokens the *other*
replicas have on each candidate (this replica's own load is already in ``Worker.inflight`` /
``inflight_prefill_tokens``). While Redis is down it answers empty: each replica routes on what it
knows, and the reservations are re-written when Redis is back.

On a Redis Cluster (``index.backend: redis_cluster``) every load key carries one hash tag
(``P:{P:load}:load:<worker>``), so the scripts that touch several workers' keys run on the one node
that owns that slot (``route_key`` declares it); a call slower than ``call_timeout_s`` or any
cluster error makes ``peer_loads`` answer empty for ``retry_interval_s``, so no request waits on a
failing node. The load keys are small and short-lived; one node takes them (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence

import redis.asyncio as aioredis

from orchestrator.kv.redis_index import REDIS_DOWN_ERRORS, LuaScript
from orchestrator.router.types import PeerLoad

log = logging.getLogger("dyad.kv.shared_load")

# ARGV: prefix, ttl_ms, then (worker, member) pairs.  ZADD with expiry = server time + ttl.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local exp = now + tonumber(ARGV[2])
for i = 3, #ARGV, 2 do
  local key = ARGV[1] .. ':load:' .. ARGV[i]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZADD', key, exp, ARGV[i + 1])
  redis.call('PEXPIRE', key, tonumber(ARGV[2]) * 2)
end
return now
"""

# KEYS: the worker's load key.  ARGV: old member, new member.  Swap, keeping the expiry.
_SWAP = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[1], s, ARGV[2])
  return 1
end
return 0
"""

# ARGV: prefix, own replica id, workers...  → "i n tokens;" for each worker i (1-based) that other
# replicas load (one short string, cheap to parse; most workers usually have none). Read-only:
# expired reservations are skipped here and trimmed by the next _RESERVE on that worker.
_PEERS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local own = ARGV[2] .. '|'
local out = {}
for i = 3, #ARGV do
  local members = redis.call('ZRANGEBYSCORE', ARGV[1] .. ':load:' .. ARGV[i], '(' .. now, '+inf')
  local n, tokens = 0, 0
  for _, m in ipairs(members) do
    if string.sub(m, 1, #own) ~= own then
      n = n + 1
      tokens = tokens + tonumber(string.match(m, '|(%d+)$') or '0')
    end
  end
  if n > 0 then out[#out + 1] = (i - 2) .. ' ' .. n .. ' ' .. tokens end
end
return table.concat(out, ';')
"""


class SharedLoad:
    def __init__(self, client: aioredis.Redis, key_prefix: str = "dyad", ttl_s: float = 30.0,
                 replica_id: str | None = None, *, route_key: str | None = None,
                 down_errors: tuple[type[BaseException], ...] = REDIS_DOWN_ERRORS,
                 call_timeout_s: float | None = None, retry_interval_s: float = 1.0) -> None:
        self.client = client
        self.route_key = route_key  # cluster: a key in the load keys' slot, so scripts go to its node
        self.down_errors = (*down_errors, asyncio.TimeoutError)
        self.call_timeout_s = call_timeout_s
        self.retry_interval_s = retry_interval_s
        self._skip_until = 0.0
        self.key_prefix = key_prefix
        self.ttl_ms = int(ttl_s * 1000)
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self._live: dict[str, tuple[str, str]] = {}  # request id → (worker, current member)
        self._first: dict[str, str] = {}  # request id → its original member, once swapped at first token
        self._writes: dict[str, asyncio.Task[None]] = {}  # request id → its reservation being written
        self._reserve_s, self._peers_s, self._swap_s = LuaScript(_RESERVE), LuaScript(_PEERS), LuaScript(_SWAP)
        self._task: asyncio.Task[None] | None = None

    async def _script(self, script: LuaScript, args: list[object]) -> object:
        call = (script.call_keys(self.client, [self.route_key], args) if self.route_key is not None
                else script(self.client, args))
        if self.call_timeout_s is None:
            return await call
        return await asyncio.wait_for(call, self.call_timeout_s)

    def _member(self, request_id: str, prefill_tokens: int) -> str:
        return f"{self.replica_id}|{request_id}|{max(0, int(prefill_tokens))}"

    def reserve_soon(self, request_id: str, worker_id: str, prefill_tokens: int) -> None:
        """``reserve`` without holding the request: the write runs in the background, and this
        request's later ``first_token`` / ``release`` wait for it, so they never overtake it."""
        task = asyncio.ensure_future(self.reserve(request_id, worker_id, prefill_tokens))
        self._writes[request_id] = task
        task.add_done_callback(lambda _t: self._writes.pop(request_id, None) if self._writes.get(request_id)
                               is _t else None)

    async def _written(self, request_id: str) -> None:
        task = self._writes.get(request_id)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    async def reserve(self, request_id: str, worker_id: str, prefill_tokens: int) -> None:
        member = self._member(request_id, prefill_tokens)
        self._live[request_id] = (worker_id, member)
        with contextlib.suppress(*self.down_errors):
            await self._script(self._reserve_s, [self.key_prefix, self.ttl_ms, worker_id, member])

    async def first_token(self, request_id: str) -> None:
        """Prefill done: keep the request counted in flight, with no queued prefill tokens left."""
        await self._written(request_id)
        entry = self._live.get(request_id)
        if entry is None or request_id in self._first:
            return
        worker_id, member = entry
        done = self._member(request_id, 0)
        if done == member:
            return
        self._live[request_id] = (worker_id, done)
        self._first[request_id] = member
        with contextlib.suppress(*self.down_errors):
            await self._swap_s.call_keys(self.client, [f"{self.key_prefix}:load:{worker_id}"], [member, done])

    async def release(self, request_id: str) -> None:
        await self._written(request_id)
        entry = self._live.pop(request_id, None)
        original = self._first.pop(request_id, None)
        if entry is None:
            return
        worker_id, member = entry
        members = [member] if original is None else [member, original]
        with contextlib.suppress(*self.down_errors):
            await self.client.zrem(f"{self.key_prefix}:load:{worker_id}", *members)

    async def peer_loads(self, worker_ids: Sequence[str]) -> dict[str, PeerLoad]:
        if not worker_ids:
            return {}
        if self._skip_until and time.monotonic() < self._skip_until:
            return {}
        try:
            flat = await self._script(self._peers_s, [self.key_prefix, self.replica_id, *worker_ids])
        except self.down_errors:
            self._skip_until = time.monotonic() + self.retry_interval_s
            return {}
        self._skip_until = 0.0
        out: dict[str, PeerLoad] = {}
        text = flat.decode() if isinstance(flat, bytes) else str(flat)
        for entry in text.split(";") if text else ():
            i, n, tokens = entry.split(" ")
            out[worker_ids[int(i) - 1]] = PeerLoad(inflight=int(n), prefill_tokens=int(tokens))
        return out

    async def renew(self) -> None:
        """Push every live reservation's expiry forward (also re-creates them after a Redis restart)."""
        if not self._live:
            return
        args: list[object] = [self.key_prefix, self.ttl_ms]
        for worker_id, member in list(self._live.values()):
            args += [worker_id, member]
        with contextlib.suppress(*self.down_errors):
            await self._script(self._reserve_s, args)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            await self.renew()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._renew_loop(), name="dyad-shared-load")

    async def stop(self, release: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if release:
            for rid in list(self._live):
                await self.release(rid)
