"""Per-key rate limits: token buckets for requests per minute and tokens per minute.

A key with ``rpm: 60`` has a bucket of 60 request tokens refilled at one per second; a request
takes one, and is refused with 429 and ``Retry-After`` (seconds until it would fit) when the
bucket is short. ``tpm`` works the same with the request's token cost (prompt estimate plus
its output budget: ``max_tokens`` times ``n``, ``annotate.output_budget``; admission charges at
most the whole bucket up front). A request costlier than a whole bucket is let through only when the
bucket is full, so one huge request cannot be refused forever. When the answer is over, what it really used (the engine's
usage, else what was relayed) beyond that charge is taken from the tokens bucket too (``debit``,
no check: the bucket may go into debt): a request that names no ``max_tokens``, or whose prompt
was estimated short, pays for what it generated, and the key's next requests wait for the refill.

Both buckets of a key are checked and charged together (never one without the other). With
``limits.backend: redis`` the buckets live in Redis, so every gateway replica draws from the same
budget: one Lua script refills (on Redis' own clock, the same for every replica), checks and
charges atomically. While Redis is unreachable the limiter decides on this process' local
buckets (each replica then enforces the full limit on its own) and tries Redis again a second
later; decisions never wait on a dead Redis for longer than a short socket timeout.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.clock import Clock
from orchestrator.errors import RateLimited
from orchestrator.loop_thread import on_loop_thread
from orchestrator.redis_clients import ColdConnection, OffPathClient

if TYPE_CHECKING:
    from orchestrator.gateway.auth import ClientIdentity
    from orchestrator.telemetry.metrics import DyadMetrics

log = logging.getLogger("dyad.gateway.limits")

REDIS_RETRY_S = 1.0  # after a Redis failure, decide locally for this long before trying Redis again
REDIS_TIMEOUT_S = 0.25


@dataclass(frozen=True)
class Limit:
    """One bucket to draw from: ``capacity`` per minute, ``cost`` for this request."""

    dimension: str  # "requests" | "tokens"
    capacity: float
    cost: float

    @property
    def per_s(self) -> float:
        return self.capacity / 60.0


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``, ``250ms``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    return f"{whole // 60}m{whole % 60}s" if whole >= 60 else f"{whole}s"


def ratelimit_headers(limits: list[Limit], levels: list[float]) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-limit|remaining|reset-<requests|tokens>`` for each bucket: the budget per
    minute, what is left now, and how long until the bucket is full again."""
    out = []
    for lim, level in zip(limits, levels, strict=True):
        d = lim.dimension.encode()
        out.append((b"x-ratelimit-limit-" + d, str(int(lim.capacity)).encode()))
        out.append((b"x-ratelimit-remaining-" + d, str(max(0, math.floor(level))).encode()))
        out.append((b"x-ratelimit-reset-" + d, _duration(max(0.0, lim.capacity - level) / lim.per_s).encode()))
    return out


def limits_for(identity: ClientIdentity, tokens: int | None) -> list[Limit]:
    """The buckets a request draws from; ``tokens`` None: a request that generates nothing (reading or
    cancelling a stored response) counts against the requests bucket only."""
    out = []
    if identity.rpm:
        out.append(Limit("requests", float(identity.rpm), 1.0))
    if identity.tpm and tokens is not None:
        out.append(Limit("tokens", float(identity.tpm), float(max(1, tokens))))
    return out


class LocalBuckets:
    """Token buckets in this process. Pure: time comes in as ``now``."""

    def __init__(self, max_keys: int = 100_000) -> None:
        self._buckets: dict[tuple[str, str], list[float]] = {}  # (key, dimension) → [level, updated]
        self.max_keys = max_keys

    def take(self, key: str, limits: list[Limit], now: float, check: bool = True) -> tuple[float, int, list[float]]:
        """Charge every bucket and return (0, -1, levels after the charge), or charge nothing and return
        (seconds to wait, index of the limit that needs the longest wait, levels now). ``check`` False:
        charge without checking (``RateLimiter.debit``: the bucket may go into debt)."""
        levels = []
        wait, short = 0.0, -1
        for i, lim in enumerate(limits):
            b = self._buckets.get((key, lim.dimension))
            level = lim.capacity if b is None else min(lim.capacity, b[0] + max(0.0, now - b[1]) * lim.per_s)
            need = min(lim.cost, lim.capacity)
            if check and level < need and (need - level) / lim.per_s > wait:
                wait, short = (need - level) / lim.per_s, i
            levels.append(level)
        if wait > 0:
            return wait, short, levels
        if len(self._buckets) > self.max_keys:
            self._buckets.clear()  # a full bucket is the default state: forgetting only forgives
        left = [level - lim.cost for lim, level in zip(limits, levels, strict=True)]
        for lim, level in zip(limits, left, strict=True):
            self._buckets[(key, lim.dimension)] = [level, now]
        return 0.0, -1, left


# KEYS: one bucket hash per limit. ARGV: 1 to check (0: charge unchecked, ``debit``), then capacity,
# refill per ms, cost for each key in order. Returns {0, 0, levels after the charge...} when charged,
# else {milliseconds to wait, 1-based index of the shortest bucket, levels now...} (levels as strings:
# Lua numbers would be truncated to integers).
# Time is Redis' own (TIME), so replicas agree.
TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local check = tonumber(ARGV[1]) == 1
local levels = {}
local wait, short = 0, 0
for i, key in ipairs(KEYS) do
  local cap = tonumber(ARGV[3 * i - 1])
  local rate = tonumber(ARGV[3 * i])
  local cost = tonumber(ARGV[3 * i + 1])
  local b = redis.call('HMGET', key, 'level', 'ts')
  local level = tonumber(b[1])
  if level == nil then
    level = cap
  else
    level = math.min(cap, level + math.max(0, now - tonumber(b[2])) * rate)
  end
  local need = math.min(cost, cap)
  if check and level < need and (need - level) / rate > wait then wait, short = (need - level) / rate, i end
  levels[i] = level
end
if wait > 0 then
  local out = {math.ceil(wait), short}
  for i = 1, #KEYS do out[i + 2] = tostring(levels[i]) end
  return out
end
local out = {0, 0}
for i, key in ipairs(KEYS) do
  local cap = tonumber(ARGV[3 * i - 1])
  local rate = tonumber(ARGV[3 * i])
  local left = levels[i] - tonumber(ARGV[3 * i + 1])
  redis.call('HSET', key, 'level', tostring(left), 'ts', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((cap - left) / rate) + 1000)
  out[i + 2] = tostring(left)
end
return out
"""


class RateLimiter:
    """Checks a request against its key's buckets; raises ``RateLimited`` (429 + Retry-After)."""

    def __init__(self, clock: Clock, metrics: DyadMetrics | None = None, *, redis_url: str | None = None,
                 key_prefix: str = "dyad") -> None:
        self.clock = clock
        self.metrics = metrics
        self.local = LocalBuckets()
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self._redis: Any = None
        self._script: Any = None
        self._redis_down_until = 0.0
        self._redis_down = False

    @property
    def shared(self) -> bool:
        return self.redis_url is not None

    async def check(self, identity: ClientIdentity, tokens: int | None) -> list[tuple[bytes, bytes]]:
        """Charge the request to its key's buckets; returns the ``x-ratelimit-*`` headers for the answer
        (none for a key without limits), or raises ``RateLimited`` carrying them. ``tokens`` None: the
        requests bucket only (``limits_for``)."""
        limits = limits_for(identity, tokens)
        if not limits:
            return []
        wait, short, levels = await self._take(identity.name, limits)
        headers = ratelimit_headers(limits, levels)
        if wait > 0:
            lim = limits[short]
            what = f"{lim.capacity:g} {lim.dimension} per minute"
            retry = max(1, math.ceil(wait))
            raise RateLimited(f"Rate limit of API key '{identity.name}' reached ({what}). Retry in {retry} s.",
                              code="tpm_exceeded" if lim.dimension == "tokens" else "rpm_exceeded",
                              headers={"Retry-After": str(retry),
                                       **{k.decode(): v.decode() for k, v in headers}})
        return headers

    async def debit(self, identity: ClientIdentity, tokens: int) -> None:
        """Charge ``tokens`` more to the key's tokens-per-minute bucket, unchecked (what an answer used
        beyond what its request was charged). Nothing for a key without ``tpm``."""
        if identity.tpm and tokens > 0:
            await self._take(identity.name, [Limit("tokens", float(identity.tpm), float(tokens))], check=False)

    async def _take(self, name: str, limits: list[Limit], check: bool = True) -> tuple[float, int, list[float]]:
        now = self.clock.now()
        if self.redis_url is not None and now >= self._redis_down_until:
            await on_loop_thread()  # (network I/O: on the loop's thread, never the native plane's)
            try:
                result = await self._take_redis(name, limits, check)
            except ColdConnection:
                pass  # no open connection yet: one is being opened off the path; this request decides locally
            except Exception as e:  # noqa: BLE001 - any Redis failure: decide locally, retry later
                self._redis_down_until = now + REDIS_RETRY_S
                if not self._redis_down:
                    log.warning("rate limits: Redis unreachable (%s: %s); using local buckets",
                                type(e).__name__, e)
                self._redis_down = True
            else:
                if self._redis_down:
                    log.warning("rate limits: Redis is back; buckets shared again")
                self._redis_down = False
                return result
        if self.redis_url is not None and self.metrics is not None:
            self.metrics.rate_limit_fallbacks.inc()
        return self.local.take(name, limits, now, check)

    def _client(self) -> OffPathClient:
        if self._redis is None:
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError

            assert self.redis_url is not None
            # Connections are opened off the request path (``OffPathClient``): a call waits at most
            # ``REDIS_TIMEOUT_S`` on an open one. No retry of a reply timeout: the script may have run and
            # charged the bucket already, and running it again would charge the request twice.
            self._redis = OffPathClient(self.redis_url, call_timeout_s=REDIS_TIMEOUT_S, retry_s=REDIS_RETRY_S,
                                        name="rate limits",
                                        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                                        retry_on_error=[RedisConnectionError], retry_on_timeout=False)
            self._script = self._redis.redis.register_script(TAKE_LUA)
        return self._redis

    async def connect(self) -> bool:
        """Open the first shared-bucket connection before a request needs one (the gateway awaits it at start;
        without Redis configured, nothing). False when Redis did not answer (requests then decide locally until
        a connection is open)."""
        return True if self.redis_url is None else await self._client().connect()

    async def _take_redis(self, name: str, limits: list[Limit], check: bool) -> tuple[float, int, list[float]]:
        client = self._client()
        # One hash tag per key name: both buckets in the same cluster slot.
        keys = [f"{self.key_prefix}:rl:{{{name}}}:{lim.dimension}" for lim in limits]
        args: list[float] = [1 if check else 0]
        for lim in limits:
            args += [lim.capacity, lim.per_s / 1000.0, lim.cost]
        wait_ms, short, *levels = await client.call(self._script, keys=keys, args=args)
        return int(wait_ms) / 1000.0, int(short) - 1, [float(v) for v in levels]

    async def close(self) -> None:
        client, self._redis = self._redis, None
        if client is not None:
            await client.aclose()
