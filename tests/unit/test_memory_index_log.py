"""The in-memory index's store log (LRU order for the cap) against a plain reference model.

The reference keeps what the index kept before the log: one ordered map of (worker, block) entries,
oldest first, a store moving an entry to the end; the cap evicts from the front. Random sequences
of stores (several tiers), removals, worker clears and evictions must leave the same entries, in the
same order, with the same tier masks, and the log must hold each entry exactly once.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from orchestrator.kv.index import Tier
from orchestrator.kv.memory_index import MemoryPrefixIndex


class Reference:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.entries: OrderedDict[tuple[str, int], int] = OrderedDict()  # (worker, block) → tier mask
        self.evictions = 0

    def store(self, worker: str, hashes: list[int], tier: Tier) -> None:
        for h in hashes:
            mask = self.entries.pop((worker, h), 0)
            self.entries[(worker, h)] = mask | int(tier)
        while len(self.entries) > self.cap:
            self.entries.popitem(last=False)
            self.evictions += 1

    def remove(self, worker: str, hashes: list[int], tier: Tier | None) -> None:
        for h in hashes:
            mask = self.entries.get((worker, h))
            if mask is None:
                continue
            mask &= ~(0xFF if tier is None else int(tier))
            if mask:
                self.entries[(worker, h)] = mask
            else:
                del self.entries[(worker, h)]

    def clear(self, worker: str) -> None:
        for key in [k for k in self.entries if k[0] == worker]:
            del self.entries[key]


def test_the_store_log_keeps_lru_order_tiers_and_bounds():
    rng = random.Random(3)
    for _trial in range(40):
        cap = rng.choice([5, 20, 60])
        index = MemoryPrefixIndex(max_blocks=cap)
        ref = Reference(cap)
        for _step in range(300):
            worker = rng.choice(["a", "b", "c", "d"])
            op = rng.random()
            start = rng.randrange(0, 50)
            hashes = list(range(start, start + rng.randrange(0, 15)))
            if op < 0.6:
                tier = rng.choice([Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK])
                if rng.random() < 0.5:
                    index.store_now(worker, hashes, tier)
                else:
                    index.store_later(worker, hashes, tier)  # (no loop: applied at once)
                ref.store(worker, hashes, tier)
            elif op < 0.9:
                tier = rng.choice([None, Tier.DEVICE, Tier.HOST])
                index.remove_now(worker, hashes, tier)
                ref.remove(worker, hashes, tier)
            else:
                index.clear_worker_now(worker)
                ref.clear(worker)
            assert index.size_now() == len(ref.entries)
            assert [(w, h, m) for w, h, m in index.entries()] == [(w, h, m) for (w, h), m in ref.entries.items()]
            # the log holds each entry exactly once, and no empty store
            assert sum(len(record) for _slot, record in index._log.values()) == index._count
            assert all(record for _slot, record in index._log.values())
        assert index.evictions == ref.evictions
        for w in ("a", "b", "c", "d"):
            held = [h for (ww, h) in ref.entries if ww == w]
            slot = index._slots.get(w)
            assert (len(index._held.get(slot, ())) if slot is not None else 0) == len(held)
            for h in held:
                assert (index._blocks[h] >> (8 * slot)) & 0xFF == ref.entries[(w, h)]
        # every mask bit belongs to an entry
        live = {(index._ids[s], h) for s, held in index._held.items() for h in held}
        assert live == set(ref.entries)
