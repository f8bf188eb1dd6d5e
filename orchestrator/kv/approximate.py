"""Approximate prefix tracking for engines that publish no KV events (SGLang, vLLM without events).

The router records its own decisions: a request's blocks are assumed cached on the worker it was
sent to, for ``index.approximate_ttl_s`` seconds after the last request that used them (Dynamo and
llm-d do the same, 120 s by default). Expiry is driven by the clock passed in, so it runs unchanged
in virtual time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from orchestrator.kv.index import PrefixIndex, Tier


class ApproximateRecorder:
    def __init__(self, index: PrefixIndex, ttl_s: float, max_entries: int = 1_000_000) -> None:
        self.index = index
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._expiry: OrderedDict[tuple[str, int], float] = OrderedDict()  # ordered by expiry

    def __len__(self) -> int:
        return len(self._expiry)

    async def record(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        """``worker_id`` just received a request for these blocks: it will hold them for a while."""
        if not block_hashes:
            return
        until = now + self.ttl_s
        exp = self._expiry
        for h in block_hashes:
            key = (worker_id, h)
            if key in exp:
                exp.move_to_end(key)
            exp[key] = until
        await self.index.store(worker_id, block_hashes, Tier.DEVICE)
        if len(exp) > self.max_entries:  # the index evicts on its own; just keep this map bounded
            for _ in range(len(exp) - self.max_entries):
                exp.popitem(last=False)

    async def expire(self, now: float) -> int:
        """Remove entries whose TTL has passed; returns how many."""
        exp = self._expiry
        gone: dict[str, list[int]] = {}
        while exp:
            key, until = next(iter(exp.items()))
            if until > now:
                break
            exp.popitem(last=False)
            gone.setdefault(key[0], []).append(key[1])
        for worker_id, hashes in gone.items():
            await self.index.remove(worker_id, hashes)
        return sum(len(v) for v in gone.values())

    def forget_worker(self, worker_id: str) -> None:
        for key in [k for k in self._expiry if k[0] == worker_id]:
            del self._expiry[key]
