"""Per-block holder masks: which workers hold a block, in which tiers, as one integer.

Every worker gets a small integer *slot*. A block's holders are one int with **one byte per
slot**: byte ``s`` is worker ``s``'s tier mask (1 device, 2 host, 4 disk; 0 = not held). It is
the same layout in memory and in Redis (a string whose byte ``s`` is that mask, read back with
``int.from_bytes(raw, "little")``), so both backends share ``walk`` below.

Why: the overlap question is answered by walking the request's blocks and AND-ing masks, which
costs a few big-int operations per block whatever the fleet size, plus a little work per worker
whose match ends (each worker drops out at most once).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

from orchestrator.kv.index import Tier, best_tier_weight

SLOT_BITS = 8  # one byte per worker
TIER_BITS = 0b111


def slot_bit(slot: int) -> int:
    """The lowest bit of ``slot``'s byte: the worker's bit in an "any tier" mask."""
    return 1 << (SLOT_BITS * slot)


def tier_of(mask: int, slot: int) -> int:
    """Worker ``slot``'s tier mask inside a block's holder mask."""
    return (mask >> (SLOT_BITS * slot)) & 0xFF


def slots_of(bits: int) -> Iterable[int]:
    """The slots whose lowest bit is set in an "any tier" mask."""
    while bits:
        low = bits & -bits
        yield (low.bit_length() - 1) // SLOT_BITS
        bits ^= low


class SlotTable:
    """Worker id ↔ slot. A freed slot is reused first (lowest first), so masks stay narrow however
    many workers come and go (autoscaling)."""

    def __init__(self) -> None:
        self.slot_of: dict[str, int] = {}
        self.ids: list[str] = []  # slot → worker id (stale for free slots)
        self._free: list[int] = []  # min-heap

    def assign(self, worker_id: str) -> tuple[int, bool]:
        """The worker's slot, and whether it was assigned just now."""
        slot = self.slot_of.get(worker_id)
        if slot is not None:
            return slot, False
        if self._free:
            slot = heapq.heappop(self._free)
            self.ids[slot] = worker_id
        else:
            slot = len(self.ids)
            self.ids.append(worker_id)
        self.slot_of[worker_id] = slot
        return slot, True

    def free(self, worker_id: str) -> None:
        """The worker holds nothing any more: its slot may go to another."""
        slot = self.slot_of.pop(worker_id, None)
        if slot is not None:
            heapq.heappush(self._free, slot)


class TierCredit:
    """Per-tier-mask credit for one set of tier weights (precomputed; cheap to reuse)."""

    def __init__(self, weights: Mapping[str, float]) -> None:
        self.by_mask = [best_tier_weight(m, weights) for m in range(8)]
        self.device = self.by_mask[int(Tier.DEVICE)]
        # True when holding a block in the device tier is always credited in full (the default):
        # then only holders without the device bit need per-worker work.
        self.device_is_best = all(self.device >= c for c in self.by_mask)


def walk(masks: Iterable[int | None], candidates: int, credit: TierCredit) -> dict[int, tuple[int, float]]:
    """Longest consecutive prefix per slot: ``{slot: (blocks, weighted blocks)}`` (0-length omitted).

    ``masks`` are the request's blocks' holder masks in order (None or 0 = no holder; the walk
    stops there); ``candidates`` has ``slot_bit(s)`` set for each slot to consider.
    """
    active = candidates
    depth: dict[int, int] = {}
    deficit: dict[int, float] = {}
    wd = credit.device
    by_mask = credit.by_mask
    every_active = not credit.device_is_best
    walked = 0
    for mask in masks:
        if not mask:
            break
        still = (mask | (mask >> 1) | (mask >> 2)) & active
        if still != active:
            if walked:
                for s in slots_of(active & ~still):
                    depth[s] = walked
            active = still
            if not active:
                break
        # Holders of this block without its device copy (or everyone, for unusual weights).
        partial = active if every_active else active & ~mask
        if partial:
            for s in slots_of(partial):
                deficit[s] = deficit.get(s, 0.0) + wd - by_mask[(mask >> (SLOT_BITS * s)) & TIER_BITS]
        walked += 1
    if walked:
        for s in slots_of(active):
            depth[s] = walked
    return {s: (n, n * wd - deficit.get(s, 0.0)) for s, n in depth.items()}


class WalkInputs:
    """Memoized inputs of ``walk`` for one slot table: candidate masks and tier credits.

    Both backends route the same few candidate sets and tier weights over and over, so the
    "worker ids → slot mask" and "weights → ``TierCredit``" conversions are cached here (bounded;
    a full cache is simply dropped). Call ``slots_changed`` whenever the slot table changes.
    """

    MAX_CANDIDATE_MASKS = 256  # cached "candidate set → slot mask" entries
    MAX_CREDITS = 64  # cached "tier weights → TierCredit" entries

    def __init__(self) -> None:
        self._candidate_masks: dict[tuple[str, ...], int] = {}
        self._credits: dict[tuple[tuple[str, float], ...], TierCredit] = {}

    def slots_changed(self) -> None:
        self._candidate_masks.clear()

    def candidates(self, workers: Sequence[str] | None, slot_of: Mapping[str, int]) -> int:
        """``slot_bit`` of every candidate's slot (every slot in ``slot_of`` when ``workers`` is None)."""
        if workers is None:
            return sum(slot_bit(s) for s in slot_of.values())
        key = tuple(workers)
        mask = self._candidate_masks.get(key)
        if mask is None:
            mask = 0
            for w in workers:
                s = slot_of.get(w)
                if s is not None:
                    mask |= slot_bit(s)
            if len(self._candidate_masks) >= self.MAX_CANDIDATE_MASKS:
                self._candidate_masks.clear()
            self._candidate_masks[key] = mask
        return mask

    def credit(self, weights: Mapping[str, float]) -> TierCredit:
        key = tuple(sorted(weights.items()))
        credit = self._credits.get(key)
        if credit is None:
            if len(self._credits) > self.MAX_CREDITS:
                self._credits.clear()
            credit = self._credits[key] = TierCredit(weights)
        return credit
