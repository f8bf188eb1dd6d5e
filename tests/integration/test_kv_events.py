"""KV event mapping (pure) and the ZMQ subscriber against a vLLM-format publisher on real sockets
(PUB + ROUTER replay, as vLLM's ZmqEventPublisher binds them). Real-vLLM events: tests/integration."""

from __future__ import annotations

import asyncio

import msgpack
import zmq
import zmq.asyncio

from orchestrator.kv.events import KvEventMapper, KvEventSubscriber
from orchestrator.kv.hashing import BlockHasher
from orchestrator.kv.index import Tier
from orchestrator.kv.memory_index import MemoryPrefixIndex
from tests.fixtures.redis import free_port

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks
OURS = BlockHasher("m", BS).hash_blocks(TOKENS)


def stored(engine_hashes, tokens, parent=None, medium="GPU", **kw):
    return {"type": "BlockStored", "block_hashes": engine_hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": medium, "lora_name": None, **kw}


def test_stored_events_are_rehashed_from_token_ids_and_chained_through_engine_parents():
    m = KvEventMapper("w", lambda: "m")
    op1 = m.apply(stored([9001, 9002], TOKENS[:8]))
    op2 = m.apply(stored([9003, 9004, 9005, 9006], TOKENS[8:], parent=9002))
    assert op1.kind == "store" and op1.hashes == OURS[:2] and op1.tier is Tier.DEVICE
    assert op2.hashes == OURS[2:]  # independent of the engine's own hash values
    rm = m.apply({"type": "BlockRemoved", "block_hashes": [9004, 12345], "medium": "GPU"})
    assert rm.kind == "remove" and rm.hashes == [OURS[3]]
    assert m.apply({"type": "AllBlocksCleared"}).kind == "clear" and not m.engine_to_ours


def test_unknown_parent_multimodal_and_salt():
    m = KvEventMapper("w", lambda: "m")
    assert m.apply(stored([1], TOKENS[4:8], parent=777)) is None and m.unmapped == 1
    assert m.apply(stored([2], TOKENS[:4], extra_keys=[[("mm-hash", 0)]])) is None
    op = m.apply(stored([3], TOKENS[:4], extra_keys=[["salt-1"]]))
    assert op.hashes == BlockHasher("m", BS, "salt-1").hash_blocks(TOKENS[:4])
    lora = m.apply(stored([4], TOKENS[:4], lora_name="ad", extra_keys=[["ad"]]))
    assert lora.hashes == BlockHasher("ad", BS).hash_blocks(TOKENS[:4]) and lora.namespace == "ad"


def test_medium_maps_to_tier_and_removal_is_per_tier():
    m = KvEventMapper("w", lambda: "m")
    m.apply(stored([1], TOKENS[:4]))
    op = m.apply(stored([1], TOKENS[:4], medium="CPU"))
    assert op.tier is Tier.HOST
    op = m.apply({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"})
    assert op.tier is Tier.DEVICE and 1 in m.engine_to_ours  # still held on the host tier
    m.apply({"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"})
    assert 1 not in m.engine_to_ours


class Publisher:
    """vLLM's wire format: PUB [topic, seq, msgpack([ts, events, dp_rank])]; ROUTER replay."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.port, self.replay_port = free_port(), free_port()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        while True:
            client, _empty, start = await self.router.recv_multipart()
            s = int.from_bytes(start, "big")
            for seq, buf in self.buffer:
                if seq >= s:
                    await self.router.send_multipart([client, b"", b"kv-events", seq.to_bytes(8, "big"), buf])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def publish(self, events, send: bool = True) -> None:
        payload = msgpack.packb([1.0, events, None])
        self.buffer.append((self.seq, payload))
        if send:
            await self.pub.send_multipart([b"kv-events", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def restart(self) -> None:
        self.buffer.clear()
        self.seq = 0

    def close(self) -> None:
        self._task.cancel()
        self.pub.close(0)
        self.router.close(0)


async def until(pred, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_subscriber_replays_gaps_joins_late_and_clears_on_restart():
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    index = MemoryPrefixIndex()
    mapper = KvEventMapper("w", lambda: "m")
    resets: list[str] = []

    async def on_batch(wid, ts, events):
        for ev in events:
            op = mapper.apply(ev)
            if op and op.kind == "store":
                index.store_now(wid, op.hashes, op.tier)
            elif op and op.kind == "remove":
                index.remove_now(wid, op.hashes, op.tier)
            elif op:
                index.clear_worker_now(wid)

    async def on_reset(wid, why):
        resets.append(why)
        mapper.reset()
        index.clear_worker_now(wid)

    # Batch 0 is published before anyone listens: the subscriber must learn it by replay.
    await pub.publish([stored([1, 2], TOKENS[:8])])
    sub = KvEventSubscriber("w", f"tcp://*:{pub.port}", on_batch, on_reset,
                            replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}", context=ctx)
    sub.start()
    try:
        await asyncio.sleep(0.3)  # SUB connects
        await pub.publish([stored([3], TOKENS[8:12], parent=2)])
        await until(lambda: index.overlaps_now(OURS).get("w") and index.overlaps_now(OURS)["w"].blocks == 3)
        # A batch lost on the wire (not sent, only buffered): the next live one reveals the gap.
        await pub.publish([stored([4], TOKENS[12:16], parent=3)], send=False)
        await pub.publish([stored([5, 6], TOKENS[16:24], parent=4)])
        await until(lambda: index.overlaps_now(OURS)["w"].blocks == 6)
        assert sub.gaps == 1 and sub.replayed >= 2
        # Engine restart: seq starts again at 0 with an empty cache.
        pub.restart()
        await pub.publish([stored([7], TOKENS[:4])])
        await until(lambda: resets == ["restart"])
        await until(lambda: index.overlaps_now(OURS).get("w") is not None
                    and index.overlaps_now(OURS)["w"].blocks == 1)
    finally:
        await sub.stop()
        pub.close()
        ctx.term()


class _CountingIndex(MemoryPrefixIndex):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    async def store(self, worker_id, block_hashes, tier=Tier.DEVICE):
        self.writes += 1
        await super().store(worker_id, block_hashes, tier)

    async def remove(self, worker_id, block_hashes, tier=None):
        self.writes += 1
        await super().remove(worker_id, block_hashes, tier)


async def test_a_batch_is_applied_in_order_with_runs_merged():
    from orchestrator.config import load_config
    from orchestrator.fleet.registry import FleetRegistry
    from orchestrator.kv.tokenization import RequestTokenizer
    from orchestrator.kv.tracker import PrefixTracker

    cfg = load_config({"models": [{"name": "m", "block_size": BS}],
                       "workers": [{"id": "w", "url": "http://127.0.0.1:1", "models": ["m"]}]}, environ={})
    index = _CountingIndex()
    fleet = FleetRegistry.from_config(cfg)
    fleet.record_health(fleet.get("w"), True, 0.0)
    tracker = PrefixTracker(cfg, fleet, index, RequestTokenizer(cfg))
    tracker.mappers["w"] = KvEventMapper("w", lambda: "m")
    batch = [stored([1, 2], TOKENS[:8]), stored([3], TOKENS[8:12], parent=2), stored([4], TOKENS[12:16], parent=3),
             {"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU"},
             {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"},
             stored([3], TOKENS[8:12], parent=2), stored([5, 6], TOKENS[12:20], parent=3, medium="CPU")]
    await tracker.apply_events("w", 0.0, batch)
    # 3 stores → 1 write, 2 removes → 1, then a device store and a host store: 4 writes in all.
    assert index.writes == 4
    ov = (await index.overlaps(OURS, {"device": 1.0, "host": 0.5, "disk": 0.25}))["w"]
    assert ov.blocks == 5 and ov.weighted_blocks == 3 + 2 * 0.5  # block 3 re-stored after its removal
