"""Approximate prefix tracking for engines that publish no KV events (SGLang, vLLM without events).

The router records its own decisions: a request's blocks are assumed cached on the worker it was
sent to, for ``index.approximate_ttl_s`` seconds after the last request that used them (Dynamo and
llm-d do the same, 120 s by default). Expiry is driven by the clock passed in, so it runs unchanged
in virtual time.

With a shared (Redis) index the expiry is shared too: entries carry their expiry in Redis, any
replica that routes to them refreshes it, and any replica's expiry pass drops them — so a replica
does not remove what another still uses, and one that stops leaves nothing behind. This replica's
own record then only ages its local mirror (the fallback while Redis is unreachable).

With the in-memory index a record costs the request nothing on its way to the engine: the index
applies it with ``store_later`` and this recorder keeps its own expiry entries aside too, both applied
at the event loop's next turn (once the request has been sent) or before anything reads them — a new
8k-token prompt is ~250 new entries in two large hash tables, ~0.5 ms of a gateway's time.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

from orchestrator.kv.deferred import Deferred
from orchestrator.kv.entry_log import drop_owner, move_out_of_older
from orchestrator.kv.index import PrefixIndex, Tier

SHARED_EXPIRY_EVERY_S = 1.0  # how often a replica runs the shared expiry pass


class ApproximateRecorder:
    def __init__(self, index: PrefixIndex, ttl_s: float, max_entries: int = 1_000_000) -> None:
        self.index = index
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        # Entries: worker → block → the record that last wrote it (one C-level dict update per record, no
        # key tuples); records in expiry order: number → (when, worker, {block: number} of the blocks it
        # was the last to write), so each entry sits in exactly one record.
        self._of: dict[str, dict[int, int]] = {}
        self._records: OrderedDict[int, tuple[float, str, dict[int, int]]] = OrderedDict()
        self._entries = 0
        self._recorded = 0
        self.shared = hasattr(index, "record_approximate") and hasattr(index, "mirror")
        self._next_shared_pass = 0.0
        if self.shared:
            index.approximate_ttl_of = self.remaining  # type: ignore[attr-defined]
        self._now = 0.0
        self._pass: asyncio.Future[int] | None = None
        # Deferred records (local index only): (worker, blocks, expiry), applied by ``flush``.
        self._store_later = None if self.shared else getattr(index, "store_later", None)
        self._later = Deferred(self._remember)  # expiry entries of records not applied yet

    def __len__(self) -> int:
        if self._later.pending:
            self._later.flush()
        return self._entries

    def remaining(self, worker_id: str, block_hash: int) -> float | None:
        """Seconds left on an entry this replica recorded (None: not an approximate entry)."""
        if self._later.pending:
            self._later.flush()
        entries = self._of.get(worker_id)
        number = entries.get(block_hash) if entries is not None else None
        until = self._records[number][0] if number is not None else None
        return None if until is None else max(0.0, until - self._now)

    async def record(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        """``worker_id`` just received a request for these blocks: it will hold them for a while."""
        if not block_hashes:
            return
        self._now = now
        if self._store_later is not None:  # local index: applied at the loop's next turn or before a read
            self._store_later(worker_id, block_hashes, Tier.DEVICE)
            self._later.add(worker_id, block_hashes, now + self.ttl_s)
            return
        self._remember(worker_id, block_hashes, now + self.ttl_s)
        if self.shared:
            await self.index.record_approximate(worker_id, block_hashes, self.ttl_s)  # type: ignore[attr-defined]
        else:
            await self.index.store(worker_id, block_hashes, Tier.DEVICE)

    def flush(self) -> None:
        """Apply the deferred records' expiry entries now, in order."""
        self._later.flush()

    def _remember(self, worker_id: str, block_hashes: Sequence[int], until: float) -> None:
        self._recorded += 1
        written = dict.fromkeys(block_hashes, self._recorded)
        entries = self._of.get(worker_id)
        if entries is None:
            entries = self._of[worker_id] = {}
        records = self._records
        if not entries.keys().isdisjoint(written):  # recorded before: those entries move to this record
            move_out_of_older(entries, written, records, 2)
        before = len(entries)
        entries.update(written)
        self._entries += len(entries) - before
        records[self._recorded] = (until, worker_id, written)
        if self._entries > self.max_entries:  # the index evicts on its own; just keep this map bounded
            self._drop_oldest(self._entries - self.max_entries)

    def _drop_oldest(self, n: int) -> None:
        """Forget the ``n`` entries that expire first (their index entries stay until the index evicts them)."""
        records = self._records
        while n > 0 and records:
            number, (until, worker_id, blocks) = records.popitem(last=False)
            if len(blocks) > n:  # only part of this record goes: the rest stays the oldest
                gone = list(islice(blocks, n))
                for h in gone:
                    del blocks[h]
                records[number] = (until, worker_id, blocks)
                records.move_to_end(number, last=False)
            else:
                gone = list(blocks)
            entries = self._of[worker_id]
            for h in gone:
                del entries[h]
            self._entries -= len(gone)
            n -= len(gone)

    async def expire(self, now: float) -> int:
        """Remove entries whose TTL has passed; returns how many this replica had recorded."""
        if self._later.pending:
            self._later.flush()
        self._now = now
        records = self._records
        gone: dict[str, list[int]] = {}
        while records:
            number, (until, worker_id, blocks) = next(iter(records.items()))
            if until > now:
                break
            del records[number]
            entries = self._of[worker_id]
            for h in blocks:
                del entries[h]
            gone.setdefault(worker_id, []).extend(blocks)
            self._entries -= len(blocks)
        for worker_id, hashes in gone.items():
            if self.shared:
                self.index.mirror.remove_now(worker_id, hashes)  # type: ignore[attr-defined]
            else:
                await self.index.remove(worker_id, hashes)
        if self.shared and now >= self._next_shared_pass and (self._pass is None or self._pass.done()):
            self._next_shared_pass = now + SHARED_EXPIRY_EVERY_S
            # In the background: it is a Redis round trip, not this request's business.
            self._pass = asyncio.ensure_future(self.index.expire_approximate())  # type: ignore[attr-defined]
        return sum(len(v) for v in gone.values())

    def forget_worker(self, worker_id: str) -> None:
        if self._later.pending:
            self._later.flush()
        entries = self._of.pop(worker_id, None)
        if entries is None:
            return
        self._entries -= len(entries)
        drop_owner(entries, self._records, 2)
