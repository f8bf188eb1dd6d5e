"""In-process prefix index (the default backend).

Layout: ``block → {worker: tier mask}`` for lookups, an ordered dict of ``(worker, block)`` entries
for LRU eviction, and ``worker → blocks`` so clearing a worker costs only its own entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from orchestrator.kv.index import DEFAULT_TIER_WEIGHTS, PrefixIndex, Tier, best_tier_weight
from orchestrator.router.types import Overlap

if TYPE_CHECKING:
    from orchestrator.telemetry.metrics import DyadMetrics


class MemoryPrefixIndex(PrefixIndex):
    backend = "memory"

    def __init__(self, max_blocks: int = 1_000_000, metrics: DyadMetrics | None = None) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._metrics = metrics
        self._blocks: dict[int, dict[str, int]] = {}
        self._lru: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._by_worker: dict[str, set[int]] = {}
        self._offloaded: dict[int, int] = {}  # block → holders without the device tier
        self.evictions = 0

    # --- writes
    async def store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
        self.store_now(worker_id, block_hashes, tier)

    def store_now(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
        """Synchronous ``store`` (the virtual-time simulator and the Redis fallback use it)."""
        mine = self._by_worker.setdefault(worker_id, set())
        lru = self._lru
        for h in block_hashes:
            holders = self._blocks.get(h)
            if holders is None:
                holders = self._blocks[h] = {}
            old = holders.get(worker_id, 0)
            self._set_mask(h, holders, worker_id, old, old | int(tier))
            key = (worker_id, h)
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
        for h in block_hashes:
            holders = self._blocks.get(h)
            if holders is None or worker_id not in holders:
                continue
            old = holders[worker_id]
            mask = 0 if tier is None else old & ~int(tier)
            if mask:
                self._set_mask(h, holders, worker_id, old, mask)
            else:
                self._drop(worker_id, h, holders)
        self._gauge()

    async def clear_worker(self, worker_id: str) -> None:
        self.clear_worker_now(worker_id)

    def clear_worker_now(self, worker_id: str) -> None:
        for h in list(self._by_worker.get(worker_id, ())):
            holders = self._blocks.get(h)
            if holders is not None:
                self._drop(worker_id, h, holders)
        self._by_worker.pop(worker_id, None)
        self._gauge()

    def _set_mask(self, h: int, holders: dict[str, int], worker_id: str, old: int, new: int) -> None:
        holders[worker_id] = new
        was_off = bool(old) and not old & Tier.DEVICE
        is_off = not new & Tier.DEVICE
        if was_off != is_off:
            self._count_offloaded(h, 1 if is_off else -1)

    def _count_offloaded(self, h: int, delta: int) -> None:
        n = self._offloaded.get(h, 0) + delta
        if n > 0:
            self._offloaded[h] = n
        else:
            self._offloaded.pop(h, None)

    def _drop(self, worker_id: str, h: int, holders: dict[str, int]) -> None:
        old = holders.pop(worker_id, None)
        if old is not None and not old & Tier.DEVICE:
            self._count_offloaded(h, -1)
        if not holders:
            del self._blocks[h]
        self._lru.pop((worker_id, h), None)
        mine = self._by_worker.get(worker_id)
        if mine is not None:
            mine.discard(h)

    def _evict(self) -> None:
        over = len(self._lru) - self.max_blocks
        if over <= 0:
            return
        for _ in range(over):
            (worker_id, h), _v = self._lru.popitem(last=False)
            holders = self._blocks.get(h)
            if holders is not None:
                old = holders.pop(worker_id, None)
                if old is not None and not old & Tier.DEVICE:
                    self._count_offloaded(h, -1)
                if not holders:
                    del self._blocks[h]
            mine = self._by_worker.get(worker_id)
            if mine is not None:
                mine.discard(h)
        self.evictions += over
        if self._metrics is not None:
            self._metrics.index_evictions.labels(self.backend).inc(over)

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
        """Walk the request's blocks while some worker still holds every block so far.

        The per-block test "do all still-matching workers hold this block" is a set comparison done
        in C; per-worker tier credit is only computed for blocks that some worker holds outside
        the device tier (counted in ``_offloaded``), so the common all-device walk stays cheap.
        """
        if not block_hashes:
            return {}
        blocks = self._blocks
        first = blocks.get(block_hashes[0])
        if not first:
            return {}
        active = set(first) if workers is None else set(first).intersection(workers)
        if not active:
            return {}
        credit = {m: best_tier_weight(m, tier_weights) for m in range(1, 8)}
        wd = credit[int(Tier.DEVICE)]
        device_is_best = all(wd >= c for c in credit.values())
        offloaded = self._offloaded
        depth: dict[str, int] = {}
        deficit: dict[str, float] = dict.fromkeys(active, 0.0)
        walked = 0
        for h in block_hashes:
            holders = blocks.get(h)
            if not holders:
                break
            keys = holders.keys()
            if not active <= keys:
                still = active.intersection(keys)
                for w in active - still:
                    depth[w] = walked
                active = still
                if not active:
                    break
            if not device_is_best or offloaded.get(h):
                for w in active:
                    deficit[w] += wd - credit[holders[w]]
            walked += 1
        for w in active:
            depth[w] = walked
        return {w: Overlap(blocks=n, weighted_blocks=n * wd - deficit[w]) for w, n in depth.items() if n > 0}

    async def size(self) -> int:
        return len(self._lru)

    async def worker_blocks(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))
