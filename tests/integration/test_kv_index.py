"""One behaviour suite for both prefix-index backends: in memory, and a real redis-server."""

from __future__ import annotations

import pytest

from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.index import PrefixIndex, Tier
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.kv.redis_index import RedisPrefixIndex
from orchestrator.telemetry.metrics import DyadMetrics
from tests.fixtures.redis import redis_server, unique_prefix  # noqa: F401

H = BlockHasher("m", 4)


def blocks(tokens: list[int]) -> list[int]:
    return H.hash_blocks(tokens)


PROMPT = list(range(40))  # 10 blocks
B = blocks(PROMPT)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def make_index(request):
    made: list[PrefixIndex] = []

    def factory(max_blocks: int = 10_000, metrics: DyadMetrics | None = None) -> PrefixIndex:
        if request.param == "memory":
            idx: PrefixIndex = MemoryPrefixIndex(max_blocks=max_blocks, metrics=metrics)
        else:
            server = request.getfixturevalue("redis_server")
            idx = RedisPrefixIndex(server.url, key_prefix=unique_prefix(), max_blocks=max_blocks, metrics=metrics)
        made.append(idx)
        return idx

    yield factory
    for idx in made:
        await idx.close()


async def test_longest_consecutive_prefix_per_worker(make_index):
    idx = make_index()
    await idx.store("a", B[:6])
    await idx.store("b", B[:3])
    await idx.store("b", B[4:8])  # a hole at block 3: only the first 3 count
    await idx.store("c", B[1:9])  # no first block: nothing counts
    ov = await idx.overlaps(B)
    assert {w: o.blocks for w, o in ov.items()} == {"a": 6, "b": 3}
    assert ov["a"].weighted_blocks == pytest.approx(6.0)


async def test_tiers_are_credited_by_weight_and_best_tier_wins(make_index):
    idx = make_index()
    await idx.store("a", B[:2], Tier.DEVICE)
    await idx.store("a", B[2:4], Tier.HOST)
    await idx.store("b", B[:4], Tier.DISK)
    await idx.store("b", B[:1], Tier.DEVICE)  # block 0 in device and disk: device credited
    ov = await idx.overlaps(B, {"device": 1.0, "host": 0.5, "disk": 0.25})
    assert ov["a"].blocks == 4 and ov["a"].weighted_blocks == pytest.approx(3.0)
    assert ov["b"].blocks == 4 and ov["b"].weighted_blocks == pytest.approx(1.75)


async def test_remove_one_tier_keeps_the_other(make_index):
    idx = make_index()
    await idx.store("a", B[:3], Tier.DEVICE)
    await idx.store("a", B[:3], Tier.HOST)
    await idx.remove("a", B[1:2], Tier.DEVICE)
    ov = await idx.overlaps(B, {"device": 1.0, "host": 0.5, "disk": 0.25})
    assert ov["a"].blocks == 3 and ov["a"].weighted_blocks == pytest.approx(2.5)
    await idx.remove("a", B[1:2])  # all tiers
    ov = await idx.overlaps(B)
    assert ov["a"].blocks == 1


async def test_clear_worker_forgets_only_that_worker(make_index):
    idx = make_index()
    await idx.store("a", B)
    await idx.store("b", B[:5])
    assert await idx.size() == 15
    await idx.clear_worker("a")
    ov = await idx.overlaps(B)
    assert set(ov) == {"b"} and ov["b"].blocks == 5
    assert await idx.size() == 5
    assert await idx.worker_blocks("a") == 0
    await idx.store("c", B[:2])  # (memory: takes the slot "a" left free)
    ov = await idx.overlaps(B)
    assert {w: o.blocks for w, o in ov.items()} == {"b": 5, "c": 2}
    await idx.store("a", B[:1])  # "a" comes back: a fresh slot, nothing of its past entries
    assert {w: o.blocks for w, o in (await idx.overlaps(B)).items()} == {"a": 1, "b": 5, "c": 2}


async def test_candidate_filter(make_index):
    idx = make_index()
    for w in ("a", "b", "c"):
        await idx.store(w, B[:4])
    ov = await idx.overlaps(B, workers=["b", "zz"])
    assert set(ov) == {"b"}
    assert await idx.overlaps(B, workers=[]) == {}


async def test_cap_evicts_least_recently_stored_and_counts(make_index):
    metrics = DyadMetrics()
    idx = make_index(max_blocks=8, metrics=metrics)
    await idx.store("a", B[:5])
    await idx.store("b", B[:5])  # 10 entries > 8: a's blocks 0 and 1 go first
    assert await idx.size() == 8
    ov = await idx.overlaps(B)
    assert "a" not in ov and ov["b"].blocks == 5
    backend = idx.backend
    assert metrics.registry.get_sample_value("dyad_index_evictions_total", {"backend": backend}) == 2
    # The cap is published from the start (dashboards plot fill = blocks / capacity).
    assert metrics.registry.get_sample_value("dyad_index_capacity_blocks", {"backend": backend}) == 8
    # Storing again refreshes recency: b's early blocks survive the next eviction.
    await idx.store("b", B[:2])
    await idx.store("c", B[:6])  # evicts a's 3 blocks, then b's blocks 2..4 (older than b's 0..1)
    ov = await idx.overlaps(B)
    assert set(ov) == {"b", "c"} and ov["b"].blocks == 2 and ov["c"].blocks == 6


async def test_empty_and_unknown(make_index):
    idx = make_index()
    assert await idx.overlaps([]) == {}
    assert await idx.overlaps(B) == {}
    await idx.remove("nobody", B)
    await idx.clear_worker("nobody")
    assert await idx.size() == 0


async def test_different_namespaces_do_not_match(make_index):
    idx = make_index()
    await idx.store("a", BlockHasher("lora-x", 4).hash_blocks(PROMPT))
    assert await idx.overlaps(B) == {}


@pytest.mark.redis
async def test_redis_down_falls_back_to_local_view_and_resyncs(redis_server):  # noqa: F811
    idx = RedisPrefixIndex(redis_server.url, key_prefix=unique_prefix(), retry_interval_s=0.0)
    other = RedisPrefixIndex(redis_server.url, key_prefix=idx.key_prefix)
    try:
        await idx.store("a", B[:4])
        assert (await other.overlaps(B))["a"].blocks == 4  # shared through Redis
        with redis_server.stopped():
            await idx.store("b", B[:6])  # Redis is down: kept locally
            ov = await idx.overlaps(B)
            assert not idx.available and idx.fallback_lookups >= 1
            assert ov["a"].blocks == 4 and ov["b"].blocks == 6
        # Redis is back, empty. The next call reconnects and resyncs the local view into it.
        await idx.overlaps(B)
        assert idx.available
        if idx._resync_task is not None:
            await idx._resync_task
        ov = await other.overlaps(B)
        assert ov["a"].blocks == 4 and ov["b"].blocks == 6
    finally:
        await idx.close()
        await other.close()


def reference_overlaps(held: dict[tuple[str, int], int], hashes: list[int], weights: dict[str, float],
                       workers: list[str]) -> dict[str, tuple[int, float]]:
    """The definition, computed naively: consecutive held blocks from the start, best tier credited."""
    credit = {Tier.DEVICE: weights["device"], Tier.HOST: weights["host"], Tier.DISK: weights["disk"]}
    out = {}
    for w in workers:
        n, total = 0, 0.0
        for h in hashes:
            mask = held.get((w, h), 0)
            if not mask:
                break
            n += 1
            total += max(c for t, c in credit.items() if mask & t)
        if n:
            out[w] = (n, total)
    return out


async def test_random_operations_match_the_reference_model(make_index):
    """70 workers (slots beyond one 64-bit word), every tier, stores/removes/clears in random order."""
    import random

    rng = random.Random(5)
    idx = make_index(max_blocks=1_000_000)
    workers = [f"worker-{i}" for i in range(70)]
    prompts = [BlockHasher("m", 4).hash_blocks([p] * 4 + list(range(60))) for p in range(3)]
    held: dict[tuple[str, int], int] = {}
    weights = {"device": 1.0, "host": 0.5, "disk": 0.25}
    for step in range(150):
        w = rng.choice(workers)
        hashes = rng.choice(prompts)[: rng.randint(1, 16)]
        op = rng.random()
        if op < 0.6:
            tier = rng.choice([Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK])
            await idx.store(w, hashes, tier)
            for h in hashes:
                held[(w, h)] = held.get((w, h), 0) | tier
        elif op < 0.9:
            part = hashes[rng.randint(0, len(hashes) - 1):]
            tier = rng.choice([None, Tier.DEVICE, Tier.HOST])
            await idx.remove(w, part, tier)
            for h in part:
                left = 0 if tier is None else held.get((w, h), 0) & ~tier
                if left:
                    held[(w, h)] = left
                else:
                    held.pop((w, h), None)
        else:
            await idx.clear_worker(w)
            for key in [k for k in held if k[0] == w]:
                del held[key]
        if step % 10 == 9:
            for prompt in prompts:
                subset = rng.sample(workers, 40)
                got = await idx.overlaps(prompt, weights, subset)
                want = reference_overlaps(held, prompt, weights, subset)
                assert {k: (o.blocks, round(o.weighted_blocks, 6)) for k, o in got.items()} == \
                    {k: (n, round(c, 6)) for k, (n, c) in want.items()}
    assert await idx.size() == len(held)


@pytest.mark.redis
async def test_redis_slot_table_follows_other_replicas_and_data_loss(redis_server):  # noqa: F811
    import redis as sync_redis

    idx = RedisPrefixIndex(redis_server.url, key_prefix=unique_prefix())
    other = RedisPrefixIndex(redis_server.url, key_prefix=idx.key_prefix)
    try:
        await idx.store("a", B[:2])
        assert set(await idx.overlaps(B)) == {"a"}  # idx caches the slot table: a = slot 0
        await other.store("b", B[:5])  # a slot idx has not seen
        assert {w: o.blocks for w, o in (await idx.overlaps(B)).items()} == {"a": 2, "b": 5}
        # Another replica clears "a"; its slot goes to a newcomer: idx must not call it "a".
        await other.clear_worker("a")
        await other.store("c", B[:4])
        assert {w: o.blocks for w, o in (await idx.overlaps(B)).items()} == {"b": 5, "c": 4}
        assert int(await other.client.get(f"{idx.key_prefix}:idx:nslots")) == 2  # slot 0 was reused
        # Redis loses its data (flushed, or restarted empty) and slots are handed out again in
        # another order: b = slot 0, a = slot 1. idx must not read b's bits as a's.
        sync_redis.Redis.from_url(redis_server.url).flushdb()
        await other.store("b", B[:3])
        await other.store("a", B[:1])
        assert {w: o.blocks for w, o in (await idx.overlaps(B)).items()} == {"a": 1, "b": 3}
    finally:
        await idx.close()
        await other.close()
