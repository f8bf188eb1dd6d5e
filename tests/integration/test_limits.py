"""Rate limits: token buckets locally, shared through a real redis-server, local fallback while it is down."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.clock import VirtualClock
from orchestrator.errors import RateLimited
from orchestrator.gateway.auth import ClientIdentity
from orchestrator.gateway.limits import Limit, LocalBuckets, RateLimiter
from orchestrator.telemetry.metrics import DyadMetrics
from tests.fixtures.redis import redis_server, unique_prefix  # noqa: F401


def test_bucket_refills_at_the_per_minute_rate():
    b = LocalBuckets()
    rpm = [Limit("requests", 60, 1)]
    assert all(b.take("k", rpm, 0.0)[:2] == (0.0, -1) for _ in range(60))  # a full minute's burst
    wait, short, _ = b.take("k", rpm, 0.0)
    assert wait == pytest.approx(1.0) and short == 0
    assert b.take("k", rpm, 0.5)[0] == pytest.approx(0.5)
    assert b.take("k", rpm, 1.0)[:2] == (0.0, -1)
    assert b.take("other", rpm, 1.0)[:2] == (0.0, -1)  # keys do not share buckets


def test_both_buckets_are_charged_together_or_not_at_all():
    b = LocalBuckets()
    limits = [Limit("requests", 10, 1), Limit("tokens", 1000, 800)]
    assert b.take("k", limits, 0.0)[0] == 0
    wait, short, _ = b.take("k", limits, 0.0)  # tokens short: 200 left, 800 needed
    assert short == 1 and wait == pytest.approx(600 / (1000 / 60))
    # the refused request did not take a request token: 9 one-token requests still fit
    assert all(b.take("k", [limits[0]], 0.0)[0] == 0 for _ in range(9))
    assert b.take("k", [limits[0]], 0.0)[0] > 0


def test_a_request_larger_than_the_bucket_passes_once_when_full_and_leaves_debt():
    b = LocalBuckets()
    big = [Limit("tokens", 600, 1200)]
    assert b.take("k", big, 0.0)[0] == 0
    assert b.take("k", big, 0.0)[0] == pytest.approx(120.0)  # -600 → 600 takes two minutes


async def test_limiter_raises_429_with_retry_after():
    clock = VirtualClock()
    lim = RateLimiter(clock)
    who = ClientIdentity("team", rpm=2)
    first = dict(await lim.check(who, 10))
    assert first == {b"x-ratelimit-limit-requests": b"2", b"x-ratelimit-remaining-requests": b"1",
                     b"x-ratelimit-reset-requests": b"30s"}  # OpenAI's headers: 1 left, full again in 30 s
    assert dict(await lim.check(who, 10))[b"x-ratelimit-remaining-requests"] == b"0"
    with pytest.raises(RateLimited) as e:
        await lim.check(who, 10)
    assert e.value.status == 429 and e.value.code == "rpm_exceeded" and e.value.headers["Retry-After"] == "30"
    assert e.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.value.headers["x-ratelimit-reset-requests"] == "1m0s"  # empty bucket: a whole minute to refill
    assert "'team'" in e.value.message and "2 requests per minute" in e.value.message
    clock.advance(30)
    await lim.check(who, 10)
    await lim.check(ClientIdentity("unlimited"), 10**9)  # no limits: never refused
    with pytest.raises(RateLimited) as e:
        await lim.check(ClientIdentity("t2", tpm=100), 50)
        await lim.check(ClientIdentity("t2", tpm=100), 60)
    assert e.value.code == "tpm_exceeded"


@pytest.mark.redis
async def test_replicas_share_buckets_in_redis_and_fall_back_locally_when_it_is_down(redis_server):  # noqa: F811
    prefix = unique_prefix("rl")
    metrics = DyadMetrics()
    a = RateLimiter(VirtualClock(), metrics, redis_url=redis_server.url, key_prefix=prefix)
    b = RateLimiter(VirtualClock(), metrics, redis_url=redis_server.url, key_prefix=prefix)
    who = ClientIdentity("shared", rpm=6, tpm=1000)
    try:
        assert await a.connect() and await b.connect()  # (as the gateway does at start: a first connection)
        seen = [dict(await lim.check(who, 10))[b"x-ratelimit-remaining-requests"]
                for lim in (a, b, a, b, a, b)]  # six requests between two replicas: the whole budget
        assert seen == [b"5", b"4", b"3", b"2", b"1", b"0"]  # one shared bucket, counted in Redis
        for lim in (a, b):
            with pytest.raises(RateLimited) as e:
                await lim.check(who, 10)
            assert e.value.code == "rpm_exceeded" and 1 <= int(e.value.headers["Retry-After"]) <= 10
        with redis_server.stopped():
            # Redis down: each replica decides on its own local buckets (no error, no hang)
            for _ in range(6):
                await a.check(who, 10)
            with pytest.raises(RateLimited):
                await a.check(who, 10)
            assert metrics.rate_limit_fallbacks._value.get() == 7
        # Redis back (empty after the crash): a request that finds no open connection decides locally at once
        # and has one opened in the background (never on its own path; a's was already being opened); from
        # then on the buckets are shared again
        await asyncio.sleep(1.1)
        other = ClientIdentity("other", rpm=100)
        for lim in (a, b):
            await lim.check(other, 10)  # (local if no connection is open yet)
            await lim._client().opening()
        local = metrics.rate_limit_fallbacks._value.get()
        assert 7 < local <= 9  # (b's at least: its pooled connection died with the restart)
        for lim in (a, b, a, b, a, b):
            await lim.check(who, 10)
        with pytest.raises(RateLimited):
            await b.check(who, 10)
        assert metrics.rate_limit_fallbacks._value.get() == local
    finally:
        await a.close()
        await b.close()


def test_debit_takes_unchecked_and_the_bucket_refills_from_the_debt():
    b = LocalBuckets()
    tpm = Limit("tokens", 600, 100)
    assert b.take("k", [tpm], 0.0)[0] == 0  # 500 left
    assert b.take("k", [Limit("tokens", 600, 900)], 0.0, check=False)[2] == [pytest.approx(-400)]  # into debt
    wait, short, _ = b.take("k", [tpm], 0.0)
    assert short == 0 and wait == pytest.approx(50.0)  # -400 → 100 at 10/s
    assert b.take("fresh", [Limit("tokens", 600, 50)], 0.0, check=False)[2] == [pytest.approx(550)]  # starts full


@pytest.mark.redis
async def test_tokens_used_after_the_answer_are_charged_to_the_shared_bucket(redis_server):  # noqa: F811
    prefix = unique_prefix("rl-debit")
    a = RateLimiter(VirtualClock(), redis_url=redis_server.url, key_prefix=prefix)
    b = RateLimiter(VirtualClock(), redis_url=redis_server.url, key_prefix=prefix)
    who = ClientIdentity("debited", tpm=1000)
    try:
        assert await a.connect() and await b.connect()
        await a.check(who, 100)
        await a.debit(who, 700)  # replica a's answer used 700 more than it was charged
        with pytest.raises(RateLimited) as e:
            await b.check(who, 300)  # replica b sees ~200 left in Redis
        assert e.value.code == "tpm_exceeded"
        assert 150 <= int(e.value.headers["x-ratelimit-remaining-tokens"]) <= 260
        await a.debit(ClientIdentity("no-tpm"), 10**9)  # a key without a tokens limit: nothing to charge
    finally:
        await a.close()
        await b.close()
