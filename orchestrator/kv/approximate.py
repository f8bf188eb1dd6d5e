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
from collections import deque
from collections.abc import Sequence

from orchestrator.kv.index import PrefixIndex, Tier

SHARED_EXPIRY_EVERY_S = 1.0  # how often a replica runs the shared expiry pass
COMPACT_SLACK = 65_536  # batches may hold this many outdated block references (beyond 2x the entries) before a compaction


class ApproximateRecorder:
    def __init__(self, index: PrefixIndex, ttl_s: float, max_entries: int = 1_000_000) -> None:
        self.index = index
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        # Expiry per entry: worker → block → when (one C-level dict update per record, no key tuples), and the
        # records in expiry order: (when, worker, blocks). A block recorded again later stays in its older
        # record too; that reference is skipped (its entry expires later) and dropped by ``_compact``.
        self._until: dict[str, dict[int, float]] = {}
        self._records: deque[tuple[float, str, Sequence[int]]] = deque()
        self._entries = 0
        self._referenced = 0  # block references held by _records (>= _entries)
        self.shared = hasattr(index, "record_approximate") and hasattr(index, "mirror")
        self._next_shared_pass = 0.0
        if self.shared:
            index.approximate_ttl_of = self.remaining  # type: ignore[attr-defined]
        self._now = 0.0
        self._pass: asyncio.Future[int] | None = None
        # Deferred records (local index only): (worker, blocks, expiry), applied by ``flush``.
        self._store_later = None if self.shared else getattr(index, "store_later", None)
        self._pending: list[tuple[str, Sequence[int], float]] = []
        self._flush_handle: asyncio.Handle | None = None

    def __len__(self) -> int:
        if self._pending:
            self.flush()
        return self._entries

    def remaining(self, worker_id: str, block_hash: int) -> float | None:
        """Seconds left on an entry this replica recorded (None: not an approximate entry)."""
        if self._pending:
            self.flush()
        entries = self._until.get(worker_id)
        until = entries.get(block_hash) if entries is not None else None
        return None if until is None else max(0.0, until - self._now)

    async def record(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        """``worker_id`` just received a request for these blocks: it will hold them for a while."""
        if not block_hashes:
            return
        self._now = now
        if self._store_later is not None:  # local index: applied at the loop's next turn or before a read
            self._store_later(worker_id, block_hashes, Tier.DEVICE)
            self._pending.append((worker_id, block_hashes, now + self.ttl_s))
            if self._flush_handle is None:
                self._flush_handle = asyncio.get_running_loop().call_soon(self._flush_soon)
            return
        self._remember(worker_id, block_hashes, now + self.ttl_s)
        if self.shared:
            await self.index.record_approximate(worker_id, block_hashes, self.ttl_s)  # type: ignore[attr-defined]
        else:
            await self.index.store(worker_id, block_hashes, Tier.DEVICE)

    def _flush_soon(self) -> None:
        self._flush_handle = None
        self.flush()

    def flush(self) -> None:
        """Apply the deferred records' expiry entries now, in order."""
        while self._pending:
            pending, self._pending = self._pending, []
            for worker_id, block_hashes, until in pending:
                self._remember(worker_id, block_hashes, until)

    def _remember(self, worker_id: str, block_hashes: Sequence[int], until: float) -> None:
        entries = self._until.get(worker_id)
        if entries is None:
            entries = self._until[worker_id] = {}
        before = len(entries)
        entries.update(dict.fromkeys(block_hashes, until))
        self._entries += len(entries) - before
        self._records.append((until, worker_id, block_hashes))
        self._referenced += len(block_hashes)
        if self._entries > self.max_entries:  # the index evicts on its own; just keep this map bounded
            self._drop_oldest(self._entries - self.max_entries)
        elif self._referenced > 2 * self._entries + COMPACT_SLACK:
            self._compact()

    def _drop_oldest(self, n: int) -> None:
        """Forget the ``n`` entries that expire first (their index entries stay until the index evicts them)."""
        records = self._records
        while n > 0 and records:
            until, worker_id, hashes = records.popleft()
            self._referenced -= len(hashes)
            entries = self._until.get(worker_id)
            if entries is None:
                continue
            for i, h in enumerate(hashes):
                if n == 0:
                    rest = hashes[i:]
                    records.appendleft((until, worker_id, rest))
                    self._referenced += len(rest)
                    break
                if entries.get(h) == until:
                    del entries[h]
                    self._entries -= 1
                    n -= 1

    def _compact(self) -> None:
        """Drop the references to blocks recorded again since (bounds ``_records`` by the entries)."""
        kept: deque[tuple[float, str, Sequence[int]]] = deque()
        referenced = 0
        for until, worker_id, hashes in self._records:
            entries = self._until.get(worker_id)
            if entries is None:
                continue
            live = [h for h in hashes if entries.get(h) == until]
            if live:
                kept.append((until, worker_id, live))
                referenced += len(live)
        self._records, self._referenced = kept, referenced

    async def expire(self, now: float) -> int:
        """Remove entries whose TTL has passed; returns how many this replica had recorded."""
        if self._pending:
            self.flush()
        self._now = now
        records = self._records
        gone: dict[str, list[int]] = {}
        while records and records[0][0] <= now:
            _until, worker_id, hashes = records.popleft()
            self._referenced -= len(hashes)
            entries = self._until.get(worker_id)
            if entries is None:
                continue
            out = gone.setdefault(worker_id, [])
            before = len(out)
            for h in hashes:
                left = entries.get(h)
                if left is not None and left <= now:  # (a block recorded again later expires later)
                    del entries[h]
                    out.append(h)
            self._entries -= len(out) - before
        gone = {w: hs for w, hs in gone.items() if hs}
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
        if self._pending:
            self.flush()
        entries = self._until.pop(worker_id, None)
        if entries is not None:
            self._entries -= len(entries)
