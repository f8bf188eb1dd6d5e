"""In-process prefix index (the default backend).

Layout (``orchestrator/kv/masks.py``): each worker id gets a slot (a cleared worker's slot is
reused); ``block → holder mask`` (one
byte per slot holding that worker's tier mask) answers lookups with a few int operations per
block whatever the fleet size. An ordered dict of ``(slot, block)`` entries gives the LRU order
for the cap, and ``slot → blocks`` lets clearing a worker touch only its own entries.

``store_later`` is ``store_now`` applied at the event loop's next turn — for a request being routed,
once its bytes have gone to the engine — or before the index is next read or written, whichever comes
first: every call sees every store made before it, in order, exactly as with ``store_now``; only the
moment the CPU is spent moves off the request's path (the approximate recorder's writes, ~0.3 ms for
a new 8k-token prompt against a large index).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from orchestrator.kv.index import DEFAULT_TIER_WEIGHTS, PrefixIndex, Tier
from orchestrator.kv.masks import SLOT_BITS, SlotTable, WalkInputs, tier_of, walk
from orchestrator.router.types import Overlap

if TYPE_CHECKING:
    from orchestrator.telemetry.metrics import DyadMetrics


class MemoryPrefixIndex(PrefixIndex):
    backend = "memory"

    def __init__(self, max_blocks: int = 1_000_000, metrics: DyadMetrics | None = None) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self._init_capacity(max_blocks, metrics)
        self._table = SlotTable()  # worker id ↔ slot; a cleared worker's slot is reused first
        self._slots = self._table.slot_of
        self._ids = self._table.ids  # slot → worker id
        self._blocks: dict[int, int] = {}  # block hash → holder mask
        self._lru: OrderedDict[tuple[int, int], None] = OrderedDict()  # (slot, block), oldest first
        self._by_slot: dict[int, set[int]] = {}
        self._walk_inputs = WalkInputs()
        self._pending: list[tuple[str, Sequence[int], Tier]] = []  # store_later, not applied yet
        self._flush_handle: asyncio.Handle | None = None

    # --- slots
    def _slot(self, worker_id: str) -> int:
        # A slot is only freed once none of its entries remain (clear_worker).
        slot, created = self._table.assign(worker_id)
        if created:
            self._walk_inputs.slots_changed()
        return slot

    # --- writes
    async def store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE,
                    anchors: Sequence[int] | None = None) -> None:
        self.store_now(worker_id, block_hashes, tier)

    def store_later(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
        """``store_now`` at the loop's next turn, or before the next read or write of this index
        (``block_hashes`` is kept, not copied: do not change it afterwards)."""
        self._pending.append((worker_id, block_hashes, tier))
        if self._flush_handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): now
                self.flush()
                return
            self._flush_handle = loop.call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._flush_handle = None
        self.flush()

    def flush(self) -> None:
        """Apply every pending ``store_later`` now, in order."""
        while self._pending:
            pending, self._pending = self._pending, []
            for worker_id, block_hashes, tier in pending:
                self._store(worker_id, block_hashes, tier)

    def store_now(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
        """Synchronous ``store`` (the virtual-time simulator and the Redis fallback use it)."""
        if self._pending:
            self.flush()
        self._store(worker_id, block_hashes, tier)

    def _store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier) -> None:
        slot = self._slot(worker_id)
        bits = int(tier) << (SLOT_BITS * slot)
        mine = self._by_slot.setdefault(slot, set())
        blocks, lru = self._blocks, self._lru
        for h in block_hashes:
            blocks[h] = blocks.get(h, 0) | bits
            key = (slot, h)
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                mine.add(h)
        self._evict()
        self._gauge()

    async def remove(self, worker_id: str, block_hashes: Sequence[int], tier: Tier | None = None) -> None:
        self.remove_now(worker_id, block_hashes, tier)

    def remove_now(self, worker_id: str, block_hashes: Sequence[int], tier: Tier | None = None) -> None:
        if self._pending:
            self.flush()
        slot = self._slots.get(worker_id)
        if slot is None:
            return
        shift = SLOT_BITS * slot
        clear = ~((0xFF if tier is None else int(tier)) << shift)
        blocks = self._blocks
        for h in block_hashes:
            mask = blocks.get(h)
            if mask is None or not (mask >> shift) & 0xFF:
                continue
            mask &= clear
            if (mask >> shift) & 0xFF:
                blocks[h] = mask
            else:
                self._drop(slot, h, mask)
        self._gauge()

    async def clear_worker(self, worker_id: str) -> None:
        self.clear_worker_now(worker_id)

    def clear_worker_now(self, worker_id: str) -> None:
        if self._pending:
            self.flush()
        slot = self._slots.get(worker_id)
        if slot is None:
            return
        keep = ~(0xFF << (SLOT_BITS * slot))
        for h in list(self._by_slot.get(slot, ())):
            mask = self._blocks.get(h)
            if mask is not None:
                self._drop(slot, h, mask & keep)
        self._by_slot.pop(slot, None)
        self._table.free(worker_id)
        self._walk_inputs.slots_changed()
        self._gauge()

    def _drop(self, slot: int, h: int, remaining: int) -> None:
        """Worker ``slot`` no longer holds ``h``; ``remaining`` is the block's mask without it."""
        if remaining:
            self._blocks[h] = remaining
        else:
            self._blocks.pop(h, None)
        self._lru.pop((slot, h), None)
        mine = self._by_slot.get(slot)
        if mine is not None:
            mine.discard(h)

    def _evict(self) -> None:
        over = len(self._lru) - self.max_blocks
        if over <= 0:
            return
        # ``_drop`` inlined: this loop runs for every entry past the cap (a method call per entry
        # costs ~6% of an eviction-heavy store)
        blocks, by_slot, lru = self._blocks, self._by_slot, self._lru
        for _ in range(over):
            (slot, h), _v = lru.popitem(last=False)
            mask = blocks.get(h)
            if mask is not None:
                mask &= ~(0xFF << (SLOT_BITS * slot))
                if mask:
                    blocks[h] = mask
                else:
                    del blocks[h]
            mine = by_slot.get(slot)
            if mine is not None:
                mine.discard(h)
        self._count_evictions(over)

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.index_blocks.labels(self.backend).set(len(self._lru))

    # --- reads
    async def overlaps(
        self,
        block_hashes: Sequence[int],
        tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
        workers: Sequence[str] | None = None,
    ) -> dict[str, Overlap]:
        return self.overlaps_now(block_hashes, tier_weights, workers)

    def overlaps_now(
        self,
        block_hashes: Sequence[int],
        tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
        workers: Sequence[str] | None = None,
    ) -> dict[str, Overlap]:
        """Walk the request's blocks AND-ing holder masks (``masks.walk``)."""
        if self._pending:
            self.flush()
        if not block_hashes:
            return {}
        candidates = self._walk_inputs.candidates(workers, self._slots)
        if not candidates:
            return {}
        get = self._blocks.get
        found = walk(map(get, block_hashes), candidates, self._walk_inputs.credit(tier_weights))
        ids = self._ids
        return {ids[s]: Overlap(blocks=n, weighted_blocks=wb) for s, (n, wb) in found.items()}

    async def size(self) -> int:
        return self.size_now()

    def size_now(self) -> int:
        if self._pending:
            self.flush()
        return len(self._lru)

    async def worker_blocks(self, worker_id: str) -> int:
        if self._pending:
            self.flush()
        slot = self._slots.get(worker_id)
        return 0 if slot is None else len(self._by_slot.get(slot, ()))

    def entries(self) -> Iterator[tuple[str, int, int]]:
        """Every ``(worker id, block hash, tier mask)``, least recently stored first (Redis resync)."""
        if self._pending:
            self.flush()
        ids, blocks = self._ids, self._blocks
        for slot, h in list(self._lru):
            mask = tier_of(blocks.get(h, 0), slot)
            if mask:
                yield ids[slot], h, mask
