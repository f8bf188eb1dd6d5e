"""Prefill work this gateway has dispatched and not yet seen finish: the router's fresh view of load.

A scrape is up to a second old and the prefix index only learns a block once the engine stores it,
so for the work it sent itself the router keeps its own books, per worker:

- **uncached prompt tokens** still to prefill (``Worker.inflight_prefill_tokens``), charged when a
  request is dispatched and released at its first token (or when it ends without one);
- **prefixes in flight**: the chained block hashes of those prompts. An engine admits requests in
  order and re-checks its prefix cache when it starts one (vLLM caches a step's blocks as it
  schedules them), so a request sent behind an in-flight prompt that shares its first N blocks will
  find those N blocks cached when it starts. ``covered_by_worker`` says how many, per worker; the policy
  credits them like cached blocks, and the request is charged only for the rest, so copies of one
  prefix queued on a worker are counted once, not once per copy.

- **the backlog still to compute** (``Worker.prefill_backlog_tokens``, read as ``queued_prefill_tokens``): a charge is released only
  at the first token, so a worker halfway through a 60k-token prompt would look as busy as one that
  has not started. Each worker is modelled as a first-come-first-served prefill server: the ledger
  learns its rate from the releases it sees (tokens of a request / the time from when it could
  start — its dispatch or the previous first token, whichever is later — to its own first token),
  and between events drains the backlog at that rate; never below zero, never above what is still
  charged. Until a worker has a rate the backlog is the charge.

The live ``Router`` and the virtual-time fleet use this same ledger, so both see the same load.
No I/O and no clock of its own: the caller passes ``now``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from orchestrator.fleet.worker import Worker
from orchestrator.kv.index import DEFAULT_TIER_WEIGHTS
from orchestrator.kv.masks import SlotTable, TierCredit, slot_bit, walk

MAX_PER_WORKER = 4096  # in-flight prompts remembered per worker (oldest forgotten beyond: a lost release must not grow this)
RATE_MEMORY = 0.9  # weight of the past in the learned prefill rate, per observed release


_DEVICE = TierCredit(DEFAULT_TIER_WEIGHTS)  # in-flight blocks are held in the device tier (slot_bit)


@dataclass
class _Charge:
    worker: Worker
    tokens: int
    blocks: tuple[int, ...]
    at: float | None  # when it was dispatched


@dataclass
class _Server:
    """One worker as a FIFO prefill server: learned rate and the backlog estimate."""

    tokens_seen: float = 0.0  # decayed sums behind the rate (tokens / busy seconds)
    seconds_seen: float = 0.0
    backlog: float = 0.0
    since: float | None = None  # when ``backlog`` was last brought up to date
    last_release: float | None = None

    @property
    def rate(self) -> float | None:
        return self.tokens_seen / self.seconds_seen if self.seconds_seen > 0 and self.tokens_seen > 0 else None

    def drain(self, now: float | None) -> None:
        if now is None:
            return
        since = self.since
        if since is None:
            self.since = now
        elif now > since:
            if self.backlog > 0 and self.seconds_seen > 0 and self.tokens_seen > 0:  # (a learned rate: ``rate``)
                self.backlog = max(0.0, self.backlog - self.tokens_seen / self.seconds_seen * (now - since))
            self.since = now


class InflightLedger:
    def __init__(self, max_per_worker: int = MAX_PER_WORKER) -> None:
        self.max_per_worker = max_per_worker
        self._charges: dict[Hashable, _Charge] = {}
        self._per_worker: dict[str, dict[Hashable, None]] = {}  # worker id → keys, oldest first
        self._refs: dict[str, dict[int, int]] = {}  # worker id → block hash → in-flight prompts holding it
        self._servers: dict[str, _Server] = {}
        # Per block, who has it in flight: the prefix index's holder-mask layout (a byte per worker
        # slot, device bit set), so ``covered_by_worker`` walks the request's blocks once for the fleet.
        self._holders: dict[int, int] = {}
        self._slots = SlotTable()

    def rate(self, worker_id: str) -> float | None:
        """The worker's learned prefill rate in tokens per second (None before its first release)."""
        s = self._servers.get(worker_id)
        return s.rate if s is not None else None

    def refresh(self, workers: Sequence[Worker], now: float) -> None:
        """Bring each worker's ``prefill_backlog_tokens`` up to ``now`` (call before a decision)."""
        for w in workers:
            s = self._servers.get(w.id)
            if s is None:
                continue  # never charged here: queued_prefill_tokens is the charge
            s.drain(now)
            self._publish(w, s)

    @staticmethod
    def _publish(w: Worker, s: _Server) -> None:
        if s.backlog > w.inflight_prefill_tokens:
            s.backlog = float(w.inflight_prefill_tokens)
        w.prefill_backlog_tokens = s.backlog

    def covered_by_worker(self, workers: Sequence[Worker], block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker of ``workers`` (those with any), the leading blocks of ``block_hashes`` that a
        prompt in flight there is computing: one walk over the request's blocks AND-ing the blocks'
        holder masks (``orchestrator.kv.masks``, as the prefix index does)."""
        if not block_hashes or not self._holders:
            return {}
        slot_of = self._slots.slot_of
        candidates = 0
        for w in workers:
            slot = slot_of.get(w.id)
            if slot is not None:
                candidates |= slot_bit(slot)
        if not candidates:
            return {}
        found = walk(map(self._holders.get, block_hashes), candidates, _DEVICE)
        ids = self._slots.ids
        return {ids[slot]: n for slot, (n, _) in found.items()}

    def charge(self, key: Hashable, worker: Worker, tokens: int, block_hashes: Sequence[int] = (),
               now: float | None = None) -> None:
        """Dispatched at ``now``: ``tokens`` uncached prompt tokens and the prompt's blocks are now
        in flight on ``worker``."""
        if key in self._charges:
            self.release(key)
        tokens = max(0, tokens)
        c = _Charge(worker, tokens, tuple(block_hashes), now)
        self._charges[key] = c
        worker.inflight_prefill_tokens += tokens
        s = self._servers.setdefault(worker.id, _Server())
        s.drain(now)
        s.backlog += tokens
        self._publish(worker, s)
        keys = self._per_worker.setdefault(worker.id, {})
        keys[key] = None
        if c.blocks:
            refs = self._refs.setdefault(worker.id, {})
            bit = slot_bit(self._slots.assign(worker.id)[0])
            holders = self._holders
            once = dict.fromkeys(c.blocks, 1)
            if len(once) == len(c.blocks) and refs.keys().isdisjoint(once):  # new to this worker: C-level updates
                refs.update(once)
                if holders.keys().isdisjoint(once):  # ... and in flight nowhere
                    holders.update(dict.fromkeys(once, bit))
                else:
                    for h in c.blocks:
                        holders[h] = holders.get(h, 0) | bit
            else:
                for h in c.blocks:
                    n = refs.get(h, 0)
                    refs[h] = n + 1
                    if not n:
                        holders[h] = holders.get(h, 0) | bit
        if len(keys) > self.max_per_worker:
            self.release(next(iter(keys)))

    def release(self, key: Hashable, now: float | None = None, prefilled: bool = True) -> int | None:
        """Prefilled at ``now`` (or ended without a first token: ``prefilled=False``, nothing is
        learned from it): undo ``charge``; the tokens released, or None when nothing was charged
        under ``key`` (idempotent)."""
        c = self._charges.pop(key, None)
        if c is None:
            return None
        w = c.worker
        w.inflight_prefill_tokens = max(0, w.inflight_prefill_tokens - c.tokens)
        s = self._servers.get(w.id)
        if s is not None:
            if prefilled and now is not None and c.at is not None:
                start = c.at if s.last_release is None or s.last_release < c.at else s.last_release
                if now > start:
                    s.tokens_seen = RATE_MEMORY * s.tokens_seen + c.tokens
                    s.seconds_seen = RATE_MEMORY * s.seconds_seen + (now - start)
                s.last_release = now
            s.drain(now)
            self._publish(w, s)
        keys = self._per_worker.get(w.id)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self._per_worker[w.id]
        if c.blocks:
            refs = self._refs[w.id]
            keep = ~slot_bit(self._slots.slot_of[w.id])
            holders = self._holders
            for h in c.blocks:
                left = refs[h] - 1
                if left:
                    refs[h] = left
                else:
                    del refs[h]
                    m = holders[h] & keep
                    if m:
                        holders[h] = m
                    else:
                        del holders[h]
            if not refs:  # nothing of this worker in flight: its slot is free for another
                del self._refs[w.id]
                self._slots.free(w.id)
        return c.tokens

    def __len__(self) -> int:
        return len(self._charges)
