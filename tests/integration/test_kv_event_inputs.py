"""A hostile or buggy engine (and a full Redis) against KV-event ingestion, over real ZMQ sockets and a real
redis-server. Each test failed before its fix. In-process cases: tests/unit/test_kv_event_inputs.py."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest
import redis
import zmq
import zmq.asyncio

from orchestrator.kv.events import KvEventMapper, KvEventSubscriber
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.redis_index import RedisPrefixIndex
from tests.fixtures.redis import RedisServer, unique_prefix
from tests.integration.test_kv_events import TOKENS, Publisher, stored, until

OURS = BlockHasher("m", 4).hash_blocks(TOKENS)


class _Follower:
    """A subscriber on a Publisher, applying stores to a list (and counting resets)."""

    def __init__(self, ctx, pub: Publisher, *, replay: bool = True, on_reset=None, replay_timeout_s: float = 2.0):
        self.mapper = KvEventMapper("w", lambda: "m")
        self.stores: list[list[int]] = []
        self.resets: list[str] = []
        self.malformed: list[str] = []

        async def on_batch(wid, ts, events):
            for ev in events:
                op = self.mapper.apply(ev)
                if op is not None and op.kind == "store":
                    self.stores.append(op.hashes)

        async def reset(wid, why):
            self.resets.append(why)
            self.mapper.reset()
            if on_reset is not None:
                await on_reset(wid, why)

        self.sub = KvEventSubscriber(
            "w", f"tcp://127.0.0.1:{pub.port}", on_batch, reset, context=ctx, replay_timeout_s=replay_timeout_s,
            replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}" if replay else None,
            on_malformed=lambda wid, what: self.malformed.append(what))


def _frames(seq_bytes: bytes, payload: bytes) -> list[bytes]:
    return [b"kv-events", seq_bytes, payload]


@pytest.mark.parametrize("bad", [
    (-5).to_bytes(8, "big", signed=True),  # a negative counter (the next good one made a negative replay start)
    (1 << 64).to_bytes(9, "big"),  # 9 bytes: past 64 bits (a replay start that does not fit 8 bytes)
    (1 << 72).to_bytes(10, "big"),
])
async def test_a_seq_that_is_not_an_8_byte_counter_is_skipped_and_the_stream_goes_on(bad):
    """The subscriber took any bytes as ``seq``: a negative one, or one past 64 bits, then made the gap
    replay's start ``to_bytes(8)`` raise OverflowError — out of the subscriber's loop, which ended for
    good: that engine's entries froze (stale hits, none new) until it was removed from the fleet."""
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    f = _Follower(ctx, pub)
    f.sub.start()
    try:
        await asyncio.sleep(0.3)
        await pub.publish([stored([1], TOKENS[:4])])
        await until(lambda: len(f.stores) == 1)
        payload = msgpack.packb([1.0, [stored([2], TOKENS[:4])], None])
        await pub.pub.send_multipart(_frames(bad, payload))
        await pub.pub.send_multipart(_frames(bad[:-1] + bytes([bad[-1] ^ 3]), payload))  # another one, "later"
        await until(lambda: len(f.malformed) == 2)
        await pub.publish([stored([3], TOKENS[4:8], parent=1)])
        await pub.publish([stored([4], TOKENS[8:12], parent=3)])
        await until(lambda: len(f.stores) == 3)
        assert not f.sub._task.done() and f.sub.malformed == 2 and f.sub.restarts == 0
        assert f.stores == [OURS[:1], OURS[1:2], OURS[2:3]]
    finally:
        await f.sub.stop()
        pub.close()
        ctx.term()


async def test_messages_with_missing_or_extra_frames_and_undecodable_payloads_are_counted():
    """Messages with the wrong number of frames were dropped silently (no count, no log line); an
    undecodable payload was logged on every message (no bound) and counted nowhere."""
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    f = _Follower(ctx, pub, replay=False)
    f.sub.start()
    try:
        await asyncio.sleep(0.3)
        await pub.pub.send_multipart([b"kv-events", (0).to_bytes(8, "big")])  # no payload
        await pub.pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), b"\x90", b"extra"])
        await pub.pub.send(b"kv-events")  # one frame
        for i in range(3):
            await pub.pub.send_multipart(_frames(i.to_bytes(8, "big"), b"\xc1 not msgpack"))
        await until(lambda: len(f.malformed) == 6)
        assert f.malformed == ["message"] * 3 + ["batch"] * 3
        pub.seq = 3
        await pub.publish([stored([1], TOKENS[:4])])
        await until(lambda: len(f.stores) == 1)
        assert f.sub.gaps == 0 and f.sub.restarts == 0  # (the undecodable ones still advanced the sequence)
    finally:
        await f.sub.stop()
        pub.close()
        ctx.term()


async def test_a_flood_of_malformed_messages_is_logged_at_a_bounded_rate(caplog):
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    f = _Follower(ctx, pub, replay=False)
    f.sub.start()
    try:
        await asyncio.sleep(0.3)
        with caplog.at_level(logging.INFO, logger="dyad.kv.events"):
            for i in range(300):
                await pub.pub.send_multipart(_frames(i.to_bytes(8, "big"), b"\xc1"))
            await until(lambda: len(f.malformed) == 300)
        lines = [r for r in caplog.records if r.name == "dyad.kv.events"]
        assert 1 <= len(lines) <= 3, [r.getMessage() for r in lines]
    finally:
        await f.sub.stop()
        pub.close()
        ctx.term()


class _GarbageReplay:
    """A replay socket that answers every request with garbage, then (maybe) the end marker."""

    def __init__(self, ctx, port: int, *, end: bool) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{port}")
        self.end = end
        self.asked = 0
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            client, _empty, _start = await self.router.recv_multipart()
            self.asked += 1
            await self.router.send_multipart([client, b"", b"x"])  # too few frames
            await self.router.send_multipart([client, b"", b"kv-events", b"\x01\x02", b"\x90"])  # 2-byte seq
            await self.router.send_multipart([client, b"", b"kv-events", (-7).to_bytes(8, "big", signed=True),
                                              msgpack.packb([1.0, [stored([9], TOKENS[:4])]])])
            await self.router.send_multipart([client, b"", b"kv-events", (1).to_bytes(8, "big"), b"\xc1"])
            if self.end:
                await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._task.cancel()
        self.router.close(0)


@pytest.mark.parametrize("end", [True, False])
async def test_a_replay_socket_that_answers_garbage_or_never_ends(end):
    """Garbage from the replay socket is skipped and counted; a replay that never ends times out; the live
    stream goes on either way."""
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    pub.router.close(0)
    pub._task.cancel()
    await asyncio.sleep(0.05)
    bad = _GarbageReplay(ctx, pub.replay_port, end=end)
    f = _Follower(ctx, pub, replay_timeout_s=0.5)
    f.sub.start()
    try:
        await until(lambda: bad.asked >= 1)  # the start-up replay
        await asyncio.sleep(0.3 if end else 0.8)
        pub.seq = 5  # (past the garbage's seq 1: the next live batch is a gap, replayed from that socket again)
        await pub.publish([stored([1], TOKENS[:4])])
        await pub.publish([stored([2], TOKENS[4:8], parent=1)])
        await until(lambda: len(f.stores) >= 2)
        assert f.stores[-2:] == [OURS[:1], OURS[1:2]]
        assert not f.sub._task.done() and f.sub.malformed >= 4  # (3 replay frames; the batch of seq 1)
    finally:
        await f.sub.stop()
        bad.close()
        pub.close()
        ctx.term()


async def test_a_failing_clear_on_an_engine_restart_does_not_end_the_subscriber():
    """``on_reset`` (clearing the restarted engine's entries) was awaited bare in the subscriber's loop: a
    clear that raised (a shared index refusing writes) ended the subscriber for good."""
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)

    async def failing(wid, why):
        raise RuntimeError("OOM command not allowed")

    f = _Follower(ctx, pub, on_reset=failing)
    f.sub.start()
    try:
        await asyncio.sleep(0.3)
        await pub.publish([stored([1], TOKENS[:4])])
        await pub.publish([stored([2], TOKENS[4:8], parent=1)])
        await until(lambda: len(f.stores) == 2)
        pub.restart()
        await pub.publish([stored([5], TOKENS[:4])])
        await until(lambda: f.resets == ["restart"])
        await until(lambda: len(f.stores) == 3)
        await pub.publish([stored([6], TOKENS[4:8], parent=5)])
        await until(lambda: len(f.stores) == 4)
        assert not f.sub._task.done() and f.sub.errors == 1
    finally:
        await f.sub.stop()
        pub.close()
        ctx.term()


async def test_a_full_redis_is_treated_as_down_and_repaired_when_it_has_room():
    """Redis at ``maxmemory`` with ``noeviction`` refuses writes (OOM) but answers reads: the index's
    stores, removals and clears raised OutOfMemoryError (out of the KV-event batch, so the rest of it was
    lost), lookups kept reading Redis, and nothing was repaired once Redis had room again: a restarted
    engine's cleared entries stayed credited there until evicted. Now a write Redis refuses switches the
    replica to its mirror as an outage does; a write probe finds it writable again, then the workers cleared
    meanwhile are cleared in Redis and the mirror is written back."""
    with RedisServer() as server:
        idx = RedisPrefixIndex(server.url, key_prefix=unique_prefix(), retry_interval_s=0.1)
        admin = redis.Redis.from_url(server.url)
        try:
            await idx.store("a", OURS[:3])
            await idx.store("b", OURS[:2])
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", admin.info("memory")["used_memory"] + 1024)
            await idx.clear_worker("a")  # engine a restarted
            await idx.store("a", OURS[:1])  # and stored its first block again
            await idx.store("b", OURS[2:4])
            assert not idx.available
            ov = await idx.overlaps(OURS)
            assert {w: o.blocks for w, o in ov.items()} == {"a": 1, "b": 4}  # (the mirror)
            admin.config_set("maxmemory", 0)
            await until(lambda: idx.available and idx.resyncs == 1, timeout=5.0)
            fresh = RedisPrefixIndex(server.url, key_prefix=idx.key_prefix)  # reads Redis only
            try:
                ov = await fresh.overlaps(OURS)
                assert {w: o.blocks for w, o in ov.items()} == {"a": 1, "b": 4}
            finally:
                await fresh.close()
        finally:
            admin.close()
            await idx.close()
