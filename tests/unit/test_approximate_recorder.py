"""The approximate recorder and the in-memory index's deferred writes (``store_later``).

Both move work off the request's path (applied at the loop's next turn) without changing what any
reader sees: every read, write or expiry first applies what is pending, in order. The recorder's
expiry is checked against a plain reference model (one ordered map of (worker, block) → expiry,
what it kept before) on random operation sequences.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict

from orchestrator.kv.approximate import ApproximateRecorder
from orchestrator.kv.index import Tier
from orchestrator.kv.memory_index import MemoryPrefixIndex


class ReferenceRecorder:
    """(worker, block) → expiry in expiry order: the semantics the recorder must keep."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.expiry: OrderedDict[tuple[str, int], float] = OrderedDict()

    def record(self, worker: str, hashes: list[int], now: float) -> None:
        for h in hashes:
            self.expiry.pop((worker, h), None)
            self.expiry[(worker, h)] = now + self.ttl_s

    def expire(self, now: float) -> set[tuple[str, int]]:
        gone = set()
        while self.expiry:
            key, until = next(iter(self.expiry.items()))
            if until > now:
                break
            self.expiry.popitem(last=False)
            gone.add(key)
        return gone

    def forget(self, worker: str) -> None:
        for key in [k for k in self.expiry if k[0] == worker]:
            del self.expiry[key]


async def _blocks(index: MemoryPrefixIndex, worker: str) -> int:
    return await index.worker_blocks(worker)


def test_a_record_is_visible_to_the_next_read_without_a_loop_turn():
    async def main() -> None:
        index = MemoryPrefixIndex()
        rec = ApproximateRecorder(index, ttl_s=10.0)
        await rec.record("w0", [1, 2, 3], 0.0)
        # nothing has yielded to the loop: the writes are pending, and every read applies them first
        assert index._later.pending and rec._later.pending
        assert (await index.overlaps([1, 2, 3, 4]))["w0"].blocks == 3
        assert rec.remaining("w0", 2) == 10.0
        assert len(rec) == 3
    asyncio.run(main())


def test_pending_writes_are_applied_at_the_next_loop_turn():
    async def main() -> None:
        index = MemoryPrefixIndex()
        rec = ApproximateRecorder(index, ttl_s=10.0)
        await rec.record("w0", [7, 8], 0.0)
        await asyncio.sleep(0)
        assert not index._later.pending and not rec._later.pending
        assert index.size_now() == 2 and rec._entries == 2
    asyncio.run(main())


def test_pending_stores_keep_their_order_with_later_writes():
    async def main() -> None:
        index = MemoryPrefixIndex(max_blocks=3)
        index.store_later("w0", [1, 2, 3])
        index.store_now("w0", [4])  # applies [1, 2, 3] first: 1 is the oldest, evicted by the cap
        assert await index.size() == 3
        assert (await index.overlaps([1])) == {}
        assert (await index.overlaps([2, 3]))["w0"].blocks == 2
        index.store_later("w1", [9])
        index.remove_now("w1", [9])  # the pending store is applied before the removal, not after it
        assert await index.worker_blocks("w1") == 0
        index.store_later("w1", [9])
        await index.clear_worker("w1")
        assert await index.worker_blocks("w1") == 0 and not index._later.pending
    asyncio.run(main())


def test_store_later_without_a_loop_stores_at_once():
    index = MemoryPrefixIndex()
    index.store_later("w0", [1, 2], Tier.HOST)
    assert not index._later.pending and index.size_now() == 2


def test_expiry_keeps_blocks_recorded_again_and_removes_them_from_the_index():
    async def main() -> None:
        index = MemoryPrefixIndex()
        rec = ApproximateRecorder(index, ttl_s=10.0)
        await rec.record("w0", [1, 2, 3, 4], 0.0)
        await rec.record("w0", [1, 2], 5.0)  # a later request for the first two blocks
        assert await rec.expire(9.0) == 0
        assert await rec.expire(11.0) == 2  # 3 and 4; 1 and 2 live until 15
        assert (await index.overlaps([1, 2, 3]))["w0"].blocks == 2
        assert await rec.expire(15.0) == 2
        assert await index.worker_blocks("w0") == 0 and len(rec) == 0
        assert not rec._records and not any(rec._of.values())
    asyncio.run(main())


def test_the_expiry_map_is_bounded_and_holds_each_entry_once():
    async def main() -> None:
        index = MemoryPrefixIndex()
        rec = ApproximateRecorder(index, ttl_s=1e9, max_entries=100)
        for i in range(50):
            await rec.record("w0", list(range(i * 10, i * 10 + 10)), float(i))
        assert len(rec) == 100  # the oldest dropped from the map (the index bounds itself)
        assert rec.remaining("w0", 0) is None and rec.remaining("w0", 499) is not None
        # the same blocks recorded over and over: each entry moves to its latest record, none piles up
        for i in range(20_000):
            await rec.record("w0", [1, 2, 3, 4, 5], 100.0 + i)
        assert len(rec) <= 100 and len(rec._records) <= len(rec)
        assert sum(len(blocks) for _u, _w, blocks in rec._records.values()) == len(rec)
    asyncio.run(main())


def test_forget_worker_drops_its_entries_and_later_records_start_fresh():
    async def main() -> None:
        index = MemoryPrefixIndex()
        rec = ApproximateRecorder(index, ttl_s=10.0)
        await rec.record("w0", [1, 2], 0.0)
        await rec.record("w1", [1, 2], 0.0)
        rec.forget_worker("w0")
        assert len(rec) == 2 and rec.remaining("w0", 1) is None
        await rec.record("w0", [1], 5.0)
        assert await rec.expire(10.0) == 2  # w1's; w0's new entry lives until 15
        assert rec.remaining("w0", 1) == 5.0
    asyncio.run(main())


def test_expiry_matches_the_reference_model_on_random_sequences():
    async def main() -> None:
        rng = random.Random(7)
        for _trial in range(30):
            index = MemoryPrefixIndex()
            rec = ApproximateRecorder(index, ttl_s=rng.choice([1.0, 3.0, 10.0]))
            ref = ReferenceRecorder(rec.ttl_s)
            now = 0.0
            for _step in range(200):
                now += rng.choice([0.0, 0.1, 0.5, 1.0])
                op = rng.random()
                worker = rng.choice(["a", "b", "c"])
                if op < 0.6:
                    start = rng.randrange(0, 40)
                    hashes = list(range(start, start + rng.randrange(1, 12)))
                    await rec.record(worker, hashes, now)
                    ref.record(worker, hashes, now)
                    if rng.random() < 0.5:
                        await asyncio.sleep(0)  # sometimes applied at the loop's turn, sometimes by the next read
                elif op < 0.95:
                    before = {(w, h) for w, d in rec._of.items() for h in d} if not rec._later.pending else None
                    n = await rec.expire(now)
                    gone = ref.expire(now)
                    assert n == len(gone)
                    if before is not None:
                        after = {(w, h) for w, d in rec._of.items() for h in d}
                        assert before - after == gone
                else:
                    rec.forget_worker(worker)
                    ref.forget(worker)
                assert len(rec) == len(ref.expiry)
                for (w, h), until in ref.expiry.items():
                    assert rec._records[rec._of[w][h]][0] == until
                # each entry in exactly one record, in expiry order as the reference keeps it
                assert sum(len(blocks) for _u, _w, blocks in rec._records.values()) == len(ref.expiry)
                order = [(w, h) for _u, w, blocks in rec._records.values() for h in blocks]
                assert order == list(ref.expiry)
            # the index holds exactly what has not expired (nothing else writes it here)
            for w in ("a", "b", "c"):
                held = {h for (ww, h) in ref.expiry if ww == w}
                if w not in {k[0] for k in ref.expiry}:
                    continue
                assert await index.worker_blocks(w) >= len(held)
    asyncio.run(main())
