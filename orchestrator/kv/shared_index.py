"""What the two shared backends of the prefix index have in common: ``RedisPrefixIndex`` (one node) and
``RedisClusterPrefixIndex`` (Redis Cluster) keep the index where every router replica reads it, and
both keep this replica's own local mirror beside it.

- **The mirror**: every write goes to a local ``MemoryPrefixIndex`` too; while the store is
  unreachable lookups are answered from it, and once it answers again the mirror is written back
  (``resync``), so a restarted or failed-over store is refilled without waiting for engines.
- **The slot table view**: the store maps worker ids to small slots (``masks.py``); a replica caches
  that table with the ``(epoch, generation)`` it was read at and re-reads it when either changes.
- **The answer**: holder masks read from the store are walked (``masks.walk``) with the cached
  table into per-worker overlaps, exactly as the memory backend does.

The availability policy itself (when a replica tries the store again) differs per backend and lives
in each; both flip ``available``, which keeps ``mirror_since`` and the gauges ``dyad_index_mirror_only``
/ ``dyad_index_mirror_since_timestamp_seconds`` true (an operator alerts on a replica stuck on its
mirror: docs/operations.md, "Failover").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from orchestrator.clock import Clock
from orchestrator.kv.index import PrefixIndex, Tier
from orchestrator.kv.masks import WalkInputs, walk
from orchestrator.kv.memory_index import MemoryPrefixIndex
from orchestrator.router.types import Overlap

if TYPE_CHECKING:
    from orchestrator.telemetry.metrics import DyadMetrics


class SharedPrefixIndex(PrefixIndex):
    """Base of the Redis backends: key prefix, capacity, local mirror, slot table view, counters."""

    def __init__(self, key_prefix: str, max_blocks: int, metrics: DyadMetrics | None, clock: Clock,
                 retry_interval_s: float) -> None:
        self.key_prefix = key_prefix
        self._init_capacity(max_blocks, metrics)
        self._clock = clock
        self.mirror = MemoryPrefixIndex(max_blocks=max_blocks)  # this replica's own view; the fallback
        # The slot table as last read from the store, valid for (epoch, generation) = _slot_view.
        self._slot_view: tuple[bytes, bytes] = (b"", b"")
        self._slot_of: dict[str, int] = {}
        self._id_of: dict[int, str] = {}
        self._walk_inputs = WalkInputs()
        self._available = True
        self.mirror_since: float | None = None  # clock time this replica went on its mirror (None: not on it)
        if metrics is not None:
            metrics.index_mirror_only.labels(self.backend).set(0)
            metrics.index_mirror_since.labels(self.backend).set(0)
        self._retry_interval_s = retry_interval_s
        self.fallback_lookups = 0
        self.resyncs = 0
        self.slot_reloads = 0

    @property
    def available(self) -> bool:
        """The shared store answers (False: lookups come from the mirror until it is back and resynced)."""
        return self._available

    @available.setter
    def available(self, up: bool) -> None:
        if up == self._available:
            return
        self._available = up
        self.mirror_since = None if up else self._clock.now()
        if self._metrics is not None:
            self._metrics.index_mirror_only.labels(self.backend).set(0 if up else 1)
            since = self._metrics.index_mirror_since.labels(self.backend)
            if up:
                since.set(0)
            else:
                since.set_to_current_time()  # wall time, for `time() - ...` in PromQL

    def _set_slot_table(self, epoch: bytes | None, gen: bytes | None, table: Mapping[bytes | str, bytes]) -> None:
        """The slot table just read from the store (``worker id → slot``) at ``(epoch, gen)``."""
        self._slot_view = (epoch or b"", gen or b"")
        self._slot_of = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in table.items()}
        self._id_of = {s: w for w, s in self._slot_of.items()}
        self._walk_inputs.slots_changed()
        self.slot_reloads += 1

    def _answer(self, masks: Iterable[int | None], tier_weights: Mapping[str, float],
                workers: Sequence[str] | None) -> dict[str, Overlap]:
        """Per-worker overlaps from the request's blocks' holder masks, read from the store."""
        candidates = self._walk_inputs.candidates(workers, self._slot_of)
        if not candidates:
            return {}
        found = walk(masks, candidates, self._walk_inputs.credit(tier_weights))
        id_of = self._id_of
        return {id_of[s]: Overlap(blocks=n, weighted_blocks=wb) for s, (n, wb) in found.items() if s in id_of}

    def _mirror_by_tier(self, entries: Iterable[tuple[str, int, int]] | None = None
                        ) -> dict[tuple[str, Tier], list[int]]:
        """Mirror entries (or ``entries``) grouped per (worker, tier), oldest first: what a resync writes."""
        grouped: dict[tuple[str, Tier], list[int]] = {}
        for worker_id, h, mask in self.mirror.entries() if entries is None else entries:
            for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
                if mask & tier:
                    grouped.setdefault((worker_id, tier), []).append(h)
        return grouped
