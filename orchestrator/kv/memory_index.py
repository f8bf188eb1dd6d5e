"""In-process prefix index (the default backend).

Layout (``orchestrator/kv/masks.py``): each worker id gets a slot (a cleared worker's slot is
reused); ``block → holder mask`` (one
byte per slot holding that worker's tier mask) answers lookups with a few int operations per
block whatever the fleet size. ``slot → {block: store number}`` holds each worker's entries (so
clearing a worker touches only its own), and the log of stores (store number → the blocks it wrote
that no later store rewrote), oldest first, gives the LRU order for the cap: an entry belongs to the
last store that wrote it, so the log holds each entry exactly once. A store of a new 8k-token prompt
is then a few C-level dict operations and one log entry, with no ``(slot, block)`` key objects.

``store_later`` is ``store_now`` applied at the event loop's next turn — for a request being routed,
once its bytes have gone to the engine — or before the index is next read or written, whichever comes
first: every call sees every store made before it, in order, exactly as with ``store_now``; only the
moment the CPU is spent moves off the request's path (the approximate recorder's writes, ~0.3 ms for
a new 8k-token prompt against a large index).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from orchestrator.kv.deferred import Deferred
from orchestrator.kv.entry_log import drop_owner, move_out_of_older
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
        self._held: dict[int, dict[int, int]] = {}  # slot → block → number of the store that last wrote it
        # store number → (slot, {block: store number} of the blocks it was the last to write), oldest first
        self._log: OrderedDict[int, tuple[int, dict[int, int]]] = OrderedDict()
        self._count = 0  # entries: (slot, block) pairs
        self._stores = 0
        self._walk_inputs = WalkInputs()
        self._later = Deferred(self._store)  # store_later calls, not applied yet

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
        self._later.add(worker_id, block_hashes, tier)

    def flush(self) -> None:
        """Apply every pending ``store_later`` now, in order."""
        self._later.flush()

    def store_now(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
        """Synchronous ``store`` (the virtual-time simulator and the Redis fallback use it)."""
        if self._later.pending:
            self._later.flush()
        self._store(worker_id, block_hashes, tier)

    def _store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier) -> None:
        slot = self._slot(worker_id)
        if not block_hashes:
            self._gauge()
            return
        bits = int(tier) << (SLOT_BITS * slot)
        self._stores += 1
        written = dict.fromkeys(block_hashes, self._stores)
        blocks = self._blocks
        new = blocks.keys().isdisjoint(written)
        if new:  # held by no one (a new prompt): one C-level update
            blocks.update(dict.fromkeys(written, bits))
        else:
            get = blocks.get
            for h in written:
                blocks[h] = get(h, 0) | bits
        held = self._held.get(slot)
        if held is None:
            held = self._held[slot] = {}
        log = self._log
        # (a worker's entries all have a mask in ``_blocks``: when none of these had one, none is held here)
        if not new and not held.keys().isdisjoint(written):  # stored before: those entries move to this store
            move_out_of_older(held, written, log, 1)
        before = len(held)
        held.update(written)
        self._count += len(held) - before
        log[self._stores] = (slot, written)
        self._evict()
        self._gauge()

    async def remove(self, worker_id: str, block_hashes: Sequence[int], tier: Tier | None = None) -> None:
        self.remove_now(worker_id, block_hashes, tier)

    def remove_now(self, worker_id: str, block_hashes: Sequence[int], tier: Tier | None = None) -> None:
        if self._later.pending:
            self._later.flush()
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
        if self._later.pending:
            self._later.flush()
        slot = self._slots.get(worker_id)
        if slot is None:
            return
        held = self._held.pop(slot, None) or {}
        _clear_slot(self._blocks, held, slot)
        drop_owner(held, self._log, 1)
        self._count -= len(held)
        self._table.free(worker_id)
        self._walk_inputs.slots_changed()
        self._gauge()

    def _drop(self, slot: int, h: int, remaining: int) -> None:
        """Worker ``slot`` no longer holds ``h``; ``remaining`` is the block's mask without it."""
        if remaining:
            self._blocks[h] = remaining
        else:
            self._blocks.pop(h, None)
        held = self._held.get(slot)
        number = held.pop(h, None) if held is not None else None
        if number is None:
            return
        self._count -= 1
        entry = self._log.get(number)
        if entry is not None:
            record = entry[1]
            record.pop(h, None)
            if not record:
                del self._log[number]

    def _evict(self) -> None:
        over = self._count - self.max_blocks
        if over <= 0:
            return
        # Oldest store first, in its order (not through ``_drop``: this runs for every entry past the cap).
        blocks, held_by_slot, log = self._blocks, self._held, self._log
        evicted = 0
        while evicted < over and log:
            number, (slot, record) = log.popitem(last=False)
            left = over - evicted
            if len(record) > left:  # only part of this store goes: the rest stays the oldest
                victims: Iterable[int] = list(islice(record, left))
                for h in victims:
                    del record[h]
                log[number] = (slot, record)
                log.move_to_end(number, last=False)
                evicted += left
            else:
                victims = record
                evicted += len(record)
            held = held_by_slot[slot]
            for h in victims:
                del held[h]
            _clear_slot(blocks, victims, slot)
        self._count -= evicted
        self._count_evictions(evicted)

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.index_blocks.labels(self.backend).set(self._count)

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
        if self._later.pending:
            self._later.flush()
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
        if self._later.pending:
            self._later.flush()
        return self._count

    async def worker_blocks(self, worker_id: str) -> int:
        if self._later.pending:
            self._later.flush()
        slot = self._slots.get(worker_id)
        return 0 if slot is None else len(self._held.get(slot, ()))

    def entries(self) -> Iterator[tuple[str, int, int]]:
        """Every ``(worker id, block hash, tier mask)``, least recently stored first (Redis resync)."""
        if self._later.pending:
            self._later.flush()
        ids, blocks = self._ids, self._blocks
        for slot, record in [(slot, list(record)) for slot, record in self._log.values()]:
            for h in record:
                mask = tier_of(blocks.get(h, 0), slot)
                if mask:
                    yield ids[slot], h, mask


def _clear_slot(blocks: dict[int, int], hashes: Iterable[int], slot: int) -> None:
    """Clear worker ``slot``'s bits in each of ``hashes``' masks; a block no worker holds any more goes."""
    keep = ~(0xFF << (SLOT_BITS * slot))
    for h in hashes:
        mask = blocks.get(h)
        if mask is not None:
            mask &= keep
            if mask:
                blocks[h] = mask
            else:
                del blocks[h]
