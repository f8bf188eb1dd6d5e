"""The global prefix index: which worker holds which KV block, in which tier.

One interface, three backends: ``MemoryPrefixIndex`` (default, one gateway), and ``RedisPrefixIndex``
and ``RedisClusterPrefixIndex`` (router replicas share them; their common part is
``shared_index.SharedPrefixIndex``). Both answer the routing question "for this request's block list, how many
consecutive blocks from the start does each worker hold?" with cost proportional to the request's
blocks (block → set of workers; the walk stops as soon as no worker still matches), never to the
fleet size. Both are bounded (``index.max_blocks`` (worker, block) entries, least recently stored or
used evicted first, counted in ``dyad_index_evictions_total``).

A block may sit in several tiers of one worker (device and an offload tier); the overlap credits its
best tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from enum import IntFlag
from typing import TYPE_CHECKING

from orchestrator.router.types import Overlap

if TYPE_CHECKING:
    from orchestrator.telemetry.metrics import DyadMetrics


class Tier(IntFlag):
    """Where a cached block lives; a bit mask so one entry can hold several tiers."""

    DEVICE = 1
    HOST = 2
    DISK = 4

    @property
    def key(self) -> str:
        return {Tier.DEVICE: "device", Tier.HOST: "host", Tier.DISK: "disk"}[self]

    @classmethod
    def from_medium(cls, medium: str | None) -> Tier:
        """vLLM/SGLang event ``medium`` → tier. GPU (also reported on CPU builds) is the device tier."""
        m = (medium or "GPU").strip().upper()
        if m in ("CPU", "CPU_TIER", "HOST", "DRAM", "CPU_PINNED"):
            return cls.HOST
        if m in ("DISK", "SSD", "NVME", "LOCAL_FILE", "FILE", "STORAGE"):
            return cls.DISK
        return cls.DEVICE


DEFAULT_TIER_WEIGHTS: dict[str, float] = {"device": 1.0, "host": 0.75, "disk": 0.25}

# Blocks of one prompt chain are grouped by position: block ``i`` belongs to the group anchored at
# block ``(i // GROUP_BLOCKS) * GROUP_BLOCKS`` of its chain (every holder of block i holds that
# anchor too, as hashes are chained). The Redis Cluster backend keeps a group under one hash slot,
# so a lookup touches ceil(n / GROUP_BLOCKS) slots (docs/prefix-index.md).
GROUP_BLOCKS = 16


def chain_anchors(block_hashes: Sequence[int], first_position: int = 0,
                  first_anchor: int | None = None) -> list[int]:
    """The group anchor of each block of a chain whose first block sits at ``first_position``
    (``first_anchor``: the anchor of that position's group when it starts before this list)."""
    out: list[int] = []
    anchor = first_anchor
    for i, h in enumerate(block_hashes):
        if (first_position + i) % GROUP_BLOCKS == 0 or anchor is None:
            anchor = h
        out.append(anchor)
    return out


def best_tier_weight(mask: int, weights: Mapping[str, float]) -> float:
    """The credit of a block held in the tiers of ``mask``: its best tier's weight."""
    best = 0.0
    for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
        if mask & tier:
            best = max(best, weights.get(tier.key, 0.0))
    return best


class PrefixIndex(ABC):
    """Worker ↔ block membership. All methods are coroutines so the Redis backend fits the same shape."""

    backend: str = "abstract"
    max_blocks: int
    evictions: int
    _metrics: DyadMetrics | None

    def _init_capacity(self, max_blocks: int, metrics: DyadMetrics | None) -> None:
        """The bound every backend keeps (``index.max_blocks``), its gauge, and the eviction count."""
        self.max_blocks = max_blocks
        self._metrics = metrics
        self.evictions = 0
        if metrics is not None:
            metrics.index_capacity.labels(self.backend).set(max_blocks)

    def _count_evictions(self, n: int) -> None:
        """``n`` entries were dropped by the cap (``dyad_index_evictions_total``)."""
        self.evictions += n
        if self._metrics is not None:
            self._metrics.index_evictions.labels(self.backend).inc(n)

    @abstractmethod
    async def store(self, worker_id: str, block_hashes: Sequence[int], tier: Tier = Tier.DEVICE,
                    anchors: Sequence[int] | None = None) -> None:
        """Record that ``worker_id`` holds these blocks in ``tier`` (refreshes their recency).

        ``anchors``: each block's group anchor (``chain_anchors``), when the blocks are not a chain
        from position 0; only the cluster backend uses it."""

    @abstractmethod
    async def remove(self, worker_id: str, block_hashes: Sequence[int], tier: Tier | None = None) -> None:
        """Forget these blocks on ``worker_id`` (in one tier, or in all tiers when ``tier`` is None)."""

    @abstractmethod
    async def clear_worker(self, worker_id: str) -> None:
        """Forget everything about ``worker_id`` (engine restarted, cache reset, worker unhealthy)."""

    @abstractmethod
    async def overlaps(
        self,
        block_hashes: Sequence[int],
        tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
        workers: Sequence[str] | None = None,
    ) -> dict[str, Overlap]:
        """Longest consecutive prefix of ``block_hashes`` held by each worker (workers with 0 omitted).

        ``workers`` restricts the answer to those ids (the request's candidates); None = all.
        """

    @abstractmethod
    async def size(self) -> int:
        """(worker, block) entries currently held."""

    async def worker_blocks(self, worker_id: str) -> int:
        """Entries held for one worker (diagnostics and tests)."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release connections (no-op in memory)."""
        return None
