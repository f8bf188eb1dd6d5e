"""KV events an engine gets wrong, in-process: what the mapper, the batch decoder and the tracker do with
them (each test failed before its fix). The same over real ZMQ sockets and Redis:
tests/integration/test_kv_event_inputs.py."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from orchestrator.config import load_config
from orchestrator.fleet.registry import FleetRegistry
from orchestrator.kv import events as kv_events
from orchestrator.kv.events import KvEventMapper, KvEventSubscriber
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.index import Tier
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.kv.tokenization import RequestTokenizer
from orchestrator.kv.tracker import PrefixTracker
from orchestrator.telemetry.metrics import DyadMetrics

BS = 4
TOKENS = list(range(100, 124))


def stored(engine_hashes, tokens, parent=None, **kw):
    return {"type": "BlockStored", "block_hashes": engine_hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, **kw}


def _tracker(index=None, metrics=None, max_blocks=1_000_000):
    cfg = load_config({"models": [{"name": "m", "block_size": BS}], "index": {"max_blocks": max_blocks},
                       "workers": [{"id": "w", "url": "http://127.0.0.1:1", "models": ["m"]}]}, environ={})
    fleet = FleetRegistry.from_config(cfg)
    fleet.record_health(fleet.get("w"), True, 0.0)
    tracker = PrefixTracker(cfg, fleet, index or MemoryPrefixIndex(), RequestTokenizer(cfg), metrics)
    tracker.mappers["w"] = KvEventMapper("w", lambda: "m")
    return tracker, fleet


def _samples(metrics, name="dyad_kv_events_total"):
    return {s.labels["type"]: s.value for m in metrics.registry.collect() for s in m.samples
            if s.name == name and s.labels.get("worker") == "w"}


@pytest.mark.parametrize("lora", [["ad"], {"a": 1}, 7])
async def test_a_lora_name_that_is_not_a_name_is_one_malformed_event_not_a_lost_batch(lora):
    """``lora_name`` became the namespace as it was: a list (unhashable) then raised in the tracker's
    block-size bookkeeping, out of ``apply_events``: the rest of that batch (good events) was lost."""
    tracker, _ = _tracker()
    batch = [stored([1], TOKENS[:4], lora_name=lora), stored([2], TOKENS[:4]), stored([3], TOKENS[4:8], parent=2)]
    await tracker.apply_events("w", 0.0, batch)
    assert tracker.mappers["w"].malformed == 1
    ov = (await tracker.index.overlaps(BlockHasher("m", BS).hash_blocks(TOKENS[:8])))["w"]
    assert ov.blocks == 2


@pytest.mark.parametrize("block_size", [True, 4.0, "4"])
def test_a_block_size_that_is_not_an_integer_is_malformed(block_size):
    """``True`` was read as a block size of 1 (and the tracker then hashed every request of the model
    with it); a float was truncated."""
    m = KvEventMapper("w", lambda: "m")
    assert m.apply(stored([1], TOKENS[:4], block_size=block_size)) is None and m.malformed == 1


async def test_event_types_an_engine_makes_up_do_not_mint_metric_children():
    """Every distinct ``type`` string became a label value of dyad_kv_events_total: an engine sending
    made-up types grew the registry (and every scrape) without bound. Malformed events are counted too."""
    metrics = DyadMetrics()
    tracker, _ = _tracker(metrics=metrics)
    batch = [{"type": f"Made-up-{i}"} for i in range(500)] + [{"type": None}, {"type": ["x"]}]
    batch += [stored([1], TOKENS[:4]), {"type": "BlockRemoved", "block_hashes": "zz"}]
    await tracker.apply_events("w", 0.0, batch)
    assert _samples(metrics) == {"unknown": 502.0, "BlockStored": 1.0, "BlockRemoved": 1.0, "malformed": 1.0}


def test_the_engine_hash_map_is_bounded():
    """An engine that stores and never reports removals (or whose BlockRemoved were lost) grew the
    mapper's engine-hash map forever, past what the capped index could even hold."""
    m = KvEventMapper("w", lambda: "m", max_mapped=100)
    for i in range(1000):
        assert m.apply(stored([10_000 + i], [i, i + 1, i + 2, i + 3])) is not None
    assert len(m.engine_to_ours) == 100 and m.forgotten == 900
    assert 10_999 in m.engine_to_ours and 10_000 not in m.engine_to_ours  # the oldest went first
    # a re-stored block is the newest again: kept while older ones go
    m.apply(stored([10_900], [900, 901, 902, 903]))
    for i in range(1000, 1099):
        m.apply(stored([10_000 + i], [i, i + 1, i + 2, i + 3]))
    assert 10_900 in m.engine_to_ours and 10_901 not in m.engine_to_ours


def test_the_tracker_sizes_the_engine_hash_map_from_the_index_cap():
    tracker, fleet = _tracker(max_blocks=1234)
    w = fleet.get("w")
    from orchestrator.config import KvEventsConfig  # noqa: PLC0415 - only this test needs it
    w.kv_events = KvEventsConfig(endpoint="inproc://nowhere")
    tracker.mappers.clear()
    tracker._subscribe(w)
    assert tracker.mappers["w"].max_mapped == 1234


@pytest.mark.parametrize("payload", [
    msgpack.packb(5), msgpack.packb([1.0]), msgpack.packb([1.0, 5]), msgpack.packb(["x", []]),
    msgpack.packb([None, []]), msgpack.packb({"ts": [1], "events": []}), b"\xc1", b"", msgpack.packb("hi"),
    msgpack.packb([1.0, [1, 2]])[:-1],
])
def test_a_batch_of_another_shape_raises(payload):
    with pytest.raises((ValueError, TypeError, msgpack.UnpackException)):
        list(kv_events.iter_batch(payload))


def test_a_batch_is_decoded_a_chunk_at_a_time():
    events = [stored([i], TOKENS[:4]) for i in range(2500)]
    chunks = list(kv_events.iter_batch(msgpack.packb([7.0, events + [3, "x"], 0]), chunk=1000))
    assert [len(c) for _, c in chunks] == [1000, 1000, 500] and {ts for ts, _ in chunks} == {7.0}
    assert list(kv_events.iter_batch(msgpack.packb([7.0, []]))) == [(7.0, [])]  # an empty batch still reports its ts
    assert list(kv_events.iter_batch(msgpack.packb({"events": [stored([1], TOKENS[:4])], "ts": 2.0}))) \
        == [(0.0, [stored([1], TOKENS[:4])])]  # (a map-shaped batch: tolerated)


async def test_a_huge_batch_does_not_stall_the_event_loop():
    """A batch of 200,000 events was decoded whole (msgpack.unpackb) and applied in one go: the event loop
    stopped for the whole of it (a million events: ~15 s on this machine). Now it is decoded and applied
    EVENTS_PER_CHUNK events at a time with the loop running in between."""
    tracker, _ = _tracker()
    events = [stored([i], [i % 40_000, 1, 2, 3]) for i in range(200_000)]
    payload = msgpack.packb([1.0, events, 0])
    sub = KvEventSubscriber("w", "inproc://unused", tracker.apply_events, tracker._on_reset)
    ticks = [0]

    async def ticker():  # (runs once each time the loop gets control back)
        while True:
            await asyncio.sleep(0)
            ticks[0] += 1

    tick = asyncio.get_running_loop().create_task(ticker())
    await asyncio.sleep(0)
    before = ticks[0]
    await sub._apply(0, payload)
    ran = ticks[0] - before
    tick.cancel()
    assert sub.batches == 1 and sub.next_seq == 1
    assert len(tracker.mappers["w"].engine_to_ours) == 200_000
    # the loop ran between the chunks (counted, not timed: the machine's speed does not enter)
    chunks = 200_000 // kv_events.EVENTS_PER_CHUNK
    assert ran >= chunks - 1, (ran, chunks)
    assert kv_events.EVENTS_PER_CHUNK <= 4096


class _SlowIndex(MemoryPrefixIndex):
    """A shared index's writes take a round trip: the fleet can change while one is in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def store(self, worker_id, block_hashes, tier=Tier.DEVICE, anchors=None):
        self.entered.set()
        await self.gate.wait()
        await super().store(worker_id, block_hashes, tier)


@pytest.mark.parametrize("change", ["removed", "unhealthy"])
async def test_a_worker_removed_or_down_while_its_batch_is_applied_keeps_no_entries(change):
    """``apply_events`` checked the worker once, before the batch: a worker removed (or marked down, its
    entries cleared) while a write of its batch was in flight had that write and every later one of the
    batch land after the clear — a removed worker's entries stayed in the index, a down one was credited
    with blocks it no longer holds."""
    index = _SlowIndex()
    tracker, fleet = _tracker(index=index)
    batch = [stored([1], TOKENS[:4]), {"type": "BlockRemoved", "block_hashes": [1]},
             stored([2, 3], TOKENS[:8])]
    task = asyncio.get_running_loop().create_task(tracker.apply_events("w", 0.0, batch))
    await index.entered.wait()
    if change == "removed":
        fleet.remove("w")
    else:
        fleet.record_health(fleet.get("w"), False, 0.0)
        for _ in range(10):
            if fleet.get("w").state.name == "UNHEALTHY":
                break
            fleet.record_health(fleet.get("w"), False, 0.0)
    assert change == "removed" or fleet.get("w").state.name == "UNHEALTHY"
    await asyncio.sleep(0)
    index.gate.set()
    await task
    await asyncio.sleep(0.01)  # (the fleet listener's background clear)
    assert await index.size() == 0
