"""The shared prefix index and the shared rate limits over TLS (``rediss://``), against a real
redis-server that listens only on a TLS port, with certificates from a throwaway CA made here by the
openssl CLI (tests/fixtures/redis_tls.py): one-way TLS and mutual TLS, a whole ``dyad serve`` pointed
at it with ``--redis``, and what happens when the TLS settings are wrong (local fallback, said once).
The engine behind the gateway is the project's simulator (routing and Redis are what is tested)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import redis as sync_redis

from adapters.prometheus_text import parse_samples
from orchestrator.clock import VirtualClock
from orchestrator.gateway.auth import ClientIdentity, hash_key
from orchestrator.gateway.limits import RateLimited, RateLimiter
from orchestrator.kv.redis_index import RedisPrefixIndex
from orchestrator.sim.server import SimEngineThread
from orchestrator.telemetry.metrics import DyadMetrics
from tests.fixtures.dyad_process import dyad_serve
from tests.fixtures.pki import make_pki
from tests.fixtures.redis import unique_prefix
from tests.fixtures.redis_tls import TlsRedisServer

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("redis-pki"))


@pytest.fixture(scope="module", params=["tls", "mutual-tls"])
def tls_redis(request, pki):
    with TlsRedisServer(pki, auth_clients=request.param == "mutual-tls") as server:
        yield server


async def test_prefix_index_shared_between_replicas_over_tls(tls_redis):
    prefix = unique_prefix("tls-idx")
    a = RedisPrefixIndex(tls_redis.url, prefix, clock=VirtualClock())
    b = RedisPrefixIndex(tls_redis.url, prefix, clock=VirtualClock())  # another gateway replica
    try:
        blocks = [11, 22, 33, 44, 55]
        await a.store("w0", blocks)
        await a.store("w1", blocks[:2])
        found = await b.overlaps(blocks + [66])
        assert {w: o.blocks for w, o in found.items()} == {"w0": 5, "w1": 2}
        assert await b.size() == 7
        await a.remove("w0", blocks[3:])
        assert (await b.overlaps(blocks))["w0"].blocks == 3
        assert a.available and b.available and b.fallback_lookups == 0  # every answer came from Redis
    finally:
        await a.close()
        await b.close()
    # and the keys really are in that server, read back over TLS by an independent client
    client = sync_redis.Redis.from_url(tls_redis.url)
    assert client.keys(f"{prefix}:*")
    client.close()


async def test_rate_limits_shared_between_replicas_over_tls(tls_redis):
    prefix = unique_prefix("tls-rl")
    metrics = DyadMetrics()
    a = RateLimiter(VirtualClock(), metrics, redis_url=tls_redis.url, key_prefix=prefix)
    b = RateLimiter(VirtualClock(), metrics, redis_url=tls_redis.url, key_prefix=prefix)
    who = ClientIdentity("tls-key", rpm=4)
    try:
        # (the TLS handshake has its own budget, off the request path: redis_clients.OffPathClient; the limiter's
        # 0.25-s bound is a call's, and a handshake on a loaded machine outlasted it when it covered both)
        assert await a.connect() and await b.connect()
        for lim in (a, b, a, b):  # the whole budget, split between two replicas
            await lim.check(who, 10)
        for lim in (a, b):
            with pytest.raises(RateLimited) as e:
                await lim.check(who, 10)
            assert e.value.code == "rpm_exceeded"
        assert metrics.rate_limit_fallbacks._value.get() == 0  # decided in Redis, not locally
    finally:
        await a.close()
        await b.close()


async def test_wrong_tls_settings_fall_back_to_local_state(tls_redis, pki, caplog):
    """A plain redis:// URL on the TLS port, or rediss:// without the CA that signed the server: the
    index answers from its local mirror and the limits from local buckets; the gateway keeps serving."""
    for url, why in ((tls_redis.plain_url, "plain"), (tls_redis.url_with(), "unknown CA")):
        prefix = unique_prefix("tls-bad")
        # a liveness bound, not the production 0.5 s: on a loaded machine the handshake can outlast
        # 0.5 s, and the index then logs a timeout instead of the certificate error this test checks
        idx = RedisPrefixIndex(url, prefix, clock=VirtualClock(), socket_timeout_s=5.0)
        metrics = DyadMetrics()
        lim = RateLimiter(VirtualClock(), metrics, redis_url=url, key_prefix=prefix)
        try:
            await idx.store("w0", [1, 2, 3])
            assert {w: o.blocks for w, o in (await idx.overlaps([1, 2, 3])).items()} == {"w0": 3}, why
            assert not idx.available and idx.fallback_lookups >= 1, why
            await lim.check(ClientIdentity("k", rpm=100), 1)
            assert metrics.rate_limit_fallbacks._value.get() == 1, why
            await lim._client().opening()  # (the connection it had opened in the background: refused, logged)
        finally:
            await idx.close()
            await lim.close()
    said = [r.getMessage() for r in caplog.records]
    for who in ("redis index unreachable", "rate limits: could not open a connection to Redis"):
        assert any(who in m and "CERTIFICATE_VERIFY_FAILED" in m for m in said), (who, said)


def test_dyad_serve_with_a_rediss_url(tls_redis):
    """``dyad serve --redis rediss://...`` (a real gateway process): routing state and rate-limit
    buckets end up in the TLS-only Redis."""
    prefix = unique_prefix("tls-gw")
    engine = SimEngineThread(model="m", profile="cpu-tiny", kv_events=False).start()
    env = {"DYAD_INDEX__KEY_PREFIX": prefix, "DYAD_LIMITS__BACKEND": "redis", "DYAD_LIMITS__KEY_PREFIX": prefix,
           "DYAD_HEALTH__INTERVAL_S": "0.2",
           # two client keys: one warms the gateway's TLS connection to Redis (the first one pays the
           # handshake), the other is the one counted
           "DYAD_AUTH__KEYS": f"[{{name: warm, sha256: {hash_key('warm-key')}, rpm: 1000}}, "
                              f"{{name: counted, sha256: {hash_key('counted-key')}, rpm: 3}}]"}
    gw = dyad_serve("--worker", engine.url, "--policy", "kv_aware", "--redis", tls_redis.url, env=env, clean_env=True)
    try:
        gw.start()
        url = gw.url
        body = {"model": "m", "max_tokens": 2, "prompt": "shared system prompt " * 40}

        def fallbacks() -> float:  # rate-limit checks decided locally because Redis did not answer in time
            text = httpx.get(f"{url}/metrics", timeout=10).text
            return sum(x.value for x in parse_samples(text, ("dyad_rate_limit_local_fallbacks_total",)))

        # The first request pays the TLS handshake; on a loaded machine it can outlast the limiter's 0.25-s
        # Redis timeout and be counted locally (CI, once). Warm until a warm request went through Redis.
        for _ in range(5):
            before = fallbacks()
            warm = httpx.post(f"{url}/v1/completions", json=body, timeout=30,
                              headers={"authorization": "Bearer warm-key"})
            assert warm.status_code == 200, warm.text
            if fallbacks() == before:
                break
        else:
            raise AssertionError("no warm-up request reached the TLS Redis in 5 tries")
        codes = [httpx.post(f"{url}/v1/completions", json=body, timeout=30,
                            headers={"authorization": "Bearer counted-key"}).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]  # the key's rpm 3, counted in Redis
        assert fallbacks() == before  # every counted request's check went through Redis
        client = sync_redis.Redis.from_url(tls_redis.url)
        try:
            deadline = time.monotonic() + 10
            while not client.keys(f"{prefix}:idx*"):  # the routing decision's approximate index entry
                assert time.monotonic() < deadline, client.keys(f"{prefix}:*")
                time.sleep(0.05)
            assert client.keys(f"{prefix}:rl:*")
        finally:
            client.close()
    finally:
        gw.stop()
        engine.stop()


class _SlowHandshake:
    """A TCP relay in front of the TLS Redis that holds the server's first bytes of every connection (its TLS
    ServerHello) for ``delay_s``: a connection takes longer to open than the limiter's bound for a call (0.25 s,
    ``limits.REDIS_TIMEOUT_S``), as a handshake does on a loaded gateway or to a far Redis. Later bytes pass."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.port, self.delay_s = port, delay_s
        self.server: asyncio.Server | None = None
        self.connections = 0
        self.relays: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.relays:
            task.cancel()
        await asyncio.gather(*self.relays, return_exceptions=True)

    async def _relay(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.relays.add(task)
        ur, uw = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: float) -> None:
            try:
                while data := await r.read(65536):
                    if delay:
                        await asyncio.sleep(delay)
                        delay = 0.0
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(cr, uw, 0.0), pipe(ur, cw, self.delay_s))


async def test_a_tls_handshake_slower_than_a_calls_bound_still_opens_a_shared_connection(tls_redis):
    """The limiter's bound for a call (0.25 s) once covered the opening of its connection, TLS handshake included:
    a handshake always slower than that never completed, and every decision was local for good (each replica its
    own buckets). Connections are now opened off the request path with their own budget
    (redis_clients.OffPathClient): the first request decides locally at once, without waiting for the handshake,
    and once the connection is open the buckets are shared."""
    relay = _SlowHandshake(tls_redis.port, delay_s=0.6)
    port = await relay.start()
    url = tls_redis.url.replace(f":{tls_redis.port}/", f":{port}/")
    prefix = unique_prefix("tls-slow")
    metrics = DyadMetrics()
    a = RateLimiter(VirtualClock(), metrics, redis_url=url, key_prefix=prefix)
    b = RateLimiter(VirtualClock(), metrics, redis_url=tls_redis.url, key_prefix=prefix)  # (direct: the witness)
    who = ClientIdentity("slow-key", rpm=5)
    try:
        assert await b.connect()
        await a.check(who, 1)
        assert metrics.rate_limit_fallbacks._value.get() == 1  # no open connection: decided locally ...
        opening = a._client()._warming
        assert opening is not None and not opening.done()  # ... and at once: the handshake is still under way
        await a._client().opening()
        assert a._client().opened == 1 and relay.connections == 1
        for lim in (a, b, a, b, a):  # now shared: the key's 5 per minute in Redis (the local decision above
            await lim.check(who, 1)   # was not counted there)
        for lim in (b, a):
            with pytest.raises(RateLimited):
                await lim.check(who, 1)
        assert metrics.rate_limit_fallbacks._value.get() == 1
    finally:
        await a.close()
        await b.close()
        await relay.stop()
